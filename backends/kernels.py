"""The HSTU attention kernels: op "attention" of the op registry (backends/ops.py), selected by
``ops.attention``. This module is that op's front: ``register_kernel`` adds the attention's model
options to an implementation's declaration.

A kernel is one function with ``Backend.hstu_attention``'s contract plus ``B`` (the backend, or
its precision view, running the call)::

    fn(B, q[T, H, dqk], k[T, H, dqk], v[T, H, dv], layout: Jagged, norm_len: int,
       bias: AttentionBias) -> out[T, H, dv]

    out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + rab[i, j]) / n * v_j, zeros on padding
    rows (n = norm_len; rab from ``B.relative_bias(layout, n, bias)``), differentiable in q, k, v,
    bias.pos_w and bias.ts_w; q, k, v in B's compute dtype (fp32, or bf16/fp16 under a precision
    view), bias tables likewise, ts/query_ts int32.

and a declaration of what it supports, checked by name at start-up (``configure`` with the config;
``Backend.use_ops`` again with the backend it builds): the backends that implement it, the dtypes
(``backend.dtype``), precisions (``backend.precision``), device kinds, the relative position / time
bias (``model.pos_bias`` / ``model.time_bias``), whether it uses or needs the layout's tile plan
(``model.attention_tile``), and an optional check of the model's shapes. A kernel asked for
something it lacks is refused with a ConfigError naming the kernel, the option and the kernels that
would do.

A new kernel is one ``register_kernel`` call, from any module (an experiment script, a plugin)::

    from backends.kernels import register_kernel

    @register_kernel("my_kernel", backends=("torch",), dtypes=("float32",))
    def my_kernel(B, q, k, v, layout, norm_len, bias):
        ...

``ops.attention = "my_kernel"`` selects it; ``"default"`` means the backend's own choice
(``Backend.default_ops["attention"]``: "best" on torch and jax, "auto" on npu). Kernels
that must set something up once per backend (load a vendor op, compile) register a
``factory(B) -> fn`` instead, which raises ``npu_ops.UnsupportedOnBackend`` / ``BackendUnavailable``
with the reason when the kernel cannot run here. tests/differential runs every registered kernel on
every backend of ``GRF_TEST_BACKENDS`` against the padded reference (outputs and gradients).

A kernel whose backward already recomputes the scores from q, k, v (keeping nothing else for
backward) may say so with an attribute ``fn.recomputes(B, q, layout) -> bool``: where it returns
true, ``backend.attention_recompute`` runs the kernel as it is instead of recomputing it once more.

The ranking model's target-aware attention is op "ranking_attention", registered here too.

This module imports no array library: the config check imports it, and factories import their
vendor code only when a backend is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import npu_ops  # no vendor import: its kernels load their vendor code when a factory asks for one
from gr_functional.errors import UnsupportedOnBackend

from . import cpu_fused, ops
from .ops import DTYPES, PRECISIONS, Impl

KernelFn = Callable[..., Any]  # fn(B, q, k, v, layout, norm_len, bias) -> out (module docstring)
TilePlan = Literal["ignored", "used", "required"]


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
class AttentionKernel(Impl):
    """A registered attention kernel: an ``ops.Impl`` plus the attention's model options.

    pos_bias / time_bias: supports the relative position / time bias.
    tile_plan: "ignored"; "used" (runs ``layout.tiles`` when the batch has a plan, padded
    otherwise); "required" (refused when ``model.attention_tile = 0`` builds no plan).
    check_model: ``check_model(model_config) -> reason | None``: shape limits of the kernel.
    """

    pos_bias: bool = True
    time_bias: bool = True
    tile_plan: TilePlan = "ignored"
    check_model: Callable[[Any], str | None] | None = None

    def limits(self, cfg) -> tuple[str, str] | None:
        model = cfg.model
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
        return super().limits(cfg)


KERNELS = ops.get_op("attention").impls


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
    if tile_plan not in ("ignored", "used", "required"):
        raise ValueError(f"register_kernel({name!r}): unknown tile_plan {tile_plan!r}: ignored | used | required")
    return ops.register("attention", name, fn, factory=factory, backends=backends, dtypes=dtypes,
                        precisions=precisions, devices=devices, doc=doc, replace=replace,
                        impl_class=AttentionKernel, pos_bias=pos_bias, time_bias=time_bias, tile_plan=tile_plan,
                        check_model=check_model)


def unregister_kernel(name: str) -> None:
    """Remove kernel ``name`` (tests, plugins that replace a kernel); unknown names are ignored."""
    ops.unregister("attention", name)


def kernel_names(backend: str | None = None) -> tuple[str, ...]:
    """Registered kernel names (those that run on ``backend`` when given), in registration order."""
    return ops.impl_names("attention", backend)


def valid_names(backend: str) -> tuple[str, ...]:
    """The ``ops.attention`` values ``backend`` accepts: "default" and its kernels."""
    return ops.valid_names("attention", backend)


def get_kernel(name: str) -> AttentionKernel:
    """The registered kernel ``name`` (not "default"), or ConfigError naming the registered ones."""
    return ops.get_impl("attention", name)


def default_kernel(backend: str) -> str:
    """What ``"default"`` means on ``backend`` (its class's ``default_ops["attention"]``)."""
    return ops.default_impl("attention", backend)


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
    """The fused C++ tile attention (backends/cpu_fused: a torch extension on torch, an XLA FFI
    custom call on jax), built on first use."""
    return cpu_fused.factory(B)


# float32 and float64 (the tests' oracle precision); 16-bit precisions run the tiles in 16 bits,
# which the kernel does not: refused
register_kernel("cpu_fused", factory=_cpu_fused_factory, backends=("torch", "jax"), precisions=("fp32",),
                devices=("cpu",), tile_plan="required",
                doc="fused C++ tiles on CPU: BLAS products, bias/SiLU/mask in cache, backward recomputes")


def _best_factory(B):
    """cpu_fused where it runs (CPU, fp32/fp64 compute, a tile plan, the ops built), else
    jagged; a build that fails is reported once, as a warning with the reason
    (``cpu_fused.available``, shared with the fused sampled logits)."""
    on = B.device_kind == "cpu" and cpu_fused.available(B=B)
    front = cpu_fused.ops_for(B)

    def runs_fused(B, q, layout) -> bool:
        return on and layout.tiles is not None and B._dtype_name_of(q) in ("float32", "float64")

    def best(B, q, k, v, layout, norm_len, bias):
        if runs_fused(B, q, layout):
            return front.attention(B, q, k, v, layout, norm_len, bias)
        return jagged(B, q, k, v, layout, norm_len, bias)

    best.recomputes = runs_fused
    return best


register_kernel("best", factory=_best_factory, backends=("torch", "jax"), tile_plan="used",
                doc="the fastest measured: cpu_fused on CPU (fp32/fp64, where it builds), else jagged")


def _triton_factory(B):
    """The portable Triton kernel (npu_ops/triton_hstu.py): upstream Triton on CUDA (CPU only
    in the interpreter, TRITON_INTERPRET=1: tests), triton-ascend on an NPU."""
    attention = npu_ops.triton_hstu_attention(require_ascend=B.device_kind == "npu")
    attention.check_device(B.device_kind)
    return attention.attend


# float32 only: the kernels accumulate in fp32 and give tl.dot an explicit fp32/bf16 input
# precision (float64 inputs would be rounded silently). Precisions: fp32 is tested forward and
# backward, bf16 forward only; fp16 not at all, so it is refused.
register_kernel("triton", factory=_triton_factory, backends=("torch", "npu"), dtypes=("float32",),
                precisions=("fp32", "bf16"), devices=("cuda", "npu", "cpu"),
                doc="portable Triton jagged attention, bias computed in-kernel, no score matrix in memory")


def _pallas_factory(B):
    """The Pallas jagged kernel (backends/pallas_hstu.py): interpret mode on a CPU, Pallas' GPU
    lowering on a GPU."""
    from . import pallas_hstu

    return pallas_hstu.make_kernel(B)


# float32 in, fp32 accumulation; on a CPU it is interpreted (verification speed, not training
# speed): JAX's CPU default is "best" (the C++ tiles as a custom call).
register_kernel("pallas", factory=_pallas_factory, backends=("jax",), dtypes=("float32",), precisions=("fp32",),
                devices=("cpu", "gpu"),
                doc="Pallas jagged attention: no padding, bias in-kernel, no atomics (interpreted on CPU)")


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
    return npu_ops.mxrec_hstu_attention().attend


register_kernel("mxrec", factory=_mxrec_factory, backends=("npu",), dtypes=("float32",), devices=("npu",),
                check_model=_mxrec_limits,
                doc="RecSDK torch.ops.mxrec.hstu_jagged (Ascend), dense bias from relative_bias")


def _auto_factory(B):
    """mxrec when RecSDK's ops are loaded, else the Triton kernel (triton-ascend)."""
    ok, reason = npu_ops.mxrec_status()
    if ok:
        return _mxrec_factory(B)
    try:
        return _triton_factory(B)
    except UnsupportedOnBackend as exc:
        raise UnsupportedOnBackend(f"no HSTU attention kernel for 'auto': mxrec is unavailable "
                                   f"({reason}); triton: {exc}") from exc


# declares what mxrec runs (the kernel it picks where RecSDK is installed); when it falls back to
# triton, fp16 runs the Triton kernel untested (the explicit "triton" refuses it)
register_kernel("auto", factory=_auto_factory, backends=("npu",), dtypes=("float32",), devices=("npu",),
                doc="mxrec when RecSDK's ops are loaded, else triton")


@ops.register("ranking_attention", "reference")
def ranking_reference(B, q, k, v, layout, num_targets, norm_len, alpha):
    """The padded dense target-aware attention (``Backend.stu_attention_padded``): the oracle."""
    return B.stu_attention_padded(q, k, v, layout, num_targets, norm_len, alpha)


__all__ = ["AttentionBias", "AttentionKernel", "KERNELS", "NO_BIAS", "default_kernel", "get_kernel", "kernel_names",
           "register_kernel", "unregister_kernel", "valid_names"]
