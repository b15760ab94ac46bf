"""The registry of HSTU attention kernels: one entry per kernel, selected by ``backend.hstu_kernel``.

A kernel is one function with ``Backend.hstu_attention``'s contract plus ``B`` (the backend, or
its precision view, running the call)::

    fn(B, q[T, H, dqk], k[T, H, dqk], v[T, H, dv], layout: Jagged, norm_len: int,
       bias: AttentionBias) -> out[T, H, dv]

    out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + rab[i, j]) / n * v_j, zeros on padding
    rows (n = norm_len; rab from ``B.relative_bias(layout, n, bias)``), differentiable in q, k, v,
    bias.pos_w and bias.ts_w; q, k, v in B's compute dtype (fp32, or bf16/fp16 under a precision
    view), bias tables likewise, ts/query_ts int32.

and a declaration of what it supports, checked by name at start-up (``config.validate`` with the
config; ``get_backend`` again with the backend it builds): the backends that implement it, the
dtypes (``backend.dtype``), precisions (``backend.precision``), device kinds, the relative
position / time bias (``model.pos_bias`` / ``model.time_bias``), whether it uses or needs the
layout's tile plan (``model.attention_tile``), and an optional check of the model's shapes. A
kernel asked for something it lacks is refused with a ConfigError naming the kernel, the option
and the kernels that would do.

A new kernel is one ``register_kernel`` call, from any module (an experiment script, a plugin)::

    from backends.kernels import register_kernel

    @register_kernel("my_kernel", backends=("torch",), dtypes=("float32",))
    def my_kernel(B, q, k, v, layout, norm_len, bias):
        ...

``backend.hstu_kernel = "my_kernel"`` selects it; ``"default"`` means the backend's own choice
(``Backend.default_hstu_kernel``: "best" on torch, "jagged" on jax, "auto" on npu). Kernels that must set
something up once per backend (load a vendor op, compile) register a ``factory(B) -> fn``
instead, which raises ``npu_ops.UnsupportedOnBackend`` / ``BackendUnavailable`` with the reason
when the kernel cannot run here. tests/differential runs every registered kernel on every
backend of ``GRF_TEST_BACKENDS`` against the padded reference (outputs and gradients).

A kernel whose backward already recomputes the scores from q, k, v (keeping nothing else for
backward) may say so with an attribute ``fn.recomputes(B, q, layout) -> bool``: where it returns
true, ``backend.attention_recompute`` runs the kernel as it is instead of recomputing it once more.

This module imports no array library: ``gr_functional.config`` imports it (lazily) to check a
config, and factories import their vendor code only when a backend is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

from gr_functional.errors import ConfigError
from gr_functional.registry import Registry, did_you_mean

KernelFn = Callable[..., Any]  # fn(B, q, k, v, layout, norm_len, bias) -> out (module docstring)
TilePlan = Literal["ignored", "used", "required"]

DTYPES = ("float32", "float64")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class AttentionBias:
    """The relative attention bias of one HSTU layer, as parameters (``Backend.relative_bias``
    turns them into the dense ``[B, L, L]`` bias; fused kernels build it in-kernel).

    pos_w[2n-1] float or None: ``rab_pos[i, j] = pos_w[(n-1) + j - i]`` (n = norm_len).
    ts_w[K+1] float or None: ``rab_time[i, j] = ts_w[bucket(|query_ts_i - ts_j|)]``, K buckets.
    ts[T] int32: each token's event time; query_ts[T] int32: the time of the item position i
    predicts (the request time). Both are read only when ts_w is given.
    memo: a dict shared by the layers of one forward pass (``model.encode`` makes one per batch)
    or None: the index arrays every layer would recompute from the batch alone (time buckets,
    positions, causal masks) are computed by the first layer and reused (``Backend._memo``).
    """

    pos_w: Any = None
    ts_w: Any = None
    ts: Any = None
    query_ts: Any = None
    memo: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


NO_BIAS = AttentionBias()


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A registered attention kernel: its factory and what it supports (module docstring).

    backends: backend names that implement it; None = every backend (written on ``B.xp``).
    dtypes / precisions: ``backend.dtype`` / ``backend.precision`` values it runs.
    devices: device kinds (``Backend.device_kind``: "cpu", "cuda", "npu", ...); None = any.
    pos_bias / time_bias: supports the relative position / time bias.
    tile_plan: "ignored"; "used" (runs ``layout.tiles`` when the batch has a plan, padded
    otherwise); "required" (refused when ``model.attention_tile = 0`` builds no plan).
    check_model: ``check_model(model_config) -> reason | None``: shape limits of the kernel.
    """

    name: str
    factory: Callable[[Any], KernelFn]
    backends: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = DTYPES
    precisions: tuple[str, ...] = PRECISIONS
    devices: tuple[str, ...] | None = None
    pos_bias: bool = True
    time_bias: bool = True
    tile_plan: TilePlan = "ignored"
    check_model: Callable[[Any], str | None] | None = None
    doc: str = ""
    source: Any = dataclasses.field(default=None, compare=False, repr=False)  # the registered fn or factory

    def runs_on(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends

    def unsupported(self, *, dtype: str | None = None, precision: str | None = None, device: str | None = None,
                    model: Any = None) -> tuple[str, str] | None:
        """``(option, what it supports)`` of the first option given that this kernel lacks, or None.
        ``model`` is a ``ModelConfig`` (its bias switches, tile plan and shapes are checked)."""
        if dtype is not None and dtype not in self.dtypes:
            return f"backend.dtype={dtype!r}", f"it runs {', '.join(self.dtypes)}"
        if precision is not None and precision not in self.precisions:
            return f"backend.precision={precision!r}", f"it runs {', '.join(self.precisions)}"
        if device is not None and self.devices is not None and device not in self.devices:
            return f"device {device!r}", f"it runs on {', '.join(self.devices)}"
        if model is not None:
            if model.pos_bias and not self.pos_bias:
                return "model.pos_bias=true", "it has no relative position bias"
            if model.time_bias and not self.time_bias:
                return "model.time_bias=true", "it has no relative time bias"
            if self.tile_plan == "required" and model.tile == 0:
                return "model.attention_tile=0", "it needs the tile plan (attention_tile -1 or >= 1)"
            if self.check_model is not None:
                reason = self.check_model(model)
                if reason:
                    return "the model's shapes", reason
        return None


KERNELS: Registry[AttentionKernel] = Registry(
    "attention kernel", config_key="backend.hstu_kernel",
    how="Register one with @backends.kernels.register_kernel(NAME, ...) in a module passed to grf train --plugin")


def register_kernel(name: str, fn: KernelFn | None = None, *, factory: Callable[[Any], KernelFn] | None = None,
                    backends: tuple[str, ...] | None = None, dtypes: tuple[str, ...] = DTYPES,
                    precisions: tuple[str, ...] = PRECISIONS, devices: tuple[str, ...] | None = None,
                    pos_bias: bool = True, time_bias: bool = True, tile_plan: TilePlan = "ignored",
                    check_model: Callable[[Any], str | None] | None = None, doc: str = "",
                    replace: bool = False):
    """Register attention kernel ``name``: either ``fn`` (the kernel, signature in the module
    docstring; ``@register_kernel(name, ...)`` works as a decorator) or ``factory(B) -> fn``
    (called once when a backend selecting the kernel is built). The other arguments declare
    what it supports (``AttentionKernel``). A taken name raises unless ``replace=True`` or it is
    the same function again (a module imported twice)."""
    if name == "default":
        raise ValueError("'default' is not a kernel name: it means the backend's own choice")
    if fn is not None and factory is not None:
        raise ValueError(f"register_kernel({name!r}): pass fn or factory, not both")
    bad = [d for d in dtypes if d not in DTYPES] + [p for p in precisions if p not in PRECISIONS]
    if bad or tile_plan not in ("ignored", "used", "required"):
        raise ValueError(f"register_kernel({name!r}): unknown dtype/precision/tile_plan {bad or tile_plan!r}; "
                         f"dtypes: {DTYPES}, precisions: {PRECISIONS}, tile_plan: ignored | used | required")

    def add(kernel_fn: KernelFn | None, kernel_factory: Callable[[Any], KernelFn] | None):
        made = kernel_factory if kernel_factory is not None else (lambda B: kernel_fn)
        source = kernel_fn if kernel_fn is not None else kernel_factory
        text = doc or (source.__doc__ or "").strip().split("\n")[0]
        KERNELS.add(name, AttentionKernel(name, made, tuple(backends) if backends is not None else None,
                                          tuple(dtypes), tuple(precisions),
                                          tuple(devices) if devices is not None else None, pos_bias, time_bias,
                                          tile_plan, check_model, text, source), origin_of=source, replace=replace)
        return source

    if fn is None and factory is None:
        return lambda f: add(f, None)
    return add(fn, factory)


def unregister_kernel(name: str) -> None:
    """Remove kernel ``name`` (tests, plugins that replace a kernel); unknown names are ignored."""
    KERNELS.remove(name)


def kernel_names(backend: str | None = None) -> tuple[str, ...]:
    """Registered kernel names (those that run on ``backend`` when given), in registration order."""
    return tuple(k.name for k in KERNELS.values() if backend is None or k.runs_on(backend))


def valid_names(backend: str) -> tuple[str, ...]:
    """The ``backend.hstu_kernel`` values ``backend`` accepts: "default" and its kernels."""
    return ("default",) + kernel_names(backend)


def get_kernel(name: str) -> AttentionKernel:
    """The registered kernel ``name`` (not "default"), or ConfigError naming the registered ones."""
    return KERNELS.get_or(name, lambda message: ConfigError(f"backend.hstu_kernel={name!r}: {message}"))


def default_kernel(backend: str) -> str:
    """What ``"default"`` means on ``backend`` (its class's ``default_hstu_kernel``)."""
    from . import backend_class

    return backend_class(backend).default_hstu_kernel


def _quoted(names) -> str:
    return ", ".join(repr(n) for n in names)


def kernel_problem(name: str, backend: str, *, dtype: str | None = None, precision: str | None = None,
                   device: str | None = None, model: Any = None) -> str | None:
    """Why ``backend.hstu_kernel = name`` cannot run on ``backend`` with these options (each None
    is not checked), or None when it can. The reason names the kernel, the option and the
    kernels of ``backend`` that support it."""
    resolved = default_kernel(backend) if name == "default" else name
    kernel = KERNELS.find(resolved)
    if kernel is None or not kernel.runs_on(backend):
        hint = did_you_mean(resolved, valid_names(backend))
        hint = "" if hint == f" (did you mean {resolved!r}?)" else hint
        where = "" if kernel is None else f"; {resolved!r} runs on: {', '.join(kernel.backends or ())}"
        return (f"the {backend} backend has no such kernel{hint}{where}; valid for {backend}: "
                f"{_quoted(valid_names(backend))}")
    options = dict(dtype=dtype, precision=precision, device=device, model=model)
    lacking = kernel.unsupported(**options)
    if lacking is None:
        return None
    option, supported = lacking
    others = [k.name for k in KERNELS.values() if k.runs_on(backend) and k.unsupported(**options) is None]
    label = f"kernel {resolved!r}" + (f" (the {backend} default)" if name == "default" else "")
    alternatives = (f"kernels for {backend} that support it: {_quoted(others)}" if others
                    else f"no kernel for {backend} supports it")
    return f"{label} does not support {option}: {supported}; {alternatives}"


def check_kernel(name: str, backend: str, **options) -> AttentionKernel:
    """The kernel ``name`` resolves to on ``backend``, or ConfigError with ``kernel_problem``'s reason."""
    problem = kernel_problem(name, backend, **options)
    if problem is not None:
        raise ConfigError(f"backend.hstu_kernel={name!r}: {problem}")
    return KERNELS.get(default_kernel(backend) if name == "default" else name)


def check_config(cfg) -> str | None:
    """``kernel_problem`` of a whole ``Config`` (backend, dtype, precision, model; the device is
    checked when the backend is built, where its kind is known)."""
    b = cfg.backend
    return kernel_problem(b.hstu_kernel, b.name, dtype=b.dtype, precision=b.precision, model=cfg.model)


def build(B, name: str) -> tuple[AttentionKernel, KernelFn]:
    """``(kernel, fn)`` for backend ``B``: resolve ``name`` ("default": B's own choice), check B's
    backend, dtype and device against the declaration (ConfigError naming the option), then run
    the factory (BackendUnavailable with the reason when the kernel cannot run here)."""
    from npu_ops import UnsupportedOnBackend  # no vendor import: the error classes only

    from .base import BackendUnavailable

    kernel = check_kernel(name, B.name, dtype=B.dtype_name, device=B.device_kind)
    try:
        fn = kernel.factory(B)
    except (UnsupportedOnBackend, ImportError) as exc:
        raise BackendUnavailable(f"backend {B.name!r}: attention kernel {kernel.name!r} cannot run here: {exc}. "
                                 f"Choose another with backend.hstu_kernel (valid for {B.name}: "
                                 f"{_quoted(valid_names(B.name))})") from exc
    return kernel, fn


# ----------------------------------------------------------------------------- shipped kernels
# Written once on B.xp (backends/base.py), so every backend has them.
@register_kernel("jagged", tile_plan="used")
def jagged(B, q, k, v, layout, norm_len, bias):
    """The no-padding tiles of ``layout.tiles`` where they save enough work
    (``Backend.tiles_pay_off``: static shapes), else the padded reference."""
    if layout.tiles is not None and B.tiles_pay_off(layout):
        return B.hstu_attention_tiled(q, k, v, layout, norm_len, bias)
    return B.hstu_attention_padded(q, k, v, layout, norm_len, bias)


@register_kernel("tiled", tile_plan="used")
def tiled(B, q, k, v, layout, norm_len, bias):
    """The no-padding tiles whenever the batch has a plan, else the padded reference."""
    if layout.tiles is not None:
        return B.hstu_attention_tiled(q, k, v, layout, norm_len, bias)
    return B.hstu_attention_padded(q, k, v, layout, norm_len, bias)


@register_kernel("reference")
def reference(B, q, k, v, layout, norm_len, bias):
    """The padded dense ``[B, H, L, L]`` attention: the oracle."""
    return B.hstu_attention_padded(q, k, v, layout, norm_len, bias)


def _cpu_fused_factory(B):
    """The fused C++ tile attention (backends/cpu_fused), built on first use."""
    from . import cpu_fused

    return cpu_fused.factory(B)


# float32 and float64 (the tests' oracle precision); 16-bit precisions run the tiles in 16 bits,
# which the kernel does not: refused
register_kernel("cpu_fused", factory=_cpu_fused_factory, backends=("torch",), precisions=("fp32",),
                devices=("cpu",), tile_plan="required",
                doc="fused C++ tiles on CPU: BLAS products, bias/SiLU/mask in cache, backward recomputes")


def _best_factory(B):
    """cpu_fused where it runs (CPU, fp32/fp64 compute, a tile plan, the extension built, and
    ``backend.cpu_fused`` on), else jagged; a build that fails is reported once, as a warning with
    the reason (``cpu_fused.available``, shared with the fused sampled logits)."""
    from . import cpu_fused

    on = B.device_kind == "cpu" and getattr(B, "cpu_fused", True) and cpu_fused.available()

    def runs_fused(B, q, layout) -> bool:
        return on and layout.tiles is not None and B._dtype_name_of(q) in ("float32", "float64")

    def best(B, q, k, v, layout, norm_len, bias):
        if runs_fused(B, q, layout):
            return cpu_fused.attention(B, q, k, v, layout, norm_len, bias)
        return jagged(B, q, k, v, layout, norm_len, bias)

    best.recomputes = runs_fused
    return best


register_kernel("best", factory=_best_factory, backends=("torch",), tile_plan="used",
                doc="the fastest measured: cpu_fused on CPU (fp32/fp64, where it builds), else jagged")


def _triton_factory(B):
    """The portable Triton kernel (npu_ops/triton_hstu.py): upstream Triton on CUDA (CPU only
    in the interpreter, TRITON_INTERPRET=1: tests), triton-ascend on an NPU."""
    import npu_ops

    attention = npu_ops.triton_hstu_attention(require_ascend=B.device_kind == "npu")
    attention.check_device(B.device_kind)
    return attention.attend


# float32 only: the kernels accumulate in fp32 and give tl.dot an explicit fp32/bf16 input
# precision (float64 inputs would be rounded silently). Precisions: fp32 is tested forward and
# backward, bf16 forward only; fp16 not at all, so it is refused.
register_kernel("triton", factory=_triton_factory, backends=("torch", "npu"), dtypes=("float32",),
                precisions=("fp32", "bf16"), devices=("cuda", "npu", "cpu"),
                doc="portable Triton jagged attention, bias computed in-kernel, no score matrix in memory")


def _mxrec_limits(model) -> str | None:
    """The documented limits of mxrec.hstu_jagged that a model's shapes can violate."""
    from npu_ops.mxrec_hstu import HSTU_JAGGED_LIMITS as lim

    lo, hi = lim.heads
    if not lo <= model.num_heads <= hi:
        return f"model.num_heads={model.num_heads}: mxrec.hstu_jagged takes {lo}..{hi} heads"
    lo, hi = lim.head_dim
    for key in ("dqk", "dv"):
        d = getattr(model, key)
        if not (lo <= d <= hi and d % lim.head_dim_multiple == 0):
            return (f"model.{key}={d}: mxrec.hstu_jagged takes head dims in [{lo}, {hi}] that are multiples "
                    f"of {lim.head_dim_multiple} (e.g. 48 or 64)")
    lo, hi = lim.max_seq_len
    if not lo <= model.max_len <= hi:
        return f"model.max_len={model.max_len}: mxrec.hstu_jagged takes sequences of {lo}..{hi}"
    return None


def _mxrec_factory(B):
    """RecSDK's Ascend HSTU attention (``torch.ops.mxrec.hstu_jagged``, npu_ops/mxrec_hstu.py)
    fed the dense bias of ``B.relative_bias``."""
    import npu_ops

    return npu_ops.mxrec_hstu_attention().attend


register_kernel("mxrec", factory=_mxrec_factory, backends=("npu",), dtypes=("float32",), devices=("npu",),
                check_model=_mxrec_limits,
                doc="RecSDK torch.ops.mxrec.hstu_jagged (Ascend), dense bias from relative_bias")


def _auto_factory(B):
    """mxrec when RecSDK's ops are loaded, else the Triton kernel (triton-ascend)."""
    import npu_ops

    ok, reason = npu_ops.mxrec_status()
    if ok:
        return _mxrec_factory(B)
    try:
        return _triton_factory(B)
    except npu_ops.UnsupportedOnBackend as exc:
        raise npu_ops.UnsupportedOnBackend(f"no HSTU attention kernel for 'auto': mxrec is unavailable "
                                           f"({reason}); triton: {exc}") from exc


# declares what mxrec runs (the kernel it picks where RecSDK is installed); when it falls back to
# triton, fp16 runs the Triton kernel untested (the explicit "triton" refuses it)
register_kernel("auto", factory=_auto_factory, backends=("npu",), dtypes=("float32",), devices=("npu",),
                doc="mxrec when RecSDK's ops are loaded, else triton")


__all__ = ["AttentionBias", "AttentionKernel", "NO_BIAS", "build", "check_config", "check_kernel", "default_kernel",
           "get_kernel", "kernel_names", "kernel_problem", "register_kernel", "unregister_kernel", "valid_names"]
