"""Our pure AdamW against the two oracles, optax.adamw and torch.optim.AdamW, on the same grads."""
from __future__ import annotations

import numpy as np
import optax
import pytest
import torch

from backends import get_backend
from gr_functional.config import OptimConfig
from gr_functional.optim import adamw_init, adamw_update
from gr_functional.tree import tree_items

from .common import FWD_TOL, rel_err

OPT = OptimConfig(lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.05)


def _problem(seed=0, steps=5):
    rng = np.random.default_rng(seed)
    params = {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)]}
    grads = [{"a": rng.standard_normal((4, 3)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)]}
             for _ in range(steps)]
    return params, grads


def _ours(name, params, grads):
    B = get_backend(name)
    p = B.asarray_tree(params)
    state = adamw_init(B, p)
    for g in grads:
        p, state = adamw_update(B, B.asarray_tree(g), state, p, OPT)
    return {k: B.to_numpy(v) for k, v in tree_items(p)}


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
