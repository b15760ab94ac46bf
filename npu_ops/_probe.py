"""Lazy, cached probes: can torch_npu run here, and are RecSDK's mxrec HSTU ops loaded?

Nothing here imports torch_npu (or torch) at module import time; the probes do, once, when
asked. A probe never raises: it returns ``(ok, reason)`` where ``reason`` is the real cause
and the fix, so a run that asked for the NPU can fail loudly with it.

Why the import must really be attempted (torch_npu's install guide; observed on this CI image):
``importlib.util.find_spec("torch_npu")`` succeeds whenever the wheel is installed, even
without the CANN runtime, and then ``import torch_npu`` fails (``libhccl.so: cannot open
shared object file``). Worse, torch_npu registers a ``torch.backends`` entry point that
``import torch`` autoloads, so on such a host ``import torch`` itself raises
``RuntimeError: Failed to load the backend extension: torch_npu`` unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is set before Python starts.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sysconfig
from typing import Any, Callable

INSTALL_HINT = "pip install 'gr-functional[npu]' on an Ascend host with CANN"
CANN_HINT = ("install the CANN toolkit matching torch_npu and load its environment "
             "(`source /usr/local/Ascend/ascend-toolkit/set_env.sh`) before starting Python")
AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"
MXREC_LIB_VAR = "GRF_MXREC_LIB"

# Probe stages, in the order they are checked. tests/npu skips only on the first three
# ("torch_npu cannot import"); "no_device" on a host with a working torch_npu is an error.
STAGE_TORCH_IMPORT_FAILED = "torch_import_failed"
STAGE_NOT_INSTALLED = "not_installed"
STAGE_IMPORT_FAILED = "import_failed"
STAGE_NO_DEVICE = "no_device"
STAGE_OK = "ok"
IMPORT_STAGES = (STAGE_TORCH_IMPORT_FAILED, STAGE_NOT_INSTALLED, STAGE_IMPORT_FAILED)


@dataclasses.dataclass(frozen=True)
class TorchNpuProbe:
    """Result of probing torch_npu: ``stage`` is one of the STAGE_* names, ``reason`` says why
    and how to fix it (or, when ok, the versions and device count)."""

    stage: str
    reason: str

    @property
    def ok(self) -> bool:
        return self.stage == STAGE_OK

    @property
    def importable(self) -> bool:
        """True when ``import torch_npu`` succeeded (whether or not a device is visible)."""
        return self.stage not in IMPORT_STAGES


def _describe(exc: BaseException) -> str:
    """``Type: message``, followed by the chained cause (torch wraps the loader error)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


def probe_torch_npu(import_module: Callable[[str], Any] = importlib.import_module,
                    environ: dict | None = None) -> TorchNpuProbe:
    """Uncached probe; ``import_module``/``environ`` are injectable so tests can simulate
    hosts (broken CANN, no device) without the vendor wheel."""
    env = os.environ if environ is None else environ
    autoload = env.get(AUTOLOAD_VAR, "1")
    # 1. torch itself: on a host with torch_npu but no CANN, `import torch` autoloads
    #    torch_npu and fails before any of our code could run.
    try:
        torch = import_module("torch")
    except (ImportError, OSError, RuntimeError) as exc:
        msg = _describe(exc)
        if "torch_npu" in msg or "backend extension" in msg:
            return TorchNpuProbe(STAGE_TORCH_IMPORT_FAILED, (
                f"`import torch` failed while autoloading the torch_npu backend extension: {msg}. "
                f"torch_npu is installed but cannot load (usually the CANN runtime is missing). "
                f"Either {CANN_HINT}, or set {AUTOLOAD_VAR}=0 before Python starts to use torch "
                f"without the NPU (or uninstall torch-npu on hosts without Ascend hardware)."))
        return TorchNpuProbe(STAGE_TORCH_IMPORT_FAILED, f"`import torch` failed: {msg}")

    # 2. torch_npu: try the import for real; find_spec alone reports broken installs as fine.
    try:
        torch_npu = import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            return TorchNpuProbe(STAGE_NOT_INSTALLED, f"torch_npu is not installed: {INSTALL_HINT}")
        return TorchNpuProbe(STAGE_IMPORT_FAILED, (
            f"torch_npu {_dist_version('torch-npu', 'torch_npu')} is installed but a module it needs "
            f"is missing: {_describe(exc)}"))
    except (ImportError, OSError, RuntimeError) as exc:
        hint = CANN_HINT
        if autoload == "0":
            hint += f" ({AUTOLOAD_VAR}=0 is set, which only lets `import torch` succeed without it)"
        return TorchNpuProbe(STAGE_IMPORT_FAILED, (
            f"torch_npu {_dist_version('torch-npu', 'torch_npu')} is installed but failed to import "
            f"with torch {getattr(torch, '__version__', '?')}: {_describe(exc)}. Usually the CANN "
            f"libraries are missing or torch_npu does not match the torch release: {hint}"))

    # 3. a device: torch_npu imported, but the driver may see no NPU.
    npu = getattr(torch, "npu", None) or getattr(torch_npu, "npu", None)
    version = getattr(torch_npu, "__version__", None) or _dist_version("torch-npu", "torch_npu")
    try:
        available = bool(npu is not None and npu.is_available())
        count = int(npu.device_count()) if available else 0
    except (RuntimeError, OSError) as exc:
        return TorchNpuProbe(STAGE_NO_DEVICE, (
            f"torch_npu {version} imported but querying the NPU failed: {_describe(exc)}; "
            f"check `npu-smi info`, the driver, and ASCEND_RT_VISIBLE_DEVICES"))
    if not available or count < 1:
        return TorchNpuProbe(STAGE_NO_DEVICE, (
            f"torch_npu {version} imported but torch.npu.is_available() is False: no Ascend NPU "
            f"is visible (check `npu-smi info`, the driver, and ASCEND_RT_VISIBLE_DEVICES)"))
    return TorchNpuProbe(STAGE_OK, f"torch_npu {version} with {count} NPU device(s)")


@functools.lru_cache(maxsize=None)
def torch_npu_probe() -> TorchNpuProbe:
    """Cached ``probe_torch_npu()`` for this process (import outcomes do not change)."""
    return probe_torch_npu()


def torch_npu_status() -> tuple[bool, str]:
    """``(True, "torch_npu X with N NPU device(s)")`` or ``(False, reason)``; lazy and cached."""
    probe = torch_npu_probe()
    return probe.ok, probe.reason


# ---------------------------------------------------------------------------------- mxrec
def _mxrec_packet(ops) -> Any | None:
    try:
        return getattr(ops, "hstu_jagged")
    except (AttributeError, RuntimeError):
        return None


def _load_mxrec_libraries(torch) -> list[str]:
    """Try the documented ways RecSDK registers ``torch.ops.mxrec``; return what was tried.

    Order: ``$GRF_MXREC_LIB`` (os.pathsep-separated .so paths, e.g. a RecSDK build's
    ``libfbgemm_npu_api.so``), ``import rec_cust_ops`` (newer RecSDK packaging, per RecSDK
    issues #1346/#1350), then ``<purelib>/libfbgemm_npu_api.so`` (the path RecSDK's README loads).
    """
    paths = [p for p in os.environ.get(MXREC_LIB_VAR, "").split(os.pathsep) if p]
    tried = [] if paths else [f"${MXREC_LIB_VAR} is not set"]
    default_so = os.path.join(sysconfig.get_path("purelib"), "libfbgemm_npu_api.so")
    for path in paths:
        try:
            torch.ops.load_library(path)
            tried.append(f"loaded {path}")
        except (OSError, RuntimeError) as exc:
            tried.append(f"load_library({path!r}) failed: {_describe(exc)}")
    if _mxrec_packet(torch.ops.mxrec) is None:
        if importlib.util.find_spec("rec_cust_ops") is not None:
            try:
                importlib.import_module("rec_cust_ops")
                tried.append("imported rec_cust_ops")
            except (ImportError, OSError, RuntimeError) as exc:
                tried.append(f"import rec_cust_ops failed: {_describe(exc)}")
        else:
            tried.append("rec_cust_ops is not installed")
    if _mxrec_packet(torch.ops.mxrec) is None:
        if os.path.exists(default_so):
            try:
                torch.ops.load_library(default_so)
                tried.append(f"loaded {default_so}")
            except (OSError, RuntimeError) as exc:
                tried.append(f"load_library({default_so!r}) failed: {_describe(exc)}")
        else:
            tried.append(f"{default_so} does not exist")
    return tried


@functools.lru_cache(maxsize=None)
def mxrec_status() -> tuple[bool, str]:
    """Whether RecSDK's ``torch.ops.mxrec.hstu_jagged`` is loaded with a schema this adapter
    knows; ``(ok, reason)``. Needs a working torch_npu (the ops dispatch on PrivateUse1 only).
    Loads the RecSDK library if it is installed but not yet loaded. Cached."""
    probe = torch_npu_probe()
    if not probe.ok:
        return False, f"the mxrec ops need torch_npu on an Ascend device: {probe.reason}"
    import torch

    tried = [] if _mxrec_packet(torch.ops.mxrec) is not None else _load_mxrec_libraries(torch)
    packet = _mxrec_packet(torch.ops.mxrec)
    if packet is None:
        return False, ("torch.ops.mxrec.hstu_jagged is not registered (RecSDK's HSTU ops are not on "
                       "PyPI: build RecSDK cust_op against CANN, then point "
                       f"${MXREC_LIB_VAR} at libfbgemm_npu_api.so). Tried: " + "; ".join(tried))
    from ._errors import MxrecSchemaError
    from .mxrec_hstu import resolve_hstu_jagged

    try:
        _, note = resolve_hstu_jagged(packet)
    except MxrecSchemaError as exc:
        return False, str(exc)
    return True, f"torch.ops.mxrec.hstu_jagged loaded; {note}"


def clear_caches() -> None:
    """Forget cached probe results (tests; or after installing/loading something)."""
    torch_npu_probe.cache_clear()
    mxrec_status.cache_clear()
