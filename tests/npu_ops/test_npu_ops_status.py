"""Probes and kernel selection: torch_npu_status, mxrec_status, the npu kernels of the registry
(backends/kernels.py: "mxrec", "triton", "auto"), and the npu backend failing loudly with the
probe's reason.

Provenance: this host (no torch_npu) for the real probe; injected imports (mock_wiring) and one
subprocess with a stand-in ``torch_npu`` package for the failure modes of a broken install.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

import backends
import npu_ops
from npu_ops import _probe
from npu_ops._probe import INSTALL_HINT, probe_torch_npu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _importer(modules: dict, errors: dict):
    """An ``import_module`` stand-in: known modules, raised errors, else the real import."""
    import importlib

    def import_module(name):
        if name in errors:
            raise errors[name]
        if name in modules:
            return modules[name]
        return importlib.import_module(name)

    return import_module


def _module_not_found(name):
    exc = ModuleNotFoundError(f"No module named {name!r}")
    exc.name = name
    return exc


# ------------------------------------------------------------------------------ this host
def test_torch_npu_not_installed_here():
    ok, reason = npu_ops.torch_npu_status()
    assert not ok
    assert "not installed" in reason and INSTALL_HINT in reason
    assert npu_ops.torch_npu_probe().stage == _probe.STAGE_NOT_INSTALLED


def test_mxrec_status_names_the_torch_npu_reason():
    ok, reason = npu_ops.mxrec_status()
    assert not ok and "torch_npu" in reason and INSTALL_HINT in reason


def test_npu_backend_unavailable_with_the_probe_reason():
    _, reason = npu_ops.torch_npu_status()
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get_backend("npu")
    assert reason in str(info.value)


def test_import_loads_no_vendor_module():
    code = ("import sys, npu_ops; bad = [m for m in ('torch', 'torch_npu', 'triton', 'rec_cust_ops') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------ selection
class _StandInNpu:
    """What a kernel build reads of an NpuBackend (which cannot be created here)."""

    name, dtype_name, device_kind = "npu", "float32", "npu"


def _build_npu_kernel(kind):
    from backends import ops

    return ops.build(_StandInNpu(), "attention", kind)


def test_unknown_npu_kernel_lists_the_kinds():
    from gr_functional.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _build_npu_kernel("cuda")
    for kind in ("default", "auto", "mxrec", "triton", "reference"):
        assert repr(kind) in str(info.value)


def test_npu_default_kernel_is_auto():
    from backends import kernels

    assert kernels.default_kernel("npu") == "auto"


def test_select_triton_needs_triton_ascend():
    # upstream triton is installed here, not triton-ascend: the npu backend must refuse it
    with pytest.raises(backends.BackendUnavailable, match="ops.attention='triton' cannot run here.*not triton-ascend"):
        _build_npu_kernel("triton")


def test_select_mxrec_gives_the_reason():
    with pytest.raises(backends.BackendUnavailable, match="'mxrec' is unavailable.*torch_npu is not installed"):
        _build_npu_kernel("mxrec")


def test_select_auto_gives_both_reasons():
    with pytest.raises(backends.BackendUnavailable) as info:
        _build_npu_kernel("default")
    assert "'auto'" in str(info.value)
    assert "torch_npu is not installed" in str(info.value) and "triton" in str(info.value)


# ------------------------------------------------------------------------------ simulated hosts
def test_probe_broken_cann_reports_the_loader_error():
    err = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    probe = probe_torch_npu(_importer({}, {"torch_npu": err}), environ={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert probe.stage == _probe.STAGE_IMPORT_FAILED and not probe.importable
    assert "libhccl.so" in probe.reason and "set_env.sh" in probe.reason
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set" in probe.reason


def test_probe_missing_dependency_is_not_reported_as_not_installed():
    probe = probe_torch_npu(_importer({}, {"torch_npu": _module_not_found("yaml")}))
    assert probe.stage == _probe.STAGE_IMPORT_FAILED and "yaml" in probe.reason


def test_probe_torch_import_broken_by_autoload():
    cause = ImportError("libhccl.so: cannot open shared object file")
    err = RuntimeError("Failed to load the backend extension: torch_npu. You can disable extension "
                       "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.")
    err.__cause__ = cause
    probe = probe_torch_npu(_importer({}, {"torch": err}))
    assert probe.stage == _probe.STAGE_TORCH_IMPORT_FAILED
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in probe.reason and "libhccl.so" in probe.reason


@pytest.mark.parametrize("available, count, stage", [(False, 0, "no_device"), (True, 2, "ok")])
def test_probe_device_check(available, count, stage):
    fake = types.SimpleNamespace(__version__="2.13.0.post1", npu=types.SimpleNamespace(
        is_available=lambda: available, device_count=lambda: count))
    probe = probe_torch_npu(_importer({"torch_npu": fake}, {}))
    assert probe.stage == stage and probe.importable
    if stage == "no_device":
        assert "is_available() is False" in probe.reason
    else:
        assert probe.ok and "2 NPU device(s)" in probe.reason


@pytest.mark.slow
def test_broken_install_through_the_real_import_machinery(tmp_path):
    """A stand-in torch_npu package whose import fails like a wheel without CANN, plus its
    ``torch.backends`` entry point: without TORCH_DEVICE_BACKEND_AUTOLOAD=0 ``import torch``
    breaks (and the probe says why); with it, the probe reports the loader error."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    dist = tmp_path / "torch_npu-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    code = textwrap.dedent("""
        import npu_ops
        probe = npu_ops.torch_npu_probe()
        print(probe.stage)
        print(probe.reason)
    """)
    results = {}
    for autoload in ("1", "0"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]),
               "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                              text=True, check=True)
        results[autoload] = done.stdout.splitlines()
    stage, reason = results["1"][0], "\n".join(results["1"][1:])
    assert stage == "torch_import_failed", results
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason and "libhccl.so" in reason
    stage, reason = results["0"][0], "\n".join(results["0"][1:])
    assert stage == "import_failed", results
    assert "torch_npu 0.0.0 is installed but failed to import" in reason and "libhccl.so" in reason
