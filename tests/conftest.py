"""Shared test setup. Backends under test come from GRF_TEST_BACKENDS (default: jax,torch)."""
import os

import numpy as np
import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Triton kernels run in the CPU interpreter in tests; it is read when @triton.jit decorates, so it
# must be set before any test module imports npu_ops.triton_hstu.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One XLA compilation cache for the whole session, this process and every `grf train --backend
# jax` it starts: many tests compile the same programs (same model, same shapes), and on 2 cores
# compiling is most of a JAX test's time. Set before jax is imported (it reads them at import).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix="grf-test-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "data(*names): reads these registered data files (tests/data_needs.py): "
                                       "skipped without them, failed under GRF_REQUIRE_DATA=1")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures set up (one may read the data)
def pytest_runtest_setup(item):
    from tests.data_needs import data_file

    for mark in item.iter_markers("data"):
        for name in mark.args:
            data_file(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that meets ``DataMissing`` without declaring its data: the data skip, not a failure
    (tests/data_needs.py), unless the data is required."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.skipped:
        return
    from gr_functional.errors import DataMissing
    from tests.data_needs import data_required, missing_reason

    if call.excinfo.errisinstance(DataMissing) and not data_required():
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {missing_reason(call.excinfo.value)}")


_SKIPPED: list[tuple[str, str]] = []   # (test id, reason) of every skip this session (tests/skips.py)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    """Under ``GRF_EXPECTED_SKIPS`` (.ci/run), the skips must be the expected hardware ones."""
    from tests.skips import ENV, skip_problems

    expected = os.environ.get(ENV)
    if not expected or hasattr(session.config, "workerinput"):  # xdist workers: the controller checks
        return
    problems = skip_problems(_SKIPPED, expected)
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        write = reporter.write_line if reporter is not None else print
        write(f"{ENV}={expected}: the skips are not the expected ones:")
        for line in problems:
            write(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def test_backend_names():
    return [b for b in os.environ.get("GRF_TEST_BACKENDS", "jax,torch").split(",") if b]


@pytest.fixture(params=test_backend_names())
def backend(request):
    from backends import get_backend
    return get_backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

