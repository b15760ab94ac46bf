"""The array runtime every backend is: its array library (``xp``), transfers between host and
device (``asarray``, ``to_numpy``), autodiff and compilation (``value_and_grad``, ``jit``,
``compiled``, ``checkpoint``), dtypes and precision views (``cast``, ``with_precision``), memory
profiles and determinism. Subclasses (backends/torch.py, backends/jax.py) supply the library.

What the model computes is elsewhere: the reference of every op on ``xp``
(backends/reference_ops.py) and the fused ops chosen once through the op registry
(backends/ops.py, ``Backend.use_ops`` in backends/base.py).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from gr_functional.errors import ConfigError
from gr_functional.tree import tree_map

# Compute dtypes of the mixed-precision modes (backend.precision); "fp32" computes in the
# backend dtype itself.
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_MIXED_CLASSES: dict[type, type] = {}


class ArrayRuntime:
    """Base class of the array runtime: subclasses set ``xp`` and implement ``asarray``,
    ``to_numpy``, ``value_and_grad``, ``jit`` and ``stop_gradient``."""

    name = "base"
    # backend.compile: the training loss runs through ``compiled`` (torch.compile on torch)
    compile = False
    # where arrays created inside ops (aranges) live: None = the library default (JAX places them
    # with their inputs); torch sets its device, else CUDA ops would meet CPU constants
    array_device = None

    def __init__(self, device: str | None = None, dtype: str = "float32"):
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.device = device
        self.dtype_name = dtype
        self._thresholds_cache: dict[int, Any] = {}

    def __repr__(self):
        return f"{type(self).__name__}(device={self.device!r}, dtype={self.dtype_name!r})"

    @property
    def device_kind(self) -> str:
        """The kind of device arrays live on ("cpu", "cuda", "npu", "gpu", ...), as attention
        kernels declare the devices they run on."""
        return (self.device or "cpu").split(":")[0]

    # does every new array shape compile a new program (JAX's jit)? Host batch builders then pad
    # to the capacity ladder (a bounded set of programs) instead of exact sizes (less work)
    static_shapes = False

    # may index arrays made inside a ``checkpoint``ed function serve later calls (AttentionBias.memo)?
    # Not where checkpoint traces the function apart (JAX: they would be tracers of that trace).
    checkpoint_keeps_memo = False

    def _view(self, **attrs) -> "ArrayRuntime":
        """A shallow copy with ``attrs`` set and the caches built from the old settings dropped
        (precision views, compiled functions: they trace the kernel they were built with)."""
        view = copy.copy(self)
        view.__dict__.pop("_precision_views", None)
        view.__dict__.pop("_compiled", None)
        view.__dict__.update(attrs)
        return view

    @classmethod
    def prepare_process(cls, cfg) -> None:
        """Process-wide settings ``cfg`` asks of this backend, applied before the backend starts
        (``gr_functional.runtime.prepare_process``). Default: none."""

    # can several processes train one run (``grf train --nproc``, torchrun's WORLD_SIZE)? ``join``
    # then says how they meet
    multi_process = False

    @classmethod
    def launch_env(cls) -> dict:
        """Environment ``grf train --nproc N`` adds for the processes it starts on this host
        (beside torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Default: none."""
        return {}

    @classmethod
    def prepare_launch(cls, cfg) -> None:
        """What ``grf train --nproc N`` does once, before it starts the ranks: work every rank would
        otherwise do at once, inside its warm-up limit (building native ops). Default: nothing."""

    @classmethod
    def join(cls, cfg) -> tuple[Any, str | None]:
        """``(collective, device)`` of this process in a data-parallel run of ``cfg`` (more than
        one rank: ``runner.train``): how the backend's ranks meet. Default: it has none."""
        raise ConfigError(f"backend.name={cls.name!r} has no data-parallel run; train on one process, or use "
                          f"--backend torch --nproc N or --backend jax --devices N")

    def checkpoint(self, f: Callable) -> Callable:
        """``f`` (array arguments, differentiable) whose intermediates autograd does not keep:
        backward runs ``f`` again (torch.utils.checkpoint, jax.checkpoint). Reference: ``f``
        itself (the Array API has no autodiff)."""
        return f

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

    def with_precision(self, precision: str) -> "ArrayRuntime":
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
        self._check_precision(precision)
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

    def _dtype_name_of(self, x) -> str:
        xp = self.xp
        for name in ("float32", "bfloat16", "float16", "float64"):
            if x.dtype == getattr(xp, name):
                return name
        raise TypeError(f"not a float array: {x.dtype}")

    def _check_precision(self, precision: str) -> None:
        """Refuse a precision view whose ops cannot run ``precision`` (``Backend``: by name)."""


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
