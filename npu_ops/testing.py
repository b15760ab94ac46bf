"""Random jagged HSTU attention cases and a runner, shared by the CPU adapter tests
(tests/npu_ops, against fakes) and the Ascend tests (tests/npu, against the real kernel).

A case is host data (numpy); ``run_attention`` moves it to a backend, runs either the reference
``Backend.hstu_attention`` or an adapter fed with ``Backend.relative_bias``, and returns the output
and the gradients of ``sum(out * cotangent)`` w.r.t. q, k, v and the bias parameters, as numpy.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from gr_functional.jagged import Jagged


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """Host inputs of one attention call.

    layout: Jagged (values = token ids, int32); q[T_cap, H, dqk], k, v[T_cap, H, dv] float64
    (padding rows hold random values on purpose: every op must ignore them); cot[T_cap, H, dv]
    the output cotangent; pos_w[2n-1] / ts_w[K+1] bias params or None; ts, query_ts[T_cap] int32.
    """

    layout: Jagged
    norm_len: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cot: np.ndarray
    pos_w: np.ndarray | None
    ts_w: np.ndarray | None
    ts: np.ndarray
    query_ts: np.ndarray


def make_attention_case(lengths: Sequence[int], *, max_len: int, heads: int = 2, dqk: int = 16,
                        dv: int = 32, b_cap: int | None = None, t_cap: int | None = None,
                        bias: str = "none", norm_len: int | None = None, num_time_buckets: int = 16,
                        seed: int = 0) -> AttentionCase:
    """A random case. ``bias``: "none", "pos" (relative position, [1, L, L]) or "pos+time"
    ([B, L, L]). ``norm_len`` defaults to max_len + 3, deliberately not max_len, so a kernel that
    used its default 1/max_seq_len scale would be caught."""
    rng = np.random.default_rng(seed)
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    layout = Jagged.from_sequences(seqs, max_len=max_len, b_cap=b_cap, t_cap=t_cap)
    T = layout.t_cap
    n = max_len + 3 if norm_len is None else norm_len

    def normal(*shape):
        return rng.standard_normal(shape) * 0.5

    pos_w = normal(2 * n - 1) if bias in ("pos", "pos+time") else None
    ts_w = normal(num_time_buckets + 1) if bias == "pos+time" else None
    # per-sequence increasing event times; the query time is the next event (or +1 day at the end)
    ts = np.zeros(T, dtype=np.int32)
    query_ts = np.zeros(T, dtype=np.int32)
    offsets = np.asarray(layout.offsets)
    for b in range(layout.b_cap):
        s, e = int(offsets[b]), int(offsets[b + 1])
        if e > s:
            t = np.cumsum(rng.integers(1, 200_000, size=e - s + 1)).astype(np.int32)
            ts[s:e], query_ts[s:e] = t[:-1], t[1:]
    return AttentionCase(layout, n, normal(T, heads, dqk), normal(T, heads, dqk), normal(T, heads, dv),
                         normal(T, heads, dv), pos_w, ts_w, ts, query_ts)


def run_attention(case: AttentionCase, B, attention: Callable | None = None,
                  dtype: str | None = None) -> dict[str, np.ndarray]:
    """Output and gradients on backend ``B`` (a TorchBackend or subclass; its device, and its
    dtype unless ``dtype`` names another torch float dtype such as "bfloat16" for q, k, v; the
    bias parameters stay in B's dtype, and adapters cast the bias to q's dtype).

    attention None: the reference ``B.hstu_attention``. Otherwise ``attention(q, k, v, layout,
    norm_len, bias)`` with ``bias = B.relative_bias(...)`` (what the "mxrec" kernel does:
    ``MxrecHstuAttention.attend``).
    Returns numpy float64 arrays: out, dq, dk, dv and, when present, dpos_w, dts_w.
    """
    import torch

    qkv_dtype = getattr(torch, dtype or B.dtype_name)
    layout = B.asarray_tree(case.layout)
    params = {"q": case.q, "k": case.k, "v": case.v, "pos_w": case.pos_w, "ts_w": case.ts_w}
    # cast on the host: the device may lack float64 (and numpy lacks bfloat16)
    leaves = {name: B.asarray(torch.as_tensor(arr).to(qkv_dtype if name in ("q", "k", "v") else B.float_dtype))
                  .requires_grad_() for name, arr in params.items() if arr is not None}
    ts, query_ts = B.asarray(case.ts), B.asarray(case.query_ts)
    cot = B.asarray(torch.as_tensor(case.cot).to(qkv_dtype))
    with torch.enable_grad():
        q, k, v = leaves["q"], leaves["k"], leaves["v"]
        bias = B.AttentionBias(pos_w=leaves.get("pos_w"), ts_w=leaves.get("ts_w"), ts=ts, query_ts=query_ts)
        if attention is None:
            out = B.hstu_attention(q, k, v, layout, case.norm_len, bias)
        else:
            out = attention(q, k, v, layout, case.norm_len, B.relative_bias(layout, case.norm_len, bias))
        grads = torch.autograd.grad((out * cot).sum(), list(leaves.values()))
    result = {"out": out.detach().cpu().double().numpy()}
    for name, g in zip(leaves, grads):
        result["d" + name] = g.detach().cpu().double().numpy()
    return result
