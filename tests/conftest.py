"""Shared test setup. Backends under test come from GRF_TEST_BACKENDS (default: jax,torch)."""
import os

import numpy as np
import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Triton kernels run in the CPU interpreter in tests; it is read when @triton.jit decorates, so it
# must be set before any test module imports npu_ops.triton_hstu.
os.environ.setdefault("TRITON_INTERPRET", "1")


def test_backend_names():
    return [b for b in os.environ.get("GRF_TEST_BACKENDS", "jax,torch").split(",") if b]


@pytest.fixture(params=test_backend_names())
def backend(request):
    from backends import get_backend
    return get_backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
