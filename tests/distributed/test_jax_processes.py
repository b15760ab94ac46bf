"""Several JAX processes (``jax.distributed``, backends/dist_jax.py), on one machine with CPU
collectives (gloo), started as on several hosts or by ``grf train --nproc``:

- a process that never finds its coordinator exits 4 within 10 x dist.timeout_s + 5 s (7 s
  here), naming it, having written nothing;
- of 2 processes started by hand, their item table row-sharded over them, one killed after step
  5 ends the other within JAX's heartbeat limit (max(dist.timeout_s, 5 s)); the checkpoints stay
  intact, and ``grf train --nproc 2 --devices 2`` (4 ranks of one mesh over 2 processes, the
  table re-sharded by id) resumes the run to the parameters and every step's loss of one process
  holding the whole table (1e-5, as test_jax_mesh.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

from .common import ROOT, STEPS, final_params, free_port, metrics, subprocess_env, train_command, worst_param_error
from .test_jax_mesh import _done
import pytest

JAX = ["--backend", "jax"]


def _grf_popen(out, *extra, extra_args=()):
    return subprocess.Popen(train_command(out, *extra, args=[*JAX, *extra_args]), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _by_hand(out, rank: int, port: int, *extra, **env):
    """Process ``rank`` of 2 started directly (RANK / WORLD_SIZE / MASTER_*: the several-hosts way)."""
    return subprocess.Popen(train_command(out, *extra, args=JAX), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env))


@pytest.mark.slow
def test_a_coordinator_that_never_answers(tmp_path):
    out = tmp_path / "alone"
    start = time.monotonic()
    proc = _by_hand(out, 1, free_port(), *STEPS, "dist.timeout_s=0.2")
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 4, err[-2000:]
    assert "the JAX coordinator 127.0.0.1:" in err and "did not answer within 7 s" in err, err[-2000:]
    assert took < 7 + 60, took  # the limit, plus starting Python and JAX on a busy machine
    assert not out.exists()


ROW_SHARDED = ["train.max_steps=8", *STEPS[1:], "embedding.kind=hash", "embedding.optimizer=lazy_adam",
               "embedding.capacity=240", "loss.num_negatives=4"]


@pytest.mark.slow
def test_a_killed_process_stops_the_other_and_the_run_resumes(tmp_path):
    """With the item table row-sharded over the processes' devices (a hash table, lazy Adam)."""
    out, one = tmp_path / "killed", tmp_path / "one-process"
    sets = [*ROW_SHARDED, "embedding.sharding=row", "train.checkpoint_every=2", "dist.timeout_s=6"]
    reference = _grf_popen(one, *ROW_SHARDED)  # the whole table in one process, meanwhile
    port = free_port()
    procs = [_by_hand(out, r, port, *sets, GRF_FAULT="after-step@5", GRF_FAULT_RANK="1") for r in (0, 1)]
    deadline = time.monotonic() + 240
    for line in procs[1].stdout:  # rank 1 pauses after step 5 (and its checkpoint, if any)
        if "GRF_FAULT paused" in line or time.monotonic() > deadline:
            break
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    procs[1].communicate()
    _, err = procs[0].communicate(timeout=120)
    took = time.monotonic() - killed
    assert procs[0].returncode != 0 and "heartbeat timeout" in err, err[-2000:]
    assert took < 6 + 45, took  # max(dist.timeout_s, 5 s), plus a busy machine's margin
    names = sorted(p.name for p in (out / "checkpoints").glob("step-*.safetensors"))
    assert names[:2] == ["step-00000002.safetensors", "step-00000004.safetensors"], names
    # resumed as 2 processes x 2 forced devices: 4 ranks of one mesh over 2 processes, re-sharded by id
    _done(_grf_popen(out, *sets, extra_args=["--nproc", "2", "--devices", "2"]))
    _done(reference)
    got, want = final_params(out), final_params(one)
    want.pop("item_emb")  # row-sharded: the rows are in the checkpoint's shards
    err, leaf = worst_param_error(got, want)
    assert err <= 1e-5, f"{leaf}: {err:.2e}"
    g, w = ([r for r in metrics(p) if r["kind"] == "train"] for p in (out, one))
    assert [r["step"] for r in g] == [r["step"] for r in w] == list(range(1, 9))
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]) for a, b in zip(g, w))
    text = (out / "config.toml").read_text()
    assert "nproc = 2" in text and "devices = 2" in text
