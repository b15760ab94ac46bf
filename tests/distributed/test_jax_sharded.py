"""The JAX reference of the data-parallel step: ``backends.dist_jax.make_sharded_train_step`` over 2
forced host devices (shard_map over a "data" mesh axis, psum of gradients) gives the parameters
of single-process JAX and of the 2-rank torch run after 20 steps (<= 1e-5; measured 1.6e-7 and
5.9e-7). XLA reads XLA_FLAGS when JAX starts, so it runs in a subprocess."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from .common import ROOT, STEPS, TINY, final_params, subprocess_env, worst_param_error


def test_sharded_jax_step_equals_single_process_and_torch_ranks(tmp_path, single_jax, two_ranks):
    npz = tmp_path / "sharded.npz"
    r = subprocess.run([sys.executable, "-m", "tests.distributed.sharded_reference", str(npz), *TINY, *STEPS], cwd=ROOT,
                       env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sharded = dict(np.load(npz))
    for name, ref in (("single-process JAX", single_jax), ("2 torch ranks", two_ranks[0])):
        err, leaf = worst_param_error(sharded, final_params(ref))
        assert err <= 1e-5, f"vs {name}: {leaf}: {err:.2e}"
