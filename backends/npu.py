"""npu backend: the torch backend on an Ascend NPU, with fused HSTU ops from npu_ops.

It overrides only fused ops. ``torch_npu`` is probed lazily when the backend is created and,
if it cannot be imported, creation fails with the real reason: a run that asked for npu never
falls back to CPU silently.
"""
from __future__ import annotations

from .base import BackendUnavailable
from .torch import TorchBackend


class NpuBackend(TorchBackend):
    """``hstu_kernel`` (backends/kernels.py): "default" = "auto" (RecSDK
    ``torch.ops.mxrec.hstu_jagged`` when loaded, else the portable Triton kernel under
    triton-ascend), "mxrec", "triton", or "reference" (the plain torch reference attention on
    the NPU: slow, an explicit opt-in for debugging). ``row_kernel`` (backends/row_kernels.py):
    "default" = "auto" (fbgemm-ascend's TBE row-wise Adagrad when it imports), "fbgemm",
    "reference"."""

    name = "npu"
    default_hstu_kernel = "auto"
    # fbgemm-ascend's fused TBE row-wise Adagrad when it imports, else torch ops on the NPU
    default_row_kernel = "auto"

    def __init__(self, device: str | None = None, dtype: str = "float32", hstu_kernel: str = "default",
                 row_kernel: str = "default"):
        import npu_ops

        ok, reason = npu_ops.torch_npu_status()
        if not ok:
            raise BackendUnavailable(f"backend 'npu' is unavailable: {reason}")
        TorchBackend.__init__(self, device or "npu", dtype, hstu_kernel=hstu_kernel, row_kernel=row_kernel)
