"""Fast kernels and vendor adapters for the npu backend (and, later, portable Triton kernels).

Importing this package imports no vendor code and not even torch: the probes below import
torch / torch_npu / RecSDK only when called, once, and report the real reason when they fail
(see npu_ops/README.md for what is verified where).

Public API:
  torch_npu_status() -> (ok, reason)         can torch_npu run here (import + device)?
  mxrec_status() -> (ok, reason)             is RecSDK's torch.ops.mxrec.hstu_jagged loaded (known schema)?
  mxrec_hstu_attention() -> MxrecHstuAttention   the RecSDK adapter (its ops must be loaded)
  triton_hstu_attention(require_ascend) -> TritonHstuAttention   the portable Triton kernel
  UnsupportedOnBackend                       raised when a kernel is missing or a documented limit is hit

Both kernel objects have ``attend(B, q, k, v, layout, norm_len, bias)``, the attention-kernel
signature of backends/kernels.py, where the "mxrec", "triton" and "auto" kernels are registered.
"""
from __future__ import annotations

from ._errors import MxrecSchemaError, UnsupportedOnBackend
from ._probe import TorchNpuProbe, clear_caches, mxrec_status, torch_npu_probe, torch_npu_status


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


def mxrec_hstu_attention(ops=None, **kwargs):
    """RecSDK's HSTU attention behind our contract (``npu_ops.mxrec_hstu.MxrecHstuAttention(ops,
    **kwargs)``). ``ops`` None: ``torch.ops.mxrec``, which must be loaded (``mxrec_status``);
    raises UnsupportedOnBackend with the reason otherwise. Never falls back silently."""
    if ops is None:
        ok, reason = mxrec_status()
        if not ok:
            raise UnsupportedOnBackend(f"hstu kernel 'mxrec' is unavailable: {reason}")
    from .mxrec_hstu import MxrecHstuAttention

    return MxrecHstuAttention(ops, **kwargs)


__all__ = ["MxrecSchemaError", "TorchNpuProbe", "UnsupportedOnBackend", "clear_caches", "mxrec_hstu_attention",
           "mxrec_status", "torch_npu_probe", "torch_npu_status", "triton_hstu_attention"]
