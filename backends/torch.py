"""torch backend (CPU/CUDA): ``array_api_compat.torch`` as ``xp`` and classic autograd.

``value_and_grad`` uses ``torch.autograd.grad`` over detached leaf tensors, not torch.func:
vendor kernels are ctx-style ``autograd.Function``s, which torch.func refuses (``RuntimeError: In order
to use an autograd.Function with functorch transforms ... it must override the setup_context
staticmethod``), so one ``value_and_grad`` serves the reference and the fused kernels.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from gr_functional.tree import tree_items, tree_map, tree_map_with_path

from . import cpu_fused, dist_torch
from .cpu_fused import eager_under_compile
from .base import Backend, BackendUnavailable


class TorchBackend(Backend):
    name = "torch"
    # "best": the fused C++ CPU ops (backends/cpu_fused) for the calls they serve where the
    # extension builds, else jagged attention and the row-chunked torch Functions below
    default_ops = {**Backend.default_ops, "attention": "best", "sampled_logits": "best", "shared_logsumexp": "best"}
    multi_process = True  # torchrun's ranks (``join``)

    @classmethod
    def prepare_launch(cls, cfg) -> None:
        """Build the fused CPU ops once, in the launcher, when the ranks will use them: N ranks each
        building them (or waiting on a rebuild after a build was killed mid-compile) outlasted the
        ranks' warm-up limit. A build that fails is left for the ranks to report."""
        chosen = {op: getattr(cfg.ops, op, "default") for op in ("attention", "sampled_logits", "shared_logsumexp")}
        on_cpu = (cfg.backend.device or "cpu").startswith("cpu") and cfg.dist.backend == "gloo"
        if on_cpu and any(name in ("default", "best", "cpu_fused") for name in chosen.values()):
            cpu_fused.available(warn=False)

    @classmethod
    def join(cls, cfg):
        """One rank per process, launched by torchrun (backends/dist_torch.py): its process group
        and its device (cpu for gloo, cuda:/npu:LOCAL_RANK for nccl/hccl)."""
        device = dist_torch.device_for(cfg.dist.backend, cfg.backend.device)
        return dist_torch.init(cfg.dist, device), device

    def __init__(self, device: str | None = None, dtype: str = "float32", ops: dict[str, str] | None = None,
                 compile: bool = False):
        """ops: ``{op: implementation}`` of the op registry (backends/ops.py; omitted ops take
        ``default_ops``). Attention: "default" (= "best": "cpu_fused", the fused C++ tiles, on CPU
        in fp32/fp64 where the extension builds, else "jagged"), "jagged" (block-sparse tiles of
        ``layout.tiles``, no padding, where they pay off, else padded), "tiled", "reference"
        (padded dense, the oracle), "triton" (the portable Triton kernel of npu_ops: compiled on
        CUDA, interpreted on CPU under TRITON_INTERPRET=1), or a registered kernel of your own.
        sampled_logits / shared_logsumexp: "best", "cpu_fused" or "reference" (backends/loss_ops.py).
        row_update: "reference" or "fbgemm" (fbgemm's TBE row-wise Adagrad: fbgemm-gpu-cpu on CPU,
        fbgemm_gpu on CUDA; backends/row_kernels.py). compile: ``compiled(f)`` is ``torch.compile(f)``."""
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
        # measured crossover of the tiled kernel vs the padded one (docs/results/speed.md "Speed")
        self.jagged_min_work_ratio = 2.0 if self.torch_device.type == "cpu" else 1.0
        self.sampled_per_id_min_ratio = 2.0  # the fused sampled logits' crossover (ReferenceOps)
        self.use_ops(ops)
        self.compile = bool(compile)

    @property
    def device_kind(self) -> str:
        return self.torch_device.type

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

    # checkpoint runs f eagerly on plain tensors: index arrays it makes can serve later layers
    checkpoint_keeps_memo = True

    def checkpoint(self, f: Callable) -> Callable:
        import torch.utils.checkpoint

        # non-reentrant: works with torch.compile and with arguments that need no gradient (None)
        return lambda *args: torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False)

    def with_compile(self, on: bool) -> "TorchBackend":
        """A shallow copy with ``backend.compile`` set to ``on`` (benchmarks compare the two)."""
        return self._view(compile=bool(on))

    def compiled(self, f: Callable) -> Callable:
        if not self.compile:
            return f
        cache = self.__dict__.setdefault("_compiled", {})  # per backend view (with_ops drops it)
        if f not in cache:
            import torch._inductor.config as inductor_config  # set_deterministic leaves it to compile

            inductor_config.deterministic = self._torch.are_deterministic_algorithms_enabled()
            cache[f] = self._torch.compile(f)
        return cache[f]

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
        # torch.use_deterministic_algorithms is this call plus inductor's flag, whose import loads
        # inductor and dynamo: 1.5 s of every process's start. compiled() sets that flag instead.
        self._torch._C._set_deterministic_algorithms(on, warn_only=True)
        if "torch._inductor.config" in sys.modules:
            sys.modules["torch._inductor.config"].deterministic = on
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

    def layer_norm(self, x, eps: float = 1e-6):
        # one fused native kernel (forward and backward) instead of five elementwise passes;
        # also serves hstu_norm_mul's LN(AV) and the blocks' input LN
        return self._torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)

    def hstu_uvqk(self, x, w, splits):
        # one GEMM for u, v, q, k; SiLU in place of a temporary; the split returns views
        y = self._torch.nn.functional.silu(x @ w)
        return tuple(self._torch.split(y, list(splits), dim=-1))

    def bitcast(self, x, dtype: str):
        return x.view(getattr(self._torch, dtype))

    def set_rows(self, table, rows, values):
        # in place: the table is donated (base docstring), a multi-GB table is never copied
        with self._torch.no_grad():
            return table.index_copy_(0, rows.long(), values.to(table.dtype))

    def segment_sum(self, data, segment_ids, num_segments: int):
        # one extra bin swallows ids outside [0, S) (padding tokens use id S), as jax drops them
        ids = segment_ids.long()
        ids = ids.masked_fill((ids < 0) | (ids >= num_segments), num_segments)
        out = data.new_zeros((num_segments + 1,) + tuple(data.shape[1:]))
        return out.index_add(0, ids, data)[:num_segments]

    def sampled_logits_reference(self, user, items, ids):
        """The reference's two formulations (dense ``user @ items^T`` when ``N <=
        DENSE_LOGITS_MAX_RATIO * R``, else a row gather), row-chunk by row-chunk
        (``_chunked_sampled_logits``): neither the ``[T, N]`` scores nor the ``[T, R, D]`` gathered
        rows, nor their gradients, are ever materialised whole."""
        ids = ids.long()  # torch's gathers want int64 indices; the math is unchanged
        dense = items.shape[0] <= self.DENSE_LOGITS_MAX_RATIO * ids.shape[1]
        return _chunked_sampled_logits(self._torch)(user, items, ids, dense)

    def sampled_logits_16bit_reference(self, user, items, ids, scale, precision: str):
        """Row-chunked like ``sampled_logits_reference`` (``_chunked_sampled_logits_16bit``): each chunk's ``[c, R, D]`` rows are
        rounded to 16 bits with their positions' scales while in cache, and backward recomputes
        them; nothing ``[T, R, D]`` is ever whole."""
        low = self._torch.float16 if precision == "fp16" else self._torch.bfloat16
        return _chunked_sampled_logits_16bit(self._torch)(user, items, ids.long(), scale, low)

    def shared_logsumexp_reference(self, user, neg_items, neg_ids, targets, pos, neg_bias, scale: float,
                                   masked_logit: float):
        """Row-chunked
        (``_chunked_shared_logsumexp``): the ``[T, R]`` logits and their gradient exist one
        ``[chunk, R]`` block at a time, in cache, instead of as ~6 whole-matrix passes."""
        return _chunked_shared_logsumexp(self._torch)(user, neg_items, neg_ids.long(), targets.long(), pos,
                                                      neg_bias, float(scale), float(masked_logit))


# ----------------------------------------------------------------------------- fused ops
SAMPLED_LOGITS_CHUNK_ROWS = 1024
# The chunked ops write into preallocated blocks (``out=``), which dynamo cannot trace: under
# torch.compile they run eager (``eager_under_compile``: a graph break, at no cost).
_FUNCTIONS: dict = {}


def _row_chunks(n: int) -> list[slice]:
    """The ``SAMPLED_LOGITS_CHUNK_ROWS``-row blocks the chunked loss ops work through."""
    return [slice(s, s + SAMPLED_LOGITS_CHUNK_ROWS) for s in range(0, n, SAMPLED_LOGITS_CHUNK_ROWS)]


def _chunked_sampled_logits(torch):
    """``autograd.Function`` computing ``out[t, r] = <user[t], items[ids[t, r]]>`` on
    ``SAMPLED_LOGITS_CHUNK_ROWS`` rows at a time, in one of the reference's two formulations.

    dense: ``[chunk, N]`` score blocks (``user_c @ items^T``, then the R wanted columns).
    gather: the ``[chunk, R, D]`` rows of ``items[ids_c]`` and a batched dot with ``user_c``.

    Why: unchunked, the dense path keeps ``[T, N]`` scores for backward and its gradient is a
    zero-filled [T, N] matrix plus a scatter (on CPU the fill alone took ~20 % of an ML-1M
    HSTU-large step), and the gather path streams ``[T, R, D]`` tensors (2 GB at T=16k, R=128,
    D=256) through memory several times (~55 % of a KuaiRand-size step in ``mul`` and
    ``index_select``, profiled). Here backward recomputes one chunk at a time in cache:
    ``d user_c = G_c @ items`` or ``= g_c . rows_c``, ``d items += G_c^T @ user_c`` or an
    ``index_add`` of ``g_c x user_c``, accumulated in fp32 for bf16/fp16 inputs. Same products;
    only the summation order of the items gradient differs.
    """
    if "sampled_logits" in _FUNCTIONS:
        return _FUNCTIONS["sampled_logits"]


    class ChunkedSampledLogits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, user, items, ids, dense):
            ctx.save_for_backward(user, items, ids)
            ctx.dense = dense
            out = user.new_empty(ids.shape)
            items_t = items.t()
            for rows in _row_chunks(user.shape[0]):
                if dense:
                    torch.gather(user[rows] @ items_t, 1, ids[rows], out=out[rows])
                else:
                    picked = items.index_select(0, ids[rows].reshape(-1)).view(*ids[rows].shape, -1)
                    out[rows] = torch.bmm(picked, user[rows].unsqueeze(-1)).squeeze(-1)
            return out

        @staticmethod
        def backward(ctx, grad):
            user, items, ids = ctx.saved_tensors
            acc = torch.float32 if user.dtype in (torch.bfloat16, torch.float16) else user.dtype
            d_user = torch.empty_like(user)
            d_items = torch.zeros(items.shape, dtype=acc, device=items.device)
            items_acc = items.to(acc)
            block = None
            for rows in _row_chunks(user.shape[0]):
                g, u = grad[rows].to(acc), user[rows].to(acc)
                if ctx.dense:
                    if block is None:
                        block = torch.empty((min(SAMPLED_LOGITS_CHUNK_ROWS, user.shape[0]), items.shape[0]),
                                            dtype=acc, device=user.device)
                    G = block[: g.shape[0]].zero_()
                    G.scatter_add_(1, ids[rows], g)
                    d_user[rows] = (G @ items_acc).to(user.dtype)
                    d_items.addmm_(G.t(), u)
                else:
                    flat = ids[rows].reshape(-1)
                    picked = items_acc.index_select(0, flat).view(*ids[rows].shape, -1)   # [c, R, D]
                    d_user[rows] = torch.bmm(g.unsqueeze(1), picked).squeeze(1).to(user.dtype)
                    d_items.index_add_(0, flat, (g.unsqueeze(-1) * u.unsqueeze(1)).reshape(flat.shape[0], -1))
            return d_user, d_items.to(items.dtype), None, None

    _FUNCTIONS["sampled_logits"] = eager_under_compile(ChunkedSampledLogits.apply)
    return _FUNCTIONS["sampled_logits"]


def _chunked_sampled_logits_16bit(torch):
    """``autograd.Function`` of ``Backend.sampled_logits_16bit_reference``, ``SAMPLED_LOGITS_CHUNK_ROWS``
    positions at a time: gather the chunk's rows, round ``rows / scale`` to the 16-bit dtype and
    back, dot with the chunk's users. Backward recomputes the rounded rows: ``d user_c = g_c .
    q_c``, ``d items += index_add(g_c x user_c)`` (straight through the rounding), in fp32 for
    low-precision inputs."""
    if "sampled_logits_16bit" in _FUNCTIONS:
        return _FUNCTIONS["sampled_logits_16bit"]


    def rounded(items, ids_c, scale_c, low, acc):                                       # [c, R, D]
        # in place: one [c, R, D] array at the accumulation width and its 16-bit copy alive at once
        picked = items.index_select(0, ids_c.reshape(-1)).view(*ids_c.shape, -1).to(acc)
        s = scale_c.to(acc).view(-1, 1, 1)
        return picked.copy_(picked.div_(s).to(low)).mul_(s)

    class ChunkedSampledLogits16(torch.autograd.Function):
        @staticmethod
        def forward(ctx, user, items, ids, scale, low):
            ctx.save_for_backward(user, items, ids, scale)
            ctx.low = low
            acc = torch.float32 if user.dtype in (torch.bfloat16, torch.float16) else user.dtype
            out = user.new_empty(ids.shape)
            for rows in _row_chunks(user.shape[0]):
                q = rounded(items, ids[rows], scale[rows], low, acc)
                out[rows] = torch.bmm(q, user[rows].to(acc).unsqueeze(-1)).squeeze(-1).to(out.dtype)
            return out

        @staticmethod
        def backward(ctx, grad):
            user, items, ids, scale = ctx.saved_tensors
            acc = torch.float32 if user.dtype in (torch.bfloat16, torch.float16) else user.dtype
            d_user = torch.empty_like(user)
            d_items = torch.zeros(items.shape, dtype=acc, device=items.device)
            for rows in _row_chunks(user.shape[0]):
                g, u = grad[rows].to(acc), user[rows].to(acc)
                q = rounded(items, ids[rows], scale[rows], ctx.low, acc)
                d_user[rows] = torch.bmm(g.unsqueeze(1), q).squeeze(1).to(user.dtype)
                del q                                   # before the [c, R, D] outer product below
                flat = ids[rows].reshape(-1)
                d_items.index_add_(0, flat, (g.unsqueeze(-1) * u.unsqueeze(1)).reshape(flat.shape[0], -1))
            return d_user, d_items.to(items.dtype), None, None, None

    _FUNCTIONS["sampled_logits_16bit"] = eager_under_compile(ChunkedSampledLogits16.apply)
    return _FUNCTIONS["sampled_logits_16bit"]


def _chunked_shared_logsumexp(torch):
    """``autograd.Function`` of ``Backend.shared_logsumexp_reference`` on ``SAMPLED_LOGITS_CHUNK_ROWS`` rows
    at a time. Forward keeps only ``lse[T]``; backward recomputes each block's logits, its softmax
    ``p = exp(logit - lse)`` (0 on masked cells) and gives ``d pos = g exp(pos - lse)``,
    ``d user_c = scale (g p) @ neg_items``, ``d neg_items += scale (g p)^T @ user_c``,
    ``d neg_bias -= sum_t g p``. Low-precision inputs are computed in fp32; lse is fp32 then, as
    the mixed-precision ``logsumexp``."""
    if "shared_logsumexp" in _FUNCTIONS:
        return _FUNCTIONS["shared_logsumexp"]


    def acc_dtype(x):
        return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype

    def block(user_c, neg_t, neg_ids, targets_c, bias, scale, masked_logit):
        logits = torch.addmm(bias, user_c, neg_t, beta=-1.0, alpha=scale)                    # [c, R]
        hit = (neg_ids.unsqueeze(0) == targets_c.unsqueeze(1)) | (neg_ids == 0).unsqueeze(0)
        return logits.masked_fill_(hit, masked_logit), hit

    class ChunkedSharedLogsumexp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit):
            acc = acc_dtype(user)
            neg_t, bias, pos_a = neg_items.to(acc).t(), neg_bias.to(acc), pos.to(acc)
            lse = torch.empty(user.shape[0], dtype=acc, device=user.device)
            for rows in _row_chunks(user.shape[0]):
                logits, _ = block(user[rows].to(acc), neg_t, neg_ids, targets[rows], bias, scale, masked_logit)
                m = torch.maximum(logits.amax(dim=1), pos_a[rows])
                total = torch.exp(logits - m.unsqueeze(1)).sum(dim=1) + torch.exp(pos_a[rows] - m)
                lse[rows] = m + torch.log(total)
            ctx.save_for_backward(user, neg_items, neg_ids, targets, pos, neg_bias, lse)
            ctx.scale, ctx.masked_logit = scale, masked_logit
            return lse if acc != user.dtype else lse.to(pos.dtype)

        @staticmethod
        def backward(ctx, grad):
            user, neg_items, neg_ids, targets, pos, neg_bias, lse = ctx.saved_tensors
            acc, scale = acc_dtype(user), ctx.scale
            neg_a, bias, g_all = neg_items.to(acc), neg_bias.to(acc), grad.to(acc)
            neg_t = neg_a.t()
            d_user = torch.empty_like(user)
            d_neg = torch.zeros(neg_items.shape, dtype=acc, device=user.device)
            d_bias = torch.zeros(neg_bias.shape, dtype=acc, device=user.device)
            for rows in _row_chunks(user.shape[0]):
                u = user[rows].to(acc)
                logits, hit = block(u, neg_t, neg_ids, targets[rows], bias, scale, ctx.masked_logit)
                gp = torch.exp(logits - lse[rows].unsqueeze(1)).masked_fill_(hit, 0.0).mul_(g_all[rows].unsqueeze(1))
                d_user[rows] = (gp @ neg_a).mul_(scale).to(user.dtype)
                d_neg.addmm_(gp.t(), u, alpha=scale)
                d_bias.sub_(gp.sum(dim=0))
            d_pos = (g_all * torch.exp(pos.to(acc) - lse)).to(pos.dtype)
            return d_user, d_neg.to(neg_items.dtype), None, None, d_pos, d_bias.to(neg_bias.dtype), None, None

    _FUNCTIONS["shared_logsumexp"] = eager_under_compile(ChunkedSharedLogsumexp.apply)
    return _FUNCTIONS["shared_logsumexp"]
