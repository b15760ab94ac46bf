"""The Backend contract and the reference implementation of every kernel op.

Model code (gr_functional) calls ``B.xp`` for standard Array API math and ``B.<op>`` for the
kernel ops listed in ``Backend.KERNEL_OPS``: the ops the Array API lacks, or that some backend
fuses. Every op here is written once on ``self.xp`` and is the semantic definition; a backend
overrides an op with a native or fused kernel only when a differential test
(tests/differential/) shows the override matches this reference in outputs and gradients.

Shapes use T = token capacity, B = sequence capacity (``b_cap``), L = ``max_len``,
H = heads, d = head dim, D = model dim. Index arrays are int32.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import numpy as np

from gr_functional.jagged import Jagged
from gr_functional.tree import tree_map

from . import ops
from .catalog import BackendUnavailable
from .kernels import NO_BIAS, AttentionBias

TIME_BUCKET_DIVISOR = 0.301  # generative-recommenders: floor(log(max(|dt|, 1)) / 0.301)


def time_bucket_thresholds(num_buckets: int) -> np.ndarray:
    """``thr[k]`` = smallest integer x >= 1 with floor(log(x) / 0.301) >= k, k = 0..num_buckets.

    Bucketing by integer comparison against these thresholds is exact, so every backend
    assigns every time gap to the same bucket (float32 ``log`` can disagree by one ulp at a
    bucket edge between libraries). Thresholds beyond int32 are clipped: gaps that large
    cannot occur in int32 seconds.
    """
    thr = np.empty(num_buckets + 1, dtype=np.int64)
    for k in range(num_buckets + 1):
        x = max(1, int(math.floor(math.exp(k * TIME_BUCKET_DIVISOR))) - 2)
        while math.floor(math.log(x) / TIME_BUCKET_DIVISOR) < k:
            x += 1
            if x > np.iinfo(np.int32).max:
                break
        thr[k] = x
    return np.minimum(thr, np.iinfo(np.int32).max).astype(np.int32)


# Compute dtypes of the mixed-precision modes (backend.precision); "fp32" computes in the
# backend dtype itself.
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_MIXED_CLASSES: dict[type, type] = {}


class Backend:
    """Base class: reference kernel ops on ``self.xp``; subclasses supply the transforms.

    Subclasses must set ``xp`` and implement ``asarray``, ``to_numpy``, ``value_and_grad``,
    ``jit`` and ``stop_gradient``. They may override any name in ``KERNEL_OPS`` with their own
    formulation of the same math. The fused ops (``hstu_attention``, ``stu_attention``,
    ``sampled_logits``, ``shared_logsumexp``, ``row_update``) run the implementation the op
    registry (backends/ops.py) selected for each when the backend was built (``use_ops``).
    """

    name = "base"
    KERNEL_OPS = ("silu", "layer_norm", "l2_normalize", "logsumexp", "gather_rows", "segment_sum",
                  "sampled_logits_reference", "sampled_logits_16bit_reference", "shared_logsumexp_reference",
                  "relative_bias", "hstu_uvqk", "hstu_norm_mul", "add_head_bias")
    # sampled_logits scores all items with one matmul when the catalogue is at most this many
    # times the number of sampled ids per row (a BLAS GEMM beats gathering T*R rows: ~2.5x in a one-off
    # CPU timing at ML-1M shapes, T=21k, R=128, N=3953, not yet in benchmarks/); beyond it, it gathers
    # only the sampled rows.
    DENSE_LOGITS_MAX_RATIO = 64
    # What ``ops.<op> = "default"`` selects here (backends/ops.py), per op
    default_ops = {"attention": "jagged", "ranking_attention": "reference", "sampled_logits": "reference",
                   "shared_logsumexp": "reference", "row_update": "reference"}
    # backend.compile: the training loss runs through ``compiled`` (torch.compile on torch)
    compile = False
    # The argument type of hstu_attention's bias, reachable from model code as B.AttentionBias
    # (gr_functional imports no backend module).
    AttentionBias = AttentionBias
    # where arrays created inside ops (aranges) live: None = the library default (JAX places them
    # with their inputs); torch sets its device, else CUDA ops would meet CPU constants
    array_device = None

    def __init__(self, device: str | None = None, dtype: str = "float32"):
        """Subclasses set up their library and device, then call ``use_ops(ops)`` last
        (implementation factories may read the device)."""
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.device = device
        self.dtype_name = dtype
        self._thresholds_cache: dict[int, Any] = {}
        self.op_names: dict[str, str] = {}    # op -> the resolved implementation (config.toml keeps "default")
        self._op_fns: dict[str, Callable] = {}  # op -> its fn(B, ...)

    def __repr__(self):
        return f"{type(self).__name__}(device={self.device!r}, dtype={self.dtype_name!r})"

    @property
    def device_kind(self) -> str:
        """The kind of device arrays live on ("cpu", "cuda", "npu", "gpu", ...), as attention
        kernels declare the devices they run on."""
        return (self.device or "cpu").split(":")[0]

    def use_ops(self, choices: dict[str, str] | None = None) -> None:
        """Select each op's implementation (backends/ops.py): ``choices`` maps op names to
        implementation names; ops it leaves out, and "default", take ``default_ops``. ConfigError
        naming the option when an implementation does not run this backend, dtype or device;
        BackendUnavailable with the reason when it cannot run here."""
        choices = dict(choices or {})
        unknown = [op for op in choices if op not in ops.OPS]
        if unknown:
            raise ValueError(f"unknown op {unknown[0]!r}; ops: {', '.join(ops.OPS)}")
        for op in ops.OPS:
            impl, fn = ops.build(self, op, choices.get(op, "default"))
            self.op_names[op], self._op_fns[op] = impl.name, fn

    def with_ops(self, **choices: str) -> "Backend":
        """A shallow copy running other implementations of the ops named (benchmarks compare
        kernels on one backend); the others keep theirs; ``self`` is unchanged."""
        view = self._view(op_names=dict(self.op_names), _op_fns=dict(self._op_fns))
        view.use_ops({**self.op_names, **choices})
        return view

    @property
    def hstu_kernel(self) -> str:
        """The attention kernel in use (``ops.attention`` resolved)."""
        return self.op_names["attention"]

    @property
    def row_kernel(self) -> str:
        """The row-sparse update kernel in use (``ops.row_update`` resolved)."""
        return self.op_names["row_update"]

    def row_update(self, optimizer: str, values, grads, state_rows: dict, touched, lr, cfg):
        """``rowopt.row_update`` through the selected row kernel: ``(new_values[U, D],
        new_state_rows)`` of the gathered rows ``values[U, D]`` with summed gradients
        ``grads[U, D]``; untouched slots (``touched[U]`` false) unchanged."""
        return self._op_fns["row_update"](self, optimizer, values, grads, state_rows, touched, lr, cfg)

    # backend.attention_recompute: autograd keeps only the attention's inputs; backward recomputes
    # its score tiles (with_attention_recompute)
    attention_recompute = False
    # does every new array shape compile a new program (JAX's jit)? Host batch builders then pad
    # to the capacity ladder (a bounded set of programs) instead of exact sizes (less work)
    static_shapes = False
    # may index arrays made inside a ``checkpoint``ed function serve later calls (AttentionBias.memo)?
    # Not where checkpoint traces the function apart (JAX: they would be tracers of that trace).
    checkpoint_keeps_memo = False

    def _view(self, **attrs) -> "Backend":
        """A shallow copy with ``attrs`` set and the caches built from the old settings dropped
        (precision views, compiled functions: they trace the kernel they were built with)."""
        view = copy.copy(self)
        view.__dict__.pop("_precision_views", None)
        view.__dict__.pop("_compiled", None)
        view.__dict__.update(attrs)
        return view

    @classmethod
    def prepare_process(cls, *, attention_recompute: bool = False) -> None:
        """Process-wide settings a config asks of this backend, applied before the backend starts
        (``runner.make_backend`` calls it first). Default: none."""

    def with_attention_recompute(self, on: bool) -> "Backend":
        """A shallow copy whose ``hstu_attention`` runs under ``checkpoint``: nothing of the
        attention's inside (score tiles or matrices, probabilities, per-pair copies of q/k/v) is
        kept for backward, which recomputes it; ``self`` is unchanged."""
        return self._view(attention_recompute=bool(on))

    def checkpoint(self, f: Callable) -> Callable:
        """``f`` (array arguments, differentiable) whose intermediates autograd does not keep:
        backward runs ``f`` again (torch.utils.checkpoint, jax.checkpoint). Reference: ``f``
        itself (the Array API has no autodiff)."""
        return f

    # ------------------------------------------------------------------ transforms (abstract)
    xp: Any = None

    @property
    def float_dtype(self):
        return getattr(self.xp, self.dtype_name)

    def asarray(self, x: Any, dtype=None):
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def value_and_grad(self, f: Callable, has_aux: bool = False) -> Callable:
        """``f(params, *args) -> loss`` (or ``(loss, aux)``) becomes
        ``g(params, *args) -> (loss | (loss, aux), grads)``, grads a tree like params."""
        raise NotImplementedError

    def jit(self, f: Callable) -> Callable:
        return f

    def compiled(self, f: Callable) -> Callable:
        """``f`` compiled by the backend's graph compiler when ``backend.compile`` is on (torch:
        ``torch.compile``), else ``f``. The training loss goes through it; ``f`` stays the oracle."""
        return f

    def stop_gradient(self, x):
        raise NotImplementedError

    def block_until_ready(self, tree) -> None:
        """Wait until every array of ``tree`` is computed (timings; asynchronous devices)."""
        from gr_functional.tree import tree_leaves

        for leaf in tree_leaves(tree):
            if hasattr(leaf, "shape"):
                self.to_numpy(leaf)

    def asarray_tree(self, tree: Any) -> Any:
        """numpy tree -> backend tree; floating leaves take the backend dtype, integers stay int32."""
        def conv(leaf):
            arr = np.asarray(leaf)
            if np.issubdtype(arr.dtype, np.floating):
                return self.asarray(arr.astype(self.dtype_name, copy=False))
            return self.asarray(arr)
        return tree_map(conv, tree)

    def to_numpy_tree(self, tree: Any) -> Any:
        return tree_map(self.to_numpy, tree)

    # ------------------------------------------------------------------ precision (additions)
    def cast(self, x, dtype: str):
        """``x`` as dtype ``"float32" | "bfloat16" | "float16" | "float64"`` (differentiable: the
        gradient of a cast is cast back, so fp32 master weights get fp32 gradients)."""
        return self.xp.astype(x, getattr(self.xp, dtype))

    def bitcast(self, x, dtype: str):
        """The bits of ``x`` reinterpreted as ``dtype`` of the same width (``"int16"`` <->
        ``"float16"`` / ``"bfloat16"``): 16-bit payloads of a quantised exchange travel as int16."""
        raise NotImplementedError(f"{self.name}: bitcast is not implemented (the Array API has none)")

    def cast_tree(self, tree: Any, dtype: str) -> Any:
        """Every floating leaf of ``tree`` cast to ``dtype``; integer leaves (ids, offsets) unchanged."""
        xp = self.xp
        return tree_map(lambda x: self.cast(x, dtype) if xp.isdtype(x.dtype, "real floating") else x, tree)

    def with_precision(self, precision: str) -> "Backend":
        """A view of this backend that computes in ``precision`` ("fp32" | "bf16" | "fp16").

        "fp32" returns ``self``. Otherwise a shallow copy whose class mixes ``MixedPrecisionOps``
        into this backend's class: ``float_dtype`` (token masks, constants) is the compute dtype
        and the numerically fragile reductions (LayerNorm statistics, L2 norms, the loss's
        logsumexp) run in fp32, like torch.autocast's fp32 op list. The ops of ``self`` are not
        changed; native overrides of the concrete class still run (the mixin calls ``super()``).
        """
        if precision == "fp32":
            return self
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision must be one of {', '.join(['fp32', *COMPUTE_DTYPES])}, got {precision!r}")
        for op, name in self.op_names.items():  # each implementation must run this precision (refused by name)
            ops.check(op, name, self.name, precision=precision)
        views = self.__dict__.setdefault("_precision_views", {})
        if precision not in views:
            cls = type(self)
            mixed = _MIXED_CLASSES.get(cls)
            if mixed is None:
                mixed = type(f"{cls.__name__}Mixed", (MixedPrecisionOps, cls), {})
                _MIXED_CLASSES[cls] = mixed
            view = copy.copy(self)
            view.__dict__.pop("_precision_views", None)
            view.__class__ = mixed
            view.compute_dtype_name = COMPUTE_DTYPES[precision]
            view.precision = precision
            views[precision] = view
        return views[precision]

    def memory_profile(self, fn: Callable, *args) -> tuple[int | None, str]:
        """``(bytes, what)``: the memory of running ``fn(*args)``, as this backend can tell
        (benchmarks); ``what`` names the measure (each backend's docstring says what it counts);
        ``(None, "unavailable")`` where there is none."""
        return None, "unavailable"

    def set_deterministic(self, mode: str = "on") -> None:
        """Make later kernels deterministic where the library has a switch (torch); a no-op where
        the backend is deterministic already (JAX/XLA on CPU). ``mode``: "on", "off", or "auto"
        (on where it is cheap: CPU; off on accelerators)."""

    # ------------------------------------------------------------------ small helpers
    def _dtype_name_of(self, x) -> str:
        xp = self.xp
        for name in ("float32", "bfloat16", "float16", "float64"):
            if x.dtype == getattr(xp, name):
                return name
        raise TypeError(f"not a float array: {x.dtype}")

    def _ext(self, x):
        """Append one zero row so index ``T_cap`` (an empty cell) gathers zeros."""
        xp = self.xp
        return xp.concat([x, xp.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=self.array_device)], axis=0)

    def token_mask(self, layout: Jagged):
        """``[T]`` float: 1 on real tokens, 0 on padding."""
        xp = self.xp
        return xp.astype(layout.seq_id < layout.b_cap, self.float_dtype)

    # ------------------------------------------------------------------ kernel ops (reference)
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

    def sampled_logits(self, user, items, ids):
        """``sampled_logits_reference``'s contract, through the implementation ``ops.sampled_logits``
        selected."""
        return self._op_fns["sampled_logits"](self, user, items, ids, None, None)

    def sampled_logits_16bit(self, user, items, ids, scale, precision: str):
        """``sampled_logits_16bit_reference``'s contract, through the implementation
        ``ops.sampled_logits`` selected."""
        return self._op_fns["sampled_logits"](self, user, items, ids, scale, precision)

    def shared_logsumexp(self, user, neg_items, neg_ids, targets, pos, neg_bias, scale: float,
                         masked_logit: float):
        """``shared_logsumexp_reference``'s contract, through the implementation
        ``ops.shared_logsumexp`` selected."""
        return self._op_fns["shared_logsumexp"](self, user, neg_items, neg_ids, targets, pos, neg_bias, scale,
                                                 masked_logit)

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
                ts_d = self.gather_rows(self._ext(bias.ts), layout.dense_index)          # [B, L]
                q_d = self.gather_rows(self._ext(bias.query_ts), layout.dense_index)     # [B, L]
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
        xp = self.xp
        num_buckets = bias.ts_w.shape[0] - 1

        def buckets():
            bucket = xp.searchsorted(self.time_bucket_thresholds(num_buckets), gap(), side="right") - 1
            return xp.astype(xp.clip(bucket, 0, num_buckets), xp.int32)

        return self._memo(bias, ("time_bucket", geometry, num_buckets), buckets)

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
        return self.xp.take(self.gather_rows(self._ext(x), plan.chunk_rows), pair, axis=0)

    def hstu_uvqk(self, x, w, splits: tuple[int, int, int, int]):
        """``SiLU(x[T, D] @ w[D, sum(splits)])`` split into (u, v, q, k) along the last axis."""
        y = self.silu(self.xp.matmul(x, w))
        out, start = [], 0
        for size in splits:
            out.append(y[:, start:start + size])
            start += size
        return tuple(out)

    def hstu_attention(self, q, k, v, layout: Jagged, norm_len: int, bias: AttentionBias = NO_BIAS):
        """Jagged causal HSTU attention.

        q[T, H, dqk], k[T, H, dqk], v[T, H, dv] -> [T, H, dv] (zeros on padding rows):
        ``out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + rab[i, j]) / n * v_j``, with
        n = ``norm_len`` a fixed normaliser (no softmax, no 1/sqrt(d)) and rab from
        ``relative_bias(layout, n, bias)`` (``bias``: ``AttentionBias``, the bias parameters).
        Runs the kernel ``ops.attention`` selected (backends/kernels.py: "jagged" runs
        ``hstu_attention_tiled`` where the tile plan pays off, "tiled" whenever there is a plan,
        "reference" always ``hstu_attention_padded``, the oracle; fused kernels their own code).
        """
        attention = self._op_fns["attention"]
        recomputes = getattr(attention, "recomputes", None)  # a kernel that already does (kernels.py)
        if not self.attention_recompute or (recomputes is not None and recomputes(self, q, layout)):
            return attention(self, q, k, v, layout, norm_len, bias)

        memo = bias.memo if self.checkpoint_keeps_memo else None

        def kernel(q, k, v, pos_w, ts_w):
            # without checkpoint_keeps_memo (JAX) each layer and its backward rebuild the index arrays
            return attention(self, q, k, v, layout, norm_len,
                             dataclasses.replace(bias, pos_w=pos_w, ts_w=ts_w, memo=memo))

        return self.checkpoint(kernel)(q, k, v, bias.pos_w, bias.ts_w)

    # padded score cells over tiled ones (capacities) from which "jagged" runs the tiled kernel
    jagged_min_work_ratio = 1.0

    def tiles_pay_off(self, layout: Jagged) -> bool:
        """Static (shapes only, so a jit-time choice): does the tile plan save enough work?
        ``B_cap max_len^2 >= jagged_min_work_ratio * P_cap tile^2``. Tiles cost more per cell
        than one dense matrix (gathers, small matmuls); on CPU they won only from about 2x less
        work (README "Speed"), on GPUs already at 1.6x."""
        plan = layout.tiles
        padded = layout.b_cap * layout.max_len ** 2
        return padded >= self.jagged_min_work_ratio * plan.pair_q.shape[0] * plan.tile ** 2

    def hstu_attention_padded(self, q, k, v, layout: Jagged, norm_len: int, bias: AttentionBias = NO_BIAS):
        """The reference of ``hstu_attention``: padded dense ``[B, H, L, L]`` scores (L = max_len)."""
        xp = self.xp
        pos = xp.arange(layout.max_len, dtype=xp.int32, device=self.array_device)
        causal = xp.reshape(pos, (1, -1, 1)) >= xp.reshape(pos, (1, 1, -1))
        return self._padded_attention(q, k, v, layout, causal, norm_len, rab=self.relative_bias(layout, norm_len, bias))

    def stu_attention(self, q, k, v, layout: Jagged, num_targets, norm_len, alpha: float):
        """Target-aware HSTU attention (``stu_attention_padded``'s contract) through the kernel
        ``ops.ranking_attention`` selected."""
        return self._op_fns["ranking_attention"](self, q, k, v, layout, num_targets, norm_len, alpha)

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
            return xp.permute_dims(self.gather_rows(self._ext(x), layout.dense_index), (0, 2, 1, 3))

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
            heads = xp.permute_dims(self._ext(x), (1, 0, 2))                        # [H, T+1, d]
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


class MixedPrecisionOps:
    """Mixin of ``Backend.with_precision`` views: compute in ``compute_dtype_name`` (bf16/fp16).

    Activations and cast parameters are in the compute dtype, so every matmul and elementwise op
    runs there. Four reductions run in fp32 and cast back, because low-precision accumulation
    would cost more accuracy than it saves time: LayerNorm statistics, L2 norms (both return the
    compute dtype), ``logsumexp`` (returns fp32: it is the loss, which stays fp32) and the
    scatter-add behind a parameter table's gather gradient (``gather_table`` reads the fp32 copy).
    """

    compute_dtype_name: str = "bfloat16"
    precision: str = "bf16"

    def __repr__(self):
        return f"{type(self).__name__}(device={self.device!r}, dtype={self.dtype_name!r}, precision={self.precision!r})"

    @property
    def float_dtype(self):
        return getattr(self.xp, self.compute_dtype_name)

    def layer_norm(self, x, eps: float = 1e-6):
        return self.cast(super().layer_norm(self.cast(x, "float32"), eps), self.compute_dtype_name)

    def l2_normalize(self, x, eps: float = 1e-6):
        return self.cast(super().l2_normalize(self.cast(x, "float32"), eps), self.compute_dtype_name)

    def logsumexp(self, x, axis: int = -1):
        return super().logsumexp(self.cast(x, "float32"), axis=axis)

    def gather_table(self, table, idx):
        # Parameter tables are gathered from their fp32 copy, so the backward scatter-add (the
        # embedding and relative-bias gradients: millions of cells into a few hundred rows)
        # accumulates in fp32: more exact (bf16 worst gradient 0.11 -> 0.034), and on GPUs free of
        # bf16 compare-and-swap atomics (suspected cause of a JAX bf16 ML-1M epoch taking 149 s on
        # an H100 against 3-7 s in fp32; not re-measured). Activations keep gather_rows.
        return self.cast(super().gather_table(self.cast(table, "float32"), idx), self.compute_dtype_name)
