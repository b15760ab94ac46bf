"""The portable Triton HSTU attention kernels vs the torch backend's reference ``hstu_attention``.

Provenance: interpreter. On a CPU host the kernels run in the Triton CPU interpreter
(TRITON_INTERPRET=1, set below before triton is imported), fp32: outputs and gradients of q, k,
v, pos_w, ts_w must match ``backends.get_backend("torch").hstu_attention`` (max|a-b|/max|b| <= 1e-5
for outputs, 1e-4 for gradients). This proves the kernels' arithmetic and indexing; it does not
prove anything about compiled GPU/Ascend code (races between atomics, TF32, lowering, speed).
If TRITON_INTERPRET=0 is set explicitly and CUDA is available, the same tests run compiled on
the GPU (never run so far).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
import triton  # noqa: E402  (the test extra installs it: a missing triton must fail, not skip)
tl = triton.language

import torch  # noqa: E402

import backends  # noqa: E402
from backends.base import TIME_BUCKET_DIVISOR, time_bucket_thresholds  # noqa: E402
from npu_ops import _triton_compat as compat  # noqa: E402
from npu_ops import triton_hstu as th  # noqa: E402
from npu_ops.testing import make_attention_case, run_attention  # noqa: E402

if compat.interpreted(th._hstu_fwd_kernel):
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # a test-ordering bug, not a missing dependency: fail loudly rather than skip
    raise RuntimeError("npu_ops.triton_hstu was imported (compiled mode) before this module set "
                       "TRITON_INTERPRET=1, and there is no GPU: set TRITON_INTERPRET=1 in the environment "
                       "or in tests/conftest.py before anything imports triton")

FWD_TOL = 1e-5
GRAD_TOL = 1e-4

# (lengths, max_len, b_cap, heads, dqk, dv)
LAYOUTS = {
    "mixed_empty_slots_at_end": ([3, 1, 8, 5], 8, 7, 2, 16, 32),
    "all_max_len": ([8, 8, 8], 8, None, 2, 16, 16),
    "all_len_1": ([1, 1, 1, 1], 8, None, 2, 32, 16),
    "batch_of_one": ([5], 8, 1, 2, 16, 32),
    "empty_in_middle": ([3, 0, 4, 0], 6, 6, 2, 16, 16),
    # several 16-wide tiles per sequence, non-power-of-two head dims (padded to 32 / 16)
    "multi_tile": ([20, 0, 33, 1, 16], 40, 6, 2, 20, 12),
}
BIASES = ("none", "pos", "time", "pos+time")
# small blocks so "multi_tile" has 3 tiles per sequence; both dq strategies
SMALL_ATOMIC = th.HstuTritonConfig(16, 16, 16, 16, dq_mode="atomic", programs_per_unit=1)
SMALL_SEPARATE = th.HstuTritonConfig(16, 16, 16, 16, dq_mode="separate", programs_per_unit=1)
MIXED_BLOCKS = th.HstuTritonConfig(32, 16, 16, 32, dq_mode="atomic", programs_per_unit=1)


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    scale = np.abs(ref).max(initial=0.0)
    diff = np.abs(a - ref).max(initial=0.0)
    return float(diff / scale) if scale > 0 else float(diff)


def _case(name, bias, seed=0, num_time_buckets=16):
    lengths, max_len, b_cap, heads, dqk, dv = LAYOUTS[name]
    case = make_attention_case(lengths, max_len=max_len, b_cap=b_cap, heads=heads, dqk=dqk, dv=dv,
                               bias="none" if bias == "none" else "pos+time", seed=seed,
                               num_time_buckets=num_time_buckets)
    # small, partly negative time gaps so the pairs spread over all buckets (make_attention_case's
    # gaps of up to 2e5 s all land in the last of 16 buckets)
    rng = np.random.default_rng(seed + 1)
    T, real = case.layout.t_cap, case.layout.num_tokens()
    ts = np.zeros(T, np.int32)
    query_ts = np.zeros(T, np.int32)
    offsets = np.asarray(case.layout.offsets)
    for b in range(case.layout.b_cap):
        s, e = int(offsets[b]), int(offsets[b + 1])
        ts[s:e] = 1_000_000 + np.cumsum(rng.integers(0, 9, e - s))
        query_ts[s:e] = ts[s:e] + rng.integers(-20, 40, e - s)
    ts[real:] = rng.integers(-10**6, 10**6, T - real)      # padding rows: garbage the kernel must ignore
    query_ts[real:] = rng.integers(-10**6, 10**6, T - real)
    return dataclasses.replace(case, ts=ts, query_ts=query_ts,
                               pos_w=case.pos_w if bias in ("pos", "pos+time") else None,
                               ts_w=case.ts_w if bias in ("time", "pos+time") else None)


def _run_triton(case, path="op", config=None, device=DEVICE):
    """Output and gradients of sum(out * cot) through the Triton kernels, as numpy float64."""
    t = lambda a, dt=torch.float32: torch.as_tensor(a).to(device=device, dtype=dt)  # noqa: E731
    leaves = {name: t(arr).requires_grad_() for name, arr in
              (("q", case.q), ("k", case.k), ("v", case.v), ("pos_w", case.pos_w), ("ts_w", case.ts_w))
              if arr is not None}
    args = (leaves["q"], leaves["k"], leaves["v"], t(case.layout.offsets, torch.int32), case.layout.max_len,
            case.norm_len, leaves.get("pos_w"), leaves.get("ts_w"), t(case.ts, torch.int32),
            t(case.query_ts, torch.int32))
    if path == "op":
        out = torch.ops.grf.hstu_attention(*args)
    else:
        out = th.hstu_attention_triton(*args, config=config)
    grads = torch.autograd.grad((out * t(case.cot)).sum(), list(leaves.values()))
    result = {"out": out.detach().cpu().double().numpy()}
    for name, g in zip(leaves, grads):
        result["d" + name] = g.detach().cpu().double().numpy()
    return result


def _reference(case):
    return run_attention(case, backends.get_backend("torch"))


def _assert_matches(got, ref, case):
    assert got.keys() == ref.keys()
    errs = {key: rel_err(got[key], ref[key]) for key in ref}
    bad = {key: e for key, e in errs.items() if e > (FWD_TOL if key == "out" else GRAD_TOL)}
    assert not bad, f"relative errors above tolerance: {bad} (all: {errs})"
    for key, value in ref.items():  # the comparison is not vacuous
        assert np.abs(value).max() > 1e-3, f"{key} is ~0: the case does not exercise it"
    T = case.layout.num_tokens()  # padding rows: exactly zero output and gradients
    for key in ("out", "dq", "dk", "dv"):
        assert not got[key][T:].any(), key


# ------------------------------------------------------------------------------ attention vs reference
@pytest.mark.slow
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_custom_op_matches_reference(layout, bias):
    case = _case(layout, bias)
    _assert_matches(_run_triton(case, "op"), _reference(case), case)


@pytest.mark.slow
@pytest.mark.parametrize("config", [SMALL_ATOMIC, SMALL_SEPARATE, MIXED_BLOCKS], ids=["atomic", "separate", "mixed"])
@pytest.mark.parametrize("bias", ["none", "pos+time"])
def test_autograd_function_multi_tile(config, bias):
    case = _case("multi_tile", bias, seed=3)
    _assert_matches(_run_triton(case, "function", config), _reference(case), case)


@pytest.mark.slow
def test_time_bucket_edges_end_to_end():
    """q = k = 0, v = identity, ts_w[k] = k/8: out[i, j] = SiLU(ts_w[bucket(query_ts_i - ts_j)]) / n, so a
    bucket off by one is a large error. K = 128: gaps on both sides of every threshold, both signs,
    up to the int32 extremes (sequences 0 and 1), and random int32 times whose differences wrap
    (sequence 2, wrapping as in the reference)."""
    K, L = 128, 64
    thr = time_bucket_thresholds(K).astype(np.int64)
    edges = np.unique(np.concatenate([thr - 1, thr, thr + 1, [0, 2**31 - 2, 2**31 - 1]]))
    edges = np.random.default_rng(7).permutation(edges[edges <= 2**31 - 1])
    big = 2**31 - 1
    ts = np.concatenate([np.full(L, -big), np.full(L, big), np.random.default_rng(8).integers(-big, big, L)])
    query_ts = np.concatenate([-big + edges[0::2][:L], big - edges[1::2][:L],
                               np.random.default_rng(9).integers(-big, big, L)])
    case = make_attention_case([L] * 3, max_len=L, heads=1, dqk=16, dv=L, num_time_buckets=K, t_cap=3 * L)
    eye = np.tile(np.eye(L)[:, None, :], (3, 1, 1))
    case = dataclasses.replace(case, q=np.zeros_like(case.q), k=np.zeros_like(case.k), v=eye,
                               ts=ts.astype(np.int32), query_ts=query_ts.astype(np.int32),
                               ts_w=np.arange(K + 1, dtype=np.float64) / 8)
    got, ref = _run_triton(case, "op"), _reference(case)
    assert rel_err(got["out"], ref["out"]) <= FWD_TOL
    assert rel_err(got["dts_w"], ref["dts_w"]) <= GRAD_TOL
    assert len(np.unique(np.round(ref["out"] * case.norm_len, 5))) > 60  # many distinct buckets used


# ------------------------------------------------------------------------------ the bucket function itself
@triton.jit
def _bucket_probe_kernel(GAP, THR, OUT, n, num_buckets, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gap = tl.load(GAP + offs, mask=mask, other=0)
    tl.store(OUT + offs, th._time_bucket(gap, THR, num_buckets), mask=mask)


@pytest.mark.parametrize("num_buckets", [0, 1, 16, 128])
def test_time_bucket_exact(num_buckets):
    thr = time_bucket_thresholds(num_buckets)
    t64 = thr.astype(np.int64)
    gaps = np.concatenate([np.arange(-300, 3000), t64 - 1, t64, t64 + 1, -t64, -(t64 - 1),
                           [2**31 - 1, 2**31 - 2, -(2**31 - 1), -(2**31), 10**6, 10**8, 10**9]])
    gaps = gaps[(gaps >= -(2**31)) & (gaps <= 2**31 - 1)].astype(np.int32)
    gap_t = torch.as_tensor(gaps, device=DEVICE)
    thr_t = torch.as_tensor(thr, device=DEVICE)
    # reference: exactly Backend.relative_bias (int32 abs, searchsorted side=right, clip)
    want = (torch.searchsorted(thr_t, torch.abs(gap_t), right=True) - 1).clamp(0, num_buckets)
    out = torch.empty_like(gap_t)
    BLOCK = 1024
    _bucket_probe_kernel[(triton.cdiv(len(gaps), BLOCK),)](gap_t, thr_t, out, len(gaps), num_buckets, BLOCK=BLOCK)
    np.testing.assert_array_equal(out.cpu().numpy(), want.cpu().numpy())


def test_bucket_divisor_matches_reference():
    assert th.TIME_BUCKET_DIVISOR == TIME_BUCKET_DIVISOR


# ------------------------------------------------------------------------------ custom op machinery
@pytest.mark.slow
@pytest.mark.parametrize("bias", ["none", "pos+time"])
def test_opcheck(bias):
    case = _case("mixed_empty_slots_at_end", bias)
    t = lambda a, dt=torch.float32: torch.as_tensor(a).to(device=DEVICE, dtype=dt)  # noqa: E731
    args = (t(case.q).requires_grad_(), t(case.k).requires_grad_(), t(case.v).requires_grad_(),
            t(case.layout.offsets, torch.int32), case.layout.max_len, case.norm_len,
            None if case.pos_w is None else t(case.pos_w).requires_grad_(),
            None if case.ts_w is None else t(case.ts_w).requires_grad_(),
            t(case.ts, torch.int32), t(case.query_ts, torch.int32))
    torch.library.opcheck(torch.ops.grf.hstu_attention.default, args)


def test_compiles_with_aot_autograd():
    """torch.compile (aot_eager: no inductor codegen on this CPU host) traces the op through its
    fake and autograd registrations, fwd + bwd, without graph breaks."""
    case = _case("empty_in_middle", "pos+time")
    ref = _reference(case)
    t = lambda a, dt=torch.float32: torch.as_tensor(a).to(device=DEVICE, dtype=dt)  # noqa: E731
    q, k, v, pos_w, ts_w = (t(a).requires_grad_() for a in (case.q, case.k, case.v, case.pos_w, case.ts_w))
    offsets, ts, qts = (t(a, torch.int32) for a in (case.layout.offsets, case.ts, case.query_ts))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v, pos_w, ts_w, cot):
        out = torch.ops.grf.hstu_attention(q, k, v, offsets, case.layout.max_len, case.norm_len, pos_w, ts_w,
                                           ts, qts)
        return (out * cot).sum(), out

    value, out = loss(q, k, v, pos_w, ts_w, t(case.cot))
    grads = torch.autograd.grad(value, [q, k, v, pos_w, ts_w])
    assert rel_err(out.detach().cpu().numpy(), ref["out"]) <= FWD_TOL
    for name, g in zip(["dq", "dk", "dv", "dpos_w", "dts_w"], grads):
        assert rel_err(g.cpu().numpy(), ref[name]) <= GRAD_TOL, name


def test_backend_adapter_signature():
    """TritonHstuAttention takes Backend.hstu_attention's arguments (layout + AttentionBias), and
    ``attend`` the registry's kernel signature."""
    case = _case("batch_of_one", "pos+time")
    B = backends.get_backend("torch", device=DEVICE)
    layout = B.asarray_tree(case.layout)
    a = {name: B.asarray(np.asarray(getattr(case, name), np.float32)) for name in ("q", "k", "v", "pos_w", "ts_w")}
    bias = B.AttentionBias(pos_w=a["pos_w"], ts_w=a["ts_w"], ts=B.asarray(case.ts), query_ts=B.asarray(case.query_ts))
    want = B.hstu_attention(a["q"], a["k"], a["v"], layout, case.norm_len, bias)
    for adapter in (th.TritonHstuAttention(), th.TritonHstuAttention(use_custom_op=False, config=SMALL_SEPARATE)):
        for out in (adapter(a["q"], a["k"], a["v"], layout, case.norm_len, bias),
                    adapter.attend(B, a["q"], a["k"], a["v"], layout, case.norm_len, bias)):
            assert rel_err(out.cpu().numpy(), want.cpu().numpy()) <= FWD_TOL


# ------------------------------------------------------------------------------ dtypes, edge cases, errors
def test_bf16_inputs_forward():
    """bf16 q/k/v (the interpreter upcasts before tl.dot, triton#11584) vs the fp32 reference on the
    bf16-rounded inputs; SiLU(s)/n is rounded to bf16 before the PV product, as on a GPU."""
    case = _case("mixed_empty_slots_at_end", "pos+time")
    rounded = dataclasses.replace(case, **{n: torch.as_tensor(getattr(case, n)).bfloat16().double().numpy()
                                           for n in ("q", "k", "v")})
    ref = _reference(rounded)["out"]
    t = lambda a, dt: torch.as_tensor(a).to(device=DEVICE, dtype=dt)  # noqa: E731
    out = th.hstu_attention_triton(t(case.q, torch.bfloat16), t(case.k, torch.bfloat16), t(case.v, torch.bfloat16),
                                   t(case.layout.offsets, torch.int32), case.layout.max_len, case.norm_len,
                                   t(case.pos_w, torch.float32), t(case.ts_w, torch.float32),
                                   t(case.ts, torch.int32), t(case.query_ts, torch.int32))
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float().cpu().numpy(), ref) <= 2e-2


def test_no_sequences_and_no_tokens():
    q = torch.randn(8, 2, 16, device=DEVICE)
    for offsets in ([0], [0, 0, 0]):
        out = th.hstu_attention_triton(q, q, q, torch.tensor(offsets, dtype=torch.int32, device=DEVICE), 4, 4)
        assert out.shape == (8, 2, 16) and not out.any()


def test_contract_violations_raise():
    q = torch.randn(6, 2, 16)
    offs = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="norm_len >= max_len"):
        th.hstu_attention_triton(q, q, q, offs, 8, 4, pos_w=torch.zeros(7))
    with pytest.raises(ValueError, match=r"pos_w must be \[2n-1\]"):
        th.hstu_attention_triton(q, q, q, offs, 4, 4, pos_w=torch.zeros(8))
    with pytest.raises(ValueError, match="needs ts and query_ts"):
        th.hstu_attention_triton(q, q, q, offs, 4, 4, ts_w=torch.zeros(3))
    with pytest.raises(ValueError, match="max_len"):
        th.hstu_attention_triton(q, q, q, offs, 2, 4)
    with pytest.raises(ValueError, match="powers of two"):
        th.HstuTritonConfig(fwd_block_m=24)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        compat.backend_kind("cpu", object())  # a compiled (non-interpreted) kernel and a CPU tensor


# ------------------------------------------------------------------------------ Ascend lowering (static)
_LOWERING_SCRIPT = r'''
import glob, os, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from npu_ops import triton_hstu as th

INT_PTRS = {"OFFSETS", "THR", "TS", "QTS"}
FLOAT_PTRS_16 = {"Q", "K", "V", "O", "DO", "DK", "DV"}

def lower(fn, consts, tag, dtype="fp32"):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.isupper():
            sig[p.name] = "*i32" if p.name in INT_PTRS else ("*" + dtype if p.name in FLOAT_PTRS_16 else "*fp32")
        else:
            sig[p.name] = "fp32" if p.name == "inv_n" else "i32"
    try:
        triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("npu", "Ascend910B2", 0))
    except Exception as exc:  # without CANN it stops after ttadapter (bishengir-compile / ASCEND_HOME_PATH)
        print(tag, "stopped:", type(exc).__name__, file=sys.stderr)
    found = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", fn.__name__ + ".ttadapter"))
    for path in found:
        os.rename(path, path + "." + tag)
    print(tag, "ttadapter" if found else "NO-ttadapter")

for bias in (False, True):
    for dtype in ("fp32", "bf16"):
        base = dict(TASKS_PER_PROGRAM=8, BLOCK_DQK=64, BLOCK_DV=64, HAS_POS=bias, HAS_TS=bias, UPCAST_DOT=False,
                    DOT_PRECISION="ieee")
        fwd = dict(base, NUM_M_TILES=4, NUM_N_TILES=4, BLOCK_M=64, BLOCK_N=64)
        bwd = dict(base, NUM_M_TILES=8, NUM_N_TILES=8, BLOCK_M=32, BLOCK_N=32)
        tag = f"bias{int(bias)}_{dtype}"
        lower(th._hstu_fwd_kernel, fwd, "fwd_" + tag, dtype)
        for atomic in (False, True):
            lower(th._hstu_bwd_dkdv_kernel, dict(bwd, POS_GRAD=bias, TS_GRAD=bias, ATOMIC_DQ=atomic),
                  f"dkdv_atomicdq{int(atomic)}_" + tag, dtype)
        lower(th._hstu_bwd_dq_kernel, bwd, "dq_" + tag, dtype)
'''


@pytest.mark.skipif(not compat.is_triton_ascend(),
                    reason="needs triton-ascend (a separate venv: it replaces triton), see npu_ops/README.md")
def test_ascend_lowering_static(tmp_path):
    """Provenance: ascend_lowering. triton-ascend's frontend + Ascend adapter passes (ttir -> ttadapter)
    accept every kernel variant; no CANN, so nothing past ttadapter (bishengir, UB size) is checked."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _LOWERING_SCRIPT, repo], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if "ttadapter" in line]
    assert len(lines) == 16 and all(line.endswith(" ttadapter") for line in lines), (proc.stdout, proc.stderr[-3000:])
