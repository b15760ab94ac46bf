"""Shared setup of the data-parallel tests: tiny runs of 2 gloo ranks on CPU.

``spawn_ranks`` starts the ranks itself (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as
torchrun sets them) instead of going through torchrun: that is the several-hosts situation,
where no single launcher sees every rank, so a dead or hung rank must be caught by the ranks'
own watchdogs. ``grf train --nproc 2`` (torchrun) is tested separately.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from ..differential.common import rel_err
from ..reliability.common import ROOT, metrics, sets, subprocess_env  # noqa: F401 (re-exported)


def tiny_config(*extra: str):
    from gr_functional.configure import load_config

    return load_config(ROOT / "experiments" / "configs" / "quickstart.toml", TINY + list(extra))


def final_params(out) -> dict:
    """tree path -> numpy array of OUT/checkpoints/last.safetensors."""
    from gr_functional.checkpoint import load_checkpoint
    from gr_functional.tree import tree_items

    return dict(tree_items(load_checkpoint(out / "checkpoints" / "last.safetensors")[0]))


def worst_param_error(got: dict, want: dict) -> tuple[float, str]:
    """``(max over leaves of rel_err, that leaf)``; rel_err is relative to the reference's max."""
    assert set(got) == set(want)
    return max((rel_err(got[k], want[k]), k) for k in want)

# 64 synthetic users -> 64 training users; global batch 16 -> 4 steps per epoch
TINY = ["data.synthetic_users=64", "data.synthetic_items=120", "data.synthetic_max_events=40",
        "model.max_len=16", "model.embed_dim=16", "model.num_blocks=2", "model.num_heads=2", "model.dqk=8",
        "model.dv=8", "loss.num_negatives=8", "train.batch_size=16", "train.log_every=1", "eval.batch_size=64",
        "eval.max_users=16"]
# 20 optimizer steps (5 epochs of 4), evaluated only at the end
STEPS = ["train.max_steps=20", "train.epochs=10", "train.eval_every=100"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra) -> dict:
    env = subprocess_env(**extra)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


def train_command(out, *extra_sets: str, args=()) -> list[str]:
    return [sys.executable, "-m", "gr_functional.cli", "train", "--config", "quickstart", "--quiet",
            "--out", str(out), *sets(TINY + list(extra_sets)), *args]


def spawn_ranks(out, *extra_sets: str, world: int = 2, rank_extra_env: dict | None = None,
                args=(), command: list[str] | None = None) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``grf train`` (stdout/stderr piped, text): ``command`` (default
    ``train_command`` of the quickstart)."""
    port = free_port()
    procs = []
    for r in range(world):
        extra = (rank_extra_env or {}).get(r, {})
        procs.append(subprocess.Popen(command or train_command(out, *extra_sets, args=args), cwd=ROOT,
                                      env=rank_env(r, world, port, **extra), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def wait_all(procs, timeout: float) -> list[tuple[int, str, str]]:
    """``(returncode, stdout, stderr)`` per rank; kills every rank still running at ``timeout``
    (returncode None then)."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, o, e))
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            results.append((None, o, e))
    return results
