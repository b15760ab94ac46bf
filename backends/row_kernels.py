"""Row-sparse update kernels: op "row_update" of the op registry (backends/ops.py), selected by
``ops.row_update`` (docs/guides/sparse-embeddings.md "Sparse embeddings").

A row kernel computes ``rowopt.row_update``: the new values and optimizer state of the U rows a
step looked up (``B.row_update(name, values[U, D], grads[U, D], state_rows, touched[U], lr, cfg)``).
Each declares the backends and embedding optimizers it supports; a config asking for anything else
is refused by name when it is checked, and a documented per-call limit (dtype, width) raises
``UnsupportedOnBackend`` naming it, never a silent fallback (except under "auto", whose contract is
to fall back).

- ``reference``: the formulas of embedding/rowopt.py on ``B.xp``; every backend and optimizer.
- ``fbgemm``: fbgemm's fused TBE backward (npu_ops/fbgemm_tbe.py): fbgemm-ascend on the NPU,
  fbgemm_gpu on CUDA, fbgemm-gpu-cpu on CPU. rowwise_adagrad only: fbgemm's Adam bias-corrects
  with the table's step count, lazy_adam with each row's.
- ``auto`` (the npu default): ``fbgemm`` for the calls it supports when fbgemm-ascend imports,
  else ``reference`` (torch ops on NPU tensors).
- ``default``: the backend's own choice (``Backend.default_ops["row_update"]``: reference on torch
  and jax, auto on npu).
"""
from __future__ import annotations

from typing import Callable

from gr_functional import task
from gr_functional.embedding import rowopt
from gr_functional.errors import UnsupportedOnBackend
from npu_ops import fbgemm_tbe

from . import ops

_WHY_NOT = {"lazy_adam": "fbgemm's Adam bias-corrects with the table's step count, lazy_adam with each row's "
                         "own (README \"Sparse embeddings\")"}


def _optimizers(name: str, supported: tuple[str, ...], *, width_limits: bool = False):
    """``Impl.check`` of a row kernel serving the embedding optimizers ``supported`` (AdamW tables
    run no row kernel: not checked); ``width_limits``: fbgemm's documented limits on the table width
    and weight decay, checked before a run starts rather than at its first update."""

    def check(cfg) -> tuple[str, str] | None:
        optimizer = cfg.embedding.optimizer
        if optimizer == "adamw":
            return None
        if optimizer not in supported:
            why = _WHY_NOT.get(optimizer, "")
            return (f"embedding.optimizer={optimizer!r}",
                    f"it supports {', '.join(supported)}{': ' + why if why else ''}; use ops.row_update='reference'")
        if width_limits:
            table_dim = task.table_dim(cfg)  # the task's table (the ranking model's is ranking.embed_dim)
            reason = fbgemm_tbe.problem("npu" if cfg.backend.name == "npu" else "cpu", "float32", table_dim,
                                        cfg.optim.weight_decay)
            if reason:
                return "the table", f"{reason}; use ops.row_update='reference'"
        return None

    return check


ops.register("row_update", "reference", rowopt.reference_row_update,
             check=_optimizers("reference", ("lazy_adam", "rowwise_adagrad")),
             doc="the formulas of embedding/rowopt.py on B.xp: the oracle")


def _fbgemm_factory(fallback: bool) -> Callable:
    def factory(B):
        try:
            adapter = fbgemm_tbe.FbgemmRowwiseAdagrad(fbgemm_tbe.load_api(B.device_kind))
        except UnsupportedOnBackend:
            if fallback:
                return rowopt.reference_row_update
            raise
        return fbgemm_update(adapter, fallback=fallback)

    return factory


ops.register("row_update", "fbgemm", factory=_fbgemm_factory(False), backends=("torch", "npu"),
             check=_optimizers("fbgemm", ("rowwise_adagrad",), width_limits=True),
             doc="fbgemm's fused TBE row-wise Adagrad (fbgemm-ascend, fbgemm_gpu, fbgemm-gpu-cpu)")
ops.register("row_update", "auto", factory=_fbgemm_factory(True), backends=("npu",),
             check=_optimizers("auto", ("lazy_adam", "rowwise_adagrad")),
             doc="fbgemm for the calls it supports when fbgemm-ascend imports, else reference")


def fbgemm_update(adapter, fallback: bool) -> Callable:
    """The row-kernel fn of an ``FbgemmRowwiseAdagrad``; ``fallback``: calls it cannot serve (an
    optimizer or a documented limit) take the reference instead of raising."""

    def update(B, optimizer, values, grads, state_rows, touched, lr, cfg):
        reason = (None if optimizer == "rowwise_adagrad" else f"optimizer {optimizer!r} is not fbgemm's") or \
            fbgemm_tbe.problem(B.device_kind, B._dtype_name_of(values), values.shape[1], cfg.weight_decay)
        if reason:
            if fallback:
                return rowopt.reference_row_update(B, optimizer, values, grads, state_rows, touched, lr, cfg)
            raise UnsupportedOnBackend(f"row kernel 'fbgemm': {reason}; use ops.row_update='reference'")
        new, acc = adapter.update(values, grads, state_rows["acc"], touched, lr, cfg.eps, cfg.weight_decay)
        return new, {"acc": acc}

    return update


__all__ = ["fbgemm_update"]
