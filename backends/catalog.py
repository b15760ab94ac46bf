"""Which backends exist: ``BACKENDS`` (name -> module and class, imported when first asked for) and
``BackendUnavailable``. A leaf of the package: the op registry (``backends/ops.py``) asks a
backend class for its default implementations without importing any backend module statically.
"""
from __future__ import annotations

import importlib

from gr_functional.registry import Registry


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why and how to fix it."""


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


def multi_process_backends() -> list[str]:
    """The registered backends whose runs span several processes (``multi_process``)."""
    return [n for n in BACKENDS.names() if backend_class(n).multi_process]


def backend_class(name: str) -> type:
    """The Backend subclass registered as ``name``. Imports its module, which imports no array
    library (they load when a backend is created)."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; backends: {', '.join(BACKENDS.names())}")
    module_name, cls_name = BACKENDS.get(name)
    return getattr(importlib.import_module(module_name), cls_name)
