"""The fbgemm TBE row kernel (npu_ops/fbgemm_tbe.py, backends/row_kernels.py) on CPU.

Three oracles: the reference formulas (``rowopt.reference_row_update``), a FAKE of fbgemm's TBE
module written from its documented semantics (npu_ops/fakes/fake_fbgemm_tbe.py), and fbgemm's own
CPU implementation (fbgemm-gpu-cpu, in the test extra). The adapter must reproduce the reference
through both, and the fake must reproduce fbgemm's module: that is what makes the fake a fair
stand-in for fbgemm-ascend's kernels, which nobody here can run.
"""
from __future__ import annotations

import importlib.util
import platform

import numpy as np
import pytest
import torch

import gr_functional as grf
from backends import get_backend, row_kernels
from gr_functional.config import OptimConfig
from gr_functional.embedding import rowopt
from gr_functional.errors import ConfigError
from gr_functional.step import init_opt_state, make_train_step
from npu_ops import UnsupportedOnBackend, fbgemm_tbe
from npu_ops.fakes.fake_fbgemm_tbe import fake_api

HAVE_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
# fbgemm-gpu-cpu is in the test extra wherever it has a wheel: there its absence is a failure
WHEEL_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"


def _real_api():
    if not HAVE_FBGEMM:
        if WHEEL_PLATFORM:
            pytest.fail("fbgemm_gpu is not installed: pip install -e '.[test]' (fbgemm-gpu-cpu==1.8.0)")
        pytest.skip(f"no fbgemm-gpu-cpu wheel for {platform.system()} {platform.machine()}")
    return fbgemm_tbe.load_api("cpu")


def _case(u=300, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    values, grads = torch.randn(u, d, generator=g), torch.randn(u, d, generator=g)
    acc = torch.rand(u, generator=g) * 3
    touched = torch.rand(u, generator=g) > 0.2
    return values, grads, acc, touched


def _check_against_reference(api, weight_decay):
    B = get_backend("torch")
    values, grads, acc, touched = _case()
    cfg = OptimConfig(lr=0.05, eps=1e-8, weight_decay=weight_decay)
    lr = torch.tensor(0.05)
    want_v, want_s = rowopt.reference_row_update(B, "rowwise_adagrad", values, grads, {"acc": acc}, touched, lr, cfg)
    adapter = fbgemm_tbe.FbgemmRowwiseAdagrad(api)
    for _ in range(2):  # the second call reuses the cached table: nothing may leak between calls
        got_v, got_a = adapter.update(values, grads, acc, touched, lr, cfg.eps, weight_decay)
        np.testing.assert_allclose(got_v.numpy(), want_v.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_a.numpy(), want_s["acc"].numpy(), rtol=1e-6, atol=1e-7)
        assert torch.equal(got_v[~touched], values[~touched]) and torch.equal(got_a[~touched], acc[~touched])
    # fewer rows after more: the same table, a prefix of it
    got_v, _ = adapter.update(values[:5], grads[:5], acc[:5], touched[:5], lr, cfg.eps, weight_decay)
    np.testing.assert_allclose(got_v.numpy(), want_v[:5].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adapter_reproduces_the_reference_through_the_fake(weight_decay):
    _check_against_reference(fake_api(), weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adapter_reproduces_the_reference_through_fbgemm_cpu(weight_decay):
    _check_against_reference(_real_api(), weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fake_matches_fbgemm_cpu_module(weight_decay):
    """Duplicate indices, several steps: the fake's documented semantics are fbgemm's."""
    real_api, fake = _real_api(), fake_api()
    tables = []
    for api in (real_api, fake):
        decay = api.weight_decay_mode.L2 if weight_decay else api.weight_decay_mode.NONE
        tables.append(api.tbe_class([(40, 16, api.location.HOST, api.compute_device.CPU)],
                                    optimizer=api.optim_type.EXACT_ROWWISE_ADAGRAD, pooling_mode=api.pooling_mode.NONE,
                                    learning_rate=0.1, eps=1e-8, weight_decay=weight_decay, weight_decay_mode=decay,
                                    stochastic_rounding=False, device=torch.device("cpu")))
    init = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    for t in tables:
        with torch.no_grad():
            t.split_embedding_weights()[0].copy_(init)
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        idx = torch.randint(0, 40, (25,), generator=g)   # repeats: fbgemm sums them first
        grad = torch.randn(25, 16, generator=g)
        outs = []
        for t in tables:
            t.set_learning_rate(0.1 / (step + 1))
            out = t(idx, torch.tensor([0, 10, 25]))
            outs.append(out.detach().clone())
            out.backward(grad)
        np.testing.assert_allclose(outs[0].numpy(), outs[1].numpy(), rtol=1e-6, atol=1e-6)
    (rw, fw), (rm, fm) = [(tables[0].split_embedding_weights()[0], tables[1].split_embedding_weights()[0]),
                          (tables[0].split_optimizer_states()[0][0], tables[1].split_optimizer_states()[0][0])]
    np.testing.assert_allclose(rw.numpy(), fw.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rm.numpy(), fm.numpy(), rtol=1e-5, atol=1e-7)


def test_documented_limits_are_refused_by_name():
    assert fbgemm_tbe.problem("npu", "float32", 64, 0.0) is None
    assert "multiple of 8" in fbgemm_tbe.problem("npu", "float32", 50, 0.0)
    assert "multiple of 4" in fbgemm_tbe.problem("cpu", "float32", 50, 0.0)
    assert "float32" in fbgemm_tbe.problem("cpu", "float64", 64, 0.0)
    assert "ignores weight_decay" in fbgemm_tbe.problem("npu", "float32", 64, 0.01)
    adapter = fbgemm_tbe.FbgemmRowwiseAdagrad(fake_api())
    values, grads, acc, touched = _case(d=50)
    with pytest.raises(UnsupportedOnBackend, match="multiple of 4"):
        adapter.update(values, grads, acc, touched, 0.1, 1e-8, 0.0)
    # an empty step never reaches the op (fbgemm-ascend refuses empty indices)
    values, grads, acc, touched = _case(u=0)
    got_v, got_a = adapter.update(values, grads, acc, touched, 0.1, 1e-8, 0.0)
    assert got_v is values and got_a is acc


def test_auto_falls_back_and_fbgemm_refuses():
    """What "auto" (the npu default) does with calls fbgemm cannot serve, and what "fbgemm" does."""
    B = get_backend("torch")
    cfg = OptimConfig(lr=0.05, eps=1e-8)
    values, grads, acc, touched = _case(d=50)
    state = {"m": torch.zeros_like(values), "v": torch.zeros_like(values), "t": torch.zeros_like(acc)}
    auto = row_kernels.fbgemm_update(fbgemm_tbe.FbgemmRowwiseAdagrad(fake_api()), fallback=True)
    strict = row_kernels.fbgemm_update(fbgemm_tbe.FbgemmRowwiseAdagrad(fake_api()), fallback=False)
    for name, st in (("lazy_adam", state), ("rowwise_adagrad", {"acc": acc})):  # an optimizer, a width
        want = rowopt.reference_row_update(B, name, values, grads, st, touched, 0.05, cfg)
        got = auto(B, name, values, grads, st, touched, 0.05, cfg)
        assert torch.equal(got[0], want[0])
        with pytest.raises(UnsupportedOnBackend, match="row kernel 'fbgemm'"):
            strict(B, name, values, grads, st, touched, 0.05, cfg)


@pytest.mark.parametrize("sets, match", [
    (["ops.row_update=fbgemm", "embedding.kind=hash", "embedding.optimizer=lazy_adam"], "table's step count"),
    (["ops.row_update=fbgemm", "backend.name=jax"], "does not run on the jax backend"),
    (["ops.row_update=auto"], "does not run on the torch backend"),
    (["ops.row_update=fbgemm", "embedding.kind=hash", "embedding.optimizer=rowwise_adagrad",
      "model.embed_dim=50"], "not a multiple of 4"),
])
def test_config_refuses_row_kernels_by_name(sets, match):
    with pytest.raises(ConfigError, match=match) as err:
        grf.prepare("quickstart", sets)
    assert "ops.row_update" in str(err.value)


def test_training_with_fbgemm_equals_the_reference_kernel():
    """A hash table with row-wise Adagrad (weight decay on, evicting) trained 12 steps through
    fbgemm's CPU TBE and through the reference: the same losses and rows."""
    _real_api()
    sets = ["embedding.kind=hash", "embedding.optimizer=rowwise_adagrad", "embedding.capacity=300", "loss.num_negatives=4",
            "optim.weight_decay=0.01", "train.batch_size=8"]
    runs = []
    for kernel in ("reference", "fbgemm"):
        exp = grf.prepare("quickstart", [*sets, f"ops.row_update={kernel}"])
        B = exp.backend()
        assert B.row_kernel == kernel
        params = B.asarray_tree(exp.init_params())
        opt_state = init_opt_state(B, params, exp.cfg)
        step_fn, host, losses = make_train_step(B, exp.cfg), exp.embedding_host(), []
        for step, batch in enumerate(exp.batches(0), start=1):
            if step > 12:
                break
            (batch,), _ = host.prepare([batch], step)
            params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
            losses.append(float(m["loss"]))
        runs.append((np.asarray(losses), B.to_numpy(params["item_emb"]), host.counters()))
    (ref_l, ref_t, ref_c), (fb_l, fb_t, fb_c) = runs
    assert ref_c["evictions"] > 0 and ref_c == fb_c
    np.testing.assert_allclose(fb_l, ref_l, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fb_t, ref_t, rtol=1e-5, atol=1e-6)
