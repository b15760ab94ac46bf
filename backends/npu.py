"""npu backend: the torch backend on an Ascend NPU, with fused HSTU ops from npu_ops.

It overrides only fused ops. ``torch_npu`` is probed lazily when the backend is created and,
if it cannot be imported, creation fails with the real reason: a run that asked for npu never
falls back to CPU silently.
"""
from __future__ import annotations

from .base import BackendUnavailable
from .torch import TorchBackend


class NpuBackend(TorchBackend):
    """``hstu_kernel``: "auto" (RecSDK ``torch.ops.mxrec.hstu_jagged`` when loaded, else the
    portable Triton kernel under triton-ascend), "mxrec", "triton", or "reference" (the plain
    torch reference attention on the NPU: slow, an explicit opt-in for debugging)."""

    name = "npu"

    def __init__(self, device: str | None = None, dtype: str = "float32", hstu_kernel: str = "auto"):
        import npu_ops

        ok, reason = npu_ops.torch_npu_status()
        if not ok:
            raise BackendUnavailable(f"backend 'npu' is unavailable: {reason}")
        TorchBackend.__init__(self, device or "npu", dtype, hstu_kernel="reference")
        self._hstu_attention = None
        if hstu_kernel != "reference":
            try:
                self._hstu_attention = npu_ops.select_hstu_attention(hstu_kernel)
            except npu_ops.UnsupportedOnBackend as exc:
                raise BackendUnavailable(f"backend 'npu' has no HSTU attention kernel: {exc}. "
                                         f"Pass hstu_kernel='reference' to run the plain torch "
                                         f"attention on the NPU instead") from exc

    def hstu_attention(self, q, k, v, layout, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None):
        kernel = self._hstu_attention
        if kernel is None:
            return super().hstu_attention(q, k, v, layout, norm_len, pos_w, ts_w, ts, query_ts)
        if getattr(kernel, "takes_bias_params", False):  # Triton builds the bias in-kernel
            return kernel(q, k, v, layout, norm_len, pos_w, ts_w, ts, query_ts)
        return kernel(q, k, v, layout, norm_len, self.relative_bias(layout, norm_len, pos_w, ts_w, ts, query_ts))
