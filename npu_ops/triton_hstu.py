"""Portable Triton kernels for jagged HSTU attention with relative attention bias (fwd + bwd).

Contract (``backends.base.Backend.hstu_attention`` with the bias of ``Backend.relative_bias``)::

    hstu_attention_triton(q[T,H,dqk], k[T,H,dqk], v[T,H,dv], offsets[B+1] int32, max_len L, norm_len n,
                          pos_w[2n-1]=None, ts_w[K+1]=None, ts[T] int32=None, query_ts[T] int32=None)
        -> out[T,H,dv]

    for tokens i, j of one sequence with positions pi >= pj (causal, diagonal included):
      s_ij  = q_i . k_j + (pos_w[(n-1) + pj - pi] + ts_w[bucket(query_ts_i - ts_j)])
      out_i = sum_j SiLU(s_ij) / n * v_j;      rows of no sequence (padding, t >= offsets[-1]) are 0
      bucket(dt) = clamp(floor(log(max(|dt|, 1)) / 0.301), 0, K), EXACTLY as ``time_bucket_thresholds``:
                   an fp32 log estimate corrected by one comparison with the integer thresholds table
                   on each side (the estimate is within one bucket of the truth), plus the clipped
                   int32 tail (``|dt| >= thr[K]`` -> K). Time differences wrap in int32, as in the
                   reference.

Layout (gr_functional.jagged): offsets start at 0, are non-decreasing, may hold empty slots
anywhere; every sequence is at most ``max_len`` long (the caller's contract: Jagged checks it on
the host; checked here only when offsets are on the CPU, to avoid a device sync); the position
bias needs ``norm_len >= max_len`` (the reference cannot index pos_w otherwise).

Kernels (the Triton subset CUDA, triton-ascend and the CPU interpreter all run: a 1-D grid of
persistent programs, constexpr loop bounds with masks, no libdevice / TMA / num_warps tuning):
- ``_hstu_fwd_kernel``: task = (sequence, query tile, head); flash-style loop over key tiles up to
  the diagonal, the score tile lives in registers only.
- ``_hstu_bwd_dkdv_kernel``: task = (sequence, key tile, head); recomputes scores per query tile,
  accumulates dk, dv in registers and scatter-adds dS into d pos_w / d ts_w with atomics; with
  ``dq_mode="atomic"`` it also atomically adds dq.
- ``_hstu_bwd_dq_kernel`` (``dq_mode="separate"``): task = (sequence, query tile, head), no atomics.
All grids are 1-D and persistent (``for i in range(TASKS_PER_PROGRAM): task = pid + i * grid``),
so the grid can equal the core count on Ascend. Every loop bound is constexpr (tile counts, tasks
per program), with masks and uniform ``if``s instead of data-dependent ``range`` or ``while``. No
libdevice, TMA or inline asm. In-block offsets are int32; only the per-(sequence, head) base is an
int64 scalar added to the pointer first (no int64 vector in the TTIR). bf16 operands are upcast
before ``tl.dot`` in the interpreter (triton#11584). ``tl.dot`` always gets an explicit
input_precision. Global memory: inputs, outputs, gradients and the bias gradients only -- no score
or bias matrix: O(T), not O(sum L_b^2) and never O(B * L^2).

Known costs (reasoned, not measured): the bias terms gather pos_w / thr / ts_w per score element
and scatter dS with per-element atomics (H * sum(L_b^2)/2 atomics per bias; contention on the
K+1 buckets and 2n-1 diagonals). triton-ascend lowers these gathers and indexed atomics to scalar
loops over the tile (seen in the ttadapter IR), so the bias path will be slow on Ascend.

Entry points:
- ``hstu_attention_triton(...)``: eager, a ctx-style ``torch.autograd.Function``.
- ``torch.ops.grf.hstu_attention`` (+ ``grf::hstu_attention_bwd``): ``torch.library.custom_op``
  with ``register_fake`` and ``register_autograd``, for torch.compile. The implementation is
  registered for every device; on CPU it runs only in the Triton interpreter (TRITON_INTERPRET=1
  set before this module is imported), and raises with the fix otherwise.
- ``TritonHstuAttention``: ``fn(q, k, v, layout, norm_len, bias)`` (``bias`` an ``AttentionBias``),
  the signature of ``Backend.hstu_attention``; ``.attend`` is the registered "triton" kernel
  (backends/kernels.py).

What is verified where (tests/npu_ops/test_triton_hstu.py):
- Triton CPU interpreter, fp32, with upstream triton 3.8.0 AND with triton-ascend 3.2.0's
  interpreter (numpy 2.4): outputs and gradients of q, k, v, pos_w, ts_w vs the torch backend's
  reference ``hstu_attention`` (worst relative error ~5e-7); exact time buckets at every bucket
  edge and at the int32 extremes; ``torch.library.opcheck`` and torch.compile(aot_eager) of the
  custom op; bf16 forward through the upcast path.
- triton-ascend 3.2.0 static lowering without CANN (``test_ascend_lowering_static``, runs only
  where triton-ascend is installed): every kernel variant (bias on/off, fp32/bf16, dq atomic or
  separate) goes ``ttir -> ttadapter`` and stops at ``bishengir-compile`` (no CANN).
- NOTHING has run on a GPU or an Ascend NPU: not the compiled kernels, races between atomics
  (the interpreter runs programs one by one), TF32/bf16 numerics on hardware, the block sizes in
  ``CONFIGS`` (UB overflow on Ascend is only detected by bishengir), or speed.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from gr_functional.time_buckets import TIME_BUCKET_DIVISOR, time_bucket_thresholds  # a leaf, below backends

from . import _triton_compat as compat

_DIVISOR = tl.constexpr(TIME_BUCKET_DIVISOR)  # the kernels' copy (jit globals must be constexpr)


# ==========================================================================================
# configuration
# ==========================================================================================
@dataclasses.dataclass(frozen=True)
class HstuTritonConfig:
    """Block sizes and launch policy of one backend kind.

    programs_per_unit: persistent grid = min(tasks, units * programs_per_unit), units = SMs / AI
    cores / ``compat.INTERPRETER_PROGRAMS``; None launches one program per task.
    dq_mode: "atomic" (dq by atomics in the dk/dv kernel) or "separate" (a second pass, no dq
    atomics). dot_precision: ``tl.dot`` input_precision for fp32 operands, always passed explicitly
    (triton-ascend 3.2 has no default for it): "ieee" = full fp32, what the fp32 reference
    tolerances assume; "tf32" (CUDA) / "hf32" (Ascend) are faster and ~1e-3 relative.
    """

    fwd_block_m: int = 64
    fwd_block_n: int = 64
    bwd_block_m: int = 32
    bwd_block_n: int = 32
    dq_mode: str = "atomic"
    programs_per_unit: Optional[int] = None
    dot_precision: str = "ieee"
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None

    def __post_init__(self):
        for name in ("fwd_block_m", "fwd_block_n", "bwd_block_m", "bwd_block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name}={size}: block sizes must be powers of two >= 16 (tl.dot)")
        if self.dq_mode not in ("atomic", "separate"):
            raise ValueError(f"dq_mode must be 'atomic' or 'separate', got {self.dq_mode!r}")


# First guesses, none measured on hardware. Ascend: the triton-ascend HSTU tutorial uses 64 fwd /
# 32 bwd at head dims <= 256 to stay inside the 192 KB unified buffer (A2), one program per AI core,
# and no dq atomics (conditional/non-contiguous atomics are partly unsupported there).
CONFIGS: dict[str, HstuTritonConfig] = {
    compat.INTERPRETER: HstuTritonConfig(16, 16, 16, 16, dq_mode="atomic", programs_per_unit=1),
    compat.CUDA: HstuTritonConfig(64, 64, 32, 32, dq_mode="atomic", programs_per_unit=None,
                                  num_warps=4, num_stages=2),
    compat.ASCEND: HstuTritonConfig(64, 64, 32, 32, dq_mode="separate", programs_per_unit=1),
}


# ==========================================================================================
# kernels
# ==========================================================================================
@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _time_bucket(gap, THR, num_buckets):
    """Exact ``clamp(max{k : thr[k] <= |gap|}, 0, K)`` for an int32 tile of time differences."""
    g = tl.abs(gap)
    gf = tl.maximum(g, 1).to(tl.float32)
    est = (tl.log(gf) / _DIVISOR).to(tl.int32)          # >= 0, so truncation == floor; off by <= 1
    est = tl.minimum(tl.maximum(est, 0), num_buckets)
    est = tl.where(g < tl.load(THR + est), est - 1, est)
    nxt = tl.minimum(est + 1, num_buckets)
    est = tl.where((est < num_buckets) & (g >= tl.load(THR + nxt)), est + 1, est)
    est = tl.where(g >= tl.load(THR + num_buckets), num_buckets, est)  # clipped int32 tail
    return tl.minimum(tl.maximum(est, 0), num_buckets)


@triton.jit
def _bias_tile(offs_m, offs_n, keep, qts, kts, POS_W, TS_W, THR, norm_len, num_buckets,
               HAS_POS: tl.constexpr, HAS_TS: tl.constexpr):
    """Bias tile [BM, BN] (fp32, 0 where not kept) and its pos_w / ts_w indices (int32)."""
    zero = offs_m[:, None] * 0 + offs_n[None, :] * 0
    bias = zero.to(tl.float32)
    pos_idx = zero
    bucket = zero
    if HAS_POS:
        pos_idx = (norm_len - 1) + offs_n[None, :] - offs_m[:, None]
        pos_idx = tl.minimum(tl.maximum(pos_idx, 0), 2 * norm_len - 2)
        bias += tl.load(POS_W + pos_idx, mask=keep, other=0.0).to(tl.float32)
    if HAS_TS:
        bucket = _time_bucket(qts[:, None] - kts[None, :], THR, num_buckets)
        bias += tl.load(TS_W + bucket, mask=keep, other=0.0).to(tl.float32)
    return bias, pos_idx, bucket


@triton.jit
def _decode_task(task, num_heads, NUM_TILES: tl.constexpr):
    h = task % num_heads
    rest = task // num_heads
    return rest // NUM_TILES, rest % NUM_TILES, h


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, O, OFFSETS, POS_W, TS_W, THR, TS, QTS,
    stride_qkt, stride_qkh, stride_vt, stride_vh,
    num_seqs, num_heads, dqk, dv, norm_len, inv_n, num_buckets,
    NUM_M_TILES: tl.constexpr, NUM_N_TILES: tl.constexpr, TASKS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_tasks = num_seqs * NUM_M_TILES * num_heads
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dqk_mask = offs_dqk < dqk
    dv_mask = offs_dv < dv
    for i in range(TASKS_PER_PROGRAM):
        task = pid + i * num_programs
        b, mt, h = _decode_task(task, num_heads, NUM_M_TILES)
        b = tl.minimum(b, num_seqs - 1)  # tasks past the end load a valid slot, then do nothing
        start = tl.load(OFFSETS + b)
        seq_len = tl.load(OFFSETS + b + 1) - start
        m0 = mt * BLOCK_M
        if (task < num_tasks) & (m0 < seq_len):
            base_qk = start.to(tl.int64) * stride_qkt + h * stride_qkh
            base_v = start.to(tl.int64) * stride_vt + h * stride_vh
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < seq_len
            q = tl.load(Q + base_qk + offs_m[:, None] * stride_qkt + offs_dqk[None, :],
                        mask=m_mask[:, None] & dqk_mask[None, :], other=0.0)
            qts = offs_m * 0
            if HAS_TS:
                qts = tl.load(QTS + start + offs_m, mask=m_mask, other=0)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
            m_end = tl.minimum(m0 + BLOCK_M, seq_len)
            for nt in range(NUM_N_TILES):
                n0 = nt * BLOCK_N
                if n0 < m_end:
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < seq_len
                    k = tl.load(K + base_qk + offs_n[:, None] * stride_qkt + offs_dqk[None, :],
                                mask=n_mask[:, None] & dqk_mask[None, :], other=0.0)
                    v = tl.load(V + base_v + offs_n[:, None] * stride_vt + offs_dv[None, :],
                                mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
                    kts = offs_n * 0
                    if HAS_TS:
                        kts = tl.load(TS + start + offs_n, mask=n_mask, other=0)
                    keep = (offs_m[:, None] >= offs_n[None, :]) & m_mask[:, None] & n_mask[None, :]
                    bias, pos_idx, bucket = _bias_tile(offs_m, offs_n, keep, qts, kts, POS_W, TS_W, THR,
                                                       norm_len, num_buckets, HAS_POS, HAS_TS)
                    s = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)
                    if HAS_POS or HAS_TS:
                        s += bias
                    p = tl.where(keep, s * tl.sigmoid(s) * inv_n, 0.0)
                    acc += _dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
            tl.store(O + base_v + offs_m[:, None] * stride_vt + offs_dv[None, :], acc.to(O.dtype.element_ty),
                     mask=m_mask[:, None] & dv_mask[None, :])


@triton.jit
def _hstu_bwd_dkdv_kernel(
    Q, K, V, DO, DQ, DK, DV, DPOS, DTS, OFFSETS, POS_W, TS_W, THR, TS, QTS,
    stride_qkt, stride_qkh, stride_vt, stride_vh,
    num_seqs, num_heads, dqk, dv, norm_len, inv_n, num_buckets,
    NUM_M_TILES: tl.constexpr, NUM_N_TILES: tl.constexpr, TASKS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, POS_GRAD: tl.constexpr, TS_GRAD: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_tasks = num_seqs * NUM_N_TILES * num_heads
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dqk_mask = offs_dqk < dqk
    dv_mask = offs_dv < dv
    for i in range(TASKS_PER_PROGRAM):
        task = pid + i * num_programs
        b, nt, h = _decode_task(task, num_heads, NUM_N_TILES)
        b = tl.minimum(b, num_seqs - 1)
        start = tl.load(OFFSETS + b)
        seq_len = tl.load(OFFSETS + b + 1) - start
        n0 = nt * BLOCK_N
        if (task < num_tasks) & (n0 < seq_len):
            base_qk = start.to(tl.int64) * stride_qkt + h * stride_qkh
            base_v = start.to(tl.int64) * stride_vt + h * stride_vh
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < seq_len
            k_off = offs_n[:, None] * stride_qkt + offs_dqk[None, :]  # int32
            v_off = offs_n[:, None] * stride_vt + offs_dv[None, :]
            k = tl.load(K + base_qk + k_off, mask=n_mask[:, None] & dqk_mask[None, :], other=0.0)
            v = tl.load(V + base_v + v_off, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
            kts = offs_n * 0
            if HAS_TS:
                kts = tl.load(TS + start + offs_n, mask=n_mask, other=0)
            dk_acc = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
            dv_acc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
            first_mt = n0 // BLOCK_M  # earlier query tiles lie above the diagonal
            for mt in range(NUM_M_TILES):
                m0 = mt * BLOCK_M
                if (mt >= first_mt) & (m0 < seq_len):
                    offs_m = m0 + tl.arange(0, BLOCK_M)
                    m_mask = offs_m < seq_len
                    q_off = offs_m[:, None] * stride_qkt + offs_dqk[None, :]  # int32
                    q = tl.load(Q + base_qk + q_off, mask=m_mask[:, None] & dqk_mask[None, :], other=0.0)
                    do = tl.load(DO + base_v + offs_m[:, None] * stride_vt + offs_dv[None, :],
                                 mask=m_mask[:, None] & dv_mask[None, :], other=0.0)
                    qts = offs_m * 0
                    if HAS_TS:
                        qts = tl.load(QTS + start + offs_m, mask=m_mask, other=0)
                    keep = (offs_m[:, None] >= offs_n[None, :]) & m_mask[:, None] & n_mask[None, :]
                    bias, pos_idx, bucket = _bias_tile(offs_m, offs_n, keep, qts, kts, POS_W, TS_W, THR,
                                                       norm_len, num_buckets, HAS_POS, HAS_TS)
                    s = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)
                    if HAS_POS or HAS_TS:
                        s += bias
                    sig = tl.sigmoid(s)
                    p = tl.where(keep, s * sig * inv_n, 0.0)
                    dv_acc += _dot(tl.trans(p).to(do.dtype), do, UPCAST_DOT, DOT_PRECISION)
                    dp = _dot(do, tl.trans(v), UPCAST_DOT, DOT_PRECISION)
                    ds = tl.where(keep, dp * inv_n * (sig * (1.0 + s * (1.0 - sig))), 0.0)
                    dk_acc += _dot(tl.trans(ds).to(q.dtype), q, UPCAST_DOT, DOT_PRECISION)
                    if ATOMIC_DQ:
                        dq_part = _dot(ds.to(k.dtype), k, UPCAST_DOT, DOT_PRECISION)
                        tl.atomic_add(DQ + base_qk + q_off, dq_part, mask=m_mask[:, None] & dqk_mask[None, :])
                    if POS_GRAD:
                        tl.atomic_add(DPOS + pos_idx, ds, mask=keep)
                    if TS_GRAD:
                        tl.atomic_add(DTS + bucket, ds, mask=keep)
            tl.store(DK + base_qk + k_off, dk_acc.to(DK.dtype.element_ty), mask=n_mask[:, None] & dqk_mask[None, :])
            tl.store(DV + base_v + v_off, dv_acc.to(DV.dtype.element_ty), mask=n_mask[:, None] & dv_mask[None, :])


@triton.jit
def _hstu_bwd_dq_kernel(
    Q, K, V, DO, DQ, OFFSETS, POS_W, TS_W, THR, TS, QTS,
    stride_qkt, stride_qkh, stride_vt, stride_vh,
    num_seqs, num_heads, dqk, dv, norm_len, inv_n, num_buckets,
    NUM_M_TILES: tl.constexpr, NUM_N_TILES: tl.constexpr, TASKS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_tasks = num_seqs * NUM_M_TILES * num_heads
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dqk_mask = offs_dqk < dqk
    dv_mask = offs_dv < dv
    for i in range(TASKS_PER_PROGRAM):
        task = pid + i * num_programs
        b, mt, h = _decode_task(task, num_heads, NUM_M_TILES)
        b = tl.minimum(b, num_seqs - 1)  # tasks past the end load a valid slot, then do nothing
        start = tl.load(OFFSETS + b)
        seq_len = tl.load(OFFSETS + b + 1) - start
        m0 = mt * BLOCK_M
        if (task < num_tasks) & (m0 < seq_len):
            base_qk = start.to(tl.int64) * stride_qkt + h * stride_qkh
            base_v = start.to(tl.int64) * stride_vt + h * stride_vh
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < seq_len
            q_off = offs_m[:, None] * stride_qkt + offs_dqk[None, :]  # int32
            q = tl.load(Q + base_qk + q_off, mask=m_mask[:, None] & dqk_mask[None, :], other=0.0)
            do = tl.load(DO + base_v + offs_m[:, None] * stride_vt + offs_dv[None, :],
                         mask=m_mask[:, None] & dv_mask[None, :], other=0.0)
            qts = offs_m * 0
            if HAS_TS:
                qts = tl.load(QTS + start + offs_m, mask=m_mask, other=0)
            dq_acc = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
            m_end = tl.minimum(m0 + BLOCK_M, seq_len)
            for nt in range(NUM_N_TILES):
                n0 = nt * BLOCK_N
                if n0 < m_end:
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < seq_len
                    k = tl.load(K + base_qk + offs_n[:, None] * stride_qkt + offs_dqk[None, :],
                                mask=n_mask[:, None] & dqk_mask[None, :], other=0.0)
                    v = tl.load(V + base_v + offs_n[:, None] * stride_vt + offs_dv[None, :],
                                mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
                    kts = offs_n * 0
                    if HAS_TS:
                        kts = tl.load(TS + start + offs_n, mask=n_mask, other=0)
                    keep = (offs_m[:, None] >= offs_n[None, :]) & m_mask[:, None] & n_mask[None, :]
                    bias, pos_idx, bucket = _bias_tile(offs_m, offs_n, keep, qts, kts, POS_W, TS_W, THR,
                                                       norm_len, num_buckets, HAS_POS, HAS_TS)
                    s = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)
                    if HAS_POS or HAS_TS:
                        s += bias
                    sig = tl.sigmoid(s)
                    dp = _dot(do, tl.trans(v), UPCAST_DOT, DOT_PRECISION)
                    ds = tl.where(keep, dp * inv_n * (sig * (1.0 + s * (1.0 - sig))), 0.0)
                    dq_acc += _dot(ds.to(k.dtype), k, UPCAST_DOT, DOT_PRECISION)
            tl.store(DQ + base_qk + q_off, dq_acc.to(DQ.dtype.element_ty), mask=m_mask[:, None] & dqk_mask[None, :])


# ==========================================================================================
# host side
# ==========================================================================================
_THRESHOLDS: dict[tuple[int, str], torch.Tensor] = {}


def _thresholds(num_buckets: int, device: torch.device) -> torch.Tensor:
    key = (num_buckets, str(device))
    if key not in _THRESHOLDS:
        _THRESHOLDS[key] = torch.as_tensor(time_bucket_thresholds(num_buckets), device=device)
    return _THRESHOLDS[key]


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


@dataclasses.dataclass
class _Prepared:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor
    pos_w: Optional[torch.Tensor]
    ts_w: Optional[torch.Tensor]
    ts: Optional[torch.Tensor]
    query_ts: Optional[torch.Tensor]
    thr: Optional[torch.Tensor]
    kind: str
    cfg: HstuTritonConfig


def _prepare(q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts, config, kernel) -> _Prepared:
    """Validate the contract on the host (no device sync) and make the tensors kernel-ready."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q/k must match and v must share [T, H]: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1 or offsets.is_floating_point():
        raise ValueError(f"offsets must be 1-D integer [B+1]; got {offsets.dtype} {tuple(offsets.shape)}")
    if int(max_len) < 1 or int(norm_len) < 1:
        raise ValueError(f"max_len and norm_len must be >= 1; got {max_len}, {norm_len}")
    T = q.shape[0]
    if pos_w is not None:
        if pos_w.shape != (2 * norm_len - 1,):
            raise ValueError(f"pos_w must be [2n-1] = [{2 * norm_len - 1}]; got {tuple(pos_w.shape)}")
        if norm_len < max_len:
            raise ValueError(f"the position bias needs norm_len >= max_len (pos_w[(n-1) + pj - pi] for "
                             f"pi - pj < max_len); got norm_len={norm_len}, max_len={max_len}")
    thr = None
    if ts_w is not None:
        if ts_w.dim() != 1 or ts_w.shape[0] < 1:
            raise ValueError(f"ts_w must be [K+1]; got {tuple(ts_w.shape)}")
        if ts is None or query_ts is None:
            raise ValueError("ts_w needs ts and query_ts ([T] int32)")
        for name, t in (("ts", ts), ("query_ts", query_ts)):
            if t.shape != (T,) or t.is_floating_point():
                raise ValueError(f"{name} must be [T={T}] integer; got {t.dtype} {tuple(t.shape)}")
        ts = ts.to(torch.int32).contiguous()
        query_ts = query_ts.to(torch.int32).contiguous()
        thr = _thresholds(ts_w.shape[0] - 1, q.device)
    else:
        ts = query_ts = None
    for name, t in (("k", k), ("v", v), ("offsets", offsets), ("pos_w", pos_w), ("ts_w", ts_w), ("ts", ts),
                    ("query_ts", query_ts)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    offsets = offsets.to(torch.int32).contiguous()
    if offsets.device.type == "cpu" and offsets.shape[0] > 1:
        lengths = offsets[1:] - offsets[:-1]
        if int(offsets[0]) != 0 or bool((lengths < 0).any()) or int(offsets[-1]) > T:
            raise ValueError(f"offsets must start at 0, be non-decreasing and end <= T={T}")
        if int(lengths.max()) > max_len:
            raise ValueError(f"a sequence has length {int(lengths.max())} > max_len={max_len}")
    kind = compat.backend_kind(q.device.type, kernel)
    cfg = config if config is not None else CONFIGS[kind]
    return _Prepared(q.contiguous(), k.contiguous(), v.contiguous(), offsets,
                     None if pos_w is None else pos_w.contiguous(), None if ts_w is None else ts_w.contiguous(),
                     ts, query_ts, thr, kind, cfg)


def _grid(p: _Prepared, num_tasks: int) -> tuple[tuple[int], int]:
    """(grid, TASKS_PER_PROGRAM): the persistent loop has a constexpr trip count (it recompiles
    only when the capacities B_cap, H or max_len change, which are static in this project)."""
    if p.cfg.programs_per_unit is None:  # one program per task
        return (num_tasks,), 1
    units = compat.num_compute_units(p.kind, p.q.device)
    programs = max(1, min(num_tasks, units * p.cfg.programs_per_unit, compat.MAX_GRID))
    return (programs,), triton.cdiv(num_tasks, programs)


def _launch_opts(p: _Prepared) -> dict:
    opts = {}
    if p.kind == compat.CUDA:
        if p.cfg.num_warps is not None:
            opts["num_warps"] = p.cfg.num_warps
        if p.cfg.num_stages is not None:
            opts["num_stages"] = p.cfg.num_stages
    return opts


def _common_args(p: _Prepared, norm_len: int):
    q, v = p.q, p.v
    dummy = q  # placeholder pointer for absent optional inputs (never dereferenced)
    ptrs = (p.offsets, dummy if p.pos_w is None else p.pos_w, dummy if p.ts_w is None else p.ts_w,
            dummy if p.thr is None else p.thr, dummy if p.ts is None else p.ts,
            dummy if p.query_ts is None else p.query_ts)
    num_buckets = 0 if p.ts_w is None else p.ts_w.shape[0] - 1
    scalars = (q.stride(0), q.stride(1), v.stride(0), v.stride(1), p.offsets.shape[0] - 1, q.shape[1],
               q.shape[2], v.shape[2], int(norm_len), 1.0 / norm_len, num_buckets)
    return ptrs, scalars


def _forward(q, k, v, offsets, max_len, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None,
             config=None) -> torch.Tensor:
    p = _prepare(q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts, config, _hstu_fwd_kernel)
    out = torch.zeros(p.v.shape, dtype=p.v.dtype, device=p.v.device)
    num_seqs = p.offsets.shape[0] - 1
    n_m = triton.cdiv(max_len, p.cfg.fwd_block_m)
    num_tasks = num_seqs * n_m * q.shape[1]
    if num_tasks == 0 or q.shape[0] == 0:
        return out
    ptrs, scalars = _common_args(p, norm_len)
    grid, per_program = _grid(p, num_tasks)
    _hstu_fwd_kernel[grid](
        p.q, p.k, p.v, out, *ptrs, *scalars,
        NUM_M_TILES=n_m, NUM_N_TILES=triton.cdiv(max_len, p.cfg.fwd_block_n), TASKS_PER_PROGRAM=per_program,
        BLOCK_M=p.cfg.fwd_block_m, BLOCK_N=p.cfg.fwd_block_n,
        BLOCK_DQK=_block_d(q.shape[2]), BLOCK_DV=_block_d(v.shape[2]),
        HAS_POS=p.pos_w is not None, HAS_TS=p.ts_w is not None,
        UPCAST_DOT=compat.needs_dot_upcast(p.kind, q.dtype), DOT_PRECISION=p.cfg.dot_precision,
        **_launch_opts(p))
    return out


def _backward(grad_out, q, k, v, offsets, max_len, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None,
              config=None, pos_grad=True, ts_grad=True):
    """(dq, dk, dv, dpos_w | None, dts_w | None); bias gradients only for present (and wanted) biases."""
    p = _prepare(q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts, config, _hstu_bwd_dkdv_kernel)
    do = grad_out.to(p.v.dtype).contiguous()
    dq = torch.zeros(p.q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros_like(p.k)
    dv = torch.zeros_like(p.v)
    pos_grad = pos_grad and p.pos_w is not None
    ts_grad = ts_grad and p.ts_w is not None
    dpos = torch.zeros(p.pos_w.shape, dtype=torch.float32, device=q.device) if pos_grad else None
    dts = torch.zeros(p.ts_w.shape, dtype=torch.float32, device=q.device) if ts_grad else None
    num_seqs = p.offsets.shape[0] - 1
    H = q.shape[1]
    cfg = p.cfg
    n_m = triton.cdiv(max_len, cfg.bwd_block_m)
    n_n = triton.cdiv(max_len, cfg.bwd_block_n)
    if num_seqs * H > 0 and q.shape[0] > 0:
        ptrs, scalars = _common_args(p, norm_len)
        common = dict(BLOCK_DQK=_block_d(q.shape[2]), BLOCK_DV=_block_d(v.shape[2]),
                      HAS_POS=p.pos_w is not None, HAS_TS=p.ts_w is not None,
                      UPCAST_DOT=compat.needs_dot_upcast(p.kind, q.dtype), DOT_PRECISION=cfg.dot_precision,
                      **_launch_opts(p))
        atomic_dq = cfg.dq_mode == "atomic"
        grid, per_program = _grid(p, num_seqs * n_n * H)
        _hstu_bwd_dkdv_kernel[grid](
            p.q, p.k, p.v, do, dq, dk, dv, dq if dpos is None else dpos, dq if dts is None else dts,
            *ptrs, *scalars, NUM_M_TILES=n_m, NUM_N_TILES=n_n, TASKS_PER_PROGRAM=per_program,
            BLOCK_M=cfg.bwd_block_m,
            BLOCK_N=cfg.bwd_block_n, POS_GRAD=pos_grad, TS_GRAD=ts_grad, ATOMIC_DQ=atomic_dq, **common)
        if not atomic_dq:
            grid, per_program = _grid(p, num_seqs * n_m * H)
            _hstu_bwd_dq_kernel[grid](
                p.q, p.k, p.v, do, dq, *ptrs, *scalars, NUM_M_TILES=n_m, NUM_N_TILES=n_n,
                TASKS_PER_PROGRAM=per_program,
                BLOCK_M=cfg.bwd_block_m, BLOCK_N=cfg.bwd_block_n, **common)
    dq = dq.to(q.dtype)
    dpos = None if dpos is None else dpos.to(pos_w.dtype)
    dts = None if dts is None else dts.to(ts_w.dtype)
    return dq, dk, dv, dpos, dts


# ------------------------------------------------------------------ eager autograd.Function
class HstuAttentionFunction(torch.autograd.Function):
    """ctx-style autograd wrapper of the Triton kernels (eager; not for torch.func transforms)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts, config):
        out = _forward(q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts, config)
        ctx.save_for_backward(q, k, v, offsets, pos_w, ts_w, ts, query_ts)
        ctx.max_len, ctx.norm_len, ctx.config = int(max_len), int(norm_len), config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, offsets, pos_w, ts_w, ts, query_ts = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dv, dpos, dts = _backward(grad_out, q, k, v, offsets, ctx.max_len, ctx.norm_len, pos_w, ts_w,
                                          ts, query_ts, ctx.config, pos_grad=need[6], ts_grad=need[7])
        return dq, dk, dv, None, None, None, dpos, dts, None, None, None


def hstu_attention_triton(q, k, v, offsets, max_len, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None,
                          *, config: Optional[HstuTritonConfig] = None) -> torch.Tensor:
    """Jagged HSTU attention (see the module docstring), differentiable in q, k, v, pos_w, ts_w.

    ``config`` overrides the per-backend table ``CONFIGS`` (block sizes, dq mode, grid policy).
    """
    return HstuAttentionFunction.apply(q, k, v, offsets, int(max_len), int(norm_len), pos_w, ts_w, ts,
                                       query_ts, config)


# ------------------------------------------------------------------ torch.library custom op
@torch.library.custom_op("grf::hstu_attention", mutates_args=())
def hstu_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int,
                      norm_len: int, pos_w: Optional[torch.Tensor] = None, ts_w: Optional[torch.Tensor] = None,
                      ts: Optional[torch.Tensor] = None, query_ts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.ops.grf.hstu_attention``: the Triton forward, on every device (CPU: interpreter only)."""
    return _forward(q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts)


@hstu_attention_op.register_fake
def _hstu_attention_fake(q, k, v, offsets, max_len, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=v.dtype)


@torch.library.custom_op("grf::hstu_attention_bwd", mutates_args=())
def hstu_attention_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          offsets: torch.Tensor, max_len: int, norm_len: int, pos_w: Optional[torch.Tensor],
                          ts_w: Optional[torch.Tensor], ts: Optional[torch.Tensor],
                          query_ts: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dpos_w, dts_w); an absent bias gets an empty [0] gradient."""
    dq, dk, dv, dpos, dts = _backward(grad_out, q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts)
    def empty():  # one fresh tensor per output: custom-op outputs must not alias each other
        return q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, empty() if dpos is None else dpos, empty() if dts is None else dts


@hstu_attention_bwd_op.register_fake
def _hstu_attention_bwd_fake(grad_out, q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts):
    def empty():
        return q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            empty() if pos_w is None else torch.empty_like(pos_w), empty() if ts_w is None else torch.empty_like(ts_w))


def _op_setup_context(ctx, inputs, output):
    q, k, v, offsets, max_len, norm_len, pos_w, ts_w, ts, query_ts = inputs
    ctx.save_for_backward(q, k, v, offsets, pos_w, ts_w, ts, query_ts)
    ctx.max_len, ctx.norm_len = max_len, norm_len


def _op_backward(ctx, grad_out):
    q, k, v, offsets, pos_w, ts_w, ts, query_ts = ctx.saved_tensors
    dq, dk, dv, dpos, dts = torch.ops.grf.hstu_attention_bwd(grad_out, q, k, v, offsets, ctx.max_len,
                                                             ctx.norm_len, pos_w, ts_w, ts, query_ts)
    return (dq, dk, dv, None, None, None, None if pos_w is None else dpos, None if ts_w is None else dts,
            None, None)


hstu_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ------------------------------------------------------------------ backend adapter
class TritonHstuAttention:
    """``fn(q, k, v, layout, norm_len, bias=None) -> out``: ``Backend.hstu_attention``'s
    signature (minus self) over the Triton kernels; ``bias`` is a ``backends.kernels.AttentionBias``
    (pos_w, ts_w, ts, query_ts: the bias is built in-kernel) or None. ``attend`` is the same with
    the backend first, the attention-kernel signature of backends/kernels.py.

    use_custom_op: call ``torch.ops.grf.hstu_attention`` (torch.compile-friendly) instead of the
    eager ``autograd.Function``. Both run the same kernels.
    """

    def __init__(self, use_custom_op: bool = True, config: Optional[HstuTritonConfig] = None):
        if use_custom_op and config is not None:
            raise ValueError("config overrides apply to the eager path only (use_custom_op=False)")
        self.use_custom_op = use_custom_op
        self.config = config

    @staticmethod
    def check_device(device_type: str) -> None:
        """Raise ``UnsupportedOnBackend`` with the fix when the kernels cannot run on
        ``device_type`` here (CPU without the interpreter, an NPU without triton-ascend, ...)."""
        from ._errors import UnsupportedOnBackend

        try:
            compat.backend_kind(device_type, _hstu_fwd_kernel)
        except RuntimeError as exc:
            raise UnsupportedOnBackend(str(exc)) from None

    def __call__(self, q, k, v, layout, norm_len, bias=None):
        pos_w = ts_w = ts = query_ts = None
        if bias is not None:
            pos_w, ts_w = bias.pos_w, bias.ts_w
            if ts_w is not None:
                ts, query_ts = bias.ts, bias.query_ts
        if self.use_custom_op:
            return torch.ops.grf.hstu_attention(q, k, v, layout.offsets, int(layout.max_len), int(norm_len),
                                                pos_w, ts_w, ts, query_ts)
        return hstu_attention_triton(q, k, v, layout.offsets, layout.max_len, norm_len, pos_w, ts_w, ts, query_ts,
                                     config=self.config)

    def attend(self, B, q, k, v, layout, norm_len, bias):
        return self(q, k, v, layout, norm_len, bias)


__all__ = ["CONFIGS", "HstuAttentionFunction", "HstuTritonConfig", "TIME_BUCKET_DIVISOR", "TritonHstuAttention",
           "hstu_attention_op", "hstu_attention_triton"]
