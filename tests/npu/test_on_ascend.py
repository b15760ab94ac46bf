"""Real-hardware tests: the mxrec HSTU adapter (and the fake it was written against) and the
fbgemm-ascend TBE row kernel vs the reference, on an Ascend NPU.

Provenance: npu. Skipped ONLY when torch_npu cannot be imported (reason "no Ascend NPU: <probe
reason>"). On a host where torch_npu imports, every test runs: a missing device or missing
RecSDK ops is a failure with the probe's reason, never a skip.

Run on an Ascend host (see npu_ops/README.md):
    GRF_MXREC_LIB=/path/to/libfbgemm_npu_api.so python -m pytest tests/npu -m npu -v
Tolerances are first guesses from RecSDK's own tests (fp32 1e-4, fp16 1e-3, bf16 5e-3 against
a golden in the same dtype), widened for our float64 reference; calibrate them on hardware.
"""
from __future__ import annotations

import numpy as np
import pytest

import npu_ops
from npu_ops.testing import make_attention_case, run_attention

_PROBE = npu_ops.torch_npu_probe()
pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not _PROBE.importable, reason=f"no Ascend NPU: {_PROBE.reason}"),
]

TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
LAYOUTS = {
    "mixed_empty_slots": dict(lengths=[3, 1, 64, 17], max_len=64, b_cap=6),
    "all_max_len": dict(lengths=[128, 128], max_len=128),
    "all_len_1": dict(lengths=[1, 1, 1], max_len=32),
    "batch_of_one": dict(lengths=[50], max_len=64, b_cap=1),
    "empty_in_middle": dict(lengths=[5, 0, 9], max_len=16),
}


def _require(ok_reason):
    ok, reason = ok_reason
    if not ok:
        pytest.fail(reason)


@pytest.fixture(scope="module")
def cpu64():
    import backends

    return backends.get_backend("torch", dtype="float64")


@pytest.fixture(scope="module")
def npu32():
    _require(npu_ops.torch_npu_status())
    import backends

    return backends.get_backend("torch", device="npu", dtype="float32")


@pytest.fixture(scope="module")
def mxrec():
    _require(npu_ops.mxrec_status())
    return npu_ops.mxrec_hstu_attention()


def _compare(ref, got, tol):
    assert ref.keys() == got.keys()
    for key in ref:
        scale = max(1.0, float(np.abs(ref[key]).max()))
        np.testing.assert_allclose(got[key], ref[key], rtol=tol, atol=tol * scale, err_msg=key)


def test_torch_reference_runs_on_the_npu(cpu64, npu32):
    """No vendor kernel: the plain torch reference on the NPU vs CPU float64."""
    case = make_attention_case([3, 1, 16, 9], max_len=16, bias="pos+time")
    _compare(run_attention(case, cpu64), run_attention(case, npu32), TOL["float32"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bias", ["none", "pos", "pos+time"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mxrec_adapter_matches_reference(cpu64, npu32, mxrec, layout, bias, dtype):
    case = make_attention_case(bias=bias, heads=2, dqk=32, dv=64, **LAYOUTS[layout])
    _compare(run_attention(case, cpu64), run_attention(case, npu32, mxrec, dtype=dtype), TOL[dtype])


def test_npu_backend_end_to_end(cpu64):
    """The user path: get_backend("npu") picks the kernel and matches the reference."""
    import backends

    B = backends.get_backend("npu")
    case = make_attention_case([7, 2, 32], max_len=32, b_cap=4, bias="pos+time")
    _compare(run_attention(case, cpu64), run_attention(case, B), TOL["float32"])


@pytest.mark.parametrize("silu_scale", [0.0, 1.0 / 37])
@pytest.mark.parametrize("mask_type", [0, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fake_matches_the_real_kernel(npu32, mxrec, silu_scale, mask_type, with_bias):
    """Checks the FAKE (our reading of the docs) against the kernel, on the raw op."""
    import torch

    from npu_ops.fakes.fake_mxrec import hstu_jagged as fake

    torch.manual_seed(0)
    offs = torch.tensor([0, 5, 21, 24], dtype=torch.int64)
    S, N, D = 16, 2, 32
    q, k, v = (torch.randn(24, N, D) * 0.5 for _ in range(3))
    bias = torch.randn(3, N, S, S) * 0.5 if with_bias else None
    kw = dict(mask=None, attn_bias=bias, mask_type=mask_type, max_seq_len=S, silu_scale=silu_scale,
              seq_offset=offs)
    want = fake(q.double(), k.double(), v.double(), **{**kw, "attn_bias": None if bias is None else bias.double()})
    dev = lambda t: None if t is None else t.to("npu")  # noqa: E731
    got = mxrec.op(dev(q), dev(k), dev(v), **{**kw, "attn_bias": dev(bias), "seq_offset": dev(offs)})
    np.testing.assert_allclose(got.cpu().double().numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- fbgemm-ascend TBE
@pytest.fixture(scope="module")
def fbgemm_npu():
    _require(npu_ops.torch_npu_status())
    from npu_ops import fbgemm_tbe

    try:
        return fbgemm_tbe.load_api("npu")
    except npu_ops.UnsupportedOnBackend as exc:
        pytest.fail(str(exc))


@pytest.mark.parametrize("rows, dim", [(1, 8), (300, 64), (5000, 256)])
def test_fbgemm_row_kernel_matches_reference_on_the_npu(npu32, fbgemm_npu, rows, dim):
    """The fused TBE update on the NPU vs the reference formulas on CPU float64 (and so the fake,
    which equals the reference on CPU): what the CPU tests cannot show."""
    import torch

    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt
    from npu_ops.fbgemm_tbe import FbgemmRowwiseAdagrad

    g = torch.Generator().manual_seed(rows)
    values, grads = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    acc, touched = torch.rand(rows, generator=g), torch.rand(rows, generator=g) > 0.2
    cfg = OptimConfig(lr=0.05, eps=1e-8)
    import backends

    cpu = backends.get_backend("torch", dtype="float64")
    want_v, want_s = rowopt.reference_row_update(cpu, "rowwise_adagrad", values.double(), grads.double(),
                                                 {"acc": acc.double()}, touched, 0.05, cfg)
    adapter = FbgemmRowwiseAdagrad(fbgemm_npu)
    dev = npu32.torch_device
    got_v, got_a = adapter.update(values.to(dev), grads.to(dev), acc.to(dev), touched.to(dev), 0.05, cfg.eps, 0.0)
    _compare({"values": want_v.numpy(), "acc": want_s["acc"].numpy()},
             {"values": got_v.cpu().double().numpy(), "acc": got_a.cpu().double().numpy()}, TOL["float32"])
