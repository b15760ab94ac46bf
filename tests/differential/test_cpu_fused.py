"""The fused CPU tile attention (backends/cpu_fused, ``ops.attention = "cpu_fused"``).

test_ops.py already runs it (and "best") on every layout case against the float64 oracle at fp32
tolerances. Here: float64 to float64 rounding (so an indexing slip cannot hide under fp32
noise), tiles from 1 to max_len and each bias term alone, rows read through strides (the uvqk
slices), bitwise reproducible runs, and "best" choosing it where it runs and "jagged" elsewhere.
"""
from __future__ import annotations

import dataclasses
import os
import platform

import numpy as np
import pytest

import backends.cpu_fused as cpu_fused
from backends import BackendUnavailable, get_backend
from backends.cpu_fused import OFF as UNFUSED, xla
from npu_ops import UnsupportedOnBackend

from . import oracle
from .common import MAX_LEN, attention_bias, attention_inputs, grads, rel_err


def _fused_backend(dtype="float32"):
    try:
        return get_backend("torch", dtype=dtype, ops={"attention": "cpu_fused"})
    except BackendUnavailable as exc:  # no compiler / not x86-64 AVX2: the reason is the message
        if os.environ.get("GRF_CI") and platform.machine() == "x86_64":
            raise  # CI's machines can build it (.ci/run installs a compiler): never skip there
        pytest.skip(str(exc))


def _inputs(case, bias, seed=7):
    layout, inputs, n = attention_inputs(case, np.random.default_rng(seed), heads=3, dqk=5, dv=4,
                                         with_bias=bias != "none")
    if bias == "pos":
        inputs.pop("ts_w")
    if bias == "time":
        inputs.pop("pos_w")
    inputs = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    inputs["cot"] = np.random.default_rng(seed + 1).standard_normal(inputs["v"].shape)
    return layout, inputs, n


@pytest.mark.slow
@pytest.mark.parametrize("tile", [1, 4, 5, MAX_LEN])
@pytest.mark.parametrize("bias", ["none", "pos", "time", "both"])
@pytest.mark.parametrize("case", ["mixed", "empty_slots", "maxlen"])
def test_float64_output_and_gradients_vs_oracle(case, bias, tile):
    B = _fused_backend("float64")
    ref = get_backend("torch", dtype="float64", ops={"attention": "reference"})
    layout, inputs, n = _inputs(case, bias)
    inputs["layout"] = layout.with_tiles(tile)
    a = B.asarray_tree(inputs)
    out = B.to_numpy(B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a)))
    want = oracle.hstu_attention(inputs["q"], inputs["k"], inputs["v"], layout.offsets, n, inputs.get("pos_w"),
                                 inputs.get("ts_w"), inputs["ts"], inputs["query_ts"])
    assert rel_err(out, want) <= 1e-13

    def loss(B, a):
        return B.xp.sum(B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a)) * a["cot"])

    got, expected = grads(B, loss, inputs), grads(ref, loss, inputs)
    keys = ["q", "k", "v"] + [key for key in ("pos_w", "ts_w") if key in inputs]
    for key in keys:
        assert np.abs(expected[key]).max() > 0, key
        assert rel_err(got[key], expected[key]) <= 1e-12, key


def test_strided_rows_and_reproducible_runs():
    """q, k, v as column slices of one [T, 3*H*d] product (what hstu_uvqk hands over) give the same
    bits as contiguous copies, and two runs give the same bits (the tasks' schedule varies)."""
    import torch

    B = _fused_backend()
    layout, inputs, n = attention_inputs("mixed", np.random.default_rng(3), heads=2, dqk=4, dv=4)
    a = B.asarray_tree(dict(inputs, layout=layout.with_tiles(3)))
    bias = attention_bias(B, a)
    T = a["q"].shape[0]
    packed = torch.cat([a["q"], a["k"], a["v"]], dim=1).reshape(T, -1)
    q, k, v = (packed[:, i * 8:(i + 1) * 8].reshape(T, 2, 4) for i in range(3))
    assert not q.is_contiguous()

    def run(q, k, v):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, a["pos_w"], a["ts_w"])]
        b = dataclasses.replace(bias, pos_w=leaves[3], ts_w=leaves[4])
        out = B.hstu_attention(*leaves[:3], a["layout"], n, b)
        return [out.detach()] + list(torch.autograd.grad((out * out).sum(), leaves))

    first = run(q, k, v)
    for again in (run(q, k, v), run(q.contiguous(), k.contiguous(), v.contiguous())):
        for x, y in zip(first, again):
            assert torch.equal(x, y)


def test_best_runs_fused_on_cpu_fp32_and_jagged_otherwise(monkeypatch):
    """"best" (the torch default) calls the fused kernel on tile plans in fp32, the jagged one
    under a 16-bit precision view or without a plan."""
    _fused_backend()  # skips where the extension cannot be built
    calls = []
    real = cpu_fused.attention
    monkeypatch.setattr(cpu_fused, "attention", lambda *args: calls.append(1) or real(*args))
    B = get_backend("torch")
    assert B.hstu_kernel == "best"
    layout, inputs, n = attention_inputs("mixed", np.random.default_rng(5))
    for tiles, view, fused in ((True, B, True), (False, B, False), (True, B.with_precision("bf16"), False)):
        calls.clear()
        lay = layout.with_tiles(4) if tiles else layout
        a = view.asarray_tree(dict(inputs, layout=lay))
        q, k, v = (view.cast(a[x], "bfloat16") if view is not B else a[x] for x in ("q", "k", "v"))
        view.hstu_attention(q, k, v, a["layout"], n, attention_bias(view, a))
        assert bool(calls) == fused, (tiles, view)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n_items", [20, 5000])  # the chunked op's dense and row-gather formulations
def test_sampled_logits_vs_oracle_and_the_chunked_op(dtype, n_items):
    """``TorchBackend.sampled_logits`` on CPU runs the fused op: output vs the float64 dot, and
    output and both gradients vs the chunked torch Function (``cpu_fused.OFF``), run
    twice to the same bits; ids as int32 with repeats (one id's gradient sums many positions)."""
    import torch

    fused = _fused_backend(dtype)
    chunked = get_backend("torch", dtype=dtype, ops=UNFUSED)
    rng = np.random.default_rng(11)
    T, R, D = 1500, 7, 6  # T > one 1,024-row chunk of the chunked op
    user = rng.standard_normal((T, D))
    items = rng.standard_normal((n_items, D))
    ids = rng.integers(0, min(n_items, 40), (T, R)).astype(np.int32)
    cot = rng.standard_normal((T, R))
    want = np.einsum("td,trd->tr", user, items[ids])
    tol = 1e-13 if dtype == "float64" else 1e-6

    def run(B):
        u, it = (B.asarray(x.astype(dtype)).requires_grad_(True) for x in (user, items))
        out = B.sampled_logits(u, it, B.asarray(ids))
        return [out.detach()] + list(torch.autograd.grad(out, [u, it], B.asarray(cot.astype(dtype))))

    first, again, reference = run(fused), run(fused), run(chunked)
    assert rel_err(fused.to_numpy(first[0]), want) <= tol
    for x, y, z in zip(first, again, reference):
        assert torch.equal(x, y)
        assert rel_err(x.numpy(), z.numpy()) <= 10 * tol


def test_sampled_logits_fused_op_is_the_one_running(monkeypatch):
    """On CPU in fp32 the backend calls the fused op; with ``cpu_fused.OFF``, under a bf16 view
    or off the CPU it does not."""
    _fused_backend()
    calls = []
    real = cpu_fused.sampled_logits
    monkeypatch.setattr(cpu_fused, "sampled_logits", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(2)
    user, items = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((9, 4)).astype(np.float32)
    ids = rng.integers(0, 9, (5, 3)).astype(np.int32)
    on, off = get_backend("torch"), get_backend("torch", ops=UNFUSED)
    for B, cast, used in ((on, None, True), (off, None, False), (on.with_precision("bf16"), "bfloat16", False)):
        calls.clear()
        u, it = B.asarray(user), B.asarray(items)
        if cast:
            u, it = B.cast(u, cast), B.cast(it, cast)
        B.sampled_logits(u, it, B.asarray(ids))
        assert bool(calls) == used


def test_sampled_logits_fused_op_refuses_ids_out_of_range():
    import torch

    _fused_backend()
    with pytest.raises(RuntimeError, match=r"ids must be in \[0, 9\)"):
        cpu_fused.sampled_logits(torch.zeros(2, 3), torch.zeros(9, 3), torch.tensor([[0, 9], [1, 2]]))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_sampled_logits_round_exactly_as_the_oracle(precision, monkeypatch):
    """The fused 16-bit op (fp32 on CPU) rounds every value as ml_dtypes does, to the bit: one-hot
    users make each logit one rounded value; magnitudes over 12 decades reach fp16's subnormals
    and its flush to zero. Gradients equal the chunked op's (cpu_fused off)."""
    import torch

    from backends import cpu_fused

    B = _fused_backend()
    calls = []
    real = cpu_fused.sampled_logits_16bit
    monkeypatch.setattr(cpu_fused, "sampled_logits_16bit", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(5)
    T, N, R, D = 300, 40, 9, 13  # D: one 8-wide F16C block and a scalar tail
    items = (rng.choice([-1, 1], (N, D)) * 10.0 ** rng.uniform(-12, 0, (N, D))).astype(np.float32)
    ids = rng.integers(0, N, (T, R)).astype(np.int32)
    scale = rng.uniform(0.5, 3, T).astype(np.float32)
    hot = rng.integers(0, D, T)
    user = np.eye(D, dtype=np.float32)[hot]
    got = B.to_numpy(B.sampled_logits_16bit(*(B.asarray(a) for a in (user, items, ids, scale)), precision))
    assert calls
    divided = (items[ids] / scale[:, None, None]).astype(np.float32)            # fp32 division, as the op
    rows = oracle.round_16bit(divided, np.float32(1), precision).astype(np.float32) * scale[:, None, None]
    np.testing.assert_array_equal(got, rows[np.arange(T), :, hot])
    if precision == "fp16":  # below fp16's smallest subnormal: zero (bf16 keeps fp32's range)
        assert (got == 0).any() and (got != 0).any()

    user = rng.standard_normal((T, D)).astype(np.float32)
    cot = rng.standard_normal((T, R)).astype(np.float32)

    def run(backend):
        u, it = (torch.tensor(x, requires_grad=True) for x in (user, items))
        out = backend.sampled_logits_16bit(u, it, torch.tensor(ids), torch.tensor(scale), precision)
        return [out.detach()] + list(torch.autograd.grad(out, [u, it], torch.tensor(cot)))

    fused, again, chunked = run(B), run(B), run(get_backend("torch", ops=UNFUSED))
    for x, y, z in zip(fused, again, chunked):
        assert torch.equal(x, y)
        assert rel_err(x.numpy(), z.numpy()) <= 1e-6


# one row; blocks of 128 with a remainder; more rows than 16 groups' worth; a pool whose partial
# sums would pass the op's 64 MB over 11 blocks of rows (8 groups in fp32, 4 in float64)
@pytest.mark.slow
@pytest.mark.parametrize("T, R, D", [(1, 37, 6), (130, 37, 6), (2100, 37, 6), (1400, 2048, 1024)])
def test_shared_logsumexp_float64_vs_oracle_and_bitwise_repeatable(T, R, D, monkeypatch):
    """The fused shared-pool logsumexp in float64 against a float64 numpy oracle (logits, mask on
    accidental hits and padding ids, bias, logsumexp with the positive; all four gradients by the
    softmax's closed form) to 1e-12, and in fp32 the same bits on 1 and 2 threads."""
    import torch

    from backends import cpu_fused

    B = _fused_backend("float64")
    calls = []
    real = cpu_fused.shared_logsumexp
    monkeypatch.setattr(cpu_fused, "shared_logsumexp", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(T)
    scale, masked = 7.0, -5e4
    user, negs = rng.standard_normal((T, D)) / 2, rng.standard_normal((R, D)) / np.sqrt(D)
    neg_ids, targets = rng.integers(0, 25, R), rng.integers(0, 25, T)
    pos, bias, cot = rng.standard_normal(T) * 3, rng.standard_normal(R), rng.standard_normal(T)
    hit = (neg_ids[None, :] == targets[:, None]) | (neg_ids[None, :] == 0)
    logits = np.where(hit, masked, scale * user @ negs.T - bias)
    full = np.concatenate([pos[:, None], logits], axis=1)
    m = full.max(axis=1, keepdims=True)
    want = (m + np.log(np.exp(full - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(full - want[:, None]) * cot[:, None]
    gp = np.where(hit, 0.0, p[:, 1:])
    want_grads = [scale * gp @ negs, scale * gp.T @ user, p[:, 0], -gp.sum(axis=0)]

    def run(dtype, threads=None):
        x = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in (user, negs, pos, bias)]
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            lse = B.shared_logsumexp(x[0], x[1], torch.tensor(neg_ids), torch.tensor(targets), x[2], x[3], scale,
                                     masked)
            return [lse.detach()] + list(torch.autograd.grad(lse, x, torch.tensor(cot, dtype=dtype)))
        finally:
            torch.set_num_threads(before)

    got = run(torch.float64)
    assert calls
    assert rel_err(got[0].numpy(), want) <= 1e-12
    for g, w in zip(got[1:], want_grads):
        assert rel_err(g.numpy(), w) <= 1e-12
    one, two = run(torch.float32, 1), run(torch.float32, 2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_shared_logsumexp_with_an_empty_pool_or_zero_width():
    """R = 0 (lse = pos) and D = 0: BLAS refuses the zero leading dimensions of an empty product,
    so the op must not call it; every gradient is defined (zeros where nothing contributes)."""
    import torch

    from backends import cpu_fused

    _fused_backend()
    for T, R, D in ((5, 0, 4), (5, 3, 0), (0, 3, 4)):
        x = [torch.randn(T, D, requires_grad=True), torch.randn(R, D, requires_grad=True),
             torch.randn(T, requires_grad=True), torch.randn(R, requires_grad=True)]
        lse = cpu_fused.shared_logsumexp(x[0], x[1], torch.arange(1, R + 1), torch.zeros(T, dtype=torch.long),
                                         x[2], x[3], 3.0, -5e4)
        want = torch.logsumexp(torch.cat([x[2].detach()[:, None], (-x[3].detach())[None, :].expand(T, R)], 1), 1)
        assert torch.allclose(lse.detach(), want, atol=1e-6)
        grads = torch.autograd.grad(lse.sum(), x, allow_unused=True)
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        if R == 0:
            assert torch.equal(grads[0], torch.zeros(T, D)) and torch.equal(grads[2], torch.ones(T))


def test_blas_is_bound_from_torchs_library_and_checked():
    """sgemm_/dgemm_ come from libtorch_cpu's handle (not whichever BLAS the process loaded first)
    and pass a product check; "" or a missing path falls back to the process' global scope."""
    from backends import cpu_fused

    _fused_backend()
    module = cpu_fused.load()
    assert cpu_fused._torch_library().endswith("libtorch_cpu.so")
    assert module.bind_blas("") == ""
    assert module.bind_blas("/nonexistent/libtorch_cpu.so") == ""
    assert module.bind_blas(cpu_fused._torch_library()) == ""
    assert module.blas_threads_pinned()  # MKL's per-thread count: BLAS single-threaded in the ops


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's lock file, on which every later build would wait."""
    from torch.utils import cpp_extension

    from backends import cpu_fused

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(cpp_extension._get_build_directory(cpu_fused._NAME, verbose=False), "lock")
    open(lock, "w").close()
    cpu_fused._remove_stale_lock(cpp_extension)
    assert os.path.exists(lock)  # a build may be running
    os.utime(lock, (0, os.path.getmtime(lock) - cpu_fused._STALE_LOCK_S - 60))
    with pytest.warns(UserWarning, match="did not finish"):
        cpu_fused._remove_stale_lock(cpp_extension)
    assert not os.path.exists(lock)


def test_a_fresh_lock_that_replaced_the_stale_one_is_kept(tmp_path, monkeypatch):
    """Two processes find the same stale lock; the first removes it and starts a build (a fresh
    lock) while the second waits for its turn: the second must judge the lock again and keep it."""
    import fcntl

    from torch.utils import cpp_extension

    from backends import cpu_fused

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(cpp_extension._get_build_directory(cpu_fused._NAME, verbose=False), "lock")
    open(lock, "w").close()
    os.utime(lock, (0, os.path.getmtime(lock) - cpu_fused._STALE_LOCK_S - 60))
    real_flock = fcntl.flock

    def other_process_went_first(fd, op):
        os.remove(lock)
        open(lock, "w").close()  # its build's lock, fresh
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", other_process_went_first)
    cpu_fused._remove_stale_lock(cpp_extension)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert os.path.exists(lock)


# ----------------------------------------------------------------------------- the XLA FFI front (JAX)
def _jax_fused(ops):
    """The jax backend with ``ops``, its custom calls built (else skipped with the reason, never on CI)."""
    try:
        xla.load()
        return get_backend("jax", ops=ops)
    except (BackendUnavailable, UnsupportedOnBackend) as exc:
        if os.environ.get("GRF_CI") and platform.machine() == "x86_64":
            raise  # CI's machines can build it: never skip there
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("tile", [1, 5])
@pytest.mark.parametrize("bias", ["none", "pos", "time", "both"])
@pytest.mark.parametrize("case", ["mixed", "empty_slots"])
def test_jax_custom_call_gives_the_torch_extensions_bits(case, bias, tile):
    """The attention as an XLA FFI custom call under jit (JAX's cpu_fused) and as the torch
    extension (torch's): one kernels.h, so the output and every gradient are the same bits."""
    J = _jax_fused({"attention": "cpu_fused"})
    T = _fused_backend()
    layout, inputs, n = _inputs(case, bias)
    inputs = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in inputs.items()}
    inputs["layout"] = layout.with_tiles(tile)

    def loss(B, a):
        return B.xp.sum(B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a)) * a["cot"])

    def out(B):
        a = B.asarray_tree(inputs)
        return B.to_numpy(B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a)))

    np.testing.assert_array_equal(out(J), out(T))
    got, want = grads(J, loss, inputs), grads(T, loss, inputs)
    for key in ["q", "k", "v"] + [key for key in ("pos_w", "ts_w") if key in inputs]:
        assert np.abs(want[key]).max() > 0, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("precision", [None, "fp16", "bf16"])
def test_jax_sampled_logits_custom_call_gives_the_torch_extensions_bits(precision):
    """The sampled logits (16-bit negatives too) as XLA FFI custom calls: the torch extension's bits,
    outputs and both gradients, with repeated ids and more positions than one task takes."""
    J = _jax_fused({"sampled_logits": "cpu_fused"})
    T = get_backend("torch", ops={"sampled_logits": "cpu_fused"})
    rng = np.random.default_rng(11)
    n_pos, N, R, D = 300, 40, 6, 8
    inputs = {"user": rng.standard_normal((n_pos, D)).astype(np.float32),
              "items": (rng.standard_normal((N, D)) * 5).astype(np.float32),
              "ids": rng.integers(0, N, (n_pos, R)).astype(np.int32),
              "scale": (2.0 ** rng.integers(1, 4, n_pos)).astype(np.float32),
              "cot": rng.standard_normal((n_pos, R)).astype(np.float32)}
    inputs["ids"][:, 1] = inputs["ids"][:, 0]

    def logits(B, a):
        if precision is None:
            return B.sampled_logits(a["user"], a["items"], a["ids"])
        return B.sampled_logits_16bit(a["user"], a["items"], a["ids"], a["scale"], precision)

    np.testing.assert_array_equal(*(B.to_numpy(logits(B, B.asarray_tree(inputs))) for B in (J, T)))
    got, want = (grads(B, lambda B, a: B.xp.sum(logits(B, a) * a["cot"]), inputs) for B in (J, T))
    for key in ("user", "items"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_jax_custom_call_refuses_ids_out_of_range_by_name():
    """A kernel's check inside a custom call comes back as JAX's error with the kernel's message."""
    J = _jax_fused({"sampled_logits": "cpu_fused"})
    ids = J.asarray(np.array([[0, 9], [1, 2]], dtype=np.int32))
    with pytest.raises(Exception, match=r"ids must be in \[0, 9\)"):
        J.to_numpy(J.sampled_logits(J.asarray(np.zeros((2, 3), np.float32)), J.asarray(np.zeros((9, 3), np.float32)),
                                    ids))


@pytest.mark.parametrize("backend_name", ["torch", "jax"])
def test_best_sampled_logits_leave_wide_negatives_to_the_dense_product(backend_name, monkeypatch):
    """"best" runs the per-id fused dots while the catalogue has ``sampled_per_id_min_ratio`` rows
    per negative or more, the backend's dense formulation (its "reference") once the negatives
    are too many: the same logits either way."""
    B = _fused_backend() if backend_name == "torch" else _jax_fused({})
    front = cpu_fused.ops_for(B)
    calls = []
    real = front.sampled_logits
    monkeypatch.setattr(front, "sampled_logits", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(5)
    N, ratio = 40, B.sampled_per_id_min_ratio
    user, items = rng.standard_normal((7, 4)).astype(np.float32), rng.standard_normal((N, 4)).astype(np.float32)
    for R, fused in ((int(N / ratio), True), (int(N / ratio) + 1, False)):
        calls.clear()
        ids = rng.integers(0, N, (7, R)).astype(np.int32)
        got = B.to_numpy(B.sampled_logits(B.asarray(user), B.asarray(items), B.asarray(ids)))
        assert bool(calls) == fused, R
        assert rel_err(got, np.einsum("td,trd->tr", user, items[ids])) <= 1e-6


@pytest.mark.slow
def test_jax_without_the_custom_calls_runs_xlas_formulations_and_says_why(monkeypatch):
    """Where the XLA FFI library cannot be built (no compiler, no AVX2), JAX's "best" warns once
    with the reason and runs XLA's own tiles and sampled logits (the same results as "jagged" /
    "reference"); asking for "cpu_fused" by name is refused with the reason."""
    monkeypatch.setattr(xla, "_STATE", {"error": "cpu_fused ops for JAX: no C++ compiler ('c++' not on "
                                                           "PATH; set CXX or install g++) to build it"})
    monkeypatch.setitem(cpu_fused._BUILT, ("warned", xla.__name__), False)
    with pytest.warns(UserWarning, match=r"no C\+\+ compiler .* the backend's own formulations run instead"):
        B = get_backend("jax")
    with pytest.raises(BackendUnavailable, match=r"ops.attention='cpu_fused' cannot run here: .*no C\+\+ compiler"):
        get_backend("jax", ops={"attention": "cpu_fused"})
    layout, inputs, n = attention_inputs("mixed", np.random.default_rng(4), heads=2, dqk=4, dv=4)
    inputs["layout"] = layout.with_tiles(4)
    jagged = get_backend("jax", ops={"attention": "jagged"})
    outs = []
    for X in (B, jagged):
        a = X.asarray_tree(inputs)
        outs.append(X.to_numpy(X.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(X, a))))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_jax_library_build_waits_for_a_live_builder_then_names_its_lock(tmp_path):
    """A process holding the build's turn (a live build) is waited for, at most ``wait_s``; then
    the error names the lock file. A lock file left by a dead process holds no ``flock``: no wait."""
    import fcntl

    path = str(tmp_path / "grf_xla_ffi_test.so")
    with open(path + ".lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # this open file description holds it, as another process would
        with pytest.raises(RuntimeError, match=r"waited 0 s for another process building the library \(.*\.lock is"):
            xla._build(path, wait_s=0.3)
    open(path, "w").close()  # "built": with the lock file left behind and no holder, _build returns at once
    xla._build(path, wait_s=0.3)
