"""The input tokens of dlrm_v3's ranking model (GR ``ContextualPreprocessor`` and
``ActionEncoder``; spec section 2.2 of docs/design/dlrm_v3_ranking_spec.md). Per user, in this order::

    [ ctx_0 .. ctx_{S-1} | history_0 .. history_{U-1} | candidate_0 .. candidate_{C-1} ]

    ctx_s       = e_s @ wc[s] + bc[s]                       (a separate affine map per slot)
    history_i   = content(E[v_i]) + action(bits(a_i))
    candidate_j = content(E[c_j]) + action(target)           (a candidate's own actions are labels)

``content`` and ``action`` are towers Linear -> SwishLayerNorm -> Linear -> LayerNorm, where
SwishLayerNorm(x) = x * sigmoid(LN(x) * w + b) (GR's, not silu(LN(x))), all norms eps 1e-5.
``bits(a)`` concatenates, for each action type k, ``table[k]`` where bit ``weights[k]`` of the
bitmask a is set and zeros elsewhere: ``[K * A]`` (a concatenation, not a sum); ``target`` is one
learned ``[K * A]`` vector every candidate reads instead.
"""
from __future__ import annotations

import numpy as np

from ..model import xavier_normal
from ..contracts import Backend

LN_EPS = 1e-5


def affine_layer_norm(B: Backend, x, w, b, eps: float = LN_EPS):
    return B.layer_norm(x, eps) * w + b


def swish_layer_norm(B: Backend, x, w, b, eps: float = LN_EPS):
    """GR's SwishLayerNorm: ``x * sigmoid(LayerNorm(x) * w + b)``."""
    return x * B.sigmoid(affine_layer_norm(B, x, w, b, eps))


def tower(B: Backend, p: dict, x):
    """``LN(swish_ln(x @ w1 + b1) @ w2 + b2)`` with affine norms: x[n, d_in] -> [n, d_out]."""
    xp = B.xp
    h = swish_layer_norm(B, xp.matmul(x, p["w1"]) + p["b1"], p["sw_w"], p["sw_b"])
    return affine_layer_norm(B, xp.matmul(h, p["w2"]) + p["b2"], p["ln_w"], p["ln_b"])


def init_tower(d_in: int, d_hidden: int, d_out: int, rng: np.random.Generator) -> dict:
    """GR's init after HSTUTransducer's re-initialisation: xavier-normal weights, zero biases,
    unit / zero norms."""
    return {"w1": xavier_normal(rng, (d_in, d_hidden)), "b1": np.zeros(d_hidden, np.float32),
            "sw_w": np.ones(d_hidden, np.float32), "sw_b": np.zeros(d_hidden, np.float32),
            "w2": xavier_normal(rng, (d_hidden, d_out)), "b2": np.zeros(d_out, np.float32),
            "ln_w": np.ones(d_out, np.float32), "ln_b": np.zeros(d_out, np.float32)}


def action_bits(B: Backend, table, bitmask, weights: tuple[int, ...]):
    """``[n, K * A]``: for each of the K action types, ``table[k]`` (``table[K, A]``) where bit
    ``weights[k]`` of ``bitmask[n]`` (int) is set, zeros where not."""
    xp = B.xp
    w = xp.asarray(np.asarray(weights, np.int32), device=B.array_device)
    on = xp.astype((xp.reshape(xp.astype(bitmask, xp.int32), (-1, 1)) & xp.reshape(w, (1, -1))) > 0,
                   table.dtype)                                                          # [n, K]
    return xp.reshape(xp.reshape(on, (-1, table.shape[0], 1)) * table, (on.shape[0], -1))


def contextual_tokens(B: Backend, emb, wc, bc):
    """``emb[B, S, E]`` (each user's S contextual embeddings) -> ``[B, S, D]`` through one affine
    map per slot: ``emb[:, s] @ wc[s] + bc[s]`` (``wc[S, E, D]``, ``bc[S, D]``)."""
    xp = B.xp
    return xp.permute_dims(xp.matmul(xp.permute_dims(emb, (1, 0, 2)), wc), (1, 0, 2)) + bc


def assemble(B: Backend, ctx, items, source):
    """The jagged token sequence ``[T, D]`` from ``ctx[B, S, D]`` and ``items[n, D]`` (history and
    candidate tokens): token t is row ``source[t]`` of ``concat(ctx.reshape(B * S, D), items,
    zeros)`` (host-built index; the zero row serves padding)."""
    xp = B.xp
    D = items.shape[1]
    stacked = xp.concat([xp.reshape(ctx, (-1, D)), items,
                         xp.zeros((1, D), dtype=items.dtype, device=B.array_device)], axis=0)
    return B.gather_rows(stacked, source)


def assembly_index(num_users: int, contextual: int, item_lengths, t_cap: int, item_rows: int | None = None) -> np.ndarray:
    """The host index of ``assemble``: user b's S contextual rows, then its ``item_lengths[b]``
    item rows (items stored user after user), ``[t_cap]`` int32 padded with the zero row.
    ``num_users`` (>= len(item_lengths)) users' contextual rows and ``item_rows`` (default
    ``sum(item_lengths)``) item rows precede the zero row: the capacities of a padded batch."""
    item_lengths = np.asarray(item_lengths, np.int64)
    ctx_rows = num_users * contextual
    starts = np.concatenate([[0], np.cumsum(item_lengths)[:-1]]) if len(item_lengths) else np.zeros(0, np.int64)
    parts = [np.concatenate([b * contextual + np.arange(contextual), ctx_rows + starts[b] + np.arange(n)])
             for b, n in enumerate(item_lengths)]
    index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    pad = ctx_rows + (int(item_lengths.sum()) if item_rows is None else item_rows)
    return np.concatenate([index, np.full(t_cap - len(index), pad)]).astype(np.int32)
