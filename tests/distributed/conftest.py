"""Session fixtures of the data-parallel tests: the runs several tests compare (each made once)."""
from __future__ import annotations

import subprocess

import pytest

from .common import ROOT, STEPS, spawn_ranks, subprocess_env, tiny_config, train_command, wait_all


@pytest.fixture(scope="session")
def single_torch(tmp_path_factory):
    """A single-process torch run of STEPS optimizer steps (in this process)."""
    from gr_functional.runner import train

    out = tmp_path_factory.mktemp("single-torch")
    train(tiny_config(*STEPS), out, progress=False, resume="never")
    return out


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The same run as 2 gloo ranks (dist.balance = kk, the default): ``(out, [(rc, stdout, stderr)])``."""
    out = tmp_path_factory.mktemp("two-ranks")
    results = wait_all(spawn_ranks(out, *STEPS), timeout=120)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    return out, results


@pytest.fixture(scope="session")
def single_jax(tmp_path_factory):
    """The same run, single-process, on the JAX reference backend (a subprocess: `grf train`)."""
    out = tmp_path_factory.mktemp("single-jax")
    r = subprocess.run(train_command(out, *STEPS, args=["--backend", "jax"]), cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out
