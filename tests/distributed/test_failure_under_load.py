"""Failure detection on a saturated machine: still detects dead, stopped and hung ranks, and never
reports a slow, healthy rank as dead or hung.

The regression: on a 2-core machine at load ~7, a healthy rank whose start-up (imports, first
batch, first step) took longer than dist.timeout_s = 6 was killed as "this rank hung: no progress
for 6.0 s in phase 'run' at step 0". ``BUSY_LOOPS`` busy-loop processes run for the whole module
(``saturated``, killed in its teardown). A healthy run with rank 1's steps slowed on purpose
(``GRF_FAULT_SLOW_STEP``, backends/dist_torch.py) starts first and runs alongside the scenarios of
test_failure.py (same derived bounds), as more load; it must finish with exit 0 on both ranks.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backends.dist_torch import HANG_FACTOR

from .common import ROOT, free_port, rank_env, train_command
from .test_failure import LIM, SLACK_S, STARTUP_S, TIMEOUT_S, check_hung, check_killed, check_stopped

BUSY_LOOPS = 2   # with the ranks: load ~4 to 6 on the 2-core CI machine
# rank 1's slow steps: step 1 (warm-up, judged only by warmup_after) longer than timeout_s; step 2
# long enough that its measured time raises hang_after to HANG_FACTOR x it; step 3 longer than
# timeout_s (the old limit) but well inside that raised limit
SLOW_1 = TIMEOUT_S + 1.0
SLOW_2 = TIMEOUT_S / 3
SLOW_3 = 0.8 * LIM.hang_after(SLOW_2)


@pytest.fixture(scope="module")
def saturated():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_LOOPS)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@pytest.fixture(scope="module")
def slow_healthy_run(saturated, tmp_path_factory):
    """2 ranks, no fault, started once and left running while the scenarios run:
    ``(out, logs, procs)``; output goes to files (nobody reads pipes meanwhile)."""
    base = tmp_path_factory.mktemp("slow-healthy")
    out, port = base / "run", free_port()
    slow = {"GRF_FAULT_SLOW_STEP": f"1:{SLOW_1:g},2:{SLOW_2:g},3:{SLOW_3:g}", "GRF_FAULT_RANK": "1"}
    cmd = train_command(out, "train.epochs=2", f"dist.timeout_s={TIMEOUT_S}")
    logs, procs = [base / f"rank{r}.err" for r in range(2)], []
    for r in range(2):
        with open(logs[r], "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env(r, 2, port, **slow), stdout=subprocess.DEVNULL,
                                          stderr=err))
    try:
        yield out, logs, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [check_killed, check_hung, check_stopped], ids=["killed", "hung", "stopped"])
def test_failure_detected_under_load(saturated, slow_healthy_run, scenario, tmp_path):
    scenario(tmp_path)
    assert all(p.poll() is None for p in saturated), "the load stopped before the scenario ended"


def test_slow_healthy_run_completes_under_load(saturated, slow_healthy_run):
    assert TIMEOUT_S < SLOW_1 < LIM.warmup_after and TIMEOUT_S < SLOW_3 < HANG_FACTOR * SLOW_2
    out, logs, procs = slow_healthy_run
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=STARTUP_S + SLOW_1 + SLOW_2 + SLOW_3 + SLACK_S)
        except subprocess.TimeoutExpired:
            pass
        assert p.returncode == 0, f"rank {rank} exited {p.returncode} (None: still running):\n" \
                                  f"{logs[rank].read_text()[-3000:]}"
    assert all(p.poll() is None for p in saturated), "the load stopped before the run ended"
    # the slow steps did happen on rank 1 (forward+backward seconds per rank in timing.jsonl)
    steps = [r for r in map(json.loads, (out / "timing.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
    compute = {r["step"]: r["rank_compute_s"][1] for r in steps}
    assert compute[1] >= SLOW_1 and compute[2] >= SLOW_2 and compute[3] >= SLOW_3, compute
    assert len(steps) == 8 and json.loads((out / "eval.json").read_text())["world_size"] == 2
