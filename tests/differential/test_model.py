"""HSTU block, full loss, all gradients, one optimizer step and a 50-step trajectory: torch vs JAX."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.batch import make_batch
from gr_functional.config import Config, ModelConfig, OptimConfig
from gr_functional.optim import adamw_init, adamw_update
from gr_functional.train import make_train_step
from gr_functional.tree import tree_items

from .common import FWD_TOL, GRAD_TOL, MAX_LEN, TRAJ_TOL, rel_err

CFG = ModelConfig(num_items=200, embed_dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, max_len=MAX_LEN,
                  num_negatives=16, input_dropout=0.2, linear_dropout=0.2)

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
    return make_batch(histories, times, cfg, rng=rng, num_items=cfg.num_items, b_cap=b_cap)


def both(fn):
    return {name: fn(get_backend(name)) for name in ("jax", "torch")}


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

    res = both(run)
    assert rel_err(res["torch"][0], res["jax"][0]) <= FWD_TOL
    for key, g in res["jax"][1].items():
        assert rel_err(res["torch"][1][key], g) <= GRAD_TOL, key


@pytest.mark.parametrize("case", list(BATCH_CASES))
@pytest.mark.parametrize("kernel", ["tiled", "reference"])
def test_loss_and_every_gradient(case, kernel):
    """Both attention kernels (tiles of 4 tokens: several chunks per sequence), torch vs JAX."""
    cfg = dataclasses.replace(CFG, attention_tile=4)
    batch = make_train_batch(case, cfg=cfg)
    params = model.init_params(CFG, seed=3)

    def run(B):
        B = get_backend(B.name, hstu_kernel=kernel)
        loss, g = B.value_and_grad(lambda p, b: model.loss_fn(B, p, b, cfg))(
            B.asarray_tree(params), B.asarray_tree(batch))
        return float(loss), {k: B.to_numpy(v) for k, v in tree_items(g)}

    res = both(run)
    assert np.isfinite(res["jax"][0])
    assert rel_err(res["torch"][0], res["jax"][0]) <= FWD_TOL
    assert set(res["jax"][1]) == set(res["torch"][1]) == {k for k, _ in tree_items(params)}
    for key, g in res["jax"][1].items():
        assert np.isfinite(g).all(), key
        assert rel_err(res["torch"][1][key], g) <= GRAD_TOL, key


def test_padding_does_not_change_the_loss():
    """The same sequences under larger capacities (more padding rows, more empty slots) give the
    same loss: padding belongs to no sequence."""
    rng = np.random.default_rng(0)
    events = [5, MAX_LEN + 1, 3]
    histories = [rng.integers(1, CFG.num_items + 1, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**6, n)) for n in events]
    cfg = ModelConfig(**{**CFG.__dict__, "input_dropout": 0.0, "linear_dropout": 0.0})
    small = make_batch(histories, times, cfg, rng=np.random.default_rng(1), num_items=cfg.num_items)
    big = make_batch(histories, times, cfg, rng=np.random.default_rng(1), num_items=cfg.num_items,
                     t_cap=small.layout.t_cap * 3, b_cap=9)
    params = model.init_params(cfg, seed=0)
    B = get_backend("torch")
    losses = [float(model.loss_fn(B, B.asarray_tree(params), B.asarray_tree(b), cfg)) for b in (small, big)]
    assert rel_err(losses[1], losses[0]) <= FWD_TOL


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

    res = both(run)
    for key, value in res["jax"].items():
        assert rel_err(res["torch"][key], value) <= FWD_TOL, key


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

    res = both(run)
    assert res["jax"][-1] < res["jax"][0]  # it trains
    assert rel_err(res["torch"], res["jax"]) <= TRAJ_TOL
