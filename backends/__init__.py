"""Backend registry: ``get_backend("jax" | "torch" | "npu", device=None, dtype="float32")``.

Backends are imported lazily, so a machine without JAX can still use torch and vice versa.
"""
from __future__ import annotations

import importlib

from . import kernels, loss_ops, ops, row_kernels  # noqa: F401 - they register the shipped implementations
from .base import Backend
from .catalog import BACKENDS, BackendUnavailable, backend_class, backend_names, multi_process_backends, register_backend


def backend_status(name: str) -> tuple[bool, str]:
    """``(True, "ok")`` if ``get_backend(name)`` would succeed, else ``(False, reason)``."""
    try:
        get_backend(name)
    except Exception as exc:  # noqa: BLE001 - the reason is the product here
        return False, f"{type(exc).__name__}: {exc}"
    return True, "ok"


def get_backend(name: str, **options) -> Backend:
    """Create a backend by name. Unknown names and unavailable backends raise with the reason."""
    if name not in BACKENDS:
        lines = []
        for other in BACKENDS.names():
            ok, reason = backend_status(other)
            lines.append(f"  {other}: {'available' if ok else reason}")
        raise BackendUnavailable(f"unknown backend {name!r}; backends:\n" + "\n".join(lines))
    module_name, cls_name = BACKENDS.get(name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} needs a package that is not installed: {exc}. "
                                 f"Install the project with `pip install -e .`") from exc
    return getattr(module, cls_name)(**options)


__all__ = ["BACKENDS", "Backend", "BackendUnavailable", "backend_class", "backend_names", "backend_status",
           "get_backend", "multi_process_backends", "ops", "register_backend"]
