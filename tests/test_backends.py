"""Backend registry, transforms and error messages."""
import numpy as np
import pytest

from backends import BackendUnavailable, backend_names, get_backend
from tests.differential.common import kernel_backend, kernel_pairs


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


@pytest.mark.parametrize("kernel", [k for b, k in kernel_pairs() if b == "torch"])
def test_torch_ops_create_nothing_off_device(kernel):
    """Every array an op creates lives on the backend's device (else CUDA/NPU runs fail with
    "tensors on different devices"). Checked without a GPU on torch's "meta" device, which
    rejects a CPU operand exactly as CUDA does: a whole train step and the eval scorer, with
    every registered attention kernel that runs there (the others are skipped with the reason)."""
    import dataclasses

    from gr_functional import model
    from gr_functional.batch import make_batch
    from gr_functional.configure import load_config
    from gr_functional.step import init_opt_state, make_scorer, make_train_step

    cfg = load_config(None)
    mc = dataclasses.replace(cfg.model, num_items=100, max_len=40, attention_tile=16)
    cfg = dataclasses.replace(cfg, model=mc)
    rng = np.random.default_rng(0)
    lengths = (5, 40, 17)
    hist = [rng.integers(1, 101, n + 1) for n in lengths]
    times = [np.cumsum(rng.integers(1, 100, n + 1)) for n in lengths]
    B = kernel_backend("torch", kernel, device="meta")
    params = B.asarray_tree(model.init_params(mc, seed=0))
    batch = B.asarray_tree(make_batch(hist, times, mc, rng=rng, num_items=100))
    new_params, _, _ = make_train_step(B, cfg)(params, init_opt_state(B, params, cfg), batch)
    assert new_params["item_emb"].device.type == "meta"
    eval_batch = B.asarray_tree(make_batch(hist, times, mc, num_items=100, train=False))
    assert make_scorer(B, cfg)(params, eval_batch).device.type == "meta"
