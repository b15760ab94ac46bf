"""A Pallas jagged HSTU attention kernel for JAX (``ops.attention = "pallas"``): forward and
backward, both relative biases, the causal mask and GR's fixed normaliser, on the jagged rows
(no padding to max_len).

    out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + rab[i, j]) / n * v_j

Work is split into tasks of ``BLOCK`` rows: task t is block m of sequence b (rows
``offsets[b] + m BLOCK ...``, ``ceil(L_b / BLOCK)`` tasks per sequence; ``T_cap / BLOCK + B_cap``
tasks cover any batch of the layout's capacities, the spare ones do nothing). The grid is
(task, head); every program reads q, k, v whole (dynamic row slices) and writes its own block
of a per-task output, gathered back to rows afterwards, so no two programs write the same
memory: no atomics, and the result is bitwise repeatable.

  forward  (query task)  loops over the key blocks 0..m of its sequence: S = q k^T + rab,
                         out += SiLU(S) / n v, masked to j <= i inside the sequence
  dq       (query task)  the same loop: dS = (dO v^T) SiLU'(S) / n, dq += dS k; the bias
                         gradients of the task's cells, reduced into its own partial rows
                         (d pos_w by diagonals, d ts_w by buckets), summed over tasks outside
  dk, dv   (key task)    loops over the query blocks m..end: dk += dS^T q, dv += (SiLU(S)/n)^T dO

rab is built in-kernel from the parameters: ``pos_w[(n-1) + j - i]`` (positions inside the
sequence) and ``ts_w[bucket(|query_ts_i - ts_j|)]``, the bucket by the same integer thresholds
as every other kernel (``time_bucket_thresholds``), found by a branch-free binary search.

On a CPU the kernel runs in Pallas' interpret mode (``interpret=True``): slow, for verification:
the differential suite checks outputs and every gradient against the float64 oracle. On a GPU it
lowers through Pallas' Triton backend; that path has not run on a GPU yet (no device lent).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

BLOCK_CPU = 16  # interpret mode: small blocks keep the interpreted tiles cheap
BLOCK_GPU = 64


def _tasks(offsets, t_cap: int, block: int):
    """``(table[5, NT] int32, row_task[T_cap], row_in[T_cap], in_seq[T_cap] bool)``: per task, its
    first row, its sequence's first row, one past the sequence's last row, its block index m in
    the sequence and the sequence's block count (zeros for the spare tasks); per row, its task and
    its row in that task's block (padding rows: a spare task's row 0, ``in_seq`` false). NT =
    ceil(T_cap / BLOCK) + B_cap > the real tasks of any batch of these capacities."""
    b_cap = offsets.shape[0] - 1
    nt = -(-t_cap // block) + b_cap
    lengths = offsets[1:] - offsets[:-1]
    blocks = (lengths + block - 1) // block                                   # [B]
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks).astype(jnp.int32)])
    t = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.searchsorted(first[1:], t, side="right").astype(jnp.int32)      # b_cap for spare tasks
    real = seq < b_cap
    seq_c = jnp.minimum(seq, b_cap - 1)
    m = jnp.where(real, t - first[seq_c], 0)
    s0 = jnp.where(real, offsets[seq_c], 0)
    s1 = jnp.where(real, offsets[seq_c + 1], 0)
    table = jnp.stack([s0 + m * block, s0, s1, m, jnp.where(real, blocks[seq_c], 0)]).astype(jnp.int32)

    rows = jnp.arange(t_cap, dtype=jnp.int32)
    row_seq = jnp.searchsorted(offsets[1:], rows, side="right").astype(jnp.int32)
    in_seq = row_seq < b_cap
    row_seq_c = jnp.minimum(row_seq, b_cap - 1)
    pos = rows - offsets[row_seq_c]
    row_task = jnp.where(in_seq, first[row_seq_c] + pos // block, nt - 1)
    row_in = jnp.where(in_seq, pos % block, 0)
    return table, row_task, row_in, in_seq


def _tile(q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, h, task, qm, km, *, block, norm_len,
          has_pos, has_ts, n_thr):
    """``(S[BM, BN] fp32, valid[BM, BN], bucket[BM, BN] or None)`` of query block ``qm``
    and key block ``km`` of ``task``'s sequence (rows of ``task`` = (first row, s0, s1, ...))."""
    s0, s1 = task[1], task[2]
    qs, ks = s0 + qm * block, s0 + km * block
    r = jnp.arange(block, dtype=jnp.int32)
    qpos = (qs - s0) + r[:, None]
    kpos = (ks - s0) + r[None, :]
    valid = (qs + r[:, None] < s1) & (ks + r[None, :] < s1) & (kpos <= qpos)
    qb = q_ref[pl.ds(qs, block), h, :].astype(jnp.float32)
    kb = k_ref[pl.ds(ks, block), h, :].astype(jnp.float32)
    s = jax.lax.dot_general(qb, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if has_pos:
        s = s + pos_ref[jnp.clip((norm_len - 1) + kpos - qpos, 0, 2 * norm_len - 2)].astype(jnp.float32)
    bucket = None
    if has_ts:
        gap = jnp.abs(qts_ref[pl.ds(qs, block)][:, None] - kts_ref[pl.ds(ks, block)][None, :])
        # bucket = (number of thresholds <= gap) - 1, clipped to [0, K]: a binary search over thr
        # (padded to a power of two with int32 max), one gather per halving
        lo = jnp.zeros(gap.shape, jnp.int32)
        step = n_thr // 2
        while step >= 1:
            cand = lo + step
            lo = jnp.where(thr_ref[cand - 1] <= gap, cand, lo)
            step //= 2
        bucket = jnp.clip(lo - 1, 0, tsw_ref.shape[0] - 1)
        s = s + tsw_ref[bucket].astype(jnp.float32)
    return s, valid, bucket


def _score_grad(s, sig, valid, dp, norm_len):
    """dS = dP SiLU'(S) / n on the valid cells (sig = sigmoid(S)), 0 elsewhere."""
    return jnp.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) / norm_len, 0.0)


def _program(task_ref, q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, static):
    """``(head, task row [5 scalars], tile(qm, km))`` of the running program (grid = task, head)."""
    h = pl.program_id(1)
    task = [task_ref[i, pl.program_id(0)] for i in range(5)]
    return h, task, functools.partial(_tile, q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, h, task,
                                      **static)


def _fwd_kernel(task_ref, q_ref, k_ref, v_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, o_ref, **static):
    h, task, tile = _program(task_ref, q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, static)
    block, norm_len, qm = static["block"], static["norm_len"], task[3]

    def body(km, acc):
        s, valid, _ = tile(qm, km)
        p = jnp.where(valid, s * jax.nn.sigmoid(s) / norm_len, 0.0)
        vb = v_ref[pl.ds(task[1] + km * block, block), h, :].astype(jnp.float32)
        return acc + jnp.dot(p, vb, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, jnp.where(task[4] > 0, qm + 1, 0), body,
                            jnp.zeros((block, v_ref.shape[2]), jnp.float32))
    o_ref[0, 0, :, :] = acc.astype(o_ref.dtype)


def _dq_kernel(task_ref, q_ref, k_ref, v_ref, do_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref,
               dq_ref, dpos_ref, dts_ref, **static):
    h, task, tile = _program(task_ref, q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, static)
    block, norm_len, qm = static["block"], static["norm_len"], task[3]
    dob = do_ref[pl.ds(task[0], block), h, :].astype(jnp.float32)
    band = jnp.arange(2 * block - 1, dtype=jnp.int32)
    diag = (jnp.arange(block)[None, :] - jnp.arange(block)[:, None] + (block - 1))   # [BM, BN]: c - r + BM - 1
    buckets = jnp.arange(dts_ref.shape[2], dtype=jnp.int32)

    def body(km, carry):
        dq, dpos, dts = carry
        s, valid, bucket = tile(qm, km)
        ks = task[1] + km * block
        kb = k_ref[pl.ds(ks, block), h, :].astype(jnp.float32)
        vb = v_ref[pl.ds(ks, block), h, :].astype(jnp.float32)
        dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = _score_grad(s, jax.nn.sigmoid(s), valid, dp, norm_len)
        dq = dq + jnp.dot(ds, kb, preferred_element_type=jnp.float32)
        if static["has_pos"]:  # the tile's diagonals: pos index (n-1) + (km - qm) BLOCK + (c - r)
            sums = jnp.sum(jnp.where(diag[:, :, None] == band[None, None, :], ds[:, :, None], 0.0), axis=(0, 1))
            start = (norm_len - 1) + (km - qm) * block - (block - 1) + 2 * block  # dpos rows shifted by 2 BLOCK
            dpos = jax.lax.dynamic_update_slice(dpos, jax.lax.dynamic_slice(dpos, (start,), (2 * block - 1,)) + sums,
                                                (start,))
        if static["has_ts"]:
            dts = dts + jnp.sum(jnp.where(bucket[:, :, None] == buckets[None, None, :], ds[:, :, None], 0.0),
                                axis=(0, 1))
        return dq, dpos, dts

    init = (jnp.zeros((block, q_ref.shape[2]), jnp.float32), jnp.zeros((dpos_ref.shape[2],), jnp.float32),
            jnp.zeros((dts_ref.shape[2],), jnp.float32))
    dq, dpos, dts = jax.lax.fori_loop(0, jnp.where(task[4] > 0, qm + 1, 0), body, init)
    dq_ref[0, 0, :, :] = dq
    dpos_ref[0, 0, :] = dpos
    dts_ref[0, 0, :] = dts


def _dkdv_kernel(task_ref, q_ref, k_ref, v_ref, do_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref,
                 dk_ref, dv_ref, **static):
    h, task, tile = _program(task_ref, q_ref, k_ref, pos_ref, tsw_ref, thr_ref, qts_ref, kts_ref, static)
    block, norm_len, km = static["block"], static["norm_len"], task[3]
    vb = v_ref[pl.ds(task[0], block), h, :].astype(jnp.float32)  # this task's key block

    def body(qm, carry):
        dk, dv = carry
        s, valid, _ = tile(qm, km)
        qs = task[1] + qm * block
        qb = q_ref[pl.ds(qs, block), h, :].astype(jnp.float32)
        dob = do_ref[pl.ds(qs, block), h, :].astype(jnp.float32)
        sig = jax.nn.sigmoid(s)
        p = jnp.where(valid, s * sig / norm_len, 0.0)
        dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = _score_grad(s, sig, valid, dp, norm_len)
        tn = (((0,), (0,)), ((), ()))
        dk = dk + jax.lax.dot_general(ds, qb, tn, preferred_element_type=jnp.float32)
        dv = dv + jax.lax.dot_general(p, dob, tn, preferred_element_type=jnp.float32)
        return dk, dv

    init = (jnp.zeros((block, k_ref.shape[2]), jnp.float32), jnp.zeros((block, v_ref.shape[2]), jnp.float32))
    dk, dv = jax.lax.fori_loop(km, task[4], body, init)
    dk_ref[0, 0, :, :] = dk
    dv_ref[0, 0, :, :] = dv


def _call(kernel, grid, outs, interpret, *args, **static):
    """``pallas_call`` of ``kernel`` over ``grid`` = (tasks, heads): inputs whole (dynamic slices
    inside), each output ``outs[i]`` = (shape, dtype) blocked by (task, head)."""
    def spec(shape):
        block = (1, 1) + tuple(shape[2:])
        return pl.BlockSpec(block, lambda t, h: (t, h) + (0,) * (len(shape) - 2))

    return pl.pallas_call(
        functools.partial(kernel, **static),
        out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in outs],
        grid=grid, in_specs=[pl.no_block_spec] * len(args), out_specs=[spec(s) for s, _ in outs],
        interpret=interpret)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attention(q, k, v, pos_w, ts_w, tables, times, norm_len, block, has_pos, has_ts, interpret):
    return _forward(q, k, v, pos_w, ts_w, tables, times, norm_len, block, has_pos, has_ts, interpret)[0]


def _padded(x, block):
    """``x`` with ``block`` zero rows appended: a block read at any real row stays in bounds."""
    return jnp.concatenate([x, jnp.zeros((block,) + x.shape[1:], x.dtype)])


def _static(norm_len, block, has_pos, has_ts, thr):
    return dict(block=block, norm_len=norm_len, has_pos=has_pos, has_ts=has_ts, n_thr=int(thr.shape[0]))


def _forward(q, k, v, pos_w, ts_w, tables, times, norm_len, block, has_pos, has_ts, interpret):
    table, row_task, row_in, in_seq, thr = tables
    ts, query_ts = times
    nt, H = table.shape[1], q.shape[1]
    args = (table, _padded(q, block), _padded(k, block), _padded(v, block), pos_w, ts_w, thr,
            _padded(query_ts, block), _padded(ts, block))
    [o] = _call(_fwd_kernel, (nt, H), [((nt, H, block, v.shape[2]), q.dtype)], interpret, *args,
                **_static(norm_len, block, has_pos, has_ts, thr))
    out = jnp.where(in_seq[:, None, None], o[row_task, :, row_in], 0)                      # [T, H, dv]
    return out, (q, k, v, pos_w, ts_w, tables, times)


def _bwd(norm_len, block, has_pos, has_ts, interpret, res, g):
    q, k, v, pos_w, ts_w, tables, times = res
    table, row_task, row_in, in_seq, thr = tables
    ts, query_ts = times
    nt, H = table.shape[1], q.shape[1]
    static = _static(norm_len, block, has_pos, has_ts, thr)
    g = jnp.where(in_seq[:, None, None], g, 0)
    args = (table, _padded(q, block), _padded(k, block), _padded(v, block), _padded(g, block), pos_w, ts_w, thr,
            _padded(query_ts, block), _padded(ts, block))
    n_pos = pos_w.shape[0] + 4 * block  # shifted by 2 BLOCK, 2 BLOCK spare after: a tile's band stays in bounds
    dq, dpos, dts = _call(_dq_kernel, (nt, H), [((nt, H, block, q.shape[2]), jnp.float32),
                                                ((nt, H, n_pos), jnp.float32),
                                                ((nt, H, ts_w.shape[0]), jnp.float32)], interpret, *args, **static)
    dk, dv = _call(_dkdv_kernel, (nt, H), [((nt, H, block, k.shape[2]), jnp.float32),
                                          ((nt, H, block, v.shape[2]), jnp.float32)], interpret, *args, **static)

    def rows(x, like):
        return jnp.where(in_seq[:, None, None], x[row_task, :, row_in], 0).astype(like.dtype)

    d_pos = jnp.sum(dpos, axis=(0, 1))[2 * block:2 * block + pos_w.shape[0]].astype(pos_w.dtype)
    d_ts = jnp.sum(dts, axis=(0, 1)).astype(ts_w.dtype)
    return (rows(dq, q), rows(dk, k), rows(dv, v), d_pos if has_pos else jnp.zeros_like(pos_w),
            d_ts if has_ts else jnp.zeros_like(ts_w), None, None)


_attention.defvjp(_forward, _bwd)


def _thresholds(B, num_buckets: int):
    """``B.time_bucket_thresholds`` padded with int32 max to a power of two (the binary search's
    size)."""
    thr = jnp.asarray(B.time_bucket_thresholds(num_buckets), jnp.int32)
    size = 1 << int(np.ceil(np.log2(thr.shape[0] + 1)))
    return jnp.concatenate([thr, jnp.full((size - thr.shape[0],), np.iinfo(np.int32).max, jnp.int32)])


def make_kernel(B):
    """The registered kernel's function for JAX backend ``B``: interpret mode on a CPU, Pallas'
    GPU lowering on a GPU."""
    interpret = B.device_kind == "cpu"
    block = BLOCK_CPU if interpret else BLOCK_GPU

    def pallas(B, q, k, v, layout, norm_len, bias):
        has_pos, has_ts = bias.pos_w is not None, bias.ts_w is not None
        if has_ts and (bias.ts is None or bias.query_ts is None):
            raise ValueError("pallas attention: a time bias needs bias.ts and bias.query_ts")
        table, row_task, row_in, in_seq = _tasks(jnp.asarray(layout.offsets, jnp.int32), q.shape[0], block)
        num_buckets = bias.ts_w.shape[0] - 1 if has_ts else 1
        thr = _thresholds(B, num_buckets)
        pos_w = bias.pos_w if has_pos else jnp.zeros((2 * norm_len - 1,), q.dtype)
        ts_w = bias.ts_w if has_ts else jnp.zeros((2,), q.dtype)
        zeros_t = jnp.zeros((q.shape[0],), jnp.int32)
        times = (bias.ts if has_ts else zeros_t, bias.query_ts if has_ts else zeros_t)
        return _attention(q, k, v, pos_w, ts_w, (table, row_task, row_in, in_seq, thr), times, int(norm_len), block,
                          has_pos, has_ts, interpret)

    return pallas
