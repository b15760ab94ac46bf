"""The pure training step and the evaluation scorer.

``train_step(B, params, opt_state, batch, cfg) -> (params, opt_state, metrics)`` has no side
effects; ``make_train_step(B, cfg)`` returns it bound to a backend and config and jitted by
the backend (``jax.jit`` on JAX, eager on torch).
"""
from __future__ import annotations

from functools import partial

from . import model
from .batch import HSTUBatch
from .config import Config
from .optim import adamw_update


def train_step(B, params: dict, opt_state: dict, batch: HSTUBatch, cfg: Config):
    loss, grads = B.value_and_grad(partial(model.loss_fn, B, cfg=cfg.model))(params, batch)
    params, opt_state = adamw_update(B, grads, opt_state, params, cfg.optim)
    return params, opt_state, {"loss": loss}


def make_train_step(B, cfg: Config):
    return B.jit(partial(train_step, B, cfg=cfg))


def make_scorer(B, cfg: Config):
    """``scores = scorer(params, batch)`` -> [B_cap, N+1] for the last position of each history."""
    return B.jit(partial(model.score_last, B, cfg=cfg.model))
