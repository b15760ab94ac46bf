"""The Backend contract: an array runtime (backends/runtime.py) with the reference of every kernel op
(backends/reference_ops.py), whose fused ops run the implementation the op registry
(backends/ops.py) selected for each, once, when the backend was built (``use_ops``).

Model code (gr_functional) calls ``B.xp`` for standard Array API math and ``B.<op>`` for the kernel
ops; a backend is a subclass of ``Backend`` (backends/torch.py, jax.py, npu.py) registered in
backends/catalog.py.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from gr_functional.jagged import Jagged

from . import ops
from .catalog import BackendUnavailable
from .kernels import NO_BIAS, AttentionBias
from .reference_ops import TIME_BUCKET_DIVISOR, ReferenceOps, time_bucket_thresholds
from .runtime import COMPUTE_DTYPES, ArrayRuntime, MixedPrecisionOps


class Backend(ReferenceOps, ArrayRuntime):
    """A backend: the array runtime, the reference ops, and the op registry's choices.

    Subclasses must set ``xp`` and implement ``asarray``, ``to_numpy``, ``value_and_grad``,
    ``jit`` and ``stop_gradient``. They may override any name in ``KERNEL_OPS`` with their own
    formulation of the same math. The fused ops (``hstu_attention``, ``stu_attention``,
    ``sampled_logits``, ``shared_logsumexp``, ``row_update``) run the implementation the op
    registry (backends/ops.py) selected for each when the backend was built (``use_ops``).
    """

    # What ``ops.<op> = "default"`` selects here (backends/ops.py), per op
    default_ops = {"attention": "jagged", "ranking_attention": "reference", "sampled_logits": "reference",
                   "shared_logsumexp": "reference", "row_update": "reference"}

    def __init__(self, device: str | None = None, dtype: str = "float32"):
        """Subclasses set up their library and device, then call ``use_ops(ops)`` last
        (implementation factories may read the device)."""
        super().__init__(device, dtype)
        self.op_names: dict[str, str] = {}    # op -> the resolved implementation (config.toml keeps "default")
        self._op_fns: dict[str, Callable] = {}  # op -> its fn(B, ...)

    def _check_precision(self, precision: str) -> None:
        for op, name in self.op_names.items():  # each implementation must run this precision (refused by name)
            ops.check(op, name, self.name, precision=precision)

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

    def with_attention_recompute(self, on: bool) -> "Backend":
        """A shallow copy whose ``hstu_attention`` runs under ``checkpoint``: nothing of the
        attention's inside (score tiles or matrices, probabilities, per-pair copies of q/k/v) is
        kept for backward, which recomputes it; ``self`` is unchanged."""
        return self._view(attention_recompute=bool(on))

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

    def stu_attention(self, q, k, v, layout: Jagged, num_targets, norm_len, alpha: float):
        """Target-aware HSTU attention (``stu_attention_padded``'s contract) through the kernel
        ``ops.ranking_attention`` selected."""
        return self._op_fns["ranking_attention"](self, q, k, v, layout, num_targets, norm_len, alpha)


__all__ = ["COMPUTE_DTYPES", "TIME_BUCKET_DIVISOR", "Backend", "BackendUnavailable", "MixedPrecisionOps",
           "time_bucket_thresholds"]
