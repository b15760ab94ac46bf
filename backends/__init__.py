"""Backend registry: ``get_backend("jax" | "torch" | "npu", device=None, dtype="float32")``.

Backends are imported lazily, so a machine without JAX can still use torch and vice versa.
"""
from __future__ import annotations

import importlib

from gr_functional.registry import Registry

from .base import Backend, BackendUnavailable

# name -> (module, class): the module is imported when the backend is first asked for
BACKENDS: Registry[tuple[str, str]] = Registry(
    "backend", config_key="backend.name",
    how="Register one with backends.register_backend(NAME, module, class_name) in a --plugin module")


def register_backend(name: str, module: str, class_name: str, *, replace: bool = False) -> None:
    """Make ``get_backend(name)`` build ``module.class_name`` (a ``Backend`` subclass)."""
    BACKENDS.add(name, (module, class_name), replace=replace)


register_backend("jax", "backends.jax", "JaxBackend")
register_backend("torch", "backends.torch", "TorchBackend")
register_backend("npu", "backends.npu", "NpuBackend")


def backend_names() -> list[str]:
    return list(BACKENDS.names())


def backend_class(name: str) -> type:
    """The Backend subclass registered as ``name``. Imports its module, which imports no array
    library (they load when a backend is created)."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; backends: {', '.join(BACKENDS.names())}")
    module_name, cls_name = BACKENDS.get(name)
    return getattr(importlib.import_module(module_name), cls_name)


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
           "get_backend", "register_backend"]
