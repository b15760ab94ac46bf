"""The fused CPU ops of the torch backend: the HSTU attention (``ops.attention = "cpu_fused"``, what
the torch default "best" runs on CPU) and the sampled logits of the loss (``ops.sampled_logits`` on
CPU in fp32/fp64, with 16-bit negatives in fp32, and the shared pool's ``ops.shared_logsumexp``:
backends/loss_ops.py); the [ops] choices in ``OFF`` run none of them.

The tiled kernel (``Backend.hstu_attention_tiled``) runs each step of a tile as its own torch op:
gathers of q/k/v chunks into ``[H, P, C, d]`` copies, the score product, the bias gather and add,
SiLU, mask and scale, the value product, and in backward the same again with their scatters,
each a full memory pass over ``[H, P, C, C]`` score tiles. ``hstu_attention.cpp`` does one
``(pair, head)`` tile at a time instead: its two products on torch's own BLAS (``sgemm_`` read
straight from q/k/v rows, no chunk copies), bias, SiLU, mask and scale in one pass while the tile
is in cache, and nothing of size ``[H, P, C, C]`` kept for backward (it recomputes the tiles).
The relative bias is built in-kernel from ``pos_w`` and the memoised time buckets
(``Backend.tile_time_buckets``), and its gradient is summed in-kernel.

Built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are needed; the
build is cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) for x86-64
CPUs with AVX2. Processes take turns to build or load it (``_BuildTurn``: a ``flock`` on
``lock.owner`` in the build folder), so torch's build ``lock`` left by a process killed
mid-build is seen as such and removed, never waited on. Where it cannot be built or run, selecting the kernel raises
``UnsupportedOnBackend`` with the reason (``ops.attention`` names the kernels that run).
The sampled logits (``sampled_logits``) replace the chunked torch Function's ``[chunk, N]``
score blocks or ``[chunk, R, D]`` row copies with one dot per (position, id), read straight from
the item rows. The differential suite checks both against float64 oracles, outputs and every
gradient, in float32 and float64 (``tests/differential/test_cpu_fused.py``, ``test_ops.py``).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys

from gr_functional.errors import UnsupportedOnBackend

from .toolchain import FLAGS, HEADER, compiler_reason, note_if_slow

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hstu_attention.cpp")
# one build folder per checkout: torch's build.ninja names the source by its absolute path, so two
# checkouts sharing one folder (a working tree and a fresh clone's CI on one machine) would rebuild
# it over each other at every switch, each waiting for the other's turn (measured: a 4-rank test
# past its 180 s limit)
_NAME = "grf_hstu_cpu_fused_" + hashlib.sha1(_SOURCE.encode()).hexdigest()[:8]


def _header_flag() -> list[str]:
    """A define carrying kernels.h's hash: torch's build cache keys on the sources and flags, not
    on included headers, so a changed header must change the flags to be rebuilt."""
    with open(HEADER, "rb") as f:
        return [f"-DGRF_KERNELS_H={hashlib.sha1(f.read()).hexdigest()[:12]}"]


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built on this machine, or None (cheap checks only: no build)."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for x86-64 CPUs with AVX2, this machine is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"it needs AVX2, torch reports CPU capability {capability}"
    reason = compiler_reason()
    if reason:
        return reason
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return "torch.utils.cpp_extension needs ninja to build it (pip install ninja)"
        # the PyPI wheel's binary is on PATH only in an activated environment: cpp_extension runs
        # `ninja` by name, so put its directory there
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    return None


def _torch_library() -> str:
    """Path of torch's CPU library, whose MKL the ops call (``""`` where it is not found)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    return path if os.path.exists(path) else ""


# A build takes about a minute on 2 busy cores; a lock this old was left by a build that was
# killed (torch's FileBaton would make every later build wait on it forever). Only the fallback
# where ``flock`` cannot be used (``_build_turn``): elsewhere a dead owner is seen at once.
_STALE_LOCK_S = 30 * 60
# how long a process waits for another live one that is building or loading the ops (a build
# takes about a minute on 2 busy cores) before it gives up with a message naming the lock
_TURN_WAIT_S = 15 * 60
_TURN_NOTICE_S = 5.0   # waiting longer than this says for whom, once


def _remove_stale_lock(cpp_extension) -> None:
    """Remove torch's build lock when it is older than ``_STALE_LOCK_S`` (the fallback of
    ``_build_turn`` where ``flock`` does not work).

    Two processes may find the same stale lock at once, and one may remove it and start a build
    (a fresh lock at the same path) before the other acts. So the processes clearing stale locks
    take turns (an exclusive ``flock`` on ``lock.reap`` beside it), and each judges the lock's age
    again once it holds the turn: a fresh lock is never removed, and nothing else can replace the
    stale one in the meantime (torch creates its lock only where none exists)."""
    import fcntl
    import time
    import warnings

    try:  # a private helper of torch's: where it moves, the lock is left alone
        lock = os.path.join(cpp_extension._get_build_directory(_NAME, verbose=False), "lock")
        if time.time() - os.path.getmtime(lock) <= _STALE_LOCK_S:
            return
        reaper = open(lock + ".reap", "a")
    except OSError:
        return
    with reaper:
        fcntl.flock(reaper, fcntl.LOCK_EX)  # released when the file closes
        try:
            age = time.time() - os.path.getmtime(lock)
            if age <= _STALE_LOCK_S:
                return
            os.remove(lock)
        except OSError:  # removed by the process before us
            return
    warnings.warn(f"cpu_fused ops: removed {lock}, left {age / 60:.0f} min ago by a build that did "
                  f"not finish", stacklevel=3)


class _BuildTurn:
    """This process's turn to build or load the ops: an exclusive ``flock`` on ``lock.owner`` in
    the build folder, held across the whole ``cpp_extension.load`` call, with this pid written in
    the file.

    torch's own build lock (``lock`` beside it, a ``FileBaton``) is a bare file holding no pid:
    a process killed while it existed (``kill -9`` during the first build, or during any load:
    torch takes it on every load) leaves it, and every later load waits on it forever. The
    kernel drops a ``flock`` when its holder dies, however it dies. So once this process holds
    the turn, no other process of this package is inside ``load`` for this folder, and a ``lock``
    found then was left by one that died: it is removed (with a warning naming it). A live
    holder (a build in progress) is waited for, saying so after ``_TURN_NOTICE_S``, at most
    ``_TURN_WAIT_S``; then ``UnsupportedOnBackend`` names the holder's pid and the files to
    delete. Where ``flock`` cannot be used (no ``fcntl``, a file system without locks), the
    age rule of ``_remove_stale_lock`` applies instead."""

    def __init__(self, cpp_extension, wait_s: float | None = None):
        self.cpp_extension = cpp_extension
        self.wait_s = _TURN_WAIT_S if wait_s is None else wait_s
        self.file = None

    def __enter__(self):
        import time
        import warnings

        try:
            import fcntl

            build = self.cpp_extension._get_build_directory(_NAME, verbose=False)
            owner = os.path.join(build, "lock.owner")
            self.file = open(owner, "a+")
        except (ImportError, AttributeError, OSError):
            _remove_stale_lock(self.cpp_extension)
            return self
        lock = os.path.join(build, "lock")
        start, noticed = time.monotonic(), False
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError:  # flock unsupported here (ENOLCK, EINVAL): the age rule
                self._close()
                _remove_stale_lock(self.cpp_extension)
                return self
            waited = time.monotonic() - start
            holder = self._holder(owner)
            if waited > self.wait_s:
                self._close()
                raise UnsupportedOnBackend(
                    f"cpu_fused ops: waited {waited:.0f} s for process {holder} to finish building or loading "
                    f"them in {build} ({owner} is locked by it); when no grf process is building them, stop "
                    f"that process, or delete {lock} and {owner}, then rerun (the ops choices of cpu_fused.OFF run "
                    f"the torch formulations instead)")
            if waited > _TURN_NOTICE_S and not noticed:
                noticed = True
                warnings.warn(f"cpu_fused ops: waiting for process {holder}, which is building or loading them "
                              f"in {build} (at most {self.wait_s / 60:.0f} min)", stacklevel=3)
            time.sleep(0.2)
        try:  # the turn is ours: record whose it is, for the message of a process waiting on it
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f"{os.getpid()}\n")
            self.file.flush()
        except OSError:
            pass
        if os.path.exists(lock):
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
            else:
                warnings.warn(f"cpu_fused ops: removed {lock}, left by a build or load of them whose process "
                              f"is gone (killed while it held the lock)", stacklevel=3)
        return self

    @staticmethod
    def _holder(owner: str) -> str:
        try:
            with open(owner) as f:
                pid = f.read().strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "(pid unknown)"

    def _close(self):
        if self.file is not None:
            self.file.close()  # drops the flock
            self.file = None

    def __exit__(self, *exc):
        if self.file is not None:
            try:
                self.file.seek(0)
                self.file.truncate()
            except OSError:
                pass
        self._close()
        return False


# The [ops] choices that run none of these ops (what backend.cpu_fused = false meant before [ops];
# gr_functional.config.migrate writes the same for stored configs)
OFF = {"attention": "jagged", "sampled_logits": "reference", "shared_logsumexp": "reference"}

_BUILT: dict = {}  # "module" or "error": the one build attempt of this process


def load():
    """The built extension module (``forward``, ``backward``, ``sampled_forward``,
    ``sampled_backward``, ``sampled16_forward``, ``sampled16_backward``, ``pool_lse_forward``,
    ``pool_lse_backward``); ``UnsupportedOnBackend`` with the reason when it cannot be built or
    torch's BLAS is not found. Built (or refused) once per process."""
    if "module" in _BUILT:
        return _BUILT["module"]
    if "error" not in _BUILT:
        reason = unavailable_reason()
        if reason is None:
            from torch.utils import cpp_extension

            try:
                with note_if_slow("the fused C++ CPU ops for torch"), _BuildTurn(cpp_extension):  # never waits on a dead owner's lock
                    module = cpp_extension.load(name=_NAME, sources=[_SOURCE], extra_cflags=FLAGS + _header_flag(),
                                                extra_ldflags=["-fopenmp"], verbose=False)
            except UnsupportedOnBackend as exc:
                reason = str(exc).removeprefix("cpu_fused ops: ")
            except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError
                reason = f"building {_SOURCE} failed: {exc}"
            else:
                reason = module.bind_blas(_torch_library()) or None
                if reason is None:
                    _BUILT["module"] = module
                    return module
        _BUILT["error"] = f"cpu_fused ops: {reason}"
    raise UnsupportedOnBackend(_BUILT["error"])


def available(warn: bool = True, B=None) -> bool:
    """Whether the ops load for backend ``B`` (``ops_for``; the torch extension when None); the
    first failure is reported once as a warning with the reason (callers then run their own
    formulation)."""
    front = ops_for(B)
    try:
        front.load()
        return True
    except UnsupportedOnBackend as exc:
        if warn and not _BUILT.get(("warned", front.__name__)):
            import warnings

            _BUILT[("warned", front.__name__)] = True
            warnings.warn(f"{exc}; the backend's own formulations run instead (the [ops] choices of "
                          f"backends.cpu_fused.OFF silence this)", stacklevel=3)
        return False


def ops_for(B):
    """The ops' front for backend ``B``: this module (the torch extension) on torch and when
    ``B`` is None, ``backends.cpu_fused.xla`` (XLA FFI custom calls) on jax. Both have ``load``,
    ``attention`` and ``sampled_logits``; the torch front also ``sampled_logits_16bit`` and
    ``shared_logsumexp``."""
    return xla if B is not None and B.name == "jax" else sys.modules[__name__]


def on_cpu(x) -> bool:
    """Whether torch tensor ``x`` is on the CPU (the XLA front's ``on_cpu`` says yes to any array:
    a jax backend's arrays live on its device, checked at start-up)."""
    return x.device.type == "cpu"


def _empty(like):
    import torch

    return torch.empty(0, dtype=like.dtype, device=like.device)


def _function():
    import torch

    class FusedTiles(torch.autograd.Function):
        """out[T, H, dv] of q, k, v [T, H, d] and the bias tables; the plan's index arrays ride along."""

        @staticmethod
        def forward(ctx, q, k, v, pos_w, ts_w, index, norm_len):
            chunk_rows, pair_q, pair_k, pos, bucket = index
            ext = load()
            out = ext.forward(q, k, v, chunk_rows, pair_q, pair_k, pos, pos_w, ts_w, bucket, norm_len)
            ctx.save_for_backward(q, k, v, pos_w, ts_w)
            ctx.index, ctx.norm_len = index, norm_len
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dout):
            q, k, v, pos_w, ts_w = ctx.saved_tensors
            chunk_rows, pair_q, pair_k, pos, bucket = ctx.index
            dq, dk, dv, dpos, dts = load().backward(dout, q, k, v, chunk_rows, pair_q, pair_k, pos, pos_w, ts_w,
                                                    bucket, ctx.norm_len)
            return dq, dk, dv, dpos if pos_w.numel() else None, dts if ts_w.numel() else None, None, None

    return FusedTiles


_APPLY: dict = {}  # the Functions' eager ``apply``s, made once (a dict, not lru_cache: dynamo warns on those)


def eager_under_compile(apply):
    """``apply`` (an autograd.Function's) run eager under ``torch.compile``: a graph break around
    it. ``torch.compiler.disable`` imports dynamo, 1.5 s of every process's start, so it is applied
    only once dynamo is loaded (``torch.compile`` loads it before it traces anything)."""
    disabled = []

    def call(*args):
        if "torch._dynamo" not in sys.modules:
            return apply(*args)
        if not disabled:
            import torch

            disabled.append(torch.compiler.disable(apply))
        return disabled[0](*args)

    return call


def _eager(name: str, make):
    """``make().apply`` run eager under ``torch.compile`` (dynamo cannot trace the extension's
    calls; the graph break costs nothing, the ops are already fused)."""
    if name not in _APPLY:
        _APPLY[name] = eager_under_compile(make().apply)
    return _APPLY[name]


def _fused_tiles():
    return _eager("tiles", _function)


def _sampled_function():
    import torch

    class FusedSampledLogits(torch.autograd.Function):
        """out[T, R] of user[T, D], items[N, D], ids[T, R]; nothing but the inputs is kept."""

        @staticmethod
        def forward(ctx, user, items, ids):
            ctx.save_for_backward(user, items, ids)
            return load().sampled_forward(user, items, ids)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            user, items, ids = ctx.saved_tensors
            d_user, d_items = load().sampled_backward(grad, user, items, ids)
            return d_user, d_items, None

    return FusedSampledLogits


def _fused_sampled():
    return _eager("sampled", _sampled_function)


def sampled_logits(user, items, ids):
    """``Backend.sampled_logits_reference``: ``out[t, r] = <user[t], items[ids[t, r]]>``, user[T, D] and
    items[N, D] float32/float64 on the CPU, ids[T, R] integer -> [T, R]. One dot per (position,
    id) straight from the item rows, nothing ``[T, N]`` or ``[T, R, D]`` written; backward sums
    each id's gradient in one task (deterministic, no scatter conflicts)."""
    return _fused_sampled()(user, items, ids)


def _sampled16_function():
    import torch

    class FusedSampledLogits16(torch.autograd.Function):
        """out[T, R] of user[T, D], items[N, D], ids[T, R], scale[T] with 16-bit rounded rows."""

        @staticmethod
        def forward(ctx, user, items, ids, scale, half):
            ctx.save_for_backward(user, items, ids, scale)
            ctx.half = half
            return load().sampled16_forward(user, items, ids, scale, half)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            user, items, ids, scale = ctx.saved_tensors
            d_user, d_items = load().sampled16_backward(grad, user, items, ids, scale, ctx.half)
            return d_user, d_items, None, None, None

    return FusedSampledLogits16


def sampled_logits_16bit(user, items, ids, scale, precision: str):
    """``Backend.sampled_logits_16bit_reference`` on float32 CPU tensors: user[T, D], items[N, D], ids[T, R]
    integer, scale[T] (> 0), precision "fp16" | "bf16" -> [T, R]. Each named row is rounded to 16
    bits with its position's scale while in cache (fp16 by the CPU's F16C conversions, bf16 by
    rounding to its upper 16 bits; both to nearest even, as torch's casts) and dotted with the
    user; backward rounds again for ``d user`` and sums ``d items`` by id, straight through."""
    return _eager("sampled16", _sampled16_function)(user, items, ids, scale, precision == "fp16")


def _pool_function():
    import torch

    class FusedSharedLogsumexp(torch.autograd.Function):
        """lse[T] of the shared pool's logits; keeps the inputs and lse only."""

        @staticmethod
        def forward(ctx, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit):
            lse = load().pool_lse_forward(user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit)
            ctx.save_for_backward(user, neg_items, neg_ids, targets, pos, neg_bias, lse)
            ctx.scale, ctx.masked_logit = scale, masked_logit
            return lse

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            user, neg_items, neg_ids, targets, pos, neg_bias, lse = ctx.saved_tensors
            d_user, d_neg, d_pos, d_bias = load().pool_lse_backward(grad, user, neg_items, neg_ids, targets, pos,
                                                                    neg_bias, lse, ctx.scale, ctx.masked_logit)
            return d_user, d_neg, None, None, d_pos, d_bias, None, None

    return FusedSharedLogsumexp


def shared_logsumexp(user, neg_items, neg_ids, targets, pos, neg_bias, scale: float, masked_logit: float):
    """``Backend.shared_logsumexp_reference`` on CPU tensors of one float dtype (fp32/fp64): user[T, D],
    neg_items[R, D], neg_ids[R] and targets[T] integer, pos[T], neg_bias[R] -> lse[T]. Blocks of 128
    rows: the block's ``[128, R]`` logits by one BLAS product, then bias, mask and logsumexp while
    they are in cache; backward recomputes each block and writes ``d user`` and per-range sums of
    ``d neg_items`` / ``d neg_bias`` (added in a fixed order: bitwise reproducible)."""
    return _eager("pool", _pool_function)(user, neg_items, neg_ids, targets, pos, neg_bias, float(scale),
                                          float(masked_logit))


def _rows_contiguous(x):
    """``x[T, H, d]`` as the kernel reads it: rows of H*d contiguous values (any row stride), so
    the (u, v, q, k) column slices of one uvqk product pass without a copy."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def attention(B, q, k, v, layout, norm_len, bias):
    """``hstu_attention``'s contract (backends/kernels.py) on ``layout.tiles``, fused (module docstring)."""
    plan = layout.tiles
    pos_w = bias.pos_w if bias.pos_w is not None else _empty(q)
    ts_w = bias.ts_w if bias.ts_w is not None else _empty(q)
    bucket = B.tile_time_buckets(layout, bias) if bias.ts_w is not None else B.xp.zeros(0, dtype=B.xp.int32)
    index = (plan.chunk_rows, plan.pair_q, plan.pair_k, layout.pos, bucket)
    return _fused_tiles()(_rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v), pos_w, ts_w, index,
                                int(norm_len))


# its backward recomputes the tiles from q, k, v: backend.attention_recompute has nothing to add
attention.recomputes = lambda B, q, layout: True


def factory(B):
    """The kernel for backend ``B`` (``ops_for``; built now, so a missing compiler is reported at
    start-up)."""
    if B.device_kind != "cpu":
        raise UnsupportedOnBackend(f"cpu_fused attention runs on the CPU, not on {B.device_kind!r}")
    front = ops_for(B)
    front.load()
    return front.attention


from . import xla  # noqa: E402 - ops_for names it
