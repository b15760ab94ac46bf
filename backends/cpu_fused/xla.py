"""The fused CPU ops for JAX: ``xla_ffi.cpp`` (the torch extension's kernels.h behind XLA FFI
handlers) built into a shared library, its handlers registered as XLA custom-call targets, and
wrapped as ``custom_vjp`` functions with the contracts of the torch ops in this package:

    attention(B, q[T, H, dqk], k, v[T, H, dv], layout, norm_len, bias) -> out[T, H, dv]
    sampled_logits(user[T, D], items[N, D], ids[T, R] int32) -> out[T, R]
    sampled_logits_16bit(user, items, ids, scale[T], precision) -> out[T, R]

float32/float64 on the CPU. The kernels are the torch extension's, so a JAX step computes the same
bits as a torch step on the same inputs (``tests/differential/test_cpu_fused.py`` checks it), and
the same bits for any thread count. XLA's own formulations ("jagged", "tiled", "reference") stay
what the differential suite checks these against.

Built on first use with the C++ compiler (no torch build machinery: the handlers include only
jaxlib's FFI headers, ``jax.ffi.include_dir()``) into ``GRF_XLA_FFI_DIR`` (default
``~/.cache/gr_functional/xla_ffi``), one file per source hash, written under a ``flock`` and
renamed into place (a killed build leaves no half-written library and no lock to wait on). The
products run on torch's own MKL (``sgemm_``/``dgemm_`` of libtorch_cpu, opened without importing
torch), as in the torch extension.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import shlex
import subprocess
import tempfile

from gr_functional.errors import UnsupportedOnBackend

from .toolchain import FLAGS, HEADER, compiler_reason, note_if_slow

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_ffi.cpp")
_TARGETS = {"grf_hstu_forward": "GrfHstuForward", "grf_hstu_backward": "GrfHstuBackward",
            "grf_sampled_forward": "GrfSampledForward", "grf_sampled_backward": "GrfSampledBackward",
            "grf_sampled16_forward": "GrfSampled16Forward", "grf_sampled16_backward": "GrfSampled16Backward"}
_STATE: dict = {}  # "lib" or "error": the one build / load attempt of this process


def _torch_library() -> str:
    """libtorch_cpu.so of the installed torch, found without importing torch (``""`` if absent)."""
    spec = importlib.util.find_spec("torch")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "lib", "libtorch_cpu.so")
        if os.path.exists(path):
            return path
    return ""


def _command(out: str) -> list[str]:
    import jax

    compiler = shlex.split(os.environ.get("CXX", "")) or ["c++"]
    return [*compiler, "-std=c++17", "-shared", "-fPIC", *FLAGS, "-I", jax.ffi.include_dir(),
            "-I", os.path.dirname(_SOURCE), _SOURCE, "-o", out]


def _library_path() -> str:
    """Where the library built from the current sources, flags, jaxlib and compiler lives."""
    import jaxlib

    digest = hashlib.sha1()
    for path in (_SOURCE, HEADER):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(_command("")).encode())
    digest.update(jaxlib.__version__.encode())
    try:  # another compiler (an upgrade, CXX) builds another library
        digest.update(subprocess.run(_command("")[:1] + ["--version"], capture_output=True, text=True).stdout.encode())
    except OSError:
        pass
    root = os.environ.get("GRF_XLA_FFI_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gr_functional",
                                                             "xla_ffi")
    return os.path.join(root, f"grf_xla_ffi_{digest.hexdigest()[:16]}.so")


# how long a process waits for another one's build of the library (a build takes about 20 s on 2
# busy cores) before it gives up naming the lock; libraries of other sources unused this long are
# removed when a new one is built
_TURN_WAIT_S = 15 * 60
_STALE_S = 7 * 24 * 3600


def _take_turn(turn, lock_path: str, wait_s: float) -> None:
    import fcntl
    import time

    start = time.monotonic()
    while True:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() - start > wait_s:
                raise RuntimeError(f"waited {wait_s:.0f} s for another process building the library ({lock_path} is "
                                   f"locked by it); stop it, or choose another GRF_XLA_FFI_DIR, then rerun")
            time.sleep(0.2)


def _remove_stale(folder: str, keep: str) -> None:
    """Libraries (and their lock files) of other sources not used for ``_STALE_S``: old checkouts'."""
    import time

    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith("grf_xla_ffi_") and not path.startswith(keep):
            try:
                if time.time() - os.path.getatime(path) > _STALE_S:
                    os.remove(path)
            except OSError:
                pass


def _build(path: str, wait_s: float = _TURN_WAIT_S) -> None:
    """Compile into ``path`` unless it exists; processes take turns (a ``flock``, dropped by the
    kernel however its holder dies; a live holder is waited for at most ``wait_s``), the library
    written to a temporary name and renamed."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with open(path + ".lock", "a") as turn, note_if_slow("the fused C++ CPU ops for JAX"):
        _take_turn(turn, path + ".lock", wait_s)
        if os.path.exists(path):
            return
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(_command(tmp), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {_SOURCE} failed ({' '.join(_command(tmp))}):\n{done.stderr[-4000:]}")
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared GRF_XLA_FFI_DIR out
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _remove_stale(folder, keep=path)


def load():
    """The loaded library with its targets registered with XLA; ``UnsupportedOnBackend`` with the
    reason when it cannot be built or torch's BLAS is not found. Tried once per process."""
    if "lib" in _STATE:
        return _STATE["lib"]
    if "error" not in _STATE:
        reason = unavailable_reason()
        if reason is None:
            try:
                path = _library_path()
                _build(path)
                lib = ctypes.CDLL(path)
                lib.GrfBindBlas.restype = ctypes.c_char_p
                lib.GrfBindBlas.argtypes = [ctypes.c_char_p]
                reason = lib.GrfBindBlas(_torch_library().encode()).decode() or None
            except (OSError, RuntimeError) as exc:
                reason = str(exc)
            if reason is None:
                import jax

                try:
                    for target, symbol in _TARGETS.items():
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                except Exception as exc:  # a jaxlib whose FFI registration differs
                    reason = f"registering its XLA custom-call targets failed: {exc}"
                else:
                    _STATE["lib"] = lib
                    return lib
        _STATE["error"] = f"cpu_fused ops for JAX: {reason}"
    raise UnsupportedOnBackend(_STATE["error"])


def on_cpu(x) -> bool:
    """Any array of a jax backend built on the CPU is there (``backends.cpu_fused.on_cpu``)."""
    return True


def _functions():
    """The custom_vjp functions, made once (JAX imported only here)."""
    if "functions" in _STATE:
        return _STATE["functions"]
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    def shaped(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
    def tiles(q, k, v, pos_w, ts_w, chunk_rows, pair_q, pair_k, pos, bucket, norm_len):
        out = jax.ShapeDtypeStruct((q.shape[0], v.shape[1], v.shape[2]), q.dtype)
        return jax.ffi.ffi_call("grf_hstu_forward", out)(q, k, v, chunk_rows, pair_q, pair_k, pos, pos_w, ts_w, bucket,
                                                         norm_len=np.int64(norm_len))

    def tiles_fwd(q, k, v, pos_w, ts_w, chunk_rows, pair_q, pair_k, pos, bucket, norm_len):
        out = tiles(q, k, v, pos_w, ts_w, chunk_rows, pair_q, pair_k, pos, bucket, norm_len)
        return out, (q, k, v, pos_w, ts_w, chunk_rows, pair_q, pair_k, pos, bucket)

    def tiles_bwd(norm_len, res, dout):
        q, k, v, pos_w, ts_w, chunk_rows, pair_q, pair_k, pos, bucket = res
        grads = jax.ffi.ffi_call("grf_hstu_backward", (shaped(q), shaped(k), shaped(v), shaped(pos_w), shaped(ts_w)))(
            dout.astype(q.dtype), q, k, v, chunk_rows, pair_q, pair_k, pos, pos_w, ts_w, bucket,
            norm_len=np.int64(norm_len))
        return (*grads, None, None, None, None, None)

    tiles.defvjp(tiles_fwd, tiles_bwd)

    @jax.custom_vjp
    def sampled(user, items, ids):
        out = jax.ShapeDtypeStruct(ids.shape, user.dtype)
        return jax.ffi.ffi_call("grf_sampled_forward", out)(user, items, ids)

    def sampled_fwd(user, items, ids):
        return sampled(user, items, ids), (user, items, ids)

    def sampled_bwd(res, grad):
        user, items, ids = res
        d_user, d_items = jax.ffi.ffi_call("grf_sampled_backward", (shaped(user), shaped(items)))(
            grad.astype(user.dtype), user, items, ids)
        return d_user, d_items, None

    sampled.defvjp(sampled_fwd, sampled_bwd)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def sampled16(user, items, ids, scale, half):
        out = jax.ShapeDtypeStruct(ids.shape, user.dtype)
        return jax.ffi.ffi_call("grf_sampled16_forward", out)(user, items, ids, scale, half=half)

    def sampled16_fwd(user, items, ids, scale, half):
        return sampled16(user, items, ids, scale, half), (user, items, ids, scale)

    def sampled16_bwd(half, res, grad):
        user, items, ids, scale = res
        d_user, d_items = jax.ffi.ffi_call("grf_sampled16_backward", (shaped(user), shaped(items)))(
            grad.astype(user.dtype), user, items, ids, scale, half=half)
        return d_user, d_items, None, None  # none to scale (the oracle's rule: straight through)

    sampled16.defvjp(sampled16_fwd, sampled16_bwd)

    def int32(x):
        return jnp.asarray(x).astype(jnp.int32)

    _STATE["functions"] = (tiles, sampled, sampled16, int32)
    return _STATE["functions"]


def attention(B, q, k, v, layout, norm_len, bias):
    """``hstu_attention``'s contract (backends/kernels.py) on ``layout.tiles``, fused: the torch
    extension's kernel (``backends/cpu_fused``) as an XLA custom call."""
    tiles, _, _, int32 = _functions()
    xp = B.xp
    plan = layout.tiles
    pos_w = bias.pos_w if bias.pos_w is not None else xp.zeros(0, dtype=q.dtype)
    ts_w = bias.ts_w if bias.ts_w is not None else xp.zeros(0, dtype=q.dtype)
    bucket = B.tile_time_buckets(layout, bias) if bias.ts_w is not None else xp.zeros(0, dtype=xp.int32)
    return tiles(q, k, v, pos_w.astype(q.dtype), ts_w.astype(q.dtype), int32(plan.chunk_rows), int32(plan.pair_q),
                 int32(plan.pair_k), int32(layout.pos), int32(bucket), int(norm_len))


# its backward recomputes the tiles from q, k, v: backend.attention_recompute has nothing to add
attention.recomputes = lambda B, q, layout: True


def sampled_logits(user, items, ids):
    """``Backend.sampled_logits_reference``: ``out[t, r] = <user[t], items[ids[t, r]]>`` (the torch
    extension's ``sampled_logits``, as an XLA custom call)."""
    _, sampled, _, int32 = _functions()
    return sampled(user, items, int32(ids))


def sampled_logits_16bit(user, items, ids, scale, precision: str):
    """``Backend.sampled_logits_16bit_reference`` on float32 arrays (the torch extension's
    ``sampled_logits_16bit``, as an XLA custom call): user[T, D], items[N, D], ids[T, R], scale[T]
    (> 0), precision "fp16" | "bf16" -> [T, R]."""
    _, _, sampled16, int32 = _functions()
    return sampled16(user, items, int32(ids), scale.astype(user.dtype), precision == "fp16")


def unavailable_reason() -> str | None:
    """Why the library cannot be built or run here, or None (cheap checks only: no build, and
    torch is not imported)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for x86-64 CPUs with AVX2, this machine is {platform.machine()}"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    if missing:
        return f"it needs the CPU features avx2, fma and f16c; /proc/cpuinfo lacks {', '.join(missing)}"
    if not _torch_library():
        return "torch's libtorch_cpu.so (whose BLAS the ops call) is not found"
    return compiler_reason()
