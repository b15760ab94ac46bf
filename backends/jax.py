"""JAX backend: the numerical reference. ``jax.numpy`` as ``xp``, ``jax.jit``, ``jax.value_and_grad``.

Dataclass batches (Jagged, HSTUBatch, ...) are registered as pytrees on first use, with their
static fields as metadata, so they cross ``jit`` as arguments.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from gr_functional.tree import is_static

from .base import Backend

_REGISTERED: set[type] = set()


def _register_dataclasses(tree: Any) -> None:
    import jax

    if isinstance(tree, dict):
        for v in tree.values():
            _register_dataclasses(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _register_dataclasses(v)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        if cls not in _REGISTERED:
            fields = dataclasses.fields(cls)
            jax.tree_util.register_dataclass(
                cls,
                data_fields=[f.name for f in fields if not is_static(f)],
                meta_fields=[f.name for f in fields if is_static(f)],
            )
            _REGISTERED.add(cls)
        for f in dataclasses.fields(tree):
            if not is_static(f):
                _register_dataclasses(getattr(tree, f.name))


class JaxBackend(Backend):
    name = "jax"

    def __init__(self, device: str | None = None, dtype: str = "float32"):
        super().__init__(device, dtype)
        import jax
        import jax.numpy as jnp

        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("the jax backend in float64 needs x64 mode: set JAX_ENABLE_X64=1 "
                             "before Python starts (it is process-wide)")
        self._jax = jax
        self.xp = jnp
        self._device = jax.devices(device)[0] if device else None

    def asarray(self, x, dtype=None):
        arr = self.xp.asarray(x, dtype=dtype)
        return self._jax.device_put(arr, self._device) if self._device is not None else arr

    def asarray_tree(self, tree):
        _register_dataclasses(tree)
        return super().asarray_tree(tree)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def value_and_grad(self, f: Callable, has_aux: bool = False) -> Callable:
        # allow_int: integer leaves (index arrays riding along with params) get float0 grads
        return self._jax.value_and_grad(f, has_aux=has_aux, allow_int=True)

    def jit(self, f: Callable) -> Callable:
        return self._jax.jit(f)

    def stop_gradient(self, x):
        return self._jax.lax.stop_gradient(x)

    def set_deterministic(self) -> None:
        # XLA on CPU is deterministic. On GPU, --xla_gpu_deterministic_ops must be in XLA_FLAGS
        # before JAX starts its backend, which is too late here: say so instead of pretending.
        import os
        import warnings

        platform = (self._device or self._jax.devices()[0]).platform
        if platform == "gpu" and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
            warnings.warn("backend.deterministic on a JAX GPU needs XLA_FLAGS=--xla_gpu_deterministic_ops=true "
                          "set before Python starts; results may differ run to run")

    # native kernel ops -------------------------------------------------------------
    def silu(self, x):
        return self._jax.nn.silu(x)

    def segment_sum(self, data, segment_ids, num_segments: int):
        return self._jax.ops.segment_sum(data, segment_ids, num_segments=num_segments)

    def logsumexp(self, x, axis: int = -1):
        return self._jax.nn.logsumexp(x, axis=axis)
