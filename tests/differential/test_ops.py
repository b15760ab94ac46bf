"""Every kernel op: each backend of GRF_TEST_BACKENDS vs the float64 numpy oracle (forward) and vs
the reference ops in float64 (gradients); every registered attention kernel on every backend that
implements it, outputs and gradients vs the padded reference."""
from __future__ import annotations

import numpy as np
import pytest

from backends import BackendUnavailable, get_backend, ops
from backends.cpu_fused import OFF as UNFUSED
from backends.base import Backend, time_bucket_thresholds
from gr_functional.errors import ConfigError

from . import oracle
from .common import (FWD_TOL, GRAD_TOL, LAYOUT_CASES, attention_bias, attention_inputs, backends_under_test,
                     check_attention_kernel, grads, kernel_backend, kernel_params, reference_grad_backend,
                     rel_err)


def test_kernel_op_list_is_covered():
    # shared_logsumexp: through the shared_pool / in_batch losses vs their float64 oracle on every
    # backend (test_losses.py) and torch's chunked form vs the reference (below)
    tested = {"silu", "layer_norm", "l2_normalize", "logsumexp", "gather_rows", "segment_sum",
              "sampled_logits_reference", "sampled_logits_16bit_reference", "shared_logsumexp_reference",
              "relative_bias", "hstu_uvqk", "hstu_norm_mul", "add_head_bias"}
    assert set(Backend.KERNEL_OPS) == tested
    # the registry's ops: every implementation vs the reference in test_op_registry.py and
    # (attention) test_attention_kernel_vs_padded_reference below
    assert set(ops.OPS) == {"attention", "ranking_attention", "sampled_logits", "shared_logsumexp", "row_update"}


def _assert_grads_agree(f, inputs):
    """Gradients of ``f(B, a)`` on every backend under test vs the reference ops in float64."""
    ref = grads(reference_grad_backend(), f, inputs)
    for name in backends_under_test():
        got = grads(get_backend(name), f, inputs)
        for key in inputs:
            if np.issubdtype(np.asarray(inputs[key]).dtype, np.floating):
                assert rel_err(got[key], ref[key]) <= GRAD_TOL, (name, key)


@pytest.mark.slow
def test_elementwise_ops_vs_oracle(backend, rng):
    x = rng.standard_normal((7, 5)).astype(np.float32) * 3
    x[2] = 0.0  # zero row: l2_normalize must stay finite
    x64 = x.astype(np.float64)
    B, X = backend, backend.asarray(x)
    assert rel_err(B.to_numpy(B.silu(X)), oracle.silu(x64)) <= FWD_TOL
    assert rel_err(B.to_numpy(B.layer_norm(X, 1e-6)), oracle.layer_norm(x64)) <= FWD_TOL
    assert rel_err(B.to_numpy(B.l2_normalize(X, 1e-6)), oracle.l2_normalize(x64)) <= FWD_TOL
    assert rel_err(B.to_numpy(B.logsumexp(X, axis=1)), oracle.logsumexp(x64, axis=1)) <= FWD_TOL
    assert rel_err(B.to_numpy(B.hstu_norm_mul(X, X * 2, 1e-6)), 2 * x64 * oracle.layer_norm(x64)) <= FWD_TOL


@pytest.mark.slow
def test_elementwise_ops_grads(rng):
    x = (rng.standard_normal((7, 5)) * 3).astype(np.float32)
    x[2] = 0.0
    cot = rng.standard_normal((7, 5)).astype(np.float32)

    def f(B, a):
        xp = B.xp
        y = B.silu(a["x"]) + B.layer_norm(a["x"]) + B.l2_normalize(a["x"]) + B.hstu_norm_mul(a["x"], a["x"])
        return xp.sum(y * a["cot"]) + xp.sum(B.logsumexp(a["x"], axis=1))

    _assert_grads_agree(f, {"x": x, "cot": cot})


def test_gather_and_segment_sum(backend, rng):
    table = rng.standard_normal((10, 3)).astype(np.float32)
    idx = rng.integers(0, 10, (4, 5)).astype(np.int32)
    got = backend.to_numpy(backend.gather_rows(backend.asarray(table), backend.asarray(idx)))
    np.testing.assert_array_equal(got, table[idx])
    data = rng.standard_normal((9, 2)).astype(np.float32)
    seg = np.array([0, 0, 2, 2, 2, 5, 1, 6, -1], dtype=np.int32)  # 6 and -1 are out of range: dropped
    got = backend.to_numpy(backend.segment_sum(backend.asarray(data), backend.asarray(seg), 6))
    assert rel_err(got, oracle.segment_sum(data.astype(np.float64), seg, 6)) <= FWD_TOL


def test_gather_and_segment_sum_grads(rng):
    inputs = {"table": rng.standard_normal((10, 3)).astype(np.float32),
              "idx": rng.integers(0, 10, (13,)).astype(np.int32),     # duplicates accumulate
              "seg": np.array([0, 1, 1, 3, 3, 3, 0, 2, 2, 1, 0, 3, 3], dtype=np.int32),
              "cot": rng.standard_normal((4, 3)).astype(np.float32)}

    def f(B, a):
        rows = B.gather_rows(a["table"], a["idx"])
        return B.xp.sum(B.segment_sum(rows * rows, a["seg"], 4) * a["cot"])

    _assert_grads_agree(f, inputs)


def test_time_bucket_thresholds_match_float64_log():
    thr = time_bucket_thresholds(128)
    gaps = np.concatenate([np.arange(0, 5000), thr.astype(np.int64) - 1, thr.astype(np.int64),
                           np.array([10**6, 10**8, 2**31 - 2])])
    gaps = gaps[(gaps >= 0) & (gaps < 2**31 - 1)]
    got = np.clip(np.searchsorted(thr, np.maximum(gaps, 1), side="right") - 1, 0, 128)
    want = np.array([oracle.time_bucket(g, 128) for g in gaps])
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("num_buckets", [1, 2, 16, 128])
def test_backend_time_buckets_are_the_thresholds_rule(backend, num_buckets):
    """``Backend.time_buckets`` (JAX: a float estimate corrected by comparison) gives exactly the
    thresholds' searchsorted buckets: at every threshold and its neighbours (repeated thresholds
    included: 2 starts buckets 1 and 2, int32's maximum ends the table), zero, and random gaps."""
    thr = time_bucket_thresholds(num_buckets).astype(np.int64)
    near = (thr[:, None] + np.arange(-2, 3)[None, :]).ravel()
    random = np.random.default_rng(0).integers(0, 2**31 - 1, 20000)
    gaps = np.clip(np.concatenate([near, random, np.arange(0, 3000), [0, 2**31 - 2, 2**31 - 1]]), 0, 2**31 - 1)
    gaps = gaps.astype(np.int32).reshape(-1, 1)  # any shape
    want = np.clip(np.searchsorted(thr, gaps, side="right") - 1, 0, num_buckets)
    got = backend.to_numpy(backend.time_buckets(backend.asarray(gaps), num_buckets))
    assert got.dtype == np.int32 and got.shape == gaps.shape
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ attention kernels (registry)
@pytest.mark.slow
@pytest.mark.parametrize("backend_name, kernel", kernel_params())
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_attention_kernel_vs_padded_reference(backend_name, kernel, case, with_bias):
    """Every registered kernel (backends/kernels.py) on every backend of GRF_TEST_BACKENDS that
    implements it: output vs the float64 oracle, all gradients vs the float64 padded reference."""
    check_attention_kernel(kernel_backend(backend_name, kernel), case, with_bias)


@pytest.mark.parametrize("backend_name, kernel", kernel_params(all_backends=True))
def test_every_registered_kernel_builds_or_says_why(backend_name, kernel):
    """A kernel either builds on its backend here or is refused with the reason (no GPU, no
    Ascend NPU, a missing package): never another error."""
    if backend_name in backends_under_test():
        try:
            B = get_backend(backend_name, ops={"attention": kernel})
        except (BackendUnavailable, ConfigError) as exc:
            pytest.skip(f"kernel {kernel!r} on {backend_name}: {exc}")
        assert B.hstu_kernel == kernel
    else:
        kernel_backend(backend_name, kernel)  # skips, with the backend's reason when it is unavailable


def test_relative_bias_vs_oracle(backend, rng):
    layout, inputs, n = attention_inputs("mixed", rng)
    B = backend
    a = B.asarray_tree(inputs)
    bias = B.to_numpy(B.relative_bias(B.asarray_tree(layout), n, attention_bias(B, a)))
    f64 = {k: v.astype(np.float64) for k, v in inputs.items() if k in ("pos_w", "ts_w")}
    for b, (s, e) in enumerate(zip(layout.offsets[:-1], layout.offsets[1:])):
        want = oracle.relative_bias_seq(e - s, n, f64["pos_w"], f64["ts_w"], inputs["ts"][s:e],
                                        inputs["query_ts"][s:e])
        assert rel_err(bias[b, : e - s, : e - s], want) <= FWD_TOL


def test_hstu_uvqk_vs_oracle_and_grads(backend, rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 14)) * 0.3).astype(np.float32)
    splits = (3, 3, 4, 4)
    got = backend.hstu_uvqk(backend.asarray(x), backend.asarray(w), splits)
    want = oracle.silu(x.astype(np.float64) @ w.astype(np.float64))
    for part, (lo, hi) in zip(got, [(0, 3), (3, 6), (6, 10), (10, 14)]):
        assert rel_err(backend.to_numpy(part), want[:, lo:hi]) <= FWD_TOL
    cot = rng.standard_normal((6, 14)).astype(np.float32)

    def f(B, a):
        return B.xp.sum(B.xp.concat(B.hstu_uvqk(a["x"], a["w"], splits), axis=1) * a["cot"])

    _assert_grads_agree(f, {"x": x, "w": w, "cot": cot})


def test_add_head_bias_vs_oracle_and_grads(backend, rng):
    scores = rng.standard_normal((3, 4, 5, 5)).astype(np.float32)
    bias = rng.standard_normal((4, 5, 5)).astype(np.float32)
    got = backend.to_numpy(backend.add_head_bias(backend.asarray(scores), backend.asarray(bias)))
    assert rel_err(got, scores.astype(np.float64) + bias) <= FWD_TOL
    cot = rng.standard_normal((3, 4, 5, 5)).astype(np.float32)
    _assert_grads_agree(lambda B, a: B.xp.sum(B.add_head_bias(a["scores"], a["bias"]) * a["cot"]),
                        {"scores": scores, "bias": bias, "cot": cot})


@pytest.mark.parametrize("n_items", [20, 5000])  # dense-matmul and row-gather formulations
def test_sampled_logits_vs_oracle_and_grads(backend, rng, n_items):
    user = rng.standard_normal((9, 6)).astype(np.float32)
    items = rng.standard_normal((n_items, 6)).astype(np.float32)
    ids = rng.integers(0, n_items, (9, 4)).astype(np.int32)
    got = backend.to_numpy(backend.sampled_logits(*(backend.asarray(a) for a in (user, items, ids))))
    want = np.einsum("td,trd->tr", user.astype(np.float64), items.astype(np.float64)[ids])
    assert rel_err(got, want) <= FWD_TOL
    cot = rng.standard_normal((9, 4)).astype(np.float32)
    _assert_grads_agree(lambda B, a: B.xp.sum(B.sampled_logits(a["user"], a["items"], a["ids"]) * a["cot"]),
                        {"user": user, "items": items, "ids": ids, "cot": cot})


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_sampled_logits_16bit_vs_oracle_and_grads(backend, rng, precision):
    """Negatives read as 16-bit values with a per-position scale: vs the float64 dot of rows
    rounded by the oracle (ml_dtypes), and visibly not the fp32 logits; gradients (straight
    through to ``items``, none to ``scale``) vs the reference ops in float64."""
    T, N, R, D = 9, 50, 4, 6
    user = rng.standard_normal((T, D)).astype(np.float32)
    items = (rng.standard_normal((N, D)) * 7).astype(np.float32)
    ids = rng.integers(0, N, (T, R)).astype(np.int32)
    ids[:, 1] = ids[:, 0]
    scale = (2.0 ** rng.integers(2, 5, T)).astype(np.float32)  # powers of two: the division is exact
    args = (backend.asarray(a) for a in (user, items, ids, scale))
    got = backend.to_numpy(backend.sampled_logits_16bit(*args, precision))
    rows = oracle.round_16bit(items[ids], scale[:, None, None], precision)
    want = np.einsum("td,trd->tr", user.astype(np.float64), rows)
    assert rel_err(got, want) <= FWD_TOL
    exact = np.einsum("td,trd->tr", user.astype(np.float64), items.astype(np.float64)[ids])
    assert rel_err(got, exact) > 1e-5                                   # it did round
    cot = rng.standard_normal((T, R)).astype(np.float32)
    _assert_grads_agree(lambda B, a: B.xp.sum(B.sampled_logits_16bit(a["user"], a["items"], a["ids"], a["scale"],
                                                                      precision) * a["cot"]),
                        {"user": user, "items": items, "ids": ids, "scale": scale, "cot": cot})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_stu_attention_vs_oracle_and_grads(backend, rng, case):
    """dlrm_v3's target-aware attention (candidates see the history and themselves, not each
    other; nothing sees a candidate): vs a per-pair float64 oracle, with 0 to 3 candidates per
    sequence (0: plain causal), and gradients vs the reference ops in float64."""
    layout, inputs, n = attention_inputs(case, rng, with_bias=False)
    lengths = np.asarray(layout.lengths)
    targets = np.minimum(np.arange(len(lengths)) % 4, lengths).astype(np.int32)
    alpha = 0.7
    a = backend.asarray_tree({k: inputs[k] for k in ("q", "k", "v")})
    out = backend.stu_attention(a["q"], a["k"], a["v"], backend.asarray_tree(layout), backend.asarray(targets), n,
                                alpha)
    f64 = {k: inputs[k].astype(np.float64) for k in ("q", "k", "v")}
    want = oracle.stu_attention(f64["q"], f64["k"], f64["v"], np.asarray(layout.offsets), targets, n, alpha)
    assert rel_err(backend.to_numpy(out), want) <= FWD_TOL
    cot = rng.standard_normal(inputs["v"].shape).astype(np.float32)

    def f(B, x):
        return B.xp.sum(B.stu_attention(x["q"], x["k"], x["v"], x["layout"], x["targets"], n, alpha) * x["cot"])

    _assert_grads_agree(f, {"q": inputs["q"], "k": inputs["k"], "v": inputs["v"], "layout": layout,
                            "targets": targets, "cot": cot})


# ------------------------------------------------------------------ jagged (tiled) attention
# Tiles of 1 (every pair one cell), 5 (chunks that do not divide any length), 4 and MAX_LEN (one
# chunk per sequence, the padded case without padding).
TILES = [1, 4, 5, 12]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("tile", TILES)
def test_hstu_attention_tiled_vs_oracle(backend, rng, case, tile):
    layout, inputs, n = attention_inputs(case, rng)
    lay = backend.asarray_tree(layout.with_tiles(tile))
    a = backend.asarray_tree(inputs)
    out = backend.hstu_attention_tiled(a["q"], a["k"], a["v"], lay, n, attention_bias(backend, a))
    f64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    want = oracle.hstu_attention(f64["q"], f64["k"], f64["v"], layout.offsets, n, f64["pos_w"],
                                 f64["ts_w"], inputs["ts"], inputs["query_ts"])
    assert rel_err(backend.to_numpy(out), want) <= FWD_TOL


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("tile", [1, 5])
def test_hstu_attention_tiled_grads_vs_padded(rng, case, tile):
    """Gradients of the tiled op at several tile sizes, on every backend under test: vs the
    padded reference in float64 and vs the backend's own padded op."""
    layout, inputs, n = attention_inputs(case, rng)
    inputs["cot"] = rng.standard_normal(inputs["v"].shape).astype(np.float32)
    inputs["layout"] = layout.with_tiles(tile)

    def loss(op):
        def f(B, a):
            out = getattr(B, op)(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a))
            return B.xp.sum(out * a["cot"])
        return f

    ref = grads(reference_grad_backend(), loss("hstu_attention_padded"), inputs)
    for name in backends_under_test():
        B = get_backend(name)
        tiled, padded = grads(B, loss("hstu_attention_tiled"), inputs), grads(B, loss("hstu_attention_padded"), inputs)
        for key in ("q", "k", "v", "pos_w", "ts_w"):
            assert rel_err(tiled[key], ref[key]) <= GRAD_TOL, (name, key)
            assert rel_err(tiled[key], padded[key]) <= GRAD_TOL, (name, key)


def test_hstu_attention_dispatches_on_kernel_and_plan(rng):
    """"tiled" runs the tiles whenever there is a plan, "reference" never, "jagged" where the
    plan saves at least ``jagged_min_work_ratio`` of the padded score cells (static shapes)."""
    layout, inputs, n = attention_inputs("mixed", rng)      # b_cap 6 x max_len 12^2 = 864 cells
    fine, coarse = layout.with_tiles(1), layout.with_tiles(12)  # 192 x 1 and 8 x 144 cells (capacities)
    calls = []
    for kernel in ("jagged", "tiled", "reference"):
        B = get_backend("torch", ops={"attention": kernel})
        B.jagged_min_work_ratio = 2.0
        B.hstu_attention_tiled = lambda *a, **k: calls.append((kernel, "tiled"))
        B.hstu_attention_padded = lambda *a, **k: calls.append((kernel, "padded"))
        for lay in (layout, fine, coarse):
            B.hstu_attention(None, None, None, lay, n)
    assert calls == [("jagged", "padded"), ("jagged", "tiled"), ("jagged", "padded"),
                     ("tiled", "padded"), ("tiled", "tiled"), ("tiled", "tiled"),
                     ("reference", "padded"), ("reference", "padded"), ("reference", "padded")]
    assert get_backend("torch").jagged_min_work_ratio == 2.0    # CPU crossover (README "Speed")


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["torch", "jax"])
@pytest.mark.parametrize("n_items", [300, 5000])  # dense (N <= 64 R) and gather formulations
def test_chunked_sampled_logits_matches_reference_across_chunks(rng, n_items, backend_name):
    """torch's row-chunked autograd.Function and JAX's blocked custom-gradient op vs the reference
    formulation (Backend.sampled_logits_reference) on the same backend: several chunks and a partial one,
    repeated ids within a row, fp32 and bf16, outputs and gradients."""
    import importlib

    from backends.base import Backend

    B = get_backend(backend_name)
    chunk_rows = importlib.import_module(f"backends.{backend_name}").SAMPLED_LOGITS_CHUNK_ROWS
    T, N, R, D = 2 * chunk_rows + 37, n_items, 16, 8
    user = rng.standard_normal((T, D)).astype(np.float32)
    items = rng.standard_normal((N, D)).astype(np.float32)
    ids = rng.integers(0, N, (T, R)).astype(np.int32)
    ids[:, 1] = ids[:, 0]                                  # duplicates accumulate in backward
    cot = rng.standard_normal((T, R)).astype(np.float32)
    reference_ids = (lambda x: x.long()) if backend_name == "torch" else (lambda x: x)  # torch gathers want int64
    for dtype, tol in (("float32", FWD_TOL), ("bfloat16", 2e-2)):
        outs, grads = [], []
        for op in (B.sampled_logits, lambda u, i, x: Backend.sampled_logits_reference(B, u, i, reference_ids(x))):
            def loss(p, op=op):
                out = B.cast(op(p["user"], p["items"], B.asarray(ids)), "float32")
                return B.xp.sum(out * B.asarray(cot)), out

            params = {"user": B.cast(B.asarray(user), dtype), "items": B.cast(B.asarray(items), dtype)}
            (_, out), g = B.value_and_grad(loss, has_aux=True)(params)
            outs.append(B.to_numpy(out))
            grads.append(tuple(B.to_numpy(B.cast(g[key], "float32")) for key in ("user", "items")))
        assert rel_err(outs[0], outs[1]) <= tol
        assert rel_err(grads[0][0], grads[1][0]) <= tol
        assert rel_err(grads[0][1], grads[1][1]) <= (GRAD_TOL if dtype == "float32" else tol)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("cpu_fused", [False, True])
def test_torch_chunked_sampled_logits_16bit_matches_reference_across_chunks(rng, precision, cpu_fused):
    """torch's row-chunked 16-bit op (cpu_fused off; with it on, fp32 runs the fused C++ op and bf16
    inputs the chunked one) vs the reference formulation (Backend.sampled_logits_16bit_reference) over
    several chunks, repeated ids, fp32 and bf16 inputs: outputs and gradients."""
    import torch

    from backends import torch as torch_backend

    B = get_backend("torch", ops=None if cpu_fused else UNFUSED)
    T, N, R, D = 2 * torch_backend.SAMPLED_LOGITS_CHUNK_ROWS + 37, 5000, 16, 8
    user = rng.standard_normal((T, D)).astype(np.float32)
    items = (rng.standard_normal((N, D)) * 3).astype(np.float32)
    ids = rng.integers(0, N, (T, R)).astype(np.int32)
    ids[:, 1] = ids[:, 0]
    scale = rng.uniform(5, 20, T).astype(np.float32)
    cot = rng.standard_normal((T, R)).astype(np.float32)
    for dtype, tol in ((torch.float32, FWD_TOL), (torch.bfloat16, 2e-2)):
        outs, grads = [], []
        for op in (B.sampled_logits_16bit, lambda *a: Backend.sampled_logits_16bit_reference(B, *a)):
            u = torch.tensor(user, dtype=dtype, requires_grad=True)
            it = torch.tensor(items, dtype=dtype, requires_grad=True)
            out = op(u, it, torch.tensor(ids).long(), torch.tensor(scale), precision)
            (out.float() * torch.tensor(cot)).sum().backward()
            outs.append(out.float().detach().numpy())
            grads.append((u.grad.float().numpy(), it.grad.float().numpy()))
        assert rel_err(outs[0], outs[1]) <= tol
        assert rel_err(grads[0][0], grads[1][0]) <= tol
        assert rel_err(grads[0][1], grads[1][1]) <= (GRAD_TOL if dtype == torch.float32 else tol)


@pytest.mark.parametrize("cpu_fused", [False, True])
def test_torch_chunked_shared_logsumexp_matches_reference_across_chunks(rng, cpu_fused):
    """The shared-negatives logsumexp (shared_pool / in_batch losses): torch's row-chunked op
    (cpu_fused off; on, fp32 runs the fused C++ op, bf16 the chunked one) vs the reference
    formulation (Backend.shared_logsumexp_reference) over several chunks, with accidental hits, padding
    negatives and a bias, fp32 and bf16; outputs and all four gradients."""
    import torch

    from backends import torch as torch_backend
    from backends.base import Backend

    B = get_backend("torch", ops=None if cpu_fused else UNFUSED)
    T, R, D, scale = 2 * torch_backend.SAMPLED_LOGITS_CHUNK_ROWS + 37, 48, 8, 20.0
    user = (rng.standard_normal((T, D)) / np.sqrt(D)).astype(np.float32)
    negs = (rng.standard_normal((R, D)) / np.sqrt(D)).astype(np.float32)
    neg_ids = rng.integers(0, 30, R).astype(np.int32)       # repeats, zeros (padding)
    targets = rng.integers(0, 30, T).astype(np.int32)       # hits on many rows
    pos = rng.standard_normal(T).astype(np.float32) * 5
    bias = rng.standard_normal(R).astype(np.float32)
    cot = rng.standard_normal(T).astype(np.float32)
    for dtype, tol in ((torch.float32, FWD_TOL), (torch.bfloat16, 2e-2)):
        outs, grads = [], []
        # the reference in fp32 on the same (rounded) inputs: the chunked op accumulates in fp32
        for op, op_dtype in ((B.shared_logsumexp, dtype), (lambda *a: Backend.shared_logsumexp_reference(B, *a), torch.float32)):
            x = [torch.tensor(a, dtype=dtype).to(op_dtype).requires_grad_() for a in (user, negs, pos, bias)]
            out = op(x[0], x[1], torch.tensor(neg_ids), torch.tensor(targets), x[2], x[3], scale, -5e4)
            (out.float() * torch.tensor(cot)).sum().backward()
            outs.append(out.float().detach().numpy())
            grads.append([t.grad.float().numpy() for t in x])
        assert rel_err(outs[0], outs[1]) <= tol
        for mine, ref in zip(*grads):
            assert rel_err(mine, ref) <= (GRAD_TOL if dtype == torch.float32 else tol)
