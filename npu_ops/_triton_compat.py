"""Shims that let one Triton source run on CUDA, on triton-ascend and in the CPU interpreter.

Nothing here is kernel code. The facts behind each shim (triton-ascend's documentation and
programming guide):

- ``TRITON_INTERPRET=1`` is read when ``@triton.jit`` decorates a function, so whether a kernel
  runs in the interpreter is a property of the decorated object (``interpreted(fn)``), not of
  the environment at call time.
- The interpreter has no active driver: ``driver.active.utils.get_device_properties`` fails, so
  core counts come from torch (CUDA) or from the Ascend driver only on an Ascend host.
- triton-ascend installs as ``triton`` and ships only the ``ascend`` backend.
- The interpreter multiplies bf16 ``tl.dot`` operands as raw integers (triton#11584): kernels
  upcast to fp32 before ``tl.dot`` when ``needs_dot_upcast`` says so.
"""
from __future__ import annotations

import functools

import triton

try:  # the class the interpreter substitutes for a JITFunction (triton 3.2 and 3.8)
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - a triton without an interpreter
    _InterpretedFunction = None

# Kinds used as keys of the per-backend kernel configuration tables.
INTERPRETER = "interpreter"
CUDA = "cuda"
ASCEND = "ascend"

# Programs per launch in the interpreter: more than one so the persistent task loop is exercised,
# few because the interpreter runs programs one after another (~1 ms each).
INTERPRETER_PROGRAMS = 4
# Fallback when the Ascend driver cannot report its AI-core count (Atlas A2 910B2 has 24).
ASCEND_DEFAULT_AICORES = 24
# Ascend binds the grid to physical cores and caps it at UINT16_MAX (triton-ascend's guide).
MAX_GRID = 65535


def interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) will run in the CPU interpreter."""
    return _InterpretedFunction is not None and isinstance(kernel, _InterpretedFunction)


@functools.lru_cache(maxsize=None)
def is_triton_ascend() -> bool:
    """True when the installed ``triton`` is the triton-ascend distribution."""
    try:
        from triton import backends as _backends

        return "ascend" in getattr(_backends, "backends", {})
    except Exception:  # noqa: BLE001 - a probe never raises
        return False


def backend_kind(device_type: str, kernel) -> str:
    """``"interpreter" | "cuda" | "ascend"`` for tensors on ``device_type`` and this kernel object.

    Raises RuntimeError with the fix when the kernel cannot run on that device here (a CPU
    tensor without the interpreter, an NPU tensor without triton-ascend, ...).
    """
    if interpreted(kernel):
        if device_type != "cpu":
            raise RuntimeError(f"Triton kernels were decorated under TRITON_INTERPRET=1 (CPU interpreter) "
                               f"but the tensors are on {device_type!r}; unset TRITON_INTERPRET before "
                               f"importing npu_ops.triton_hstu to run on the device")
        return INTERPRETER
    if device_type == "cuda" and not is_triton_ascend():
        return CUDA
    if device_type == "npu" and is_triton_ascend():
        return ASCEND
    if device_type == "cpu":
        raise RuntimeError("Triton kernels need a GPU/NPU; on CPU they run only in the Triton interpreter: "
                           "set TRITON_INTERPRET=1 before importing npu_ops.triton_hstu (slow: tests only)")
    raise RuntimeError(f"no Triton backend for device {device_type!r} with the installed triton "
                       f"({'triton-ascend' if is_triton_ascend() else 'upstream triton'} {triton.__version__})")


def num_compute_units(kind: str, device) -> int:
    """Physical cores a persistent kernel should cover: SMs (CUDA), AI cores (Ascend), or a small
    constant in the interpreter."""
    if kind == INTERPRETER:
        return INTERPRETER_PROGRAMS
    if kind == CUDA:
        import torch

        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    if kind == ASCEND:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
            return int(props["num_aicore"])
        except Exception:  # noqa: BLE001 - no driver (e.g. lowering checks): documented default
            return ASCEND_DEFAULT_AICORES
    raise ValueError(f"unknown backend kind {kind!r}")


def needs_dot_upcast(kind: str, dtype) -> bool:
    """Upcast ``tl.dot`` operands to fp32: always in the interpreter for bf16 (triton#11584)."""
    import torch

    return kind == INTERPRETER and dtype == torch.bfloat16
