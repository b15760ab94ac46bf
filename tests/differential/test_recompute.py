"""``backend.attention_recompute``: the attention under activation checkpointing (torch.utils.checkpoint,
jax.checkpoint) against the same step without it (the oracle).

Provenance: CPU, both backends, the tiled and the padded kernels (both relative biases on, as in the
quickstart config), and torch with ``backend.compile``: the recomputed forward is the same
computation, so loss and gradients agree to float32 rounding (bitwise where the backend is
deterministic), while autograd keeps far less (torch's saved bytes)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import gr_functional as grf
from gr_functional.step import init_opt_state, micro_grads
from gr_functional.tree import tree_items

CASES = [("torch", "tiled", False), ("torch", "reference", False), ("jax", "tiled", False),
         ("jax", "reference", False), ("torch", "tiled", True)]


def _loss_and_grads(overrides):
    exp = grf.prepare("quickstart", ["train.batch_size=16", "model.num_blocks=2", "model.attention_tile=8",
                                     *overrides])
    B = exp.backend()
    params = B.asarray_tree(exp.init_params())
    opt_state = init_opt_state(B, params, exp.cfg)
    batch = B.asarray_tree(next(iter(exp.batches(0))))
    loss, _, grads = micro_grads(B, params, opt_state, batch, exp.cfg)
    return B, exp.cfg, (params, opt_state, batch), float(loss), dict(tree_items(B.to_numpy_tree(grads)))


@pytest.mark.slow
@pytest.mark.parametrize("backend_name,kernel,compile_", CASES)
def test_recomputed_attention_equals_kept(backend_name, kernel, compile_):
    base = [f"backend.name={backend_name}", f"ops.attention={kernel}"]
    if compile_:
        base.append("backend.compile=true")
    _, _, _, loss, grads = _loss_and_grads(base)
    B, _, _, loss_rc, grads_rc = _loss_and_grads(base + ["backend.attention_recompute=true"])
    assert B.attention_recompute
    assert abs(loss_rc - loss) <= 1e-6 * abs(loss)
    for path, g in grads.items():
        np.testing.assert_allclose(grads_rc[path], g, rtol=1e-5, atol=1e-7 * max(1.0, float(np.abs(g).max())),
                                   err_msg=str(path))


def test_recompute_keeps_less_for_backward_on_torch():
    from gr_functional.step import train_step

    kept = {}
    for on in ("false", "true"):
        B, cfg, args, _, _ = _loss_and_grads(["backend.name=torch", "ops.attention=tiled",
                                              f"backend.attention_recompute={on}"])
        kept[on], kind = B.memory_profile(partial(train_step, B, cfg=cfg), *args)
        assert kind == "autograd_saved"
    assert kept["true"] < kept["false"]


@pytest.mark.parametrize("kernel", ["cpu_fused", "best"])
def test_recompute_adds_nothing_to_a_kernel_that_recomputes(kernel, monkeypatch):
    """The fused kernel's backward already recomputes its tiles from q, k, v: with
    attention_recompute it runs once per layer and step (not again under a checkpoint) and the
    step is bitwise the one without."""
    from backends import cpu_fused

    from .test_cpu_fused import _fused_backend

    _fused_backend()  # builds the extension, or skips where it cannot be built (never under CI)
    calls = []
    tiles = cpu_fused._fused_tiles()
    monkeypatch.setitem(cpu_fused._APPLY, "tiles", lambda *a: calls.append(1) or tiles(*a))
    base = ["backend.name=torch", f"ops.attention={kernel}"]
    _, _, _, loss, grads = _loss_and_grads(base)
    assert len(calls) == 2  # model.num_blocks
    B, _, _, loss_rc, grads_rc = _loss_and_grads(base + ["backend.attention_recompute=true"])
    assert B.attention_recompute and len(calls) == 4
    assert loss_rc == loss
    for path, g in grads.items():
        np.testing.assert_array_equal(grads_rc[path], g, err_msg=str(path))


_FLAGS_PROBE = """
import os
from gr_functional.configure import load_config
from gr_functional.runtime import make_backend
cfg = load_config(None, ["backend.name=jax", "backend.attention_recompute=true"])
B = make_backend(cfg)
print(os.environ.get("XLA_FLAGS", ""))
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset,want", [
    ("", "--xla_cpu_enable_concurrency_optimized_scheduler=false"),
    ("--xla_cpu_enable_concurrency_optimized_scheduler=true", "--xla_cpu_enable_concurrency_optimized_scheduler=true")])
def test_recompute_on_jax_sets_the_low_memory_xla_flag_unless_the_user_did(preset, want):
    """XLA CPU's concurrency-optimized scheduler keeps what the recomputed attention drops, so a
    config with backend.attention_recompute on JAX turns it off before JAX starts (a fresh
    process: the flag is read once); a user's own setting of that flag is kept."""
    import subprocess
    import sys

    from ..reliability.common import ROOT, subprocess_env

    env = subprocess_env(XLA_FLAGS=preset)
    got = subprocess.run([sys.executable, "-c", _FLAGS_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip().splitlines()[-1] == want
