"""HSTU (research layer of meta-recsys/generative-recommenders), written once for every backend.

Per block, on jagged x[T, D] (generative-recommenders research/modeling/sequential/hstu.py):
    u, v, q, k = split(SiLU(LN(x) @ W_uvqk))                   LN parameter-free, eps 1e-6
    A V        = sum_{j<=i} SiLU(q_i.k_j + rab_pos + rab_time) / n * v_j   (n fixed, no 1/sqrt(d))
    x          = x + Dropout(u * LN(A V)) @ W_o + b_o
Input: E_item[id] * sqrt(D) + E_pos[pos], dropout; output: L2-normalised. Loss: a registered loss
(losses.py; GR's sampled softmax by default) over L2-normalised item embeddings, negatives passed
in as data.

The retrieval task's model is a seam: ``model.name`` picks a registered ``RetrievalModel`` (this
HSTU is ``"hstu"``). A model of one's own (another normaliser, an extra head with its own
parameters) is three functions and one ``register_model`` call in a ``--plugin`` module; the
loss, the scorer, checkpoints, resume, ``grf eval`` and ``grf report`` use it unchanged::

    @grf.model.register_model("my_hstu", init_params=my_init, param_shapes=my_shapes)
    def my_encode(B: Backend, params, batch, cfg, trace=None):   # user[T, D], L2-normalised
        ...
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from . import losses
from .batch import HSTUBatch
from .config import LossConfig, ModelConfig
from .errors import ConfigError
from .registry import Registry
from .tree import tree_items
from .contracts import Backend


def param_shapes(cfg: ModelConfig, num_items: int | None = None) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of every parameter ``init_params`` makes, paths as ``tree.tree_items``
    names them (``blocks.0.w_uvqk``); no allocation: checkpoints and the memory estimate are
    checked against it. ``num_items``: rows of the item table minus one (a hash table's capacity;
    default ``cfg.num_items``)."""
    n_items = num_items or cfg.num_items
    D, n, hv = cfg.embed_dim, cfg.norm_len, cfg.num_heads * cfg.dv
    shapes = {"item_emb": (n_items + 1, D), "pos_emb": (n + 1, D)}
    for i in range(cfg.num_blocks):
        shapes.update({f"blocks.{i}.w_uvqk": (D, sum(cfg.uvqk_splits)), f"blocks.{i}.w_o": (hv, D),
                       f"blocks.{i}.b_o": (D,)})
        if cfg.pos_bias:
            shapes[f"blocks.{i}.rab_pos"] = (2 * n - 1,)
        if cfg.time_bias:
            shapes[f"blocks.{i}.rab_time"] = (cfg.num_time_buckets + 1,)
    return shapes


def xavier_normal(rng: np.random.Generator, shape, fans: tuple[int, int] | None = None) -> np.ndarray:
    """float32 N(0, 2 / (fan_in + fan_out)); fans default to ``shape[:2]``."""
    fan_in, fan_out = fans or shape[:2]
    return (rng.standard_normal(shape) * math.sqrt(2.0 / (fan_in + fan_out))).astype(np.float32)


def xavier_uniform(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 U(+-sqrt(6 / (fan_in + fan_out))) of a ``[fan_in, fan_out]`` matrix."""
    a = math.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-a, a, shape).astype(np.float32)


def init_params(cfg: ModelConfig, seed: int = 0, num_items: int | None = None) -> dict:
    """Parameters as a nested dict of numpy float32 arrays, identical on every backend.

      item_emb[N+1, D]  truncated normal std 0.02, row 0 (padding) zero
      pos_emb[n+1, D]   xavier normal (GR re-initialises it so)
      blocks[i]: w_uvqk[D, 2*H*dv + 2*H*dqk] N(0, 0.02); w_o[H*dv, D] xavier uniform;
                 b_o[D] U(+-1/sqrt(H*dv)); rab_pos[2n-1], rab_time[K+1] N(0, 0.02) (if enabled)
    """
    n_items = num_items or cfg.num_items
    if n_items <= 0:
        raise ValueError("model.num_items must be set (> 0) before initialising parameters")
    rng = np.random.default_rng(seed)
    D, n = cfg.embed_dim, cfg.norm_len
    hv = cfg.num_heads * cfg.dv

    def trunc_normal(shape, std):
        x = rng.standard_normal(shape)
        bad = np.abs(x) > 2.0
        while bad.any():
            x[bad] = rng.standard_normal(int(bad.sum()))
            bad = np.abs(x) > 2.0
        return (x * std).astype(np.float32)

    item_emb = trunc_normal((n_items + 1, D), 0.02)
    item_emb[0] = 0.0
    params = {"item_emb": item_emb, "pos_emb": xavier_normal(rng, (n + 1, D)), "blocks": []}
    for _ in range(cfg.num_blocks):
        block = {
            "w_uvqk": (rng.standard_normal((D, sum(cfg.uvqk_splits))) * 0.02).astype(np.float32),
            "w_o": xavier_uniform(rng, (hv, D)),
            "b_o": rng.uniform(-1 / math.sqrt(hv), 1 / math.sqrt(hv), (D,)).astype(np.float32),
        }
        if cfg.pos_bias:
            block["rab_pos"] = (rng.standard_normal(2 * n - 1) * 0.02).astype(np.float32)
        if cfg.time_bias:
            block["rab_time"] = (rng.standard_normal(cfg.num_time_buckets + 1) * 0.02).astype(np.float32)
        params["blocks"].append(block)
    return params


def hstu_block(B: Backend, p: dict, x, batch: HSTUBatch, cfg: ModelConfig, keep=None, trace: dict | None = None,
               name: str = "block", memo: dict | None = None):
    """One HSTU block on x[T, D] -> [T, D]; ``keep[T, H*dv]`` is the dropout mask or None;
    ``memo``: the batch's index arrays shared by the blocks (``AttentionBias.memo``)."""
    xp = B.xp
    T = x.shape[0]
    H = cfg.num_heads
    normed = B.layer_norm(x, cfg.ln_eps)
    u, v, q, k = B.hstu_uvqk(normed, p["w_uvqk"], cfg.uvqk_splits)
    av = B.hstu_attention(
        xp.reshape(q, (T, H, cfg.dqk)), xp.reshape(k, (T, H, cfg.dqk)), xp.reshape(v, (T, H, cfg.dv)),
        batch.layout, cfg.norm_len,
        B.AttentionBias(pos_w=p.get("rab_pos"), ts_w=p.get("rab_time"), ts=batch.ts, query_ts=batch.query_ts,
                        memo=memo))
    av = xp.reshape(av, (T, H * cfg.dv))
    y = B.hstu_norm_mul(av, u, cfg.ln_eps)
    if keep is not None:
        y = y * keep
    out = x + xp.matmul(y, p["w_o"]) + p["b_o"]
    out = out * xp.reshape(B.token_mask(batch.layout), (-1, 1))
    if trace is not None:
        trace[f"{name}.uvqk"] = xp.concat([u, v, q, k], axis=1)
        trace[f"{name}.attention"] = av
        trace[f"{name}.norm_mul"] = y
        trace[f"{name}.output"] = out
    return out


def trace_names(cfg: ModelConfig) -> list[str]:
    """Names ``loss_fn`` writes into ``trace``, in forward order."""
    names = ["input"]
    for i in range(cfg.num_blocks):
        names += [f"blocks.{i}.{part}" for part in ("uvqk", "attention", "norm_mul", "output")]
    return names + ["output", "loss"]


def encode(B: Backend, params: dict, batch: HSTUBatch, cfg: ModelConfig, trace: dict | None = None):
    """User embeddings ``[T, D]`` (L2-normalised) at every position. ``trace``, if a dict, is
    filled with the named activations of every layer in forward order (used by crosscheck)."""
    xp = B.xp
    layout = batch.layout
    x = B.gather_table(params["item_emb"], layout.values) * math.sqrt(cfg.embed_dim)
    x = x + B.gather_table(params["pos_emb"], layout.pos)
    if batch.input_keep is not None:
        x = x * batch.input_keep
    x = x * xp.reshape(B.token_mask(layout), (-1, 1))
    if trace is not None:
        trace["input"] = x
    memo = {}  # time buckets and positions: the same for every block, computed by the first
    for i, block in enumerate(params["blocks"]):
        keep = None if batch.block_keep is None else batch.block_keep[i]
        x = hstu_block(B, block, x, batch, cfg, keep, trace, name=f"blocks.{i}", memo=memo)
    out = B.l2_normalize(x, cfg.l2_eps)
    if trace is not None:
        trace["output"] = out
    return out


# ----------------------------------------------------------------------------- the model registry
@dataclasses.dataclass(frozen=True)
class RetrievalModel:
    """A retrieval model (``model.name``).

      encode(B, params, batch: HSTUBatch, cfg: ModelConfig, trace=None) -> user[T, D], L2-normalised
      init_params(cfg: ModelConfig, seed: int, num_items: int | None) -> dict of numpy arrays; holds
          ``"item_emb"`` [num_items + 1, embed_dim] (the item table the loss and evaluation rank)
      param_shapes(cfg: ModelConfig, num_items: int | None) -> {path: shape} of those parameters
    """

    name: str
    encode: Callable
    init_params: Callable
    param_shapes: Callable


MODELS: Registry[RetrievalModel] = Registry(
    "retrieval model", config_key="model.name",
    how="Register one with @gr_functional.model.register_model(NAME, init_params=..., param_shapes=...) on its "
        "encode function, in a module passed to grf train --plugin")


def register_model(name: str, encode: Callable | None = None, *, init_params: Callable, param_shapes: Callable,
                   replace: bool = False):
    """Register a retrieval model (``register_model(name, encode, ...)`` or ``@register_model(name,
    ...)`` on the encode function); ``model.name = name`` selects it.

    Args:
      name: the ``model.name`` value.
      encode: ``encode(B, params, batch, cfg: ModelConfig) -> user[T, D]`` (L2-normalised).
      init_params: ``init_params(cfg, seed) -> params`` (numpy, so every backend starts equal).
      param_shapes: ``param_shapes(cfg) -> {path: shape}`` (checkpoints are checked against it).
      replace: replace another definition registered under ``name``.
    Returns:
      ``encode`` (or the decorator). Raises ValueError for a taken name.
    """
    def add(fn: Callable) -> Callable:
        MODELS.add(name, RetrievalModel(name, fn, init_params, param_shapes), origin_of=fn, replace=replace)
        return fn

    return add if encode is None else add(encode)


def model_of(cfg: ModelConfig) -> RetrievalModel:
    """The registered model ``cfg.name``, or ConfigError naming the registered ones."""
    return MODELS.get_or(cfg.name, lambda message: ConfigError(f"model.name={cfg.name!r}: {message}"))


def check_config(cfg) -> list[tuple[str, str, str]]:
    """``model.name`` must be a registered retrieval model (checked for the retrieval task) whose
    ``param_shapes`` describe what its ``init_params`` makes (``shape_disagreement``)."""
    if cfg.model.task != "retrieval":
        return []
    if cfg.model.name not in MODELS:
        return [("model", "name", MODELS.unknown_message(cfg.model.name))]
    problem = shape_disagreement(MODELS.get(cfg.model.name), cfg.model)
    return [("model", "name", problem)] if problem else []


_AGREED: set = set()   # (model, config) pairs already checked: the check builds parameters


def shape_disagreement(m: RetrievalModel, cfg: ModelConfig) -> str | None:
    """Why ``m.param_shapes`` does not describe ``m.init_params`` under ``cfg`` (with a 3-item
    catalogue, so the check costs the dense layers only), or None. Checkpoints are checked
    against ``param_shapes``: a model whose two functions disagree would train and then find
    every checkpoint it wrote unreadable, so it is refused before the run starts."""
    small = dataclasses.replace(cfg, num_items=3)
    key = (m.name, m.init_params, m.param_shapes, small)
    if key in _AGREED:
        return None
    made = {path: tuple(np.shape(leaf)) for path, leaf in tree_items(m.init_params(small, seed=0))}
    declared = {path: tuple(shape) for path, shape in m.param_shapes(small, 3).items()}
    if made == declared:
        _AGREED.add(key)
        return None
    diff = sorted(set(made) ^ set(declared))[:3] or [
        f"{k}: made {made[k]}, declared {declared[k]}" for k in sorted(made) if made[k] != declared[k]][:3]
    return (f"the registered model {m.name!r}: its param_shapes do not describe what its init_params makes "
            f"(first differences: {', '.join(map(str, diff))}); checkpoints are checked against param_shapes, "
            f"so fix whichever of the two is wrong in the register_model call")


def loss_fn(B: Backend, params: dict, batch: HSTUBatch, cfg: ModelConfig, trace: dict | None = None,
            loss: LossConfig = LossConfig()):
    """Scalar training loss of a batch: the registered loss ``loss.name`` (losses.py; GR's sampled
    softmax by default) of the user embeddings (``model.name``'s encode) against the L2-normalised
    item table."""
    user = model_of(cfg).encode(B, params, batch, cfg, trace)
    items = B.l2_normalize(params["item_emb"], cfg.l2_eps)
    value = losses.get(loss.name).fn(B, user, items, batch, loss)
    if trace is not None:
        trace["loss"] = value
    return value


def score_last(B: Backend, params: dict, batch: HSTUBatch, cfg: ModelConfig):
    """Scores ``[B_cap, N+1]`` of every item for the last position of each sequence (dot product
    of L2-normalised user and item embeddings; column 0 is the padding id). Empty slots score 0."""
    xp = B.xp
    user = model_of(cfg).encode(B, params, batch, cfg)
    last = B.gather_rows(B.append_zero_row(user), batch.layout.last_index)                              # [B, D]
    items = B.l2_normalize(params["item_emb"], cfg.l2_eps)
    return xp.matmul(last, xp.permute_dims(items, (1, 0)))


register_model("hstu", encode, init_params=init_params, param_shapes=param_shapes)
