"""The package's AdamW (``optimizers`` by ``optim.name``, the step's dense optimizer) and its schedule
against the two oracles, optax.adamw and torch.optim.AdamW, on the same grads."""
from __future__ import annotations

import numpy as np
import optax
import pytest
import torch

from backends import get_backend
from gr_functional.config import OptimConfig
from gr_functional.optimizers import apply_updates, build, schedules
from gr_functional.tree import tree_items

from .common import FWD_TOL, rel_err

OPT = OptimConfig(lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.05)


def _problem(seed=0, steps=5):
    rng = np.random.default_rng(seed)
    params = {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)]}
    grads = [{"a": rng.standard_normal((4, 3)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)]}
             for _ in range(steps)]
    return params, grads


def _adamw(B, params, grads, cfg: OptimConfig):
    """``params`` after one AdamW update per gradient, by the optimizer the step builds."""
    tx = build(B, cfg)
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    for g in grads:
        updates, state = tx.update(B, B.asarray_tree(g), state, p)
        p = apply_updates(B, p, updates)
    return p


def _learning_rate(xp, t, cfg: OptimConfig):
    return schedules.from_config(cfg)(xp, t)


def _ours(name, params, grads):
    B = get_backend(name)
    return {k: B.to_numpy(v) for k, v in tree_items(_adamw(B, params, grads, OPT))}


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_adamw_matches_optax(name):
    params, grads = _params_grads = _problem()
    tx = optax.adamw(OPT.lr, b1=OPT.beta1, b2=OPT.beta2, eps=OPT.eps, weight_decay=OPT.weight_decay)
    p = params
    state = tx.init(p)
    for g in grads:
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
    want = {k: np.asarray(v) for k, v in tree_items(p)}
    got = _ours(name, params, grads)
    for key in want:
        assert rel_err(got[key], want[key]) <= FWD_TOL, key


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_adamw_matches_torch_optim(name):
    params, grads = _problem(1)
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in tree_items(params)}
    opt = torch.optim.AdamW(list(leaves.values()), lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps,
                            weight_decay=OPT.weight_decay)
    for g in grads:
        for k, v in tree_items(g):
            leaves[k].grad = torch.tensor(v)
        opt.step()
    got = _ours(name, params, grads)
    for key, leaf in leaves.items():
        assert rel_err(got[key], leaf.detach().numpy()) <= FWD_TOL, key


# ----------------------------------------------------------------------------- learning-rate schedules
def _optax_schedule(cfg: OptimConfig):
    W, D, lr, end = cfg.warmup_steps, cfg.decay_steps, cfg.lr, cfg.lr * cfg.end_lr_factor
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, W, W + D, end)
    after = optax.constant_schedule(lr) if cfg.schedule == "constant" else optax.linear_schedule(lr, end, D)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, W), after], [W]) if W else after


SCHEDULES = [OptimConfig(lr=3e-3, schedule="constant", warmup_steps=4),
             OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=3, decay_steps=6, end_lr_factor=0.1),
             OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=0, decay_steps=5),
             OptimConfig(lr=3e-3, schedule="linear", warmup_steps=2, decay_steps=4, end_lr_factor=0.25)]


@pytest.mark.parametrize("name", ["jax", "torch"])
@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: f"{c.schedule}-w{c.warmup_steps}-d{c.decay_steps}")
def test_schedule_equals_optax_at_the_update_count(name, cfg):
    B = get_backend(name)
    sched = _optax_schedule(cfg)
    for t in range(1, 14):
        got = float(B.to_numpy(B.asarray(_learning_rate(B.xp, B.asarray(float(t)), cfg))))
        assert abs(got - float(sched(t))) <= 1e-6 * cfg.lr, (t, got, float(sched(t)))


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_scheduled_adamw_matches_optax(name):
    import dataclasses

    cfg = dataclasses.replace(OPT, schedule="cosine", warmup_steps=2, decay_steps=3, end_lr_factor=0.1)
    sched = _optax_schedule(cfg)
    params, grads = _problem(2, steps=7)
    # optax counts from 0; ours evaluates the schedule at the 1-based update number
    tx = optax.adamw(lambda count: sched(count + 1), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay)
    p, state = params, tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
    B = get_backend(name)
    q = _adamw(B, params, grads, cfg)
    for (key, want), (_, got) in zip(tree_items(p), tree_items(q)):
        assert rel_err(B.to_numpy(got), np.asarray(want)) <= FWD_TOL, key


def test_learning_rate_refuses_an_unresolved_run_long_decay():
    with pytest.raises(ValueError, match="resolve_schedule"):
        _learning_rate(np, 1.0, OptimConfig(schedule="cosine", decay_steps=0))
