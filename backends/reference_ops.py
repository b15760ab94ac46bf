"""The reference implementation of every kernel op, written once on ``self.xp``.

Model code (gr_functional) calls ``B.xp`` for standard Array API math and ``B.<op>`` for the kernel
ops listed in ``ReferenceOps.KERNEL_OPS``: the ops the Array API lacks, or that some backend fuses.
Each op here is the semantic definition; a backend overrides one with its own formulation only when
a differential test (tests/differential/) shows the override matches this reference in outputs and
gradients. The fused ops (attention, the loss's sampled logits and shared logsumexp, the ranking
attention, the row update) have implementations beside these references in the op registry
(backends/ops.py).

Shapes use T = token capacity, B = sequence capacity (``b_cap``), L = ``max_len``,
H = heads, d = head dim, D = model dim. Index arrays are int32.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from gr_functional.jagged import Jagged
# the bucket definition lives in a leaf that npu_ops' Triton kernel imports too (re-exported here)
from gr_functional.time_buckets import TIME_BUCKET_DIVISOR, time_bucket_thresholds  # noqa: F401

from .kernels import NO_BIAS, AttentionBias


class ReferenceOps:
    """Mixin of ``Backend``: the reference ops on ``self.xp`` (``self`` is an ``ArrayRuntime``)."""

    KERNEL_OPS = ("silu", "layer_norm", "l2_normalize", "logsumexp", "gather_rows", "segment_sum",
                  "sampled_logits_reference", "sampled_logits_16bit_reference", "shared_logsumexp_reference",
                  "relative_bias", "hstu_uvqk", "hstu_norm_mul", "add_head_bias")

    # sampled_logits scores all items with one matmul when the catalogue is at most this many
    # times the number of sampled ids per row (a BLAS GEMM beats gathering T*R rows: ~2.5x in a one-off
    # CPU timing at ML-1M shapes, T=21k, R=128, N=3953, not yet in benchmarks/); beyond it, it gathers
    # only the sampled rows.
    DENSE_LOGITS_MAX_RATIO = 64

    # The argument type of hstu_attention's bias, reachable from model code as B.AttentionBias
    # (gr_functional imports no backend module).
    AttentionBias = AttentionBias

    def append_zero_row(self, x):
        """Append one zero row so index ``T_cap`` (an empty cell) gathers zeros."""
        xp = self.xp
        return xp.concat([x, xp.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=self.array_device)], axis=0)

    def token_mask(self, layout: Jagged):
        """``[T]`` float: 1 on real tokens, 0 on padding."""
        xp = self.xp
        return xp.astype(layout.seq_id < layout.b_cap, self.float_dtype)

    def sigmoid(self, x):
        """``1 / (1 + exp(-x))`` via tanh, so neither it nor its gradient overflows at large |x|."""
        return 0.5 * (self.xp.tanh(0.5 * x) + 1.0)

    def silu(self, x):
        """``x * sigmoid(x)``."""
        return x * self.sigmoid(x)

    def layer_norm(self, x, eps: float = 1e-6):
        """Parameter-free LayerNorm over the last axis (biased variance, as torch)."""
        xp = self.xp
        mean = xp.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        var = xp.mean(centred * centred, axis=-1, keepdims=True)
        return centred / xp.sqrt(var + eps)

    def l2_normalize(self, x, eps: float = 1e-6):
        """``x / max(||x||_2, eps)`` over the last axis; zero rows stay zero with zero gradient."""
        xp = self.xp
        sq = xp.sum(x * x, axis=-1, keepdims=True)
        return x / xp.sqrt(xp.maximum(sq, eps * eps))

    def logsumexp(self, x, axis: int = -1):
        xp = self.xp
        m = self.stop_gradient(xp.max(x, axis=axis, keepdims=True))
        return xp.squeeze(m, axis=axis) + xp.log(xp.sum(xp.exp(x - m), axis=axis))

    def gather_rows(self, table, idx):
        """``table[N, ...]`` at ``idx[...]`` int32 -> ``[*idx.shape, ...]``. Indices are validated
        on the host; out-of-range behaviour differs between libraries and is never relied on."""
        xp = self.xp
        flat = xp.reshape(idx, (-1,))
        out = xp.take(table, flat, axis=0)
        return xp.reshape(out, tuple(idx.shape) + tuple(table.shape[1:]))

    def gather_table(self, table, idx):
        """``gather_rows`` of a parameter table (embeddings, relative-bias tables): the same rows;
        precision views gather them from the fp32 copy (``MixedPrecisionOps``)."""
        return self.gather_rows(table, idx)

    def set_rows(self, table, rows, values):
        """``table[N, ...]`` with ``table[rows[i]] = values[i]`` (rows[U] int32, values[U, ...]):
        a row-sparse optimizer writing back its rows. Rows may repeat only with identical values
        (the unique-row capacity is padded with the padding row, written back unchanged). It
        DONATES ``table``: the caller must not use the old table afterwards (torch writes in
        place, so a step over a multi-GB table copies nothing). Not differentiable.

        Reference: ``where`` over a one-hot match (O(N*U); the Array API has no scatter)."""
        xp = self.xp
        if rows.shape[0] == 0:
            return table
        idx = xp.arange(table.shape[0], dtype=rows.dtype, device=self.array_device)
        match = xp.reshape(idx, (-1, 1)) == xp.reshape(rows, (1, -1))                        # [N, U]
        hit = xp.any(match, axis=1)
        src = xp.argmax(xp.astype(match, xp.int32), axis=1)                                  # first match
        picked = xp.take(values, src, axis=0)
        mask = xp.reshape(hit, (-1,) + (1,) * (table.ndim - 1))
        return xp.where(mask, picked, table)

    def segment_sum(self, data, segment_ids, num_segments: int):
        """``out[s] = sum(data[t] for t with segment_ids[t] == s)``; ids outside [0, S) are dropped.

        Reference: a one-hot matmul (O(S*T), written on the Array API which has no scatter).
        """
        xp = self.xp
        seg = xp.arange(num_segments, dtype=segment_ids.dtype, device=self.array_device)
        onehot = xp.astype(xp.reshape(seg, (-1, 1)) == xp.reshape(segment_ids, (1, -1)), data.dtype)
        flat = xp.reshape(data, (data.shape[0], -1))
        return xp.reshape(xp.matmul(onehot, flat), (num_segments,) + tuple(data.shape[1:]))

    def sampled_logits_reference(self, user, items, ids):
        """``out[t, r] = <user[t], items[ids[t, r]]>``: user[T, D], items[N, D], ids[T, R] int32 -> [T, R].

        Two exact formulations chosen by static shapes (not by backend): a dense ``user @ items^T``
        followed by a per-row gather when N <= DENSE_LOGITS_MAX_RATIO * R, else a row gather.
        """
        xp = self.xp
        n_items, n_ids = items.shape[0], ids.shape[1]
        if n_items <= self.DENSE_LOGITS_MAX_RATIO * n_ids:
            return xp.take_along_axis(xp.matmul(user, xp.permute_dims(items, (1, 0))), ids, axis=1)
        rows = self.gather_rows(items, ids)                                   # [T, R, D]
        return xp.sum(rows * xp.reshape(user, (user.shape[0], 1, -1)), axis=-1)

    def quantize_16bit(self, x, scale, precision: str):
        """``x`` stored in 16 bits with fp32 scales, read back: ``cast(cast(x / scale, 16-bit),
        x.dtype) * scale``, precision "fp16" | "bf16", ``scale`` broadcasting against ``x`` (> 0).
        The gradient is straight-through (the identity in ``x``): the 16-bit copy is a storage and
        transfer format of rows whose fp32 master copy keeps learning."""
        xp = self.xp
        low = xp.astype(self.cast(x / scale, "float16" if precision == "fp16" else "bfloat16"), x.dtype) * scale
        return x + self.stop_gradient(low - x)

    def sampled_logits_16bit_reference(self, user, items, ids, scale, precision: str):
        """``out[t, r] = <user[t], q(items[ids[t, r]])>`` where ``q`` is ``quantize_16bit`` with the
        position's scale ``scale[t]`` (> 0; losses.segment_scales gives each jagged segment one):
        user[T, D], items[N, D], ids[T, R] int32, scale[T] -> [T, R]. The negatives a position
        reads are 16-bit values (the reference and torch gather fp32 rows and round them: the
        format a sampler would ship in half the bytes, not a saving of this op); gradients reach
        ``items`` straight through and ``user`` through the 16-bit values. Always the row-gather
        formulation (the dense one would need the catalogue rounded once per segment)."""
        xp = self.xp
        rows = self.gather_rows(items, ids)                                   # [T, R, D]
        rows = self.quantize_16bit(rows, xp.reshape(scale, (-1, 1, 1)), precision)
        return xp.sum(rows * xp.reshape(user, (user.shape[0], 1, -1)), axis=-1)

    def shared_logsumexp_reference(self, user, neg_items, neg_ids, targets, pos, neg_bias, scale: float,
                                   masked_logit: float):
        """``lse[T]``: the logsumexp of each position's ``[pos_t, scale <user_t, neg_items_r> -
        neg_bias_r for r < R]``, a negative replaced by ``masked_logit`` where ``neg_ids[r]``
        equals ``targets[t]`` (an accidental hit) or 0 (padding). The shared-negatives softmax
        (losses.shared_softmax): user[T, D], neg_items[R, D], neg_ids[R] int32, targets[T] int32,
        pos[T], neg_bias[R]. Differentiable in user, neg_items, pos and neg_bias."""
        xp = self.xp
        neg = xp.matmul(user, xp.permute_dims(neg_items, (1, 0))) * scale - xp.reshape(neg_bias, (1, -1))
        hit = xp.logical_or(xp.reshape(neg_ids, (1, -1)) == xp.reshape(targets, (-1, 1)),
                            xp.reshape(neg_ids, (1, -1)) == 0)
        neg = xp.where(hit, xp.full_like(neg, masked_logit), neg)
        return self.logsumexp(xp.concat([xp.reshape(pos, (-1, 1)), neg], axis=1), axis=1)

    def time_bucket_thresholds(self, num_buckets: int):
        # cache the numpy table only: a backend array made while JAX traces would be a tracer
        if num_buckets not in self._thresholds_cache:
            self._thresholds_cache[num_buckets] = time_bucket_thresholds(num_buckets)
        return self.asarray(self._thresholds_cache[num_buckets])

    def relative_bias(self, layout: Jagged, norm_len: int, bias: AttentionBias = NO_BIAS):
        """Dense relative attention bias ``[B, L, L]`` of one HSTU layer (shared by all heads),
        from the parameters of ``bias`` (``AttentionBias``; n = ``norm_len``):

        pos_w[2n-1]: ``rab_pos[i, j] = pos_w[(n-1) + j - i]``.
        ts_w[K+1], ts[T] int32, query_ts[T] int32:
          ``rab_time[b, i, j] = ts_w[bucket(query_ts[i] - ts[j])]`` with
          ``bucket(dt) = clamp(floor(log(max(|dt|, 1)) / 0.301), 0, K)``.
        query_ts[i] is the time of the item position i predicts (the request time).
        Returns None when both terms are off.
        """
        xp = self.xp
        L = layout.max_len
        rab = None
        if bias.pos_w is not None:
            i = xp.reshape(xp.arange(L, dtype=xp.int32, device=self.array_device), (L, 1))
            j = xp.reshape(xp.arange(L, dtype=xp.int32, device=self.array_device), (1, L))
            rel = (norm_len - 1) + j - i
            rab = xp.reshape(self.gather_table(bias.pos_w, rel), (1, L, L))
        if bias.ts_w is not None:
            def gap():
                ts_d = self.gather_rows(self.append_zero_row(bias.ts), layout.dense_index)          # [B, L]
                q_d = self.gather_rows(self.append_zero_row(bias.query_ts), layout.dense_index)     # [B, L]
                return xp.abs(xp.reshape(q_d, (-1, L, 1)) - xp.reshape(ts_d, (-1, 1, L)))

            t_bias = self._time_bias(bias, "padded", gap)
            rab = t_bias if rab is None else rab + t_bias
        return rab

    @staticmethod
    def _memo(bias: AttentionBias, key, make: Callable):
        """``make()``, computed once per forward pass when ``bias.memo`` is a dict: the index
        arrays that depend on the batch only (time buckets, positions, masks) are the same in every
        layer. Not differentiable values only."""
        if bias.memo is None:
            return make()
        if key not in bias.memo:
            bias.memo[key] = make()
        return bias.memo[key]

    def _time_bias(self, bias: AttentionBias, geometry: str, gap: Callable):
        """``ts_w[bucket(gap)]`` of ``bias``, ``gap()`` the int32 gaps ``|query_ts - ts| >= 0`` in the
        kernel's ``geometry`` (any shape); the buckets are computed once per forward pass."""
        return self.gather_table(bias.ts_w, self._time_buckets(bias, geometry, gap))

    def _time_buckets(self, bias: AttentionBias, geometry: str, gap: Callable):
        """int32 ``bucket(gap())`` (``relative_bias``'s rule) for ``bias.ts_w``'s K buckets, memoised."""
        num_buckets = bias.ts_w.shape[0] - 1

        return self._memo(bias, ("time_bucket", geometry, num_buckets), lambda: self.time_buckets(gap(), num_buckets))

    def time_buckets(self, gap, num_buckets: int):
        """int32 ``clamp(floor(log(max(gap, 1)) / 0.301), 0, K)`` of int32 gaps ``>= 0`` (any shape),
        K = ``num_buckets``: by integer comparison with ``time_bucket_thresholds``, exact."""
        xp = self.xp
        bucket = xp.searchsorted(self.time_bucket_thresholds(num_buckets), gap, side="right") - 1
        return xp.astype(xp.clip(bucket, 0, num_buckets), xp.int32)

    def tile_time_buckets(self, layout: Jagged, bias: AttentionBias):
        """``[P, C, C]`` int32 time bucket of every cell of ``layout.tiles``' pairs (query cell i of
        pair p's query chunk, key cell j of its key chunk; empty cells hold whatever their rows'
        times give), memoised per forward pass: what ``hstu_attention_tiled`` and fused tile
        kernels index ``bias.ts_w`` with."""
        xp, plan = self.xp, layout.tiles
        C, P = plan.tile, plan.pair_q.shape[0]

        def gap():
            q_t = xp.reshape(self._tile_cells(plan, bias.query_ts, plan.pair_q), (P, C, 1))
            k_t = xp.reshape(self._tile_cells(plan, bias.ts, plan.pair_k), (P, 1, C))
            return xp.abs(q_t - k_t)

        return self._time_buckets(bias, "tiled", gap)

    def _tile_cells(self, plan, x, pair):
        """Per-token ``x[T]`` -> per-pair cells ``[P, C]`` of the chunks ``pair[P]`` names."""
        return self.xp.take(self.gather_rows(self.append_zero_row(x), plan.chunk_rows), pair, axis=0)

    def hstu_uvqk(self, x, w, splits: tuple[int, int, int, int]):
        """``SiLU(x[T, D] @ w[D, sum(splits)])`` split into (u, v, q, k) along the last axis."""
        y = self.silu(self.xp.matmul(x, w))
        out, start = [], 0
        for size in splits:
            out.append(y[:, start:start + size])
            start += size
        return tuple(out)

    # padded score cells over tiled ones (capacities) from which "jagged" runs the tiled kernel
    jagged_min_work_ratio = 1.0
    # catalogue rows per negative column (N / R) from which the "best" sampled logits run the fused
    # per-id dots; below it the backend's dense [T, N] product and gather (its "reference") is
    # faster. Timed by hand on CPU at ML-1M's shape (T = 16,384, D = 50, N = 3,953, R = 128..2,048;
    # not recorded): JAX's crossover at N / R = 4.5, torch's at 2.2. `grf bench negatives` times
    # the wide-R steps that follow from it
    sampled_per_id_min_ratio = 4.0

    def sampled_per_id_pays(self, items, ids) -> bool:
        """Static (shapes only): do the per-id dots of ``ids[..., R]`` into ``items[N, D]`` beat
        the dense product? ``N >= sampled_per_id_min_ratio * R``."""
        return items.shape[0] >= self.sampled_per_id_min_ratio * ids.shape[-1]

    def tiles_pay_off(self, layout: Jagged) -> bool:
        """Static (shapes only, so a jit-time choice): does the tile plan save enough work?
        ``B_cap max_len^2 >= jagged_min_work_ratio * P_cap tile^2``. Tiles cost more per cell
        than one dense matrix (gathers, small matmuls); on CPU they won only from about 2x less
        work (docs/results/speed.md "Speed"), on GPUs already at 1.6x."""
        plan = layout.tiles
        padded = layout.b_cap * layout.max_len ** 2
        return padded >= self.jagged_min_work_ratio * plan.pair_q.shape[0] * plan.tile ** 2

    def hstu_attention_padded(self, q, k, v, layout: Jagged, norm_len: int, bias: AttentionBias = NO_BIAS):
        """The reference of ``hstu_attention``: padded dense ``[B, H, L, L]`` scores (L = max_len)."""
        xp = self.xp
        pos = xp.arange(layout.max_len, dtype=xp.int32, device=self.array_device)
        causal = xp.reshape(pos, (1, -1, 1)) >= xp.reshape(pos, (1, 1, -1))
        return self._padded_attention(q, k, v, layout, causal, norm_len, rab=self.relative_bias(layout, norm_len, bias))

    def stu_attention_padded(self, q, k, v, layout: Jagged, num_targets, norm_len, alpha: float):
        """Target-aware HSTU attention of generative-recommenders' dlrm_v3 ranking model (its
        PyTorch kernel ``pytorch_hstu_mha`` with ``causal=True`` and ``num_targets``), padded
        reference. q[T, H, dqk], k[T, H, dqk], v[T, H, dv], ``num_targets[B_cap]`` int32 (the
        candidates ending each sequence) -> [T, H, dv], zeros on padding rows::

            out_i = sum_j SiLU(alpha * q_i . k_j) / norm_len * M_ij * v_j
            M_ij  = (i == j) or (r(i) > r(j)),   r(i) = min(i, L_b - num_targets_b)

        so history tokens attend causally, each candidate attends the whole history and itself but
        no other candidate, and nothing attends a candidate. ``norm_len``: GR divides by the
        batch's padded length (no softmax, no per-row normaliser): an int, or a 0-d float array
        (a value, so batches of different lengths share one compiled program)."""
        xp = self.xp
        L, Bc = layout.max_len, layout.b_cap
        pos = xp.arange(L, dtype=xp.int32, device=self.array_device)
        r = xp.minimum(xp.reshape(pos, (1, L)), xp.reshape(layout.lengths - num_targets, (Bc, 1)))   # [B, L]
        allowed = xp.logical_or(xp.reshape(pos, (1, L, 1)) == xp.reshape(pos, (1, 1, L)),
                                xp.reshape(r, (Bc, L, 1)) > xp.reshape(r, (Bc, 1, L)))
        return self._padded_attention(q, k, v, layout, allowed, norm_len, alpha=alpha)

    def _padded_attention(self, q, k, v, layout: Jagged, allowed, norm_len, alpha: float = 1.0, rab=None):
        """The padded SiLU attention both references share: ``SiLU(alpha q.k + rab) / norm_len``
        on the pairs ``allowed[B | 1, L, L]`` (bool) permits, keys past a sequence's length never.
        ``norm_len``: a number, or a 0-d backend array (``stu_attention``)."""
        xp = self.xp
        L, Bc = layout.max_len, layout.b_cap
        H = q.shape[1]

        def dense(x):  # [T, H, d] -> [B, H, L, d]
            return xp.permute_dims(self.gather_rows(self.append_zero_row(x), layout.dense_index), (0, 2, 1, 3))

        qd, kd, vd = dense(q), dense(k), dense(v)
        scores = xp.matmul(qd, xp.permute_dims(kd, (0, 1, 3, 2)))                # [B, H, L, L]
        if alpha != 1.0:
            scores = scores * alpha
        if rab is not None:
            scores = scores + xp.reshape(rab, (-1, 1, L, L))
        j = xp.reshape(xp.arange(L, dtype=xp.int32, device=self.array_device), (1, 1, L))
        valid_j = j < xp.reshape(layout.lengths, (Bc, 1, 1))
        mask = xp.reshape(xp.astype(xp.logical_and(allowed, valid_j), scores.dtype), (Bc, 1, L, L))
        if isinstance(norm_len, (np.ndarray, np.number)):
            norm_len = norm_len.item()                 # a host value: a Python number
        if isinstance(norm_len, (int, float)):
            mask = mask / norm_len
        else:   # an array: 1/N in its float32, then the compute dtype (mask is 0/1: as exact as dividing)
            mask = mask * xp.astype(1.0 / norm_len, scores.dtype)
        probs = self.silu(scores) * mask
        out = xp.permute_dims(xp.matmul(probs, vd), (0, 2, 1, 3))                # [B, L, H, dv]
        real = layout.seq_id < Bc
        flat_idx = xp.where(real, layout.seq_id * L + layout.pos, xp.zeros_like(layout.pos))
        rows = self.gather_rows(xp.reshape(out, (Bc * L, H, -1)), flat_idx)
        return rows * xp.reshape(xp.astype(real, rows.dtype), (-1, 1, 1))

    def hstu_attention_tiled(self, q, k, v, layout: Jagged, norm_len: int, bias: AttentionBias = NO_BIAS):
        """``hstu_attention`` without padding: the block-sparse pairs of ``layout.tiles``.

        Same contract and result as ``hstu_attention``; the work is ``P`` tiles of
        ``tile x tile`` scores (``P ~ sum_b ceil(L_b/tile)^2 / 2``) instead of ``B * max_len^2``,
        and autograd keeps ``[P, H, tile, tile]`` probabilities instead of ``[B, H, L, L]``.
        Needs ``layout.tiles`` (``Jagged.with_tiles``; ``make_batch`` builds it when
        ``model.attention_tile != 0``).
        """
        xp, plan = self.xp, layout.tiles
        C, nc_cap = plan.tile, plan.nc_cap
        H, dv = v.shape[1], v.shape[2]
        P = plan.pair_q.shape[0]

        # chunk-level gathers once, then whole-chunk blocks per pair: the index ops (and their
        # backward scatter-adds) move tile*d contiguous values per index instead of d
        def per_pair(x, pair):  # [T, H, d] -> [H, P, C, d], heads first: no per-pair transposes
            heads = xp.permute_dims(self.append_zero_row(x), (1, 0, 2))                        # [H, T+1, d]
            chunks = xp.take(heads, xp.reshape(plan.chunk_rows, (-1,)), axis=1)
            chunks = xp.reshape(chunks, (H, nc_cap + 1, C, x.shape[2]))
            return xp.take(chunks, pair, axis=1)

        def cells(x, pair):  # per-token [T] -> per-pair cells [P, C]
            return self._tile_cells(plan, x, pair)

        qp, kp, vp = per_pair(q, plan.pair_q), per_pair(k, plan.pair_k), per_pair(v, plan.pair_k)
        scores = self.batched_matmul(qp, kp, transpose_b=True)                      # [H, P, C, C]

        def positions():  # [P, C, 1], [P, 1, C]: the same in every layer
            return (xp.reshape(cells(layout.pos, plan.pair_q), (P, C, 1)),
                    xp.reshape(cells(layout.pos, plan.pair_k), (P, 1, C)))

        rab = None
        if bias.pos_w is not None:
            rel = self._memo(bias, ("tiled_rel", norm_len),
                             lambda: (norm_len - 1) + self._memo(bias, "tiled_pos", positions)[1]
                             - self._memo(bias, "tiled_pos", positions)[0])
            rab = self.gather_table(bias.pos_w, rel)                                 # [P, C, C]
        if bias.ts_w is not None:
            t_bias = self.gather_table(bias.ts_w, self.tile_time_buckets(layout, bias))
            rab = t_bias if rab is None else rab + t_bias
        if rab is not None:
            scores = self.add_head_bias(scores, rab)

        def allowed():
            # pairs join chunks of one sequence, so "same sequence" is given; causal is by position
            # and empty key cells (rows == T_cap) are masked
            q_pos, k_pos = self._memo(bias, "tiled_pos", positions)
            key_real = xp.reshape(xp.take(plan.chunk_rows, plan.pair_k, axis=0) < layout.t_cap, (P, 1, C))
            return xp.logical_and(k_pos <= q_pos, key_real)

        mask = xp.astype(self._memo(bias, "tiled_allowed", allowed), scores.dtype) / norm_len
        partial = self.batched_matmul(self.silu(scores) * mask, vp)                # [H, P, C, dv]
        # the tiles of one query chunk are summed in fp32 (in bf16/fp16 a scatter-add would round
        # at every tile; the padded reference sums inside one matmul)
        partial = self.cast(xp.permute_dims(partial, (1, 2, 0, 3)), "float32")     # [P, C, H, dv]
        chunks = self.cast(self.segment_sum(partial, plan.pair_q, nc_cap + 1), self._dtype_name_of(v))
        return self.gather_rows(xp.reshape(chunks, ((nc_cap + 1) * C, H, dv)), plan.token_cell)

    def batched_matmul(self, a, b, transpose_b: bool = False):
        """``a[..., M, K] @ b[..., K, N]``, or ``a @ b^T`` for ``b[..., N, K]`` with ``transpose_b``
        (the attention tiles' products; a Backend method because XLA's CPU dots with a transposed
        operand are 2-3x slower than with a copied one, see ``JaxBackend.batched_matmul``)."""
        xp = self.xp
        return xp.matmul(a, xp.matrix_transpose(b) if transpose_b else b)

    def add_head_bias(self, scores, bias):
        """``scores[H, ...] + bias[...]``: one bias shared by all heads. Its gradient in ``bias`` is
        the sum over heads (a Backend method because XLA's CPU reduction over a short leading axis
        is slow, see ``JaxBackend.add_head_bias``)."""
        return scores + bias

    def hstu_norm_mul(self, av, u, eps: float = 1e-6):
        """``u[T, H*dv] * LayerNorm(av[T, H*dv])`` (norm over all heads together, as GR research)."""
        return u * self.layer_norm(av, eps)
