"""The project's models as flax.nnx modules, for JAX users who put them inside their own models.

    from gr_functional.interop.flax_nnx import HSTU
    hstu = HSTU(exp.cfg.model, exp.init_params())        # or HSTU(cfg.model, seed=42)
    user = hstu(batch)                                   # user[T, D], L2-normalised
    loss = hstu.loss(batch, exp.cfg.loss)                # the registered loss of cfg.loss
    optimizer = nnx.Optimizer(hstu, optax.adamw(1e-3, b2=0.98), wrt=nnx.Param)

A module holds the functional parameter tree one-to-one: every leaf of ``init_params``' tree is an
``nnx.Param`` at the same path (``blocks.0.w_uvqk`` is ``hstu.blocks[0]["w_uvqk"]``, and
``nnx.state(hstu, nnx.Param)`` has exactly the tree's paths), and ``hstu.params()`` gives the
tree back (numpy or JAX arrays in, JAX arrays out), so checkpoints of ``grf train``
load into a module and a module's parameters save as one. The forward pass is the project's own
function (``model.encode`` / ``ranking_logits``) on the JAX backend: outputs and gradients are the
functional model's, not a re-implementation's (tests/differential/test_flax.py).

A JAX-only interop module (flax imports JAX) beside the package it wraps: the run loop, the step and
the backends never import it (tests/test_layering.py), so ``gr_functional`` still imports no array
library unless a user asks for flax.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from backends import get_backend

from .. import model as model_mod
from ..config import LossConfig, ModelConfig
from ..ranking import model as ranking_mod


def _node(tree: Any):
    """An nnx tree of ``tree``: dicts become ``nnx.Dict``, lists ``nnx.List``, arrays ``nnx.Param``."""
    if isinstance(tree, dict):
        return nnx.Dict({k: _node(v) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return nnx.List([_node(v) for v in tree])
    return nnx.Param(jnp.asarray(tree))


def _tree(node: Any):
    """The inverse of ``_node``: the plain parameter tree (JAX arrays) of an nnx tree."""
    if isinstance(node, (nnx.Dict, dict)):
        return {k: _tree(node[k]) for k in node}
    if isinstance(node, (nnx.List, list)):
        return [_tree(v) for v in node]
    if isinstance(node, nnx.Param):
        return node[...]
    raise TypeError(f"not a parameter node: {type(node).__name__}")


class _Functional(nnx.Module):
    """A module whose attributes are the top-level keys of a functional parameter tree."""

    _keys: tuple = ()

    def _hold(self, params: dict) -> None:
        self._keys = tuple(params)
        for key, value in params.items():
            setattr(self, key, _node(value))

    def params(self) -> dict:
        """The functional parameter tree (JAX arrays): what ``grf train`` checkpoints."""
        return {key: _tree(getattr(self, key)) for key in self._keys}


class HSTU(_Functional):
    """The retrieval model ``cfg.name`` (HSTU by default) as an nnx module.

    ``HSTU(cfg, params=None, *, seed=0)``: ``params`` a functional tree (``init_params`` or a
    checkpoint's), else freshly initialised from ``seed`` exactly as ``grf train`` does.
    ``cfg.num_items`` must be set (``grf.prepare`` resolves it from the data)."""

    def __init__(self, cfg: ModelConfig, params: dict | None = None, *, seed: int = 0, dtype: str = "float32"):
        if cfg.num_items < 1 and params is None:
            raise ValueError("HSTU(cfg): cfg.num_items is 0; resolve it from the data (grf.prepare) or pass params")
        self.cfg = cfg
        self.backend = get_backend("jax", dtype=dtype)
        self._hold(params if params is not None else model_mod.model_of(cfg).init_params(cfg, seed=seed))

    def __call__(self, batch):
        """``user[T, D]``: the L2-normalised output at every position of ``batch`` (an HSTUBatch)."""
        return model_mod.model_of(self.cfg).encode(self.backend, self.params(), batch, self.cfg)

    def loss(self, batch, loss: LossConfig = LossConfig()):
        """The training loss of ``batch`` under ``loss`` (a registered loss; GR's by default)."""
        return model_mod.loss_fn(self.backend, self.params(), batch, self.cfg, loss=loss)

    def score_last(self, batch):
        """``[B, N+1]`` scores of every item for each sequence's last position (evaluation)."""
        return model_mod.score_last(self.backend, self.params(), batch, self.cfg)


class RankingModel(_Functional):
    """The ranking model (dlrm_v3's HSTU ranker, ``gr_functional.ranking``) as an nnx module;
    ``cfg`` is a ``RankingModelConfig`` (``grf.prepare(...).cfg`` of a ranking config gives it
    through ``ranking.task.model_config``)."""

    def __init__(self, cfg, params: dict | None = None, *, seed: int = 0, dtype: str = "float32"):
        self.cfg = cfg
        self.backend = get_backend("jax", dtype=dtype)
        self._hold(params if params is not None else ranking_mod.init_ranking_params(cfg, seed=seed))

    def __call__(self, batch):
        """``logits[c, K]`` of every candidate of ``batch`` (a RankingBatch) and task."""
        return ranking_mod.ranking_logits(self.backend, self.params(), batch, self.cfg)

    def loss(self, batch):
        """``(loss, per_task[K])``: GR's sum over tasks of 0.2 x mean BCE."""
        return ranking_mod.ranking_loss(self.backend, self.params(), batch, self.cfg)
