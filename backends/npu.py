"""npu backend: the torch backend on an Ascend NPU, with fused HSTU ops from npu_ops.

It overrides only fused ops. ``torch_npu`` is probed lazily when the backend is created and,
if it cannot be imported, creation fails with the real reason: a run that asked for npu never
falls back to CPU silently.
"""
from __future__ import annotations

from .base import BackendUnavailable
from .torch import TorchBackend


class NpuBackend(TorchBackend):
    """``ops.attention`` (backends/kernels.py): "default" = "auto" (RecSDK
    ``torch.ops.mxrec.hstu_jagged`` when loaded, else the portable Triton kernel under
    triton-ascend), "mxrec", "triton", or "reference" (the plain torch reference attention on
    the NPU: slow, an explicit opt-in for debugging). ``ops.row_update`` (backends/row_kernels.py):
    "default" = "auto" (fbgemm-ascend's TBE row-wise Adagrad when it imports), "fbgemm",
    "reference". The loss's ops: "reference" (torch's row-chunked formulations on the NPU)."""

    name = "npu"
    # auto: mxrec or triton; row_update auto: fbgemm-ascend's fused TBE row-wise Adagrad when it
    # imports, else torch ops on the NPU
    default_ops = {**TorchBackend.default_ops, "attention": "auto", "row_update": "auto",
                   "sampled_logits": "reference", "shared_logsumexp": "reference"}

    def __init__(self, device: str | None = None, dtype: str = "float32", ops: dict[str, str] | None = None):
        import npu_ops

        ok, reason = npu_ops.torch_npu_status()
        if not ok:
            raise BackendUnavailable(f"backend 'npu' is unavailable: {reason}")
        TorchBackend.__init__(self, device or "npu", dtype, ops=ops)
