"""The output side of dlrm_v3's ranking model (spec section 4 of docs/design/dlrm_v3_ranking_spec.md):
the candidates' STU outputs through GR's ``TimestampLayerNormPostprocessor``, an item tower on
the candidates' own embeddings, and the multitask head with its per-task BCE::

    user_j = LN( [x_j, time_features(q_j)] @ wp + bp )
    item_j = tower(E[c_j])                                  (tokens.tower: Linear, SwishLN, Linear, LN)
    z_j    = SwishLN(( user_j * item_j ) @ w1 + b1) @ w2 + b2          [K] logits, one per task
    loss   = sum_k  weight * mean_j BCEWithLogits(z_jk, y_jk)

``time_features`` are GR's, computed on the host in float32 as its kernel does: for each
(period seconds, periods per cycle) of ``TIME_PERIODS``, ``theta = (floor(float32(t) / period) mod
cycle) / cycle * 2 * 3.14`` (3.14, not pi) and the pair (cos theta, sin theta). GR feeds
milliseconds into rules written for seconds (its "hour" is floor(t_ms / 3600) mod 24); the
features follow the data given.
"""
from __future__ import annotations

import numpy as np

from .tokens import affine_layer_norm, swish_layer_norm
from ..contracts import Backend

TIME_PERIODS = ((3600, 24), (86400, 7))
TASK_LOSS_WEIGHT = 0.2          # GR's causal_multitask_weights, multiplying every task's mean BCE


def time_features(timestamps, periods=TIME_PERIODS) -> np.ndarray:
    """``[n, 2 * len(periods)]`` float32: (cos, sin) of each period's phase (module docstring)."""
    t = np.asarray(timestamps, np.int64).astype(np.float32)[:, None]
    unit = np.asarray([p for p, _ in periods], np.float32)[None, :]
    cycle = np.asarray([c for _, c in periods], np.float32)[None, :]
    since = np.floor_divide(t, unit)                               # Python/torch floor division, float32
    theta = np.remainder(since, cycle) / cycle * np.float32(2) * np.float32(3.14)
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1).reshape(len(t), -1).astype(np.float32)


def postprocess(B: Backend, p: dict, x, feats):
    """``LN(concat[x, feats] @ w + b)``: x[n, D], feats[n, F] -> [n, D] (GR's time-aware postprocessor)."""
    xp = B.xp
    return affine_layer_norm(B, xp.matmul(xp.concat([x, feats], axis=1), p["w"]) + p["b"], p["ln_w"], p["ln_b"])


def multitask_logits(B: Backend, p: dict, user, item):
    """``[n, K]`` logits: ``SwishLN((user * item) @ w1 + b1) @ w2 + b2``."""
    xp = B.xp
    h = swish_layer_norm(B, xp.matmul(user * item, p["w1"]) + p["b1"], p["sw_w"], p["sw_b"])
    return xp.matmul(h, p["w2"]) + p["b2"]


def task_labels(bitmask, weights) -> np.ndarray:
    """``[n, K]`` float32 labels: bit ``weights[k]`` of each candidate's action bitmask."""
    m = np.asarray(bitmask, np.int64)[:, None]
    return ((m & np.asarray(weights, np.int64)[None, :]) > 0).astype(np.float32)


def multitask_loss(B: Backend, logits, labels, mask, weight: float = TASK_LOSS_WEIGHT):
    """``(total, per_task[K])``: each task's mean BCE-with-logits over the candidates ``mask[n]``
    (1 real, 0 padding) times ``weight``, summed over tasks."""
    xp = B.xp
    bce = xp.logaddexp(xp.zeros_like(logits), logits) - labels * logits      # softplus(z) - y z
    m = xp.reshape(mask, (-1, 1))
    per_task = weight * xp.sum(bce * m, axis=0) / xp.maximum(xp.sum(m), xp.ones_like(xp.sum(m)))
    return xp.sum(per_task), per_task
