"""Row-sparse update kernels, selected by ``backend.row_kernel`` (README "Sparse embeddings").

A row kernel computes ``rowopt.row_update``: the new values and optimizer state of the U rows a
step looked up (``B.row_update(name, values[U, D], grads[U, D], state_rows, touched[U], lr, cfg)``).
Each declares the backends and optimizers it supports; a config asking for anything else is
refused by name when it is checked (``problem``), and a documented per-call limit (dtype,
width) raises ``UnsupportedOnBackend`` naming it, never a silent fallback (except under "auto",
whose contract is to fall back).

- ``reference``: the formulas of embedding/rowopt.py on ``B.xp``; every backend and optimizer.
- ``fbgemm``: fbgemm's fused TBE backward (npu_ops/fbgemm_tbe.py): fbgemm-ascend on the NPU,
  fbgemm_gpu on CUDA, fbgemm-gpu-cpu on CPU. rowwise_adagrad only: fbgemm's Adam bias-corrects
  with the table's step count, lazy_adam with each row's.
- ``auto`` (the npu default): ``fbgemm`` for the calls it supports when fbgemm-ascend imports,
  else ``reference`` (torch ops on NPU tensors).
- ``default``: the backend's own choice (``Backend.default_row_kernel``: reference on torch and
  jax, auto on npu).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

@dataclasses.dataclass(frozen=True)
class RowKernel:
    name: str
    backends: tuple[str, ...]
    optimizers: tuple[str, ...]


_KERNELS = {
    "reference": RowKernel("reference", ("jax", "torch", "npu"), ("lazy_adam", "rowwise_adagrad")),
    "fbgemm": RowKernel("fbgemm", ("torch", "npu"), ("rowwise_adagrad",)),
    "auto": RowKernel("auto", ("npu",), ("lazy_adam", "rowwise_adagrad")),
}
ROW_KERNELS = ("default", *_KERNELS)  # config.RowKernelName lists the same names
_WHY_NOT = {"lazy_adam": "fbgemm's Adam bias-corrects with the table's step count, lazy_adam with each row's "
                         "own (README \"Sparse embeddings\")"}


def resolve(name: str, backend: str) -> str:
    """``name`` with "default" replaced by ``backend``'s own choice."""
    if name != "default":
        return name
    from . import backend_class

    return backend_class(backend).default_row_kernel


def problem(name: str, backend: str, optimizer: str | None = None, dim: int | None = None,
            weight_decay: float = 0.0) -> str | None:
    """Why ``backend.row_kernel = name`` cannot serve ``optimizer`` on ``backend`` (None: it can;
    ``optimizer`` None or "adamw" is not checked: no row kernel runs then). ``dim`` (the table
    width) and ``weight_decay``: the explicit ``fbgemm`` kernel's documented limits, checked here
    so that a run is refused before it starts rather than at its first update."""
    kernel = _KERNELS.get(resolve(name, backend))
    if kernel is None:
        return f"unknown row kernel; one of {', '.join(repr(k) for k in ROW_KERNELS)}"
    if backend not in kernel.backends:
        valid = [k for k, spec in _KERNELS.items() if backend in spec.backends]
        return (f"row kernel {kernel.name!r} does not run on the {backend} backend (runs on "
                f"{', '.join(kernel.backends)}); valid for {backend}: 'default', {', '.join(map(repr, valid))}")
    if optimizer and optimizer != "adamw" and optimizer not in kernel.optimizers:
        why = _WHY_NOT.get(optimizer, "")
        return (f"row kernel {kernel.name!r} supports embedding.optimizer in {', '.join(kernel.optimizers)}, "
                f"not {optimizer!r}{': ' + why if why else ''}; use backend.row_kernel='reference'")
    if kernel.name == "fbgemm" and optimizer == "rowwise_adagrad" and dim is not None:
        from npu_ops.fbgemm_tbe import problem as limit  # no vendor import

        reason = limit("npu" if backend == "npu" else "cpu", "float32", dim, weight_decay)
        if reason:
            return f"row kernel 'fbgemm': {reason}; use backend.row_kernel='reference'"
    return None


def build(B, name: str) -> tuple[str, Callable | None]:
    """``(resolved name, fn)`` for backend ``B``; ``fn(B, optimizer, values, grads, state_rows,
    touched, lr, cfg)`` or None for the reference. BackendUnavailable when ``fbgemm`` was asked
    for and cannot load here."""
    from npu_ops import UnsupportedOnBackend

    from .base import BackendUnavailable

    resolved = resolve(name, B.name)
    reason = problem(resolved, B.name)
    if reason:
        from gr_functional.errors import ConfigError

        raise ConfigError(f"backend.row_kernel={name!r}: {reason}")
    if resolved == "reference":
        return resolved, None
    from npu_ops import fbgemm_tbe

    try:
        adapter = fbgemm_tbe.FbgemmRowwiseAdagrad(fbgemm_tbe.load_api(B.device_kind))
    except UnsupportedOnBackend as exc:
        if resolved == "auto":
            return resolved, None
        raise BackendUnavailable(f"backend {B.name!r}: {exc}. Choose backend.row_kernel='reference'") from exc
    return resolved, fbgemm_update(adapter, fallback=resolved == "auto")


def fbgemm_update(adapter, fallback: bool) -> Callable:
    """The row-kernel fn of an ``FbgemmRowwiseAdagrad``; ``fallback``: calls it cannot serve (an
    optimizer or a documented limit) take the reference instead of raising."""
    from npu_ops import fbgemm_tbe
    from npu_ops import UnsupportedOnBackend

    from gr_functional.embedding import rowopt

    def update(B, optimizer, values, grads, state_rows, touched, lr, cfg):
        reason = (None if optimizer == "rowwise_adagrad" else f"optimizer {optimizer!r} is not fbgemm's") or \
            fbgemm_tbe.problem(B.device_kind, B._dtype_name_of(values), values.shape[1], cfg.weight_decay)
        if reason:
            if fallback:
                return rowopt.reference_row_update(B, optimizer, values, grads, state_rows, touched, lr, cfg)
            raise UnsupportedOnBackend(f"row kernel 'fbgemm': {reason}; use backend.row_kernel='reference'")
        new, acc = adapter.update(values, grads, state_rows["acc"], touched, lr, cfg.eps, cfg.weight_decay)
        return new, {"acc": acc}

    return update
