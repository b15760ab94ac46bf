"""The op registry (backends/ops.py): every registered implementation of every op, on every backend
of ``GRF_TEST_BACKENDS`` that runs it, against the op's reference in float64 (outputs and
gradients); one ``[ops]`` key per op, checked by name; configs written before ``[ops]`` migrated;
an implementation registered from outside the package selected by config and trained with."""
from __future__ import annotations

import os
import platform

import numpy as np
import pytest

from backends import BackendUnavailable, get_backend, ops
from gr_functional.cli import main
from gr_functional.config import build_config, config_to_toml
from gr_functional.configure import load_config
from gr_functional.errors import ConfigError

from .common import FWD_TOL, GRAD_TOL, backends_under_test, grads, make_layout, rel_err

REFERENCE = {op: "reference" for op in ops.OPS}
TINY = ["data.synthetic_users=60", "data.synthetic_items=100", "train.epochs=1", "train.batch_size=16",
        "model.max_len=16", "model.num_blocks=1", "model.embed_dim=8", "model.num_heads=1", "model.dqk=8",
        "model.dv=8", "eval.ks=[10, 50, 200]"]


def _oracle_backend():
    """Every op's reference, in float64 on torch: the oracle of every implementation."""
    return get_backend("torch", dtype="float64", ops=REFERENCE)


def _built(backend: str, op: str, name: str):
    try:
        return get_backend(backend, ops={op: name})
    except BackendUnavailable as exc:
        # only a missing device or vendor package may skip; CI's x86-64 machines build cpu_fused
        if name == "cpu_fused" and os.environ.get("GRF_CI") and platform.machine() == "x86_64":
            raise
        pytest.skip(f"{op}={name!r} on {backend}: {exc}")


def _pairs(op: str) -> list:
    return [pytest.param(b, name, id=f"{b}-{name}") for b in backends_under_test() for name in ops.impl_names(op, b)]


def _loss_inputs(rng, T=1300, N=300, R=9, D=6):
    """T > one 1,024-row chunk of torch's chunked formulations; ids with repeats; scales powers of
    two and items fp16 values, so that every formulation rounds the same real numbers to 16 bits."""
    ids = rng.integers(0, N, (T, R)).astype(np.int32)
    ids[:, 1] = ids[:, 0]
    return {"user": rng.standard_normal((T, D)).astype(np.float32),
            "items": rng.standard_normal((N, D)).astype(np.float16).astype(np.float32), "ids": ids,
            "scale": (2.0 ** rng.integers(-1, 3, T)).astype(np.float32),
            "cot": rng.standard_normal((T, R)).astype(np.float32)}


def _compare(B, op, inputs):
    """``op(B, a)`` (an array) on ``B`` vs the float64 oracle backend: the output, and the gradients
    of ``sum(op * cot)`` w.r.t. every float input."""
    ref = _oracle_backend()
    want = ref.to_numpy(op(ref, ref.asarray_tree(inputs)))
    got = B.to_numpy(op(B, B.asarray_tree(inputs)))
    assert rel_err(got, want) <= FWD_TOL

    def loss(B, a):
        return B.xp.sum(op(B, a) * a["cot"])

    g_ref, g = grads(ref, loss, inputs), grads(B, loss, inputs)
    for key, value in inputs.items():
        if np.issubdtype(np.asarray(value).dtype, np.floating) and key not in ("cot", "scale"):
            assert rel_err(g[key], g_ref[key]) <= GRAD_TOL, key


@pytest.mark.slow
@pytest.mark.parametrize("backend, name", _pairs("sampled_logits"))
@pytest.mark.parametrize("quantized", [None, "bf16", "fp16"])
def test_every_sampled_logits_implementation_vs_the_reference(backend, name, quantized):
    B = _built(backend, "sampled_logits", name)

    def op(B, a):
        if quantized is None:
            return B.sampled_logits(a["user"], a["items"], a["ids"])
        return B.sampled_logits_16bit(a["user"], a["items"], a["ids"], a["scale"], quantized)

    _compare(B, op, _loss_inputs(np.random.default_rng(3)))


@pytest.mark.slow
@pytest.mark.parametrize("backend, name", _pairs("shared_logsumexp"))
def test_every_shared_logsumexp_implementation_vs_the_reference(backend, name):
    B = _built(backend, "shared_logsumexp", name)
    rng = np.random.default_rng(4)
    T, R, D = 1300, 40, 6
    inputs = {"user": (rng.standard_normal((T, D)) / 2).astype(np.float32),
              "negs": rng.standard_normal((R, D)).astype(np.float32), "neg_ids": rng.integers(0, 25, R).astype(np.int32),
              "targets": rng.integers(0, 25, T).astype(np.int32), "pos": rng.standard_normal(T).astype(np.float32),
              "bias": rng.standard_normal(R).astype(np.float32), "cot": rng.standard_normal(T).astype(np.float32)}

    def op(B, a):
        return B.shared_logsumexp(a["user"], a["negs"], a["neg_ids"], a["targets"], a["pos"], a["bias"], 7.0, -5e4)

    _compare(B, op, inputs)


@pytest.mark.parametrize("backend, name", _pairs("ranking_attention"))
def test_every_ranking_attention_implementation_vs_the_reference(backend, name):
    B = _built(backend, "ranking_attention", name)
    rng = np.random.default_rng(5)
    layout = make_layout("mixed")
    T, H, d = layout.t_cap, 2, 4
    real = (np.arange(T) < layout.num_tokens())[:, None, None]
    inputs = {x: (rng.standard_normal((T, H, d)) * real).astype(np.float32) for x in ("q", "k", "v")}
    inputs["cot"] = rng.standard_normal((T, H, d)).astype(np.float32)
    targets = np.minimum(np.asarray(layout.lengths), 2).astype(np.int32)

    def op(B, a):
        return B.stu_attention(a["q"], a["k"], a["v"], B.asarray_tree(layout), B.asarray(targets), 17, 0.5)

    _compare(B, op, inputs)


def _row_cases() -> list:
    """(backend, implementation, optimizer) for the optimizers each implementation declares it serves."""
    return [pytest.param(*p.values, optimizer, id=f"{p.id}-{optimizer}") for p in _pairs("row_update")
            for optimizer in ("lazy_adam", "rowwise_adagrad")
            if ops.get_impl("row_update", p.values[1]).limits(
                build_config({"embedding": {"kind": "hash", "optimizer": optimizer}})) is None]


@pytest.mark.slow
@pytest.mark.parametrize("backend, name, optimizer", _row_cases())
def test_every_row_update_implementation_vs_the_reference(backend, name, optimizer):
    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt

    B = _built(backend, "row_update", name)
    rng = np.random.default_rng(6)
    U, D = 40, 8
    values, grad = rng.standard_normal((U, D)).astype(np.float32), rng.standard_normal((U, D)).astype(np.float32)
    state = ({"m": np.zeros((U, D), np.float32), "v": np.zeros((U, D), np.float32), "t": np.zeros((U, 1), np.float32)}
             if optimizer == "lazy_adam" else {"acc": rng.uniform(0, 1, U).astype(np.float32)})
    touched = rng.random(U) < 0.7
    optim = OptimConfig(lr=0.01, weight_decay=0.0)
    results = []
    for backend_ in (B, _oracle_backend()):
        a = backend_.asarray_tree({"v": values, "g": grad, "s": state})
        new, new_state = rowopt.row_update(backend_, optimizer, a["v"], a["g"], a["s"], backend_.asarray(touched),
                                           0.01, optim)
        results.append((backend_.to_numpy(new), backend_.to_numpy_tree(new_state)))
    assert rel_err(results[0][0], results[1][0]) <= FWD_TOL
    for key in results[1][1]:
        assert rel_err(results[0][1][key], results[1][1][key]) <= FWD_TOL, key


# ------------------------------------------------------------------------------ config
def test_one_key_per_op_checked_by_name():
    assert set(build_config({}).ops.__dataclass_fields__) == set(ops.OPS)
    with pytest.raises(ConfigError, match=r"--set ops.sampled_logits=fused: ops.sampled_logits='fused': .*did you "
                                          r"mean 'cpu_fused'"):
        load_config(None, ["ops.sampled_logits=fused"])
    with pytest.raises(ConfigError, match=r"implementation 'cpu_fused' does not run on the jax backend"):
        load_config(None, ["backend.name=jax", "ops.shared_logsumexp=cpu_fused"])
    with pytest.raises(ConfigError, match=r"implementation 'cpu_fused' does not support backend.precision='bf16'.*"
                                          r"that support it: 'reference', 'best'"):
        load_config(None, ["ops.sampled_logits=cpu_fused", "backend.precision=bf16"])
    with pytest.raises(ConfigError, match=r"'fbgemm' does not support embedding.optimizer='lazy_adam'"):
        load_config(None, ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "ops.row_update=fbgemm"])


@pytest.mark.parametrize("old, new", [("backend.hstu_kernel=tiled", "ops.attention"),
                                      ("backend.row_kernel=reference", "ops.row_update"),
                                      ("backend.cpu_fused=false", "ops.attention='jagged', ops.sampled_logits")])
def test_a_user_config_naming_a_moved_key_is_told_where_it_lives(old, new):
    with pytest.raises(ConfigError) as info:
        load_config(None, [old])
    assert str(info.value).startswith(f"--set {old}: ") and new in str(info.value)


def test_a_stored_config_from_before_ops_is_migrated(tmp_path):
    """OUT/config.toml written before [ops]: backend.hstu_kernel / row_kernel move, cpu_fused=false
    becomes the choices it meant (attention 'default' ran jagged then)."""
    text = config_to_toml(build_config({})).replace("[ops]", "[old_ops]")
    text = text[:text.index("[old_ops]")] + text[text.index("[dist]"):]
    old = text.replace('[backend]\n', '[backend]\nhstu_kernel = "default"\nrow_kernel = "reference"\ncpu_fused = false\n')
    (tmp_path / "config.toml").write_text(old)
    (tmp_path / "checkpoints").mkdir()  # a run's own record
    cfg = load_config(tmp_path / "config.toml")
    assert ops.choices(cfg) == {"attention": "jagged", "ranking_attention": "default", "sampled_logits": "reference",
                                "shared_logsumexp": "reference", "row_update": "reference"}
    kept = old.replace("cpu_fused = false", "cpu_fused = true").replace('hstu_kernel = "default"', 'hstu_kernel = "tiled"')
    (tmp_path / "config.toml").write_text(kept)
    assert ops.choices(load_config(tmp_path / "config.toml"))["attention"] == "tiled"
    assert ops.choices(load_config(tmp_path / "config.toml"))["sampled_logits"] == "default"


# ------------------------------------------------------------------------------ a user's implementation
CALLS = []


@pytest.fixture
def counted_logits():
    """A sampled-logits implementation registered as a user would: the reference, counted."""
    @ops.register("sampled_logits", "counted", backends=("torch",))
    def counted(B, user, items, ids, scale=None, precision=None):
        CALLS.append(1)
        return ops.get_impl("sampled_logits", "reference").factory(B)(B, user, items, ids, scale, precision)

    yield "counted"
    ops.unregister("sampled_logits", "counted")


def test_a_registered_implementation_trains_and_is_refused_where_it_does_not_run(counted_logits, tmp_path):
    CALLS.clear()
    out = tmp_path / "run"
    sets = [x for s in TINY + ["ops.sampled_logits=counted"] for x in ("--set", s)]
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(out), *sets]) == 0
    assert CALLS and 'sampled_logits = "counted"' in (out / "config.toml").read_text()
    with pytest.raises(ConfigError, match=r"implementation 'counted' does not run on the jax backend"):
        load_config(None, ["backend.name=jax", "ops.sampled_logits=counted"])
