"""Backend registry, transforms and error messages."""
import numpy as np
import pytest

from backends import BackendUnavailable, backend_names, get_backend


def test_registry_names():
    assert backend_names() == ["jax", "torch", "npu"]


def test_unknown_backend_lists_available_and_why_npu_is_not():
    with pytest.raises(BackendUnavailable) as info:
        get_backend("tpu9")
    msg = str(info.value)
    assert "unknown backend 'tpu9'" in msg and "jax: available" in msg and "torch: available" in msg
    assert "npu:" in msg and "torch_npu" in msg


def test_npu_fails_loudly_here():
    with pytest.raises(BackendUnavailable, match="backend 'npu' is unavailable"):
        get_backend("npu")


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be"):
        get_backend("torch", dtype="float16")


def test_value_and_grad_unused_and_aux(backend):
    params = backend.asarray_tree({"a": np.ones(3, np.float32), "b": [np.full(2, 2.0, np.float32)]})

    def f(p):
        return backend.xp.sum(p["a"] * 3.0), {"aux": p["a"] * 2.0}

    (value, aux), grads = backend.value_and_grad(f, has_aux=True)(params)
    assert float(value) == 9.0
    np.testing.assert_allclose(backend.to_numpy(aux["aux"]), [2, 2, 2])
    np.testing.assert_allclose(backend.to_numpy(grads["a"]), [3, 3, 3])
    np.testing.assert_allclose(backend.to_numpy(grads["b"][0]), [0, 0])  # unused -> zeros


def test_jit_matches_eager(backend):
    x = backend.asarray(np.arange(6, dtype=np.float32))
    f = lambda v: backend.silu(v) * 2.0  # noqa: E731
    np.testing.assert_allclose(backend.to_numpy(backend.jit(f)(x)), backend.to_numpy(f(x)), rtol=1e-6)
