"""Mixed precision (backend.precision = bf16 | fp16) against fp32, on both backends.

bf16/fp16 compute with fp32 master weights: the loss function casts params and dropout masks to
the compute dtype, LayerNorm/L2-norm statistics and the loss's logsumexp run in fp32, gradients
come back in fp32. Tolerances (relative, ``rel_err`` = max|a - ref| / max|ref| per tensor; worst
measured over the layout cases and two seeds on CPU in parentheses):

  bf16: loss 1e-2 (2.8e-3), every gradient leaf 0.1 (3.4e-2), gradient cosine >= 0.999
  fp16: loss 3e-3 (7.9e-4), every gradient leaf 2e-2 (8.4e-3), gradient cosine >= 0.9999
  20-step trajectory, mean loss of the last 5 steps vs fp32: 5e-2 (both)

bf16 keeps 8 mantissa bits (relative spacing 2^-8 = 0.4%), so percent-level gradient error on
small leaves (the time-bias table) is what it costs, not a bug; fp16 keeps 11 bits. (Before the
gathers' gradients accumulated in fp32, ``MixedPrecisionOps.gather_rows``, the bf16 worst was 0.11.)
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.batch import make_batch
from gr_functional.config import BackendConfig, Config, OptimConfig, TrainConfig
from gr_functional.step import init_opt_state, make_train_step, micro_grads
from gr_functional.tree import tree_items

from ..differential.common import finite_grads, rel_err, tree_cosine
from ..differential.test_model import BATCH_CASES, CFG, NEGATIVES

TOL = {"bf16": {"loss": 1e-2, "grad": 0.1, "cos": 0.999},
       "fp16": {"loss": 3e-3, "grad": 2e-2, "cos": 0.9999}}
TRAJ_TOL = 5e-2


def cfg_for(precision, loss_scale=1024.0, window=2000):
    return Config(model=CFG, optim=OptimConfig(lr=1e-3, weight_decay=0.01),
                  backend=BackendConfig(precision=precision),
                  train=TrainConfig(loss_scale=loss_scale, loss_scale_window=window))


def fixed_cap_batch(case, seed):
    """``BATCH_CASES[case]`` at one capacity (t_cap 64, b_cap 8): JAX compiles once per precision."""
    events, _ = BATCH_CASES[case]
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, CFG.num_items + 1, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**6, n)) + 10**9 for n in events]
    return make_batch(histories, times, CFG, rng=rng, num_items=CFG.num_items, b_cap=8, t_cap=64,
                      negatives=NEGATIVES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_low_precision_loss_and_grads_against_fp32(name):
    B = get_backend(name)
    fns = {p: B.jit(partial(micro_grads, B, cfg=cfg_for(p))) for p in ("fp32", "bf16", "fp16")}
    for case in BATCH_CASES:
        params = B.asarray_tree(model.init_params(CFG, seed=10))
        batch = B.asarray_tree(fixed_cap_batch(case, seed=0))
        out = {}
        for precision, fn in fns.items():
            loss, _, grads = finite_grads(B, fn, params, init_opt_state(B, params, cfg_for(precision)), batch,
                                          f"{precision} on case {case}", tries=12)
            out[precision] = (float(loss), grads)
        loss32, grads32 = out["fp32"]
        for precision in ("bf16", "fp16"):
            loss, grads = out[precision]
            tol = TOL[precision]
            assert abs(loss - loss32) <= tol["loss"] * abs(loss32), (case, precision)
            for key, g in grads.items():
                assert rel_err(g, grads32[key]) <= tol["grad"], (case, precision, key)
            assert tree_cosine(grads, grads32) >= tol["cos"], (case, precision)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_low_precision_trajectories_track_fp32(name):
    """20 steps over 5 cycled batches: bf16 and fp16 (fixed scale, no skips) train like fp32."""
    B = get_backend(name)
    batches = [B.asarray_tree(fixed_cap_batch("mixed", seed=s)) for s in range(5)]
    params0 = model.init_params(CFG, seed=6)
    tails = {}
    for precision in ("fp32", "bf16", "fp16"):
        cfg = cfg_for(precision, loss_scale=256.0, window=10**6)
        step = make_train_step(B, cfg)
        params = B.asarray_tree(params0)
        state = init_opt_state(B, params, cfg)
        losses = []
        for i in range(20):
            params, state, m = step(params, state, batches[i % 5])
            assert bool(m["finite"]), (precision, i)
            losses.append(float(m["loss"]))
        assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), precision   # it trains
        assert all(leaf.dtype == np.float32 for _, leaf in tree_items(B.to_numpy_tree(params)))
        tails[precision] = np.mean(losses[-5:])
    for precision in ("bf16", "fp16"):
        assert abs(tails[precision] - tails["fp32"]) <= TRAJ_TOL * tails["fp32"], precision


def test_fp16_dynamic_loss_scaling():
    """An overflowing scale skips the step (params and Adam state unchanged) and halves; after
    ``loss_scale_window`` clean steps the scale doubles (torch GradScaler's rule)."""
    B = get_backend("torch")
    cfg = cfg_for("fp16", loss_scale=2.0**16, window=3)
    step = make_train_step(B, cfg)
    batch = B.asarray_tree(fixed_cap_batch("mixed", seed=0))
    params = B.asarray_tree(model.init_params(CFG, seed=1))
    state = init_opt_state(B, params, cfg)
    scales, finite = [], []
    for _ in range(14):
        before = B.to_numpy_tree(params)
        params, new_state, m = step(params, state, batch)
        scales.append(float(m["loss_scale"]))
        finite.append(bool(m["finite"]))
        if not finite[-1]:
            for (key, a), (_, b) in zip(tree_items(before), tree_items(B.to_numpy_tree(params))):
                assert np.array_equal(a, b), key
            assert float(new_state["step"]) == float(state["step"])
            assert bool(m["loss_finite"])   # the loss is fine; its scaled gradient overflowed
        state = new_state
    first_ok = finite.index(True)
    assert first_ok >= 1 and not any(finite[:first_ok])
    assert scales[:first_ok + 1] == [2.0**16 / 2**i for i in range(first_ok + 1)]   # halved per overflow
    ok_scale = scales[first_ok]
    assert finite[first_ok:first_ok + 3] == [True] * 3
    assert scales[first_ok + 3] == 2 * ok_scale        # doubled after 3 clean steps


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_runner_switch(precision, tmp_path):
    """``--set backend.precision=...`` end to end. fp16 starts at loss scale 2^16 (GradScaler's
    default), which overflows on this model: the first steps are logged as skipped overflows
    (not counted as bad steps) until the scale fits, then train lines carry the scale."""
    from gr_functional.cli import main

    from .common import TINY, metrics, sets

    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path)]
                + sets(TINY + ["train.epochs=2", f"backend.precision={precision}"])) == 0
    lines = metrics(tmp_path)
    train = [m for m in lines if m["kind"] == "train"]
    assert train and all(np.isfinite(m["loss"]) for m in train)
    assert ("loss_scale" in train[-1]) == (precision == "fp16")
    skips = [m for m in lines if m["kind"] == "skip"]
    if precision == "fp16":
        assert skips and all("fp16 gradient overflow" in m["reason"] and m["bad_in_a_row"] == 0 for m in skips)
        assert skips[0]["next_loss_scale"] == 32768.0
    else:
        assert not skips
    assert any(m["kind"] == "eval" for m in lines)
