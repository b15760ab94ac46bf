"""Fast kernels and vendor adapters for the npu backend (and, later, portable Triton kernels).

Importing this package imports no vendor code and not even torch: the probes below import
torch / torch_npu / RecSDK only when called, once, and report the real reason when they fail
(see npu_ops/README.md for what is verified where).

Public API:
  torch_npu_status() -> (ok, reason)         can torch_npu run here (import + device)?
  mxrec_status() -> (ok, reason)             is RecSDK's torch.ops.mxrec.hstu_jagged loaded (known schema)?
  select_hstu_attention(kind="auto") -> fn   fn(q, k, v, layout, norm_len, bias) -> out[T_cap, H, dv]
  UnsupportedOnBackend                       raised when a kernel is missing or a documented limit is hit
"""
from __future__ import annotations

from ._errors import MxrecSchemaError, UnsupportedOnBackend
from ._probe import TorchNpuProbe, clear_caches, mxrec_status, torch_npu_probe, torch_npu_status

HSTU_KERNELS = ("auto", "mxrec", "triton")

def triton_hstu_attention(require_ascend: bool = True):
    """The portable Triton HSTU attention (``npu_ops.triton_hstu.TritonHstuAttention``).

    require_ascend: the installed ``triton`` must be triton-ascend (the npu backend's case).
    Raises UnsupportedOnBackend with the reason when Triton cannot be imported.
    """
    try:
        from . import _triton_compat
        from .triton_hstu import TritonHstuAttention
    except ImportError as exc:
        raise UnsupportedOnBackend(f"the Triton HSTU kernel needs the 'triton' package ({exc}); on an "
                                   f"Ascend host install triton-ascend, on CUDA install triton") from exc
    if require_ascend and not _triton_compat.is_triton_ascend():
        raise UnsupportedOnBackend("the installed 'triton' is not triton-ascend (its backends lack 'ascend'); "
                                   "on an Ascend host run `pip install triton-ascend` (it replaces triton)")
    return TritonHstuAttention()


def select_hstu_attention(kind: str = "auto"):
    """The HSTU attention kernel for the npu backend.

    kind: "mxrec" (RecSDK ``torch.ops.mxrec.hstu_jagged``), "triton" (portable Triton kernel under
    triton-ascend) or "auto" (mxrec when loaded, else triton).
    Returns a callable with ``Backend.hstu_attention``'s contract. Kernels with
    ``takes_bias_params`` (Triton) take ``(q, k, v, layout, norm_len, pos_w, ts_w, ts, query_ts)``
    and build the bias in-kernel; the others (mxrec) take ``(q, k, v, layout, norm_len, bias)``
    with a dense ``bias[B_cap|1, L, L]``. Raises ValueError for an unknown kind and
    UnsupportedOnBackend, with the reason, when no kernel can run here. Never falls back silently.
    """
    if kind not in HSTU_KERNELS:
        raise ValueError(f"unknown HSTU attention kernel {kind!r}; kinds: {', '.join(HSTU_KERNELS)}")
    if kind == "triton":
        return triton_hstu_attention()
    ok, reason = mxrec_status()
    if ok:
        from .mxrec_hstu import MxrecHstuAttention

        return MxrecHstuAttention()
    if kind == "mxrec":
        raise UnsupportedOnBackend(f"hstu kernel 'mxrec' is unavailable: {reason}")
    try:
        return triton_hstu_attention()
    except UnsupportedOnBackend as exc:
        raise UnsupportedOnBackend(f"no HSTU attention kernel for kind 'auto': mxrec is unavailable "
                                   f"({reason}); triton: {exc}") from exc


__all__ = ["HSTU_KERNELS", "MxrecSchemaError", "TorchNpuProbe", "UnsupportedOnBackend", "clear_caches",
           "mxrec_status", "select_hstu_attention", "torch_npu_probe", "torch_npu_status", "triton_hstu_attention"]
