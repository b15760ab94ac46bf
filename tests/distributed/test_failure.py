"""A rank that dies or hangs makes every rank exit, within a bound, naming it; never a silent hang.

The ranks are started directly (no torchrun, as on several hosts where no launcher sees every
rank), so what stops them is the ranks' own detection: the gloo collective's error plus the
heartbeat of the rank that stopped, or the watchdog (backends/dist_torch.py). Rank 1 pauses at
``GRF_FAULT=after-step@2`` (limited to it by ``GRF_FAULT_RANK=1``); dist.timeout_s = 6.
Measured (2 busy cores): a killed rank is named by rank 0 about 3 s after the kill; a hung rank
stops both ranks about 6.3 s after it stopped making progress.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from .common import ROOT, spawn_ranks, subprocess_env, train_command, wait_all

TIMEOUT_S = 6
BOUND_S = 60     # every rank must be gone this long after the fault, with the message
PAUSE = {"GRF_FAULT": "after-step@2", "GRF_FAULT_RANK": "1"}


def _paused_pid(proc: subprocess.Popen) -> int:
    """Read ``proc``'s stdout up to the fault point's line; returns the paused pid."""
    deadline = time.monotonic() + 90
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


def test_killed_rank_stops_every_rank_naming_it(tmp_path):
    procs = _spawn(tmp_path)
    os.kill(_paused_pid(procs[1]), signal.SIGKILL)
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, _) = wait_all(procs, timeout=BOUND_S)
    assert rc0 == 4, f"rank 0 exited {rc0} (None: still running after {BOUND_S} s):\n{err0[-3000:]}"
    assert rc1 == -signal.SIGKILL
    assert time.monotonic() - t0 < BOUND_S
    assert "grf: error: rank 0:" in err0 and "rank 1 died or is stopped: no heartbeat for" in err0, err0[-3000:]


def test_hung_rank_stops_every_rank_naming_it(tmp_path):
    procs = _spawn(tmp_path)
    _paused_pid(procs[1])          # rank 1's main thread now sleeps: alive, heartbeat on, no progress
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, err1) = wait_all(procs, timeout=BOUND_S)
    elapsed = time.monotonic() - t0
    assert rc0 == 4 and rc1 == 4, f"exit codes {rc0}, {rc1}:\n{err0[-2000:]}\n{err1[-2000:]}"
    assert TIMEOUT_S - 1 <= elapsed < BOUND_S
    assert "rank 1: this rank hung: no progress for" in err1
    assert "rank 0:" in err0 and "rank 1" in err0 and "hung" in err0, err0[-3000:]


def test_stopped_rank_is_detected_by_its_missing_heartbeat(tmp_path):
    """SIGSTOP: the process and its sockets stay, only the heartbeat stops: rank 0 must not wait
    in the collective forever."""
    procs = _spawn(tmp_path)
    pid = _paused_pid(procs[1])
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        (rc0, _, err0), = wait_all(procs[:1], timeout=BOUND_S)
    finally:
        os.kill(pid, signal.SIGKILL)
        procs[1].communicate()
    assert rc0 == 4, f"rank 0 exited {rc0}:\n{err0[-3000:]}"
    assert time.monotonic() - t0 < BOUND_S
    assert "rank 1 died or is stopped: no heartbeat for" in err0, err0[-3000:]


def test_torchrun_launch_stops_when_a_rank_is_killed(tmp_path):
    """`grf train --nproc 2` (torch.distributed.run): killing rank 1 ends the whole job, and the
    output names rank 1 (torchrun's failure report and/or rank 0's own message)."""
    cmd = train_command(tmp_path / "run", "train.epochs=3", f"dist.timeout_s={TIMEOUT_S}", args=["--nproc", "2"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(**PAUSE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    os.kill(_paused_pid(proc), signal.SIGKILL)
    t0 = time.monotonic()
    (rc, _, err), = wait_all([proc], timeout=BOUND_S)
    assert rc not in (0, None), f"exit {rc}:\n{err[-3000:]}"
    assert time.monotonic() - t0 < BOUND_S
    # torchrun's report: "Root Cause (first observed failure): ... rank : 1 (local_rank: 1) ... SIGKILL"
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)", err, re.S) or "rank 1 died" in err, err[-3000:]
    assert "the 2-rank run failed" in err
