"""JAX backend: the numerical reference. ``jax.numpy`` as ``xp``, ``jax.jit``, ``jax.value_and_grad``.

Dataclass batches (Jagged, HSTUBatch, ...) are registered as pytrees on first use, with their
static fields as metadata, so they cross ``jit`` as arguments.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from gr_functional.tree import is_static

from . import dist_jax
from .base import Backend
from .reference_ops import TIME_BUCKET_DIVISOR

_REGISTERED: set[type] = set()


def _register_dataclasses(tree: Any) -> None:
    import jax

    if isinstance(tree, dict):
        for v in tree.values():
            _register_dataclasses(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _register_dataclasses(v)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        if cls not in _REGISTERED:
            fields = dataclasses.fields(cls)
            jax.tree_util.register_dataclass(
                cls,
                data_fields=[f.name for f in fields if not is_static(f)],
                meta_fields=[f.name for f in fields if is_static(f)],
            )
            _REGISTERED.add(cls)
        for f in dataclasses.fields(tree):
            if not is_static(f):
                _register_dataclasses(getattr(tree, f.name))


class JaxBackend(Backend):
    name = "jax"
    # "best": the fused C++ ops (backends/cpu_fused, XLA FFI custom calls) on CPU where they build,
    # else XLA's own formulations, which the differential suite checks both against
    default_ops = {**Backend.default_ops, "attention": "best", "sampled_logits": "best"}
    static_shapes = True    # jit compiles one program per input shape
    multi_process = True    # jax.distributed processes joining one mesh (``join``)

    def __init__(self, device: str | None = None, dtype: str = "float32", ops: dict[str, str] | None = None):
        """ops: ``{op: implementation}`` of the op registry (backends/ops.py; omitted ops take
        ``default_ops``). Attention on jax: "default" (= "best": "cpu_fused", the fused C++ tiles
        as an XLA FFI custom call, on CPU in fp32/fp64 where it builds; else "jagged"), "jagged"
        (block-sparse tiles of ``layout.tiles`` where they pay off, ``Backend.tiles_pay_off``; else
        padded), "tiled" (the tiles whenever there is a plan), "reference" (padded dense, the
        oracle), "pallas", or a registered kernel of your own; sampled logits: "best" (the fused
        C++ op likewise); every other op: "reference"."""
        super().__init__(device, dtype)
        import jax
        import jax.numpy as jnp

        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("the jax backend in float64 needs x64 mode: set JAX_ENABLE_X64=1 "
                             "before Python starts (it is process-wide)")
        self._jax = jax
        self.xp = jnp
        self._device = jax.devices(device)[0] if device else None
        # measured crossover of the tiled kernel vs the padded one (docs/results/speed.md "Speed")
        self.jagged_min_work_ratio = 2.0 if (self._device or jax.devices()[0]).platform == "cpu" else 1.0
        self.use_ops(ops)

    # XLA CPU's concurrency-optimized scheduler moves a recomputed attention early, keeping
    # what recompute means to drop: without it the recomputation saves 2.1-2.3x of the temp
    # buffers at no measured step cost (docs/results/speed.md "Recomputed attention")
    LOW_MEMORY_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

    @classmethod
    def prepare_process(cls, cfg) -> None:
        """Before JAX starts: with ``backend.attention_recompute``, add ``LOW_MEMORY_FLAG`` to
        ``XLA_FLAGS`` unless the user set that flag (read when JAX starts its CPU client, so a
        process that already ran JAX keeps its scheduler: a warning says so); ``dist.devices`` > 1:
        ask XLA for that many CPU host devices; ``WORLD_SIZE`` > 1: join the other processes
        (``jax.distributed``, backends/dist_jax.py), which JAX allows only before it computes."""
        import os
        import warnings

        dist_jax.force_host_devices(max(1, cfg.dist.devices))
        flags = os.environ.get("XLA_FLAGS", "")
        if cfg.backend.attention_recompute and "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
            if dist_jax.jax_started():
                warnings.warn(f"backend.attention_recompute on JAX: XLA's CPU scheduler keeps most of the recomputed "
                              f"attention's memory unless XLA_FLAGS={cls.LOW_MEMORY_FLAG} is set before JAX starts; "
                              f"this process already started JAX (set it in the environment)")
            else:
                os.environ["XLA_FLAGS"] = f"{flags} {cls.LOW_MEMORY_FLAG}".strip()
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if processes > 1:
            dist_jax.initialize(cfg, processes, int(os.environ.get("RANK", "0")))

    @classmethod
    def launch_env(cls) -> dict:
        """The processes' coordinator: a free port on this host (torchrun's store holds MASTER_PORT)."""
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return {dist_jax.COORDINATOR_ENV: f"127.0.0.1:{sock.getsockname()[1]}"}

    @classmethod
    def join(cls, cfg):
        """Ranks on the devices of a 1-D mesh: ``dist.devices`` of this process, or of each of
        ``WORLD_SIZE`` processes (backends/dist_jax.py ``join``)."""
        return dist_jax.join(cfg), None

    @property
    def device_kind(self) -> str:
        return (self._device or self._jax.devices()[0]).platform

    def asarray(self, x, dtype=None):
        arr = self.xp.asarray(x, dtype=dtype)
        return self._jax.device_put(arr, self._device) if self._device is not None else arr

    def asarray_tree(self, tree):
        _register_dataclasses(tree)
        return super().asarray_tree(tree)

    def device_put(self, tree, sharding):
        """``tree`` (numpy or jax leaves, batch dataclasses included) placed per ``sharding``
        (``jax.sharding``: e.g. rank r's slice on device r of a mesh, backends/dist_jax.py). Over
        several processes each passes the rows of its own devices (process-local data)."""
        jax = self._jax
        _register_dataclasses(tree)
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)
        return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)

    def to_numpy(self, x) -> np.ndarray:
        if isinstance(x, self._jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"an array sharded over several processes ({x.sharding}) has no host copy here")
            x = x.addressable_data(0)  # replicated over processes (params of a JAX mesh): this process's copy
        return np.asarray(x)

    def value_and_grad(self, f: Callable, has_aux: bool = False) -> Callable:
        # allow_int: integer leaves (index arrays riding along with params) get float0 grads
        return self._jax.value_and_grad(f, has_aux=has_aux, allow_int=True)

    def jit(self, f: Callable) -> Callable:
        return self._jax.jit(f)

    def stop_gradient(self, x):
        return self._jax.lax.stop_gradient(x)

    def checkpoint(self, f: Callable) -> Callable:
        return self._jax.checkpoint(f)

    def block_until_ready(self, tree) -> None:
        self._jax.block_until_ready(tree)

    def memory_profile(self, fn, *args):
        """XLA's own account of the compiled program: its temporary buffers (activations kept for
        backward and scratch), excluding arguments and outputs."""
        stats = self._jax.jit(fn).lower(*args).compile().memory_analysis()
        if stats is None:
            return None, "unavailable"
        return int(stats.temp_size_in_bytes), "xla_temp"

    def set_deterministic(self, mode: str = "on") -> None:
        # XLA on CPU is deterministic. On GPU, --xla_gpu_deterministic_ops must be in XLA_FLAGS
        # before JAX starts its backend, which is too late here: say so instead of pretending.
        import os
        import warnings

        platform = (self._device or self._jax.devices()[0]).platform
        if mode == "on" and platform == "gpu" and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
            warnings.warn("backend.deterministic on a JAX GPU needs XLA_FLAGS=--xla_gpu_deterministic_ops=true "
                          "set before Python starts; results may differ run to run")

    # native kernel ops -------------------------------------------------------------
    def silu(self, x):
        return self._jax.nn.silu(x)

    def segment_sum(self, data, segment_ids, num_segments: int):
        return self._jax.ops.segment_sum(data, segment_ids, num_segments=num_segments)

    def bitcast(self, x, dtype: str):
        return self._jax.lax.bitcast_convert_type(x, getattr(self._jax.numpy, dtype))

    def set_rows(self, table, rows, values):
        # functional; XLA writes in place when the caller's buffer is donated
        return table.at[rows].set(values)

    def logsumexp(self, x, axis: int = -1):
        return self._jax.nn.logsumexp(x, axis=axis)

    def time_buckets(self, gap, num_buckets: int):
        """``Backend.time_buckets``, the same integers: a float32 estimate ``floor(log(gap) / 0.301)``
        corrected twice each way by comparison with the exact thresholds (float32's ``log`` is off
        by far less than one bucket). XLA's searchsorted is a loop of gathers over the whole
        ``[P, C, C]`` gap array (measured: half the ML-1M forward); this is a few fused passes."""
        jnp = self.xp
        thr = self.time_bucket_thresholds(num_buckets)
        # thresholds repeat (2 starts buckets 1 and 2; int32's maximum ends the table): each
        # bucket found is moved to the last of its run, as searchsorted(side="right") counts them
        table = self._thresholds_cache[num_buckets]  # the numpy table thr was made from
        last_of_run = self.asarray(np.searchsorted(table, table, side="right").astype(np.int32) - 1)
        g = gap.astype(jnp.int32)
        estimate = jnp.floor(jnp.log(jnp.maximum(g, 1).astype(jnp.float32)) / np.float32(TIME_BUCKET_DIVISOR))
        bucket = jnp.clip(estimate, 0, num_buckets).astype(jnp.int32)
        for _ in range(2):
            up = jnp.logical_and(bucket < num_buckets, g >= thr[jnp.minimum(bucket + 1, num_buckets)])
            down = jnp.logical_and(bucket > 0, g < thr[bucket])
            bucket = bucket + up.astype(jnp.int32) - down.astype(jnp.int32)
        return last_of_run[bucket]

    def add_head_bias(self, scores, bias):
        """``scores[H, ...] + bias[...]`` whose ``bias`` gradient adds the H head slices one by one:
        autodiff's sum over the leading axis became one XLA CPU reduction running 17x slower
        than the adds (38 vs 2.2 ms on [2, 2048, 32, 32], jax 0.10; ~210 ms of an ML-1M HSTU-large
        step)."""
        return _add_head_bias(self._jax)(scores, bias)

    # XLA CPU runs a batched dot with a transposed operand 2-3x slower than with a copied one
    # (jax 0.10, [2, 2048, 32, 25] tiles: q @ k^T 6.8 ms, q @ copy(k^T) 4.1 ms including the copy;
    # torch's bmm takes the transpose for free); on GPUs the copy would only cost
    COPY_TRANSPOSES = None  # None: on CPU only

    def batched_matmul(self, a, b, transpose_b: bool = False):
        """``Backend.batched_matmul``; on CPU with every operand of the forward and backward
        products that would be transposed copied first (``optimization_barrier`` keeps XLA from
        folding the copy back into the dot), through a custom gradient."""
        copy = self.COPY_TRANSPOSES if self.COPY_TRANSPOSES is not None else self.device_kind == "cpu"
        if not copy:
            return super().batched_matmul(a, b, transpose_b)
        return _copied_transposes_matmul(self._jax, transpose_b)(a, b)

    def sampled_logits_reference(self, user, items, ids):
        """The reference's two formulations (``Backend.sampled_logits_reference``: dense ``user @ items^T``
        when ``N <= DENSE_LOGITS_MAX_RATIO * R``, else a row gather), one block of
        ``SAMPLED_LOGITS_CHUNK_ROWS`` rows at a time with a custom gradient
        (``_chunked_sampled_logits``), as the torch backend does. Why: differentiated whole, the
        dense path's gradient is a zero-filled ``[T, N]`` matrix and a scatter into it; XLA on CPU
        spent more time filling it (137 ms) than computing the forward scores (98 ms) on an ML-1M
        HSTU-large step (xprof trace, docs/results/speed.md "Speed")."""
        dense = items.shape[0] <= self.DENSE_LOGITS_MAX_RATIO * ids.shape[1]
        return _chunked_sampled_logits(self._jax, dense)(user, items, ids)


SAMPLED_LOGITS_CHUNK_ROWS = 1024
_FUNCTIONS: dict = {}


def _add_head_bias(jax):
    """``jax.custom_vjp`` of ``scores[H, ...] + bias[...]`` (``JaxBackend.add_head_bias``)."""
    if "add_head_bias" in _FUNCTIONS:
        return _FUNCTIONS["add_head_bias"]
    jnp = jax.numpy

    @jax.custom_vjp
    def f(scores, bias):
        return scores + bias

    def fwd(scores, bias):
        if tuple(bias.shape) != tuple(scores.shape[1:]):
            raise ValueError(f"add_head_bias: bias {tuple(bias.shape)} must be scores {tuple(scores.shape)} "
                             f"without its head axis")
        # residuals must be arrays: two scalars carry the primals' dtypes to the gradients
        return scores + bias, (jnp.zeros((), scores.dtype), jnp.zeros((), bias.dtype))

    def bwd(dtypes, g):
        d_bias = g[0]
        for h in range(1, g.shape[0]):
            d_bias = d_bias + g[h]
        return g.astype(dtypes[0].dtype), d_bias.astype(dtypes[1].dtype)

    f.defvjp(fwd, bwd)
    _FUNCTIONS["add_head_bias"] = f
    return f


def _copied_transposes_matmul(jax, transpose_b: bool):
    """``jax.custom_vjp`` of ``a @ b`` (``a @ b^T`` with ``transpose_b``) whose forward and
    backward dots all take untransposed operands: ``T`` copies a transposed one
    (``JaxBackend.batched_matmul``)."""
    key = ("copied_transposes_matmul", transpose_b)
    if key in _FUNCTIONS:
        return _FUNCTIONS[key]
    jnp = jax.numpy

    def T(x):
        return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))

    @jax.custom_vjp
    def f(a, b):
        return jnp.matmul(a, T(b) if transpose_b else b)

    def fwd(a, b):
        return f(a, b), (a, b)

    def bwd(res, g):
        a, b = res
        if transpose_b:  # out = a @ b^T: da = g @ b, db = g^T @ a
            return jnp.matmul(g, b).astype(a.dtype), jnp.matmul(T(g), a).astype(b.dtype)
        return jnp.matmul(g, T(b)).astype(a.dtype), jnp.matmul(T(a), g).astype(b.dtype)  # da = g b^T, db = a^T g

    f.defvjp(fwd, bwd)
    _FUNCTIONS[key] = f
    return f


def _chunked_sampled_logits(jax, dense: bool):
    """``f(user[T, D], items[N, D], ids[T, R] int32) -> [T, R]``, ``out[t, r] = <user[t],
    items[ids[t, r]]>``, a ``jax.custom_vjp`` over blocks of ``SAMPLED_LOGITS_CHUNK_ROWS`` rows
    (``lax.map`` forward, ``lax.scan`` backward; T is padded to whole blocks with zero users).

    dense: each block's ``[c, N]`` scores, then its R columns; backward scatters the block's
    ``[c, R]`` gradient into a ``[c, N]`` block G and takes ``d user_c = G @ items``,
    ``d items += G^T @ user_c``. gather: the block's ``[c, R, D]`` rows; backward re-gathers them
    and scatter-adds ``g x user_c`` into ``d items``. Products are the reference's; the items
    gradient is accumulated block by block (in fp32 for bf16/fp16 inputs)."""
    key = ("sampled_logits", dense)
    if key in _FUNCTIONS:
        return _FUNCTIONS[key]
    jnp, lax = jax.numpy, jax.lax

    def block_rows(T):  # balanced blocks of at most SAMPLED_LOGITS_CHUNK_ROWS (T = 1025: 2 x 513)
        n = max(1, -(-T // SAMPLED_LOGITS_CHUNK_ROWS))
        return max(1, -(-T // n))

    def blocks(x, c):  # [T, ...] -> [T_pad / c, c, ...], zero rows appended
        pad = (-x.shape[0]) % c
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
        return jnp.reshape(x, (-1, c) + tuple(x.shape[1:]))

    def block_logits(items, u_c, ids_c):
        if dense:
            return jnp.take_along_axis(u_c @ items.T, ids_c, axis=1)
        return jnp.einsum("crd,cd->cr", jnp.take(items, ids_c, axis=0), u_c)

    @jax.custom_vjp
    def f(user, items, ids):
        c = block_rows(user.shape[0])
        out = lax.map(lambda xs: block_logits(items, *xs), (blocks(user, c), blocks(ids, c)))
        return jnp.reshape(out, (-1, ids.shape[1]))[: user.shape[0]]

    def fwd(user, items, ids):
        return f(user, items, ids), (user, items, ids)

    def bwd(res, grad):
        user, items, ids = res
        acc = jnp.float32 if user.dtype in (jnp.bfloat16, jnp.float16) else user.dtype
        c = block_rows(user.shape[0])
        items_acc = items.astype(acc)
        rows = jnp.arange(c)[:, None]

        def one(d_items, xs):
            u_c, ids_c, g_c = xs
            u_c, g_c = u_c.astype(acc), g_c.astype(acc)
            if dense:
                G = jnp.zeros((c, items.shape[0]), acc).at[rows, ids_c].add(g_c)
                return d_items + G.T @ u_c, G @ items_acc
            picked = jnp.take(items_acc, ids_c, axis=0)                               # [c, R, D]
            d_u = jnp.einsum("cr,crd->cd", g_c, picked)
            return d_items.at[ids_c].add(g_c[:, :, None] * u_c[:, None, :]), d_u

        d_items, d_user = lax.scan(one, jnp.zeros(items.shape, acc),
                                   (blocks(user, c), blocks(ids, c), blocks(grad, c)))
        d_user = jnp.reshape(d_user, (-1, user.shape[1]))[: user.shape[0]].astype(user.dtype)
        return d_user, d_items.astype(items.dtype), np.zeros(ids.shape, jax.dtypes.float0)

    f.defvjp(fwd, bwd)
    _FUNCTIONS[key] = f
    return f
