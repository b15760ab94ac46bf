"""The mxrec HSTU adapter vs the reference attention, on CPU, through a FAKE of the op.

Provenance: semantic_fake. These tests prove that npu_ops/mxrec_hstu.py translates our contract
into arguments whose DOCUMENTED meaning (as implemented by npu_ops/fakes/fake_mxrec.py) gives
the reference outputs and gradients. They prove nothing about the Ascend kernel itself
(tests/npu does, on hardware).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import backends
from npu_ops import UnsupportedOnBackend
from npu_ops._errors import MxrecSchemaError
from npu_ops.fakes.fake_mxrec import DOCUMENTED_SCHEMA, FakeMxrecError, RecordingOps, fake_mxrec_ops
from npu_ops.fakes.fake_mxrec import hstu_jagged as fake_hstu_jagged
from npu_ops.mxrec_hstu import HSTU_JAGGED_LIMITS, MxrecHstuAttention
from npu_ops.testing import make_attention_case, run_attention

# float64 is beyond the real kernel; widened here only so the translation is checked at 1e-10.
LIMITS_F64 = dataclasses.replace(HSTU_JAGGED_LIMITS, dtypes=HSTU_JAGGED_LIMITS.dtypes + ("float64",))
TOL = {"float64": 1e-10, "float32": 1e-5}

# (lengths, max_len, b_cap, t_cap, heads, dqk, dv)
LAYOUTS = {
    "mixed_empty_slots": ([3, 1, 8, 5], 8, 7, None, 2, 16, 32),
    "all_max_len": ([8, 8, 8], 8, None, None, 2, 16, 32),
    "all_len_1": ([1, 1, 1, 1], 8, None, None, 2, 16, 32),
    "batch_of_one": ([5], 8, 1, None, 2, 16, 32),
    "batch_of_one_no_padding": ([8], 8, 1, 8, 1, 32, 16),
    "empty_in_middle": ([3, 0, 4, 0], 6, 6, None, 2, 16, 16),
}
BIASES = ("none", "pos", "pos+time")


@pytest.fixture(scope="module")
def fake_ops():
    return fake_mxrec_ops()


def _backend(dtype):
    return backends.get_backend("torch", dtype=dtype)


def _case(name, bias, seed=0):
    lengths, max_len, b_cap, t_cap, heads, dqk, dv = LAYOUTS[name]
    return make_attention_case(lengths, max_len=max_len, b_cap=b_cap, t_cap=t_cap, heads=heads, dqk=dqk,
                               dv=dv, bias=bias, seed=seed)


def _assert_same(ref, got, tol):
    assert ref.keys() == got.keys()
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=tol, atol=tol, err_msg=key)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapter_matches_reference(fake_ops, layout, bias, dtype):
    B = _backend(dtype)
    case = _case(layout, bias)
    limits = LIMITS_F64 if dtype == "float64" else HSTU_JAGGED_LIMITS
    ref = run_attention(case, B)
    got = run_attention(case, B, MxrecHstuAttention(fake_ops, limits=limits))
    _assert_same(ref, got, TOL[dtype])
    # the comparison is not vacuous: gradients of every input (and bias param) are non-zero
    for key, value in ref.items():
        assert np.abs(value).max() > 1e-3, f"{key} is ~0: the case does not exercise it"
    # padding rows: zero output, zero gradient
    T = case.layout.num_tokens()
    assert not got["out"][T:].any() and not got["dq"][T:].any()


def test_arguments_passed_to_the_op():
    case = _case("mixed_empty_slots", "pos+time")
    rec = RecordingOps()
    run_attention(case, _backend("float64"), MxrecHstuAttention(rec, limits=LIMITS_F64))
    (call,) = rec.calls
    kw = call["kwargs"]
    n, L = case.norm_len, case.layout.max_len
    assert n != L  # else the kernel's own default 1/max_seq_len would hide a missing silu_scale
    assert kw["silu_scale"] == 1.0 / n
    assert kw["max_seq_len"] == L and kw["mask_type"] == 0 and kw["alpha"] == 1.0 and kw["mask"] is None
    assert kw["num_context"] is None and kw["num_target"] is None and kw["target_group_size"] == 0
    T = case.layout.num_tokens()
    q, k, v = call["args"]
    assert q.shape == (T, 2, 16) and k.shape == (T, 2, 16) and v.shape == (T, 2, 32)
    assert kw["seq_offset"].dtype == torch.int64
    assert kw["seq_offset"].tolist() == [0, 3, 4, 12, 17]  # 4 real sequences; 3 empty slots dropped
    assert kw["attn_bias"].shape == (4, 2, L, L) and kw["attn_bias"].dtype == q.dtype
    assert kw["attn_bias"].is_contiguous()


def test_empty_sequences_are_never_passed():
    case = _case("empty_in_middle", "pos+time")
    rec = RecordingOps()
    run_attention(case, _backend("float64"), MxrecHstuAttention(rec, limits=LIMITS_F64))
    kw = rec.calls[0]["kwargs"]
    assert kw["seq_offset"].tolist() == [0, 3, 7]
    # the bias rows follow the kept sequences (0 and 2), not the first two slots
    B = _backend("float64")
    layout = B.asarray_tree(case.layout)
    bias = B.relative_bias(layout, case.norm_len, B.AttentionBias(B.asarray(case.pos_w), B.asarray(case.ts_w),
                                                                  B.asarray(case.ts), B.asarray(case.query_ts)))
    torch.testing.assert_close(kw["attn_bias"][:, 0], bias[[0, 2]], rtol=0, atol=0)


def test_no_real_tokens_returns_zeros_without_calling():
    case = make_attention_case([], max_len=4, b_cap=2, t_cap=8)
    rec = RecordingOps()
    att = MxrecHstuAttention(rec, limits=LIMITS_F64)
    B = _backend("float64")
    out = att(B.asarray(case.q), B.asarray(case.k), B.asarray(case.v), B.asarray_tree(case.layout), 7, None)
    assert out.shape == (8, 2, 32) and not out.any() and rec.calls == []


def test_comparison_catches_a_missing_silu_scale(fake_ops):
    """Teeth: an adapter relying on the kernel's default scale (1/max_seq_len) is caught."""
    class DropsSiluScale:
        hstu_jagged = staticmethod(lambda *a, **kw: fake_ops.hstu_jagged(*a, **{**kw, "silu_scale": 0.0}))

    case = _case("mixed_empty_slots", "pos")
    B = _backend("float64")
    ref = run_attention(case, B)
    bad = run_attention(case, B, MxrecHstuAttention(DropsSiluScale(), limits=LIMITS_F64))
    assert not np.allclose(bad["out"], ref["out"], rtol=1e-3, atol=1e-6)
    scale = case.norm_len / case.layout.max_len  # exactly the ratio of the two normalisers
    np.testing.assert_allclose(bad["out"], ref["out"] * scale, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ the fake itself
def test_fake_documented_defaults_and_masks(fake_ops):
    torch.manual_seed(0)
    q, k, v = (torch.randn(5, 2, 16, dtype=torch.float64) for _ in range(3))
    offs = torch.tensor([0, 2, 5])
    causal = fake_ops.hstu_jagged(q, k, v, max_seq_len=4, silu_scale=0.0, seq_offset=offs)
    explicit = fake_ops.hstu_jagged(q, k, v, max_seq_len=4, silu_scale=0.25, seq_offset=offs)
    torch.testing.assert_close(causal, explicit)  # silu_scale 0 means 1/max_seq_len
    # hand formula for sequence 1, row 1: sum_{j<=1} SiLU(q1.kj) / 4 * vj
    s = slice(2, 5)
    qs, ks, vs = q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1)
    p = torch.nn.functional.silu(qs @ ks.transpose(1, 2)) / 4
    expect = (p[:, 1, :2, None] * vs[:, :2]).sum(1)
    torch.testing.assert_close(causal[3], expect)
    no_mask = fake_ops.hstu_jagged(q, k, v, mask_type=2, max_seq_len=4, silu_scale=0.25, seq_offset=offs)
    torch.testing.assert_close(no_mask[3], (p[:, 1, :, None] * vs).sum(1))


@pytest.mark.parametrize("bad", [
    {"max_seq_len": 0}, {"max_seq_len": 20481}, {"mask_type": 1}, {"alpha": 2.0},
    {"seq_offset": torch.tensor([1, 5])}, {"seq_offset": torch.tensor([0, 4])},
    {"attn_bias": torch.zeros(1, 2, 5, 5, dtype=torch.float64)},   # heads/batch mismatch
    {"attn_bias": torch.zeros(2, 2, 5, 5, dtype=torch.float32)},   # dtype != q's
])
def test_fake_refuses_what_the_docs_forbid(fake_ops, bad):
    q = torch.zeros(5, 2, 16, dtype=torch.float64)
    kwargs = {"max_seq_len": 5, "silu_scale": 0.1, "seq_offset": torch.tensor([0, 2, 5]), **bad}
    with pytest.raises(FakeMxrecError):
        fake_ops.hstu_jagged(q, q, q, **kwargs)


# ------------------------------------------------------------------------------ documented limits
def _limit_inputs(lengths, max_len, heads=2, dqk=16, dv=16, dtype=torch.float32):
    case = make_attention_case(lengths, max_len=max_len, heads=heads, dqk=dqk, dv=dv)
    B = _backend("float32")
    as_t = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    return as_t(case.q), as_t(case.k), as_t(case.v), B.asarray_tree(case.layout)


@pytest.mark.parametrize("name, kwargs, limit", [
    ("float64", dict(lengths=[3], max_len=4, dtype=torch.float64), "dtype"),
    ("batch", dict(lengths=[1] * 2049, max_len=1), "batch"),
    ("seq_len", dict(lengths=[2], max_len=20481), "max_seq_len"),
    ("heads", dict(lengths=[3], max_len=4, heads=17), "heads"),
    ("dqk_multiple", dict(lengths=[3], max_len=4, dqk=24), "head_dim_qk"),
    ("dqk_small", dict(lengths=[3], max_len=4, dqk=8), "head_dim_qk"),
    ("dv_large", dict(lengths=[3], max_len=4, dv=528), "head_dim_v"),
    ("gr_default_dims", dict(lengths=[3], max_len=4, dqk=50, dv=50), "head_dim_qk"),
])
def test_documented_limits_raise_before_the_call(name, kwargs, limit):
    q, k, v, layout = _limit_inputs(**kwargs)
    rec = RecordingOps()
    with pytest.raises(UnsupportedOnBackend) as info:
        MxrecHstuAttention(rec)(q, k, v, layout, 7, None)
    msg = str(info.value)
    assert f"limit '{limit}'" in msg and "Ascend/RecSDK" in msg, msg
    assert rec.calls == []


# ------------------------------------------------------------------------------ schema drift
def test_pinned_schema_is_accepted(fake_ops):
    att = MxrecHstuAttention(fake_ops)
    assert "matches overload 'equal'" in att.schema_note


@pytest.mark.parametrize("namespace, old, new, expect", [
    ("grf_fake_mxrec_renamed", "Tensor seq_offset=None", "Tensor seq_offsets=None", "missing seq_offset"),
    ("grf_fake_mxrec_newer", "float silu_scale=0.0,",
     "float silu_scale=0.0, int max_seq_len_k=0, Tensor? seq_offset_k=None,", "new max_seq_len_k"),
    ("grf_fake_mxrec_retyped", "float silu_scale=0.0", "int silu_scale=0", "retyped silu_scale"),
])
def test_schema_drift_is_detected(namespace, old, new, expect):
    assert old in DOCUMENTED_SCHEMA
    drifted = fake_mxrec_ops(namespace, DOCUMENTED_SCHEMA.replace(old, new), impl=None)
    with pytest.raises(MxrecSchemaError) as info:
        MxrecHstuAttention(drifted)
    assert expect in str(info.value) and "schema drift" in str(info.value)


def test_missing_op_is_unsupported():
    class NoOps:
        pass

    with pytest.raises(UnsupportedOnBackend, match="no hstu_jagged op"):
        MxrecHstuAttention(NoOps())


def test_python_fake_without_schema_is_called_by_keyword():
    class PlainOps:
        hstu_jagged = staticmethod(fake_hstu_jagged)

    att = MxrecHstuAttention(PlainOps(), limits=LIMITS_F64)
    assert "not inspectable" in att.schema_note
    case = _case("batch_of_one", "pos")
    B = _backend("float64")
    _assert_same(run_attention(case, B), run_attention(case, B, att), 1e-10)
