"""A rank that dies or hangs makes every rank exit 4, within a bound, naming it; never a silent hang.

The ranks are started directly (no torchrun, as on several hosts where no launcher sees every
rank), so what stops them is the ranks' own detection: the gloo collective's error plus the
heartbeat of the rank that stopped, or the watchdog (backends/dist_torch.py). Rank 1 pauses at
``GRF_FAULT=after-step@2`` (limited to it by ``GRF_FAULT_RANK=1``); dist.timeout_s = 6.

The bounds are the documented ones (``dist_torch.limits``) plus ``SLACK_S`` for process start-up,
exit and scheduling on a loaded machine; the ``check_*`` scenarios are run again under load by
test_failure_under_load.py. Measured (2 busy cores): a killed rank is named by rank 0 about 3 s
after the kill; a hung rank stops both ranks about 6.5 s after it stopped making progress.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from backends.dist_torch import limits

from .common import ROOT, spawn_ranks, subprocess_env, train_command, wait_all

TIMEOUT_S = 6
LIM = limits(TIMEOUT_S)
SLACK_S = 45       # process exit and scheduling on a saturated 2-core machine, added to every bound
STARTUP_S = 240    # until rank 1 reaches the fault point: start-up, warm-up and 2 steps, loaded machine
PAUSE = {"GRF_FAULT": "after-step@2", "GRF_FAULT_RANK": "1"}
# every rank gone this long after the fault, with the message (module docstring of dist_torch):
# a killed or stopped rank: no heartbeat for dead_after; a hung one: no progress for hang_after,
# which after step 2 (the first step past warm-up, so no step measured yet) is timeout_s; the
# watchdogs poll once per interval, the peers hear of a failure one interval later
DEAD_BOUND_S = LIM.dead_after + 2 * LIM.interval + SLACK_S
HUNG_BOUND_S = LIM.hang_after(0.0) + 2 * LIM.interval + SLACK_S
# the store's host stopped: no store round for store_down_after, then at most 2 intervals + 1 s
# trying to publish the failure on that store
STORE_BOUND_S = LIM.store_down_after + 3 * LIM.interval + 1 + SLACK_S


def _paused_pid(proc: subprocess.Popen) -> int:
    """Read ``proc``'s stdout up to the fault point's line; returns the paused pid."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("GRF_FAULT paused"):
            return int(line.rsplit("pid=", 1)[1])
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"rank never reached the fault point (exit {proc.poll()}): {proc.stderr.read()[-3000:]}")


def _spawn(tmp_path):
    return spawn_ranks(tmp_path / "run", "train.epochs=3", f"dist.timeout_s={TIMEOUT_S}",
                       rank_extra_env={0: PAUSE, 1: PAUSE})


def check_killed(tmp_path) -> None:
    procs = _spawn(tmp_path)
    os.kill(_paused_pid(procs[1]), signal.SIGKILL)
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, _) = wait_all(procs, timeout=DEAD_BOUND_S)
    assert rc0 == 4, f"rank 0 exited {rc0} (None: still running after {DEAD_BOUND_S:g} s):\n{err0[-3000:]}"
    assert rc1 == -signal.SIGKILL
    assert time.monotonic() - t0 < DEAD_BOUND_S
    assert "grf: error: rank 0:" in err0 and "rank 1 died or is stopped: no heartbeat for" in err0, err0[-3000:]


def check_hung(tmp_path) -> None:
    procs = _spawn(tmp_path)
    _paused_pid(procs[1])          # rank 1's main thread now sleeps: alive, heartbeat on, no progress
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, err1) = wait_all(procs, timeout=HUNG_BOUND_S)
    elapsed = time.monotonic() - t0
    assert rc0 == 4 and rc1 == 4, f"exit codes {rc0}, {rc1}:\n{err0[-2000:]}\n{err1[-2000:]}"
    # not before the limit (t0 is a little after rank 1's last progress: scheduling only)
    assert LIM.hang_after(0.0) / 2 <= elapsed < HUNG_BOUND_S
    assert "rank 1: this rank hung: no progress for" in err1, err1[-3000:]
    # step 2 ended warm-up: judged by the steady limit, not the warm-up backstop
    assert f"limit max(dist.timeout_s={TIMEOUT_S:g}," in err1, err1[-3000:]
    assert "rank 0: stopping because rank 1 failed: this rank hung" in err0, err0[-3000:]


def check_stopped(tmp_path) -> None:
    """SIGSTOP: the process and its sockets stay, only the heartbeat stops: rank 0 must not wait
    in the collective forever."""
    procs = _spawn(tmp_path)
    pid = _paused_pid(procs[1])
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        (rc0, _, err0), = wait_all(procs[:1], timeout=DEAD_BOUND_S)
    finally:
        os.kill(pid, signal.SIGKILL)
        procs[1].communicate()
    elapsed = time.monotonic() - t0
    assert rc0 == 4, f"rank 0 exited {rc0}:\n{err0[-3000:]}"
    assert LIM.dead_after / 2 <= elapsed < DEAD_BOUND_S
    assert "rank 1 died or is stopped: no heartbeat for" in err0, err0[-3000:]


def check_store_host_stopped(tmp_path) -> None:
    """SIGSTOP of rank 0, which hosts the rendezvous store (ranks started directly): some store
    calls then block whatever their timeout; rank 1 must still exit naming the store."""
    pause0 = {**PAUSE, "GRF_FAULT_RANK": "0"}
    procs = spawn_ranks(tmp_path / "run", "train.epochs=3", f"dist.timeout_s={TIMEOUT_S}",
                        rank_extra_env={0: pause0, 1: pause0})
    pid = _paused_pid(procs[0])
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        (rc1, _, err1), = wait_all(procs[1:], timeout=STORE_BOUND_S)
    finally:
        os.kill(pid, signal.SIGKILL)
        procs[0].communicate()
    assert rc1 == 4, f"rank 1 exited {rc1} (None: still running after {STORE_BOUND_S:g} s):\n{err1[-3000:]}"
    assert time.monotonic() - t0 < STORE_BOUND_S
    assert "grf: error: rank 1: lost the rendezvous store at 127.0.0.1:" in err1, err1[-3000:]


def check_torchrun_killed(tmp_path) -> None:
    """`grf train --nproc 2` (torch.distributed.run): killing rank 1 ends the whole job with exit 4
    (not torchrun's 1), and the output names rank 1."""
    cmd = train_command(tmp_path / "run", "train.epochs=3", f"dist.timeout_s={TIMEOUT_S}", args=["--nproc", "2"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(**PAUSE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    os.kill(_paused_pid(proc), signal.SIGKILL)
    t0 = time.monotonic()
    (rc, _, err), = wait_all([proc], timeout=DEAD_BOUND_S)
    assert rc == 4, f"exit {rc}:\n{err[-3000:]}"
    assert time.monotonic() - t0 < DEAD_BOUND_S
    # torchrun's report: "Root Cause (first observed failure): ... rank : 1 (local_rank: 1) ... SIGKILL"
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)", err, re.S) or "rank 1 died" in err, err[-3000:]
    assert "the 2-rank run failed" in err and "rank 1 ended without an exit code" in err, err[-3000:]


@pytest.mark.slow
def test_killed_rank_stops_every_rank_naming_it(tmp_path):
    check_killed(tmp_path)


@pytest.mark.slow
def test_hung_rank_stops_every_rank_naming_it(tmp_path):
    check_hung(tmp_path)


@pytest.mark.slow
def test_stopped_rank_is_detected_by_its_missing_heartbeat(tmp_path):
    check_stopped(tmp_path)


@pytest.mark.slow
def test_stopped_store_host_is_detected(tmp_path):
    check_store_host_stopped(tmp_path)


@pytest.mark.slow
def test_torchrun_launch_exits_4_when_a_rank_is_killed(tmp_path):
    check_torchrun_killed(tmp_path)
