"""A researcher's variant, as a plugin: GR's HSTU with a learned output head (a parameter of its own),
trained with an optimizer of one's own (SGD with a clipped update), by ``grf train`` itself: run
folder, checkpoints, exact resume, ``grf eval`` and ``grf report`` keep working, and the names go
into config.toml so a resume or ``grf eval`` re-imports this file.

    grf train --config quickstart --plugin experiments/hstu_head_model.py \
        --set model.name=hstu_head --set optim.name=clipped_sgd --out runs/hstu_head

The objective is the registered loss ``loss.name`` (any of losses.py's, or one of your own:
experiments/bpr_loss.py). tests/test_model_plugin.py trains, resumes and evaluates it.
"""
from __future__ import annotations

import numpy as np

import gr_functional as grf
from gr_functional import optimizers as O
from gr_functional.optimizers.schedules import learning_rate_at
from gr_functional.tree import tree_map


def init_params(cfg, seed: int = 0, num_items: int | None = None) -> dict:
    """HSTU's parameters plus ``head`` [D, D], starting at the identity (the model starts as HSTU)."""
    params = grf.model.init_params(cfg, seed=seed, num_items=num_items)
    params["head"] = np.eye(cfg.embed_dim, dtype=np.float32)
    return params


def param_shapes(cfg, num_items: int | None = None) -> dict:
    return {**grf.model.param_shapes(cfg, num_items), "head": (cfg.embed_dim, cfg.embed_dim)}


@grf.model.register_model("hstu_head", init_params=init_params, param_shapes=param_shapes)
def encode(B, params, batch, cfg, trace=None):
    """HSTU's user embeddings through the head, L2-normalised again: user[T, D]."""
    user = grf.model.encode(B, params, batch, cfg, trace)
    return B.l2_normalize(B.xp.matmul(user, params["head"]), cfg.l2_eps)


@O.register_optimizer("clipped_sgd")
def clipped_sgd(cfg, learning_rate):
    """SGD with momentum whose per-element update is clipped to +-lr (``optim.momentum``)."""
    def clip(B, updates, state, params=None):
        xp = B.xp
        lr = learning_rate_at(learning_rate, xp, state["step"])  # the update sgd just counted
        return tree_map(lambda u: xp.clip(u, -lr, lr), updates), state

    sgd = O.sgd(learning_rate, momentum=cfg.momentum or None)
    return O.GradientTransformation(sgd.init, lambda B, u, s, p=None: clip(B, *sgd.update(B, u, s, p)))
