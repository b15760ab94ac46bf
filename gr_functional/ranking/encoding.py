"""Absolute position and time encodings of dlrm_v3's ranking model (GR ``HSTUPositionalEncoder``
with its PyTorch kernel ``ops/pytorch/pt_position.py``; spec section 3.1 of
docs/design/dlrm_v3_ranking_spec.md). The indices are integers of the batch, computed on the host in
numpy (as the time buckets of the retrieval model are), so every backend reads the same rows::

    x0 = sqrt(D) * tok + P[pos] + Tm[tau]          (then input dropout, by the caller)

Positions count back from the newest history event: with s = L_b tokens, c = num_targets_b
candidates at the end and h = s - c, token i gets ``min(max_pos - 1, h - min(i, h) + contextual)``
and the first ``contextual`` tokens get 0..contextual-1: every candidate shares position
``contextual``, the newest history event ``contextual + 1``. Time buckets:
``tau = int(sqrt(float32(q_b - t_i) clamped >= 1e-6 / 60))`` clamped to [0, cap], q_b the
timestamp of the sequence's last token (the candidates' query time). GR's PyTorch kernel caps
tau at the time table's WIDTH minus one (``ts_embeddings.size(1) - 1``: 511 for D = 512) where its
Triton kernel uses the table's length minus one (2048); training in GR runs the PyTorch kernel,
so ``gr_time_bucket_cap`` gives that cap and the model takes whichever it is given.
"""
from __future__ import annotations

import math

import numpy as np
from ..contracts import Backend


def gr_time_bucket_cap(dim: int) -> int:
    """The time-bucket cap GR's PyTorch kernel applies: the model width minus one."""
    return dim - 1


def position_indices(lengths, num_targets, contextual: int, max_pos: int) -> np.ndarray:
    """``[sum(lengths)]`` int32 position index of every token, sequences one after another."""
    out = []
    for s, c in zip(np.asarray(lengths, np.int64), np.asarray(num_targets, np.int64)):
        i = np.arange(s)
        h = s - c
        pos = np.minimum(h - np.minimum(i, h) + contextual, max_pos - 1)
        pos[:min(contextual, s)] = np.arange(min(contextual, s))
        out.append(pos)
    return (np.concatenate(out) if out else np.zeros(0, np.int64)).astype(np.int32)


def time_buckets(timestamps, offsets, cap: int) -> np.ndarray:
    """``[T]`` int32 bucket of every token's age against its sequence's last timestamp, in
    float32 as GR's kernel computes it (``timestamps`` int64 in the data's unit: GR feeds ms)."""
    t = np.asarray(timestamps, np.int64)
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    last = np.repeat(t[np.maximum(offsets[1:] - 1, 0)], lengths)
    age = np.maximum((last - t[:offsets[-1]]).astype(np.float32), np.float32(1e-6))
    tau = np.sqrt(age / np.float32(60.0)).astype(np.int32)
    return np.clip(tau, 0, cap).astype(np.int32)


def add_position_time(B: Backend, tok, pos_idx, time_idx, pos_table, time_table):
    """``sqrt(D) * tok[T, D] + pos_table[pos_idx] + time_table[time_idx]`` (indices ``[T]`` int32)."""
    scale = math.sqrt(tok.shape[1])
    return tok * scale + (B.gather_table(pos_table, pos_idx) + B.gather_table(time_table, time_idx))
