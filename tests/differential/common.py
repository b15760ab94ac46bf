"""Cases, tolerances and error measures shared by the differential suite.

Error measure: ``rel_err(a, ref) = max|a - ref| / max|ref|`` (the infinity-norm relative error of
the whole tensor), which is what a per-layer table reports too (gr_functional.crosscheck).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends.kernels import register_kernel
from gr_functional.jagged import Jagged

from ..conftest import test_backend_names

FWD_TOL = 1e-6      # fp32 forward, relative
GRAD_TOL = 1e-5     # fp32 gradients, relative
TRAJ_TOL = 1e-4     # fp32 loss after a 50-step trajectory, relative

MAX_LEN = 12

# name -> (lengths, b_cap): lengths 1 and max_len, mixed, batch of 1, empty slots (also in the middle)
LAYOUT_CASES = {
    "len1": ([1, 1, 1, 1], None),
    "maxlen": ([MAX_LEN] * 3, None),
    "mixed": ([3, MAX_LEN, 1, 7, 5, 2], None),
    "single": ([9], None),
    "empty_slots": ([4, 0, 6, 0, 1], 8),
}


def rel_err(a, ref) -> float:
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max(initial=0.0)
    diff = np.abs(a - ref).max(initial=0.0)
    return float(diff / scale) if scale > 0 else float(diff)


def finite_grads(B, fn, params, state, batch, what: str, tries: int = 16):
    """``(loss, tokens, {path: grad})`` of ``fn = train.micro_grads`` at the first loss scale,
    halved from ``state``'s as the dynamic scaler would after an fp16 overflow, whose gradients
    are all finite; they must be fp32 (master gradients)."""
    import pytest

    from gr_functional.tree import tree_items

    for _ in range(tries):
        loss, tokens, grads = fn(params, state, batch)
        grads = dict(tree_items(B.to_numpy_tree(grads)))
        if all(np.isfinite(g).all() for g in grads.values()):
            assert all(g.dtype == np.float32 for g in grads.values())
            return loss, tokens, grads
        if "loss_scale" not in state:
            break
        state["loss_scale"]["scale"] = state["loss_scale"]["scale"] * 0.5
    pytest.fail(f"gradients are not finite: {what}")


def tree_cosine(a: dict, b: dict) -> float:
    """Cosine between two flat ``{path: array}`` trees (all leaves concatenated, float64)."""
    x = np.concatenate([np.ravel(a[k]) for k in sorted(a)]).astype(np.float64)
    y = np.concatenate([np.ravel(b[k]) for k in sorted(b)]).astype(np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def make_layout(case: str, max_len: int = MAX_LEN) -> Jagged:
    lengths, b_cap = LAYOUT_CASES[case]
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    return Jagged.from_sequences(seqs, max_len=max_len, b_cap=b_cap)


# ------------------------------------------------------------------ backends and kernels under test
# The reference backend of model-level comparisons (DESIGN: JAX is the numerical reference); every
# other backend of GRF_TEST_BACKENDS is compared with it. Kernel ops' gradients are compared with
# the padded reference kernel in float64 (REFERENCE_GRADS), whatever the backend under test.
REFERENCE_BACKEND = "jax"


def backends_under_test() -> list[str]:
    """``GRF_TEST_BACKENDS`` (default jax,torch)."""
    return test_backend_names()


def compared_backends() -> list[str]:
    """The backends of ``GRF_TEST_BACKENDS`` compared with ``REFERENCE_BACKEND`` (all but it)."""
    return [b for b in backends_under_test() if b != REFERENCE_BACKEND]


def reference_grad_backend():
    """The gradient oracle of kernel ops: the reference ops (backends/base.py) in float64 on
    torch: every op of the registry its "reference" (padded attention)."""
    from backends import get_backend, ops

    return get_backend("torch", dtype="float64", ops={op: "reference" for op in ops.OPS})


def kernel_pairs(all_backends: bool = False) -> list[tuple[str, str]]:
    """``(backend, kernel)`` for every registered attention kernel and every backend of
    ``GRF_TEST_BACKENDS`` it runs on (``all_backends``: every registered backend, e.g. npu)."""
    from backends import backend_names, kernels

    names = backends_under_test()
    if all_backends:
        names = names + [b for b in backend_names() if b not in names]
    return [(b, k) for k in kernels.kernel_names() for b in names if kernels.get_kernel(k).runs_on(b)]


def kernel_params(all_backends: bool = False) -> list:
    return [pytest.param(b, k, id=f"{b}-{k}") for b, k in kernel_pairs(all_backends)]


def kernel_backend(backend: str, kernel: str, **options):
    """``get_backend(backend, ops={"attention": kernel}, **options)``, or ``pytest.skip`` with the reason
    it cannot run here: the backend is not under test or unavailable (no Ascend NPU), the kernel's
    hardware or package is missing (BackendUnavailable), or it declares it does not support these
    options (ConfigError naming the option)."""
    from backends import BackendUnavailable, backend_status, get_backend
    from gr_functional.errors import ConfigError

    if backend not in backends_under_test():
        ok, reason = backend_status(backend)
        pytest.skip(f"backend {backend!r} is not in GRF_TEST_BACKENDS" + ("" if ok else f"; here: {reason}"))
    try:
        return get_backend(backend, ops={"attention": kernel}, **options)
    except (BackendUnavailable, ConfigError) as exc:
        pytest.skip(f"kernel {kernel!r} on {backend}: {exc}")


def grads(B, f, inputs):
    """Gradients of ``f(B, a)`` (a scalar; ``a`` = ``inputs`` on B) w.r.t. the float leaves of
    ``inputs``, as numpy."""
    args = B.asarray_tree(inputs)
    _, g = B.value_and_grad(lambda a: f(B, a))(args)
    return B.to_numpy_tree(g)


def attention_inputs(case, rng, heads=2, dqk=4, dv=3, with_bias=True, norm_len=17):
    """``(layout, inputs, norm_len)``: random q, k, v (zero on padding rows), times, and the bias
    tables pos_w[2n-1], ts_w[129] when ``with_bias``, on layout case ``case``."""
    layout = make_layout(case)
    T = layout.t_cap
    real = layout.num_tokens()
    mask = (np.arange(T) < real)[:, None, None]
    q = (rng.standard_normal((T, heads, dqk)) * mask).astype(np.float32)
    k = (rng.standard_normal((T, heads, dqk)) * mask).astype(np.float32)
    v = (rng.standard_normal((T, heads, dv)) * mask).astype(np.float32)
    ts = np.zeros(T, np.int32)
    ts[:real] = rng.integers(0, 10**7, real)
    query_ts = np.zeros(T, np.int32)
    query_ts[:real] = ts[:real] + rng.integers(0, 10**5, real)
    inputs = {"q": q, "k": k, "v": v, "ts": ts, "query_ts": query_ts}
    if with_bias:
        inputs["pos_w"] = rng.standard_normal(2 * norm_len - 1).astype(np.float32)
        inputs["ts_w"] = rng.standard_normal(129).astype(np.float32)
    return layout, inputs, norm_len


def attention_bias(B, a):
    """The ``AttentionBias`` of an ``attention_inputs`` dict already on backend B."""
    return B.AttentionBias(pos_w=a.get("pos_w"), ts_w=a.get("ts_w"), ts=a["ts"], query_ts=a["query_ts"])


ATTENTION_TILE = 4  # the tile plan every kernel case carries (kernels that use tiles run several per sequence)


def check_attention_kernel(B, case: str, with_bias: bool, seed: int = 1234) -> None:
    """The attention kernel of backend B on layout ``case``: output vs the float64 numpy oracle
    (FWD_TOL) and the gradients of q, k, v (and pos_w, ts_w) vs the padded reference kernel in
    float64 (GRAD_TOL). The layout carries a tile plan, so tile-using kernels run tiles."""
    from . import oracle

    layout, inputs, n = attention_inputs(case, np.random.default_rng(seed), with_bias=with_bias)
    inputs["layout"] = layout.with_tiles(ATTENTION_TILE)
    inputs["cot"] = np.random.default_rng(seed + 1).standard_normal(inputs["v"].shape).astype(np.float32)

    a = B.asarray_tree(inputs)
    out = B.to_numpy(B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a)))
    f64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items() if k != "layout"}
    want = oracle.hstu_attention(f64["q"], f64["k"], f64["v"], layout.offsets, n, f64.get("pos_w"),
                                 f64.get("ts_w"), inputs["ts"], inputs["query_ts"])
    assert rel_err(out, want) <= FWD_TOL, f"{B.hstu_kernel} forward"

    def loss(B, a):
        out = B.hstu_attention(a["q"], a["k"], a["v"], a["layout"], n, attention_bias(B, a))
        return B.xp.sum(out * a["cot"])

    got, ref = grads(B, loss, inputs), grads(reference_grad_backend(), loss, inputs)
    keys = ("q", "k", "v", "pos_w", "ts_w") if with_bias else ("q", "k", "v")
    for key in keys:
        assert np.abs(ref[key]).max() > 0, f"{key}: the case does not exercise it"
        assert rel_err(got[key], ref[key]) <= GRAD_TOL, f"{B.hstu_kernel} d{key}"


# Tests only: RecSDK's mxrec adapter (npu_ops/mxrec_hstu.py) on the torch backend, over the FAKE
# of torch.ops.mxrec.hstu_jagged written from its documentation (npu_ops/fakes), registered like
# any kernel so the suite runs the adapter and the registry's dense-bias path on CPU. The fake
# accepts float64 and any head size; the real kernel's limits are checked by "mxrec" itself.
def _fake_mxrec_factory(B):
    import npu_ops
    from npu_ops.fakes.fake_mxrec import fake_mxrec_ops
    from npu_ops.mxrec_hstu import HSTU_JAGGED_LIMITS

    limits = dataclasses.replace(HSTU_JAGGED_LIMITS, dtypes=HSTU_JAGGED_LIMITS.dtypes + ("float64",),
                                 head_dim=(1, 512), head_dim_multiple=1)
    return npu_ops.mxrec_hstu_attention(fake_mxrec_ops(), limits=limits).attend


register_kernel("mxrec_fake", factory=_fake_mxrec_factory, backends=("torch",), devices=("cpu",),
                doc="tests only: the mxrec adapter over the documented-semantics fake of hstu_jagged")
