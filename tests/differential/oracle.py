"""float64 numpy oracles: the obviously-correct padded/per-sequence definition of each kernel op.

Every backend op is compared against these (tests/differential/test_ops.py). They loop over
sequences in Python on purpose: nothing here shares code or layout tricks with the backends.
"""
from __future__ import annotations

import math

import numpy as np

from backends.base import TIME_BUCKET_DIVISOR


def silu(x):
    return x / (1.0 + np.exp(-x))


def layer_norm(x, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


def l2_normalize(x, eps=1e-6):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def logsumexp(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def segment_sum(data, seg, num_segments):
    out = np.zeros((num_segments,) + data.shape[1:])
    for t, s in enumerate(seg):
        if 0 <= s < num_segments:
            out[s] += data[t]
    return out


def time_bucket(gap, num_buckets):
    """floor(log(max(|gap|, 1)) / 0.301) clamped to [0, K], in float64 (generative-recommenders)."""
    b = math.floor(math.log(max(abs(int(gap)), 1)) / TIME_BUCKET_DIVISOR)
    return min(max(b, 0), num_buckets)


def relative_bias_seq(L_b, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None):
    """Bias [L_b, L_b] of one sequence."""
    bias = np.zeros((L_b, L_b))
    for i in range(L_b):
        for j in range(L_b):
            if pos_w is not None:
                bias[i, j] += pos_w[norm_len - 1 + j - i]
            if ts_w is not None:
                bias[i, j] += ts_w[time_bucket(query_ts[i] - ts[j], len(ts_w) - 1)]
    return bias


def hstu_attention(q, k, v, offsets, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None):
    """Per-sequence causal SiLU attention; q[T,H,d] -> [T,H,dv]; rows past offsets[-1] are zero."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        if e == s:
            continue
        bias = relative_bias_seq(e - s, norm_len, pos_w, ts_w,
                                 None if ts is None else ts[s:e], None if query_ts is None else query_ts[s:e])
        for h in range(q.shape[1]):
            scores = q[s:e, h] @ k[s:e, h].T + bias
            probs = silu(scores) / norm_len * np.tril(np.ones_like(scores))
            out[s:e, h] = probs @ v[s:e, h]
    return out


def stu_attention(q, k, v, offsets, num_targets, norm_len, alpha):
    """Target-aware attention of GR's dlrm_v3 (``Backend.stu_attention``), written per pair:
    token i of a sequence with n tokens, the last c of them candidates, attends token j when
    i == j, or when j is a history token (j < n - c) before i; scores SiLU(alpha q.k) / norm_len."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        n, c = e - s, num_targets[b]
        for i in range(n):
            for j in range(n):
                if i == j or (j < n - c and j < i):
                    for h in range(q.shape[1]):
                        out[s + i, h] += silu(alpha * q[s + i, h] @ k[s + j, h]) / norm_len * v[s + j, h]
    return out


def round_16bit(x, scale, precision: str):
    """``x`` stored in 16 bits with fp32 scales and read back, as float64: ``x / scale`` divided
    in float32 (as the backends do on fp32 arrays), rounded to nearest-even float16 or bfloat16
    (ml_dtypes), times ``scale``."""
    import ml_dtypes

    low = np.float16 if precision == "fp16" else ml_dtypes.bfloat16
    ratio = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    return ratio.astype(low).astype(np.float64) * np.asarray(scale, np.float64)
