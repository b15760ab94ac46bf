"""torch backend (CPU/CUDA): ``array_api_compat.torch`` as ``xp`` and classic autograd.

``value_and_grad`` uses ``torch.autograd.grad`` over detached leaf tensors, not torch.func:
vendor kernels are ctx-style ``autograd.Function``s, which fail under torch.func (measured in
shared/reference/design_anchors.md §2.3).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from gr_functional.tree import tree_items, tree_map, tree_map_with_path

from .base import Backend, BackendUnavailable


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: str | None = None, dtype: str = "float32", hstu_kernel: str = "jagged"):
        """hstu_kernel: "jagged" (block-sparse tiles of ``layout.tiles``, no padding; the padded
        reference when a layout has no plan), "reference" (padded dense, the oracle) or "triton"
        (the portable Triton kernel of npu_ops: compiled on CUDA, interpreted on CPU under
        TRITON_INTERPRET=1)."""
        super().__init__(device, dtype)
        import array_api_compat.torch as xp
        import torch

        self._torch = torch
        self.xp = xp
        self.torch_device = torch.device(device or "cpu")
        self.array_device = self.torch_device
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(f"backend 'torch' on device {device!r}: this torch ({torch.__version__}) "
                                     f"sees no CUDA GPU; use backend.device=cpu, or install a CUDA build of "
                                     f"torch on a machine with a GPU")
        if hstu_kernel not in ("jagged", "reference", "triton"):
            raise ValueError(f"backend.hstu_kernel for torch must be 'jagged', 'reference' or 'triton', "
                             f"got {hstu_kernel!r}")
        self.attention_kernel = hstu_kernel
        self._triton_attention = None
        if hstu_kernel == "triton":
            import npu_ops

            self._triton_attention = npu_ops.triton_hstu_attention(require_ascend=False)

    def asarray(self, x, dtype=None):
        t = self._torch.as_tensor(np.asarray(x) if not isinstance(x, self._torch.Tensor) else x,
                                  device=self.torch_device)
        return t if dtype is None else t.to(dtype)

    def to_numpy(self, x) -> np.ndarray:
        if isinstance(x, self._torch.Tensor):
            x = x.detach().cpu()
            # numpy has no bfloat16: widen it (exactly) to float32
            return (x.float() if x.dtype == self._torch.bfloat16 else x).numpy()
        return np.asarray(x)

    def value_and_grad(self, f: Callable, has_aux: bool = False) -> Callable:
        torch = self._torch

        def wrapped(params, *args, **kwargs):
            with torch.enable_grad():
                leaves = tree_map(lambda p: p.detach().requires_grad_(p.is_floating_point()), params)
                out = f(leaves, *args, **kwargs)
                loss, aux = out if has_aux else (out, None)
                paths = [(path, leaf) for path, leaf in tree_items(leaves) if leaf.requires_grad]
                grads = torch.autograd.grad(loss, [leaf for _, leaf in paths], allow_unused=True)
            by_path = {path: (torch.zeros_like(leaf) if g is None else g)
                       for (path, leaf), g in zip(paths, grads)}
            grad_tree = tree_map_with_path(lambda path, leaf: by_path.get(path, torch.zeros_like(leaf)),
                                           leaves)
            detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
            value = (loss.detach(), tree_map(detach, aux)) if has_aux else loss.detach()
            return value, grad_tree

        return wrapped

    def stop_gradient(self, x):
        return x.detach()

    def block_until_ready(self, tree) -> None:
        # CPU kernels run synchronously in eager mode; CUDA ones are queued
        if self.torch_device.type == "cuda":
            self._torch.cuda.synchronize(self.torch_device)

    def memory_profile(self, fn, *args):
        """CUDA: peak allocated bytes during ``fn`` above those allocated before. CPU (no allocator
        statistics): bytes of the distinct storages autograd saves for backward, the activation
        memory that padding inflates."""
        torch = self._torch
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
            torch.cuda.reset_peak_memory_stats(self.torch_device)
            base = torch.cuda.memory_allocated(self.torch_device)
            fn(*args)
            torch.cuda.synchronize(self.torch_device)
            return torch.cuda.max_memory_allocated(self.torch_device) - base, "cuda_peak_allocated"
        storages: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        return sum(storages.values()), "autograd_saved"

    def set_deterministic(self, mode: str = "on") -> None:
        # "auto" = CPU only: on CUDA the deterministic index backward (sort + serial accumulation
        # per index) made an ML-1M step 24x slower on an H100 (profiled: indexing_backward_kernel)
        on = mode == "on" or (mode == "auto" and self.torch_device.type == "cpu")
        self._torch.use_deterministic_algorithms(on, warn_only=True)
        if not on:
            return
        # warn_only: an op without a deterministic kernel warns instead of failing a long run.
        # cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts, so set it before any CUDA matmul.
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # ...but do not NaN-fill every fresh allocation (a debugging aid of deterministic mode
        # against ops that read uninitialised memory; none here): ~15 % of a CPU step (profiled)
        self._torch.utils.deterministic.fill_uninitialized_memory = False

    # native kernel ops -------------------------------------------------------------
    def silu(self, x):
        return self._torch.nn.functional.silu(x)

    def logsumexp(self, x, axis: int = -1):
        return self._torch.logsumexp(x, dim=axis)

    def segment_sum(self, data, segment_ids, num_segments: int):
        # one extra bin swallows ids outside [0, S) (padding tokens use id S), as jax drops them
        ids = segment_ids.long()
        ids = ids.masked_fill((ids < 0) | (ids >= num_segments), num_segments)
        out = data.new_zeros((num_segments + 1,) + tuple(data.shape[1:]))
        return out.index_add(0, ids, data)[:num_segments]

    def hstu_attention(self, q, k, v, layout, norm_len, pos_w=None, ts_w=None, ts=None, query_ts=None):
        if self._triton_attention is None:
            return super().hstu_attention(q, k, v, layout, norm_len, pos_w, ts_w, ts, query_ts)
        return self._triton_attention(q, k, v, layout, norm_len, pos_w, ts_w, ts, query_ts)

    def sampled_logits(self, user, items, ids):
        """Where the reference takes the dense path (``N <= DENSE_LOGITS_MAX_RATIO * R``), the same
        products row-chunk by row-chunk (``_chunked_sampled_logits``): the ``[T, N]`` score matrix
        and its gradient are never materialised whole. Else the reference row gather."""
        ids = ids.long()  # torch's gathers want int64 indices; the math is unchanged
        if items.shape[0] <= self.DENSE_LOGITS_MAX_RATIO * ids.shape[1]:
            return _chunked_sampled_logits(self._torch)(user, items, ids)
        return super().sampled_logits(user, items, ids)


# ----------------------------------------------------------------------------- fused ops
SAMPLED_LOGITS_CHUNK_ROWS = 1024
_FUNCTIONS: dict = {}


def _chunked_sampled_logits(torch):
    """``autograd.Function`` computing ``out[t, r] = <user[t], items[ids[t, r]]>`` through dense
    ``[chunk, N]`` score blocks, ``SAMPLED_LOGITS_CHUNK_ROWS`` rows at a time.

    Why: the reference's dense path keeps ``user @ items^T`` ([T, N], e.g. 16k x 4k floats) for
    backward and its gradient is a zero-filled [T, N] matrix plus a scatter: on CPU the fill of
    that fresh allocation alone took ~20 % of an ML-1M HSTU-large step (profiled). Here backward
    reuses one ``[chunk, N]`` buffer: ``d user = G_c @ items``, ``d items += G_c^T @ user_c``
    (accumulated in fp32 for bf16/fp16 inputs). Exact same products; summation order differs
    only in the items gradient's chunked sum.
    """
    if "sampled_logits" in _FUNCTIONS:
        return _FUNCTIONS["sampled_logits"].apply

    class ChunkedSampledLogits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, user, items, ids):
            ctx.save_for_backward(user, items, ids)
            out = user.new_empty(ids.shape)
            items_t = items.t()
            for start in range(0, user.shape[0], SAMPLED_LOGITS_CHUNK_ROWS):
                rows = slice(start, start + SAMPLED_LOGITS_CHUNK_ROWS)
                torch.gather(user[rows] @ items_t, 1, ids[rows], out=out[rows])
            return out

        @staticmethod
        def backward(ctx, grad):
            user, items, ids = ctx.saved_tensors
            acc = torch.float32 if user.dtype in (torch.bfloat16, torch.float16) else user.dtype
            d_user = torch.empty_like(user)
            d_items = torch.zeros(items.shape, dtype=acc, device=items.device)
            items_acc = items.to(acc)
            block = torch.empty((min(SAMPLED_LOGITS_CHUNK_ROWS, max(user.shape[0], 1)), items.shape[0]),
                                dtype=acc, device=user.device)
            for start in range(0, user.shape[0], SAMPLED_LOGITS_CHUNK_ROWS):
                rows = slice(start, start + SAMPLED_LOGITS_CHUNK_ROWS)
                g = block[: ids[rows].shape[0]].zero_()
                g.scatter_add_(1, ids[rows], grad[rows].to(acc))
                d_user[rows] = (g @ items_acc).to(user.dtype)
                d_items.addmm_(g.t(), user[rows].to(acc))
            return d_user, d_items.to(items.dtype), None

    _FUNCTIONS["sampled_logits"] = ChunkedSampledLogits
    return ChunkedSampledLogits.apply
