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

TRITON_MISSING = ("the portable Triton HSTU attention kernel (for triton-ascend) is not in npu_ops yet; "
                  "it is delivered by a separate work item. Use hstu_kernel='mxrec' with RecSDK's ops "
                  "loaded, or the 'torch' backend")


def select_hstu_attention(kind: str = "auto"):
    """The HSTU attention kernel for the npu backend.

    kind: "mxrec" (RecSDK ``torch.ops.mxrec.hstu_jagged``), "triton" (portable Triton kernel:
    not available yet) or "auto" (mxrec when loaded, else the triton message).
    Returns ``fn(q[T_cap,H,dqk], k[T_cap,H,dqk], v[T_cap,H,dv], layout: Jagged, norm_len: int,
    bias[B_cap|1, L, L] | None) -> out[T_cap, H, dv]`` (contract: ``Backend.hstu_attention``).
    Raises ValueError for an unknown kind and UnsupportedOnBackend, with the reason, when the
    kernel cannot run here. Never falls back silently.
    """
    if kind not in HSTU_KERNELS:
        raise ValueError(f"unknown HSTU attention kernel {kind!r}; kinds: {', '.join(HSTU_KERNELS)}")
    if kind == "triton":
        raise UnsupportedOnBackend(f"hstu kernel 'triton': {TRITON_MISSING}")
    ok, reason = mxrec_status()
    if ok:
        from .mxrec_hstu import MxrecHstuAttention

        return MxrecHstuAttention()
    if kind == "mxrec":
        raise UnsupportedOnBackend(f"hstu kernel 'mxrec' is unavailable: {reason}")
    raise UnsupportedOnBackend(f"no HSTU attention kernel for kind 'auto': mxrec is unavailable ({reason}); "
                               f"triton: {TRITON_MISSING}")


__all__ = ["HSTU_KERNELS", "MxrecSchemaError", "TorchNpuProbe", "UnsupportedOnBackend", "clear_caches",
           "mxrec_status", "select_hstu_attention", "torch_npu_probe", "torch_npu_status"]
