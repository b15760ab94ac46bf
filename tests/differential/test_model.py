"""HSTU block, full loss, all gradients, one optimizer step and a 50-step trajectory: every backend
of GRF_TEST_BACKENDS (and every registered attention kernel on it) vs the JAX reference."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.batch import Negatives, make_batch
from gr_functional.config import Config, ModelConfig, OptimConfig
from .optim_oracle import adamw_init, adamw_update
from gr_functional.step import make_train_step
from gr_functional.tree import tree_items

from .common import (FWD_TOL, GRAD_TOL, MAX_LEN, REFERENCE_BACKEND, TRAJ_TOL, compared_backends, kernel_backend,
                     kernel_params, rel_err)

CFG = ModelConfig(num_items=200, embed_dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, max_len=MAX_LEN,
                  input_dropout=0.2, linear_dropout=0.2)
NEGATIVES = Negatives("sampled", 16)

# name -> (number of events per user, b_cap); a user of n events gives n-1 input tokens
BATCH_CASES = {
    "len1": ([2, 2, 2], None),
    "maxlen": ([MAX_LEN + 1] * 3, None),
    "longer_than_max_len": ([MAX_LEN + 9, 5], None),  # truncated to the most recent max_len
    "mixed": ([3, MAX_LEN + 1, 2, 8, 5], None),
    "single": ([7], None),
    "empty_slots": ([4, 6, 2], 8),
}


def make_train_batch(case, seed=0, cfg=CFG):
    events, b_cap = BATCH_CASES[case]
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, cfg.num_items + 1, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**6, n)) + 10**9 for n in events]
    return make_batch(histories, times, cfg, rng=rng, num_items=cfg.num_items, b_cap=b_cap, negatives=NEGATIVES)


def on_reference_and_compared(fn):
    """``(fn(reference backend), {name: fn(backend name)})`` for every backend of GRF_TEST_BACKENDS
    but the reference (JAX); skips when there is none to compare."""
    others = compared_backends()
    if not others:
        pytest.skip(f"GRF_TEST_BACKENDS names no backend besides the reference {REFERENCE_BACKEND!r}")
    return fn(get_backend(REFERENCE_BACKEND)), {name: fn(get_backend(name)) for name in others}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_block_forward_and_grads(case):
    batch = make_train_batch(case)
    params = model.init_params(CFG, seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch.layout.t_cap, CFG.embed_dim)).astype(np.float32)
    x[batch.layout.num_tokens():] = 0
    cot = rng.standard_normal(x.shape).astype(np.float32)

    def run(B):
        inputs = B.asarray_tree({"block": params["blocks"][0], "x": x})
        b = B.asarray_tree(batch)
        keep = b.block_keep[0]
        out = model.hstu_block(B, inputs["block"], inputs["x"], b, CFG, keep)
        _, g = B.value_and_grad(lambda a: B.xp.sum(
            model.hstu_block(B, a["block"], a["x"], b, CFG, keep) * B.asarray(cot)))(inputs)
        return B.to_numpy(out), {k: B.to_numpy(v) for k, v in tree_items(g)}

    ref, res = on_reference_and_compared(run)
    for name, (out, g) in res.items():
        assert rel_err(out, ref[0]) <= FWD_TOL, name
        for key, want in ref[1].items():
            assert rel_err(g[key], want) <= GRAD_TOL, (name, key)


# tiles of 4 tokens: several chunks per sequence for the kernels that use the tile plan
KERNEL_CFG = dataclasses.replace(CFG, attention_tile=4)


def _loss_and_grads(B, case):
    batch = make_train_batch(case, cfg=KERNEL_CFG)
    params = model.init_params(KERNEL_CFG, seed=3)
    loss, g = B.value_and_grad(lambda p, b: model.loss_fn(B, p, b, KERNEL_CFG))(
        B.asarray_tree(params), B.asarray_tree(batch))
    return float(loss), {k: B.to_numpy(v) for k, v in tree_items(g)}


@functools.lru_cache(maxsize=None)
def _reference_loss_and_grads(case):
    """The reference: the JAX backend with the padded reference attention."""
    return _loss_and_grads(get_backend(REFERENCE_BACKEND, ops={"attention": "reference"}), case)


def check_model_kernel(B, case: str) -> None:
    """The full loss and every parameter's gradient on backend B (its attention kernel) vs the
    JAX reference with the padded attention, on batch case ``case``."""
    want_loss, want = _reference_loss_and_grads(case)
    loss, got = _loss_and_grads(B, case)
    assert np.isfinite(want_loss)
    assert rel_err(loss, want_loss) <= FWD_TOL, f"{B.name}/{B.hstu_kernel} loss"
    assert set(got) == set(want) == {k for k, _ in tree_items(model.init_params(KERNEL_CFG, seed=3))}
    for key, g in want.items():
        assert np.isfinite(got[key]).all(), key
        assert rel_err(got[key], g) <= GRAD_TOL, f"{B.name}/{B.hstu_kernel} d{key}"


# Kernels interpreted on the CPU (Pallas' interpret mode) run the whole model on one layout: their
# kernel tests (test_ops.py) cover every layout, and interpreting six models takes a minute.
INTERPRETED = {"pallas"}


@pytest.mark.slow
@pytest.mark.parametrize("backend_name, kernel, case", [
    pytest.param(*p.values, case, id=f"{p.id}-{case}") for p in kernel_params()
    if tuple(p.values) != (REFERENCE_BACKEND, "reference") for case in BATCH_CASES
    if p.values[1] not in INTERPRETED or case == "mixed"])
def test_loss_and_every_gradient(backend_name, kernel, case):
    """Every registered attention kernel on every backend of GRF_TEST_BACKENDS that implements
    it: loss and all gradients vs the JAX reference (padded attention)."""
    check_model_kernel(kernel_backend(backend_name, kernel), case)


@pytest.mark.slow
def test_padding_does_not_change_the_loss(backend):
    """The same sequences under larger capacities (more padding rows, more empty slots) give the
    same loss: padding belongs to no sequence."""
    rng = np.random.default_rng(0)
    events = [5, MAX_LEN + 1, 3]
    histories = [rng.integers(1, CFG.num_items + 1, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**6, n)) for n in events]
    cfg = ModelConfig(**{**CFG.__dict__, "input_dropout": 0.0, "linear_dropout": 0.0})
    small = make_batch(histories, times, cfg, rng=np.random.default_rng(1), num_items=cfg.num_items,
                       negatives=NEGATIVES)
    big = make_batch(histories, times, cfg, rng=np.random.default_rng(1), num_items=cfg.num_items,
                     t_cap=small.layout.t_cap * 3, b_cap=9, negatives=NEGATIVES)
    params = model.init_params(cfg, seed=0)
    B = backend
    losses = [float(model.loss_fn(B, B.asarray_tree(params), B.asarray_tree(b), cfg)) for b in (small, big)]
    assert rel_err(losses[1], losses[0]) <= FWD_TOL


@pytest.mark.slow
def test_one_optimizer_step_same_grads():
    """One AdamW step on identical gradients: torch and JAX give the same parameters. (Gradients
    are compared separately: Adam's first step is ~lr*sign(g), which would amplify grad noise.)"""
    params = model.init_params(CFG, seed=4)
    rng = np.random.default_rng(5)
    grads = {k: v for k, v in tree_items(params)}
    from gr_functional.tree import tree_map
    grads = tree_map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    opt = OptimConfig(lr=1e-3, beta1=0.9, beta2=0.98, weight_decay=0.01)

    def run(B):
        p = B.asarray_tree(params)
        state = adamw_init(B, p)
        for _ in range(3):
            p, state = adamw_update(B, B.asarray_tree(grads), state, p, opt)
        return {k: B.to_numpy(v) for k, v in tree_items(p)}

    ref, res = on_reference_and_compared(run)
    for name, got in res.items():
        for key, value in ref.items():
            assert rel_err(got[key], value) <= FWD_TOL, (name, key)


@pytest.mark.slow
def test_50_step_trajectory():
    """50 training steps (dropout on, masks as data) over 5 cycled batches: loss curves agree."""
    cfg = Config(model=CFG, optim=OptimConfig(lr=1e-3, weight_decay=0.01))
    batches = [make_train_batch("mixed", seed=s) for s in range(5)]
    params = model.init_params(CFG, seed=6)

    def run(B):
        step = make_train_step(B, cfg)
        p = B.asarray_tree(params)
        state = adamw_init(B, p)
        dev_batches = [B.asarray_tree(b) for b in batches]
        losses = []
        for i in range(50):
            p, state, metrics = step(p, state, dev_batches[i % 5])
            losses.append(float(metrics["loss"]))
        return np.array(losses)

    ref, res = on_reference_and_compared(run)
    assert ref[-1] < ref[0]  # it trains
    for name, losses in res.items():
        assert rel_err(losses, ref) <= TRAJ_TOL, name
