"""The optimizer transforms (gr_functional/optimizers) on both backends against three oracles:
``optim.adamw_update`` (bitwise: AdamW must not change by moving), a float64 numpy implementation
of each optimizer, and optax on JAX; plus the combinators' contracts (chain, partition, masked,
apply_if_finite, accumulation, loss scaling), the schedules and the registry."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import optax
import pytest

from backends import get_backend
from gr_functional import optimizers as O
from gr_functional.config import Config, OptimConfig
from gr_functional.embedding import rowopt
from gr_functional.errors import ConfigError
from .optim_oracle import adamw_init, adamw_update, learning_rate
from gr_functional.tree import tree_items, tree_map

from .common import FWD_TOL, rel_err
from .test_optim import _optax_schedule

STEPS = 10
BASE = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.05, momentum=0.9,
                   initial_accumulator=0.1)
SCHEDULES = {
    "constant": BASE,
    "warmup-constant": dataclasses.replace(BASE, warmup_steps=4),
    "warmup-cosine": dataclasses.replace(BASE, schedule="cosine", warmup_steps=3, decay_steps=6, end_lr_factor=0.1),
    "cosine": dataclasses.replace(BASE, schedule="cosine", decay_steps=5),
    "warmup-linear": dataclasses.replace(BASE, schedule="linear", warmup_steps=2, decay_steps=4, end_lr_factor=0.25),
}


def _problem(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)

    def tree():
        return {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)],
                "c": {"d": rng.standard_normal((2, 2)).astype(np.float32)}}

    return tree(), [tree() for _ in range(steps)]


def _flat(B, tree):
    return {k: B.to_numpy(v) for k, v in tree_items(tree)}


def _assert_bitwise(B, got, want, what=""):
    got, want = _flat(B, got), _flat(B, want)
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), (what, k)


def _run(B, tx, params, grads):
    """``(params, state)`` after one ``tx`` update per gradient (numpy trees in, backend trees out)."""
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    for g in grads:
        updates, state = tx.update(B, B.asarray_tree(g), state, p)
        p = O.apply_updates(B, p, updates)
    return p, state


# ----------------------------------------------------------------------------- AdamW == optim.adamw_update, bitwise
@pytest.mark.slow
@pytest.mark.parametrize("cfg", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_adamw_is_bitwise_optim_adamw_update(backend, cfg):
    B = backend
    params, grads = _problem(1)
    p = B.asarray_tree(params)
    s = adamw_init(B, p)
    for g in grads:
        p, s = adamw_update(B, B.asarray_tree(g), s, p, cfg)
    q, t = _run(B, O.build(B, cfg), params, grads)
    _assert_bitwise(B, q, p, "params")
    assert list(t) == ["step", "mu", "nu"]          # checkpoints store opt.step, opt.mu.*, opt.nu.*
    _assert_bitwise(B, t, s, "state")
    assert t["step"].dtype == B.float_dtype and t["step"].shape == ()


def test_adamw_is_bitwise_under_jit():
    B = get_backend("jax")
    cfg = SCHEDULES["warmup-cosine"]
    params, grads = _problem(2, steps=4)
    tx = O.build(B, cfg)
    ref = B.jit(lambda g, s, p: adamw_update(B, g, s, p, cfg))

    def step(g, s, p):
        u, s = tx.update(B, g, s, p)
        return O.apply_updates(B, p, u), s

    ours = B.jit(step)
    p = q = B.asarray_tree(params)
    s, t = adamw_init(B, p), tx.init(B, q)
    for g in grads:
        g = B.asarray_tree(g)
        p, s = ref(g, s, p)
        q, t = ours(g, t, q)
    _assert_bitwise(B, q, p)
    _assert_bitwise(B, t, s)


# ----------------------------------------------------------------------------- float64 numpy oracles
def _np_lr(cfg: OptimConfig, t: int) -> float:
    """The schedule, written independently in float64."""
    W, D, lr = cfg.warmup_steps, cfg.decay_steps, cfg.lr
    if W and t < W:
        return lr * t / W
    if cfg.schedule == "constant":
        return lr
    p = min(max((t - W) / D, 0.0), 1.0)
    end = lr * cfg.end_lr_factor
    shape = (1.0 + math.cos(math.pi * p)) / 2.0 if cfg.schedule == "cosine" else 1.0 - p
    return end + (lr - end) * shape


def _np_optimizer(name: str, cfg: OptimConfig, params: dict, grads: list) -> dict:
    """Each optimizer's textbook (optax) update in float64 numpy, per flattened leaf."""
    p = {k: v.astype(np.float64) for k, v in tree_items(params)}
    s1 = {k: np.full_like(v, cfg.initial_accumulator if name == "adagrad" else 0.0) for k, v in p.items()}
    s2 = {k: np.zeros_like(v) for k, v in p.items()}
    b1, b2, eps, wd = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay
    for t, g_tree in enumerate(grads, start=1):
        lr = _np_lr(cfg, t)
        for k, g in tree_items(g_tree):
            g = g.astype(np.float64)
            if name == "adamw":
                s1[k] = b1 * s1[k] + (1 - b1) * g
                s2[k] = b2 * s2[k] + (1 - b2) * g * g
                d = (s1[k] / (1 - b1 ** t)) / (np.sqrt(s2[k] / (1 - b2 ** t)) + eps)
            elif name == "adagrad":
                s1[k] = s1[k] + g * g
                d = np.where(s1[k] > 0, 1.0 / np.sqrt(s1[k] + eps), 0.0) * g
            elif name in ("sgd", "sgd_nesterov"):
                s1[k] = g + cfg.momentum * s1[k]
                d = g + cfg.momentum * s1[k] if name == "sgd_nesterov" else s1[k]
            elif name == "lion":
                d = np.sign((1 - b1) * g + b1 * s1[k])
                s1[k] = (1 - b2) * g + b2 * s1[k]
            p[k] = p[k] - lr * (d + wd * p[k])
    return p


CASES = {"adamw": "adamw", "adagrad": "adagrad", "sgd": "sgd", "sgd_nesterov": "sgd", "lion": "lion"}


def _cfg(case: str, schedule: str = "warmup-cosine", **kw) -> OptimConfig:
    lr = 3e-3 if case == "lion" else SCHEDULES[schedule].lr    # Lion wants a smaller lr
    return dataclasses.replace(SCHEDULES[schedule], name=CASES[case], nesterov=case == "sgd_nesterov", lr=lr, **kw)


def test_every_shipped_optimizer_is_tested():
    assert set(O.names()) <= set(CASES.values())


@pytest.mark.parametrize("case", CASES)
def test_optimizer_matches_float64_oracle(backend, case):
    B = backend
    params, grads = _problem(3)
    for schedule in ("warmup-cosine", "constant"):
        cfg = _cfg(case, schedule)
        got, _ = _run(B, O.build(B, cfg), params, grads)
        want = _np_optimizer(case, cfg, params, grads)
        for k, v in _flat(B, got).items():
            assert v.dtype == np.float32
            assert rel_err(v, want[k]) <= FWD_TOL, (case, schedule, k, rel_err(v, want[k]))


def _optax_tx(case: str, cfg: OptimConfig):
    sched = _optax_schedule(cfg)
    lr = lambda count: sched(count + 1)  # noqa: E731  optax counts updates from 0, ours from 1
    if case == "adamw":
        return optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if case == "lion":
        return optax.lion(lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)
    direction = (optax.scale_by_rss(cfg.initial_accumulator, cfg.eps) if case == "adagrad"
                 else optax.trace(cfg.momentum, nesterov=case == "sgd_nesterov"))
    return optax.chain(direction, optax.add_decayed_weights(cfg.weight_decay), optax.scale_by_learning_rate(lr))


def _optax_run(tx, params, grads):
    p, state = params, tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
    return {k: np.asarray(v) for k, v in tree_items(p)}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_optimizer_matches_optax_on_jax(case):
    B = get_backend("jax")
    params, grads = _problem(4)
    cfg = _cfg(case)
    got, _ = _run(B, O.build(B, cfg), params, grads)
    want = _optax_run(_optax_tx(case, cfg), params, grads)
    for k, v in _flat(B, got).items():
        assert rel_err(v, want[k]) <= FWD_TOL, (case, k, rel_err(v, want[k]))


@pytest.mark.parametrize("case", ["adagrad", "sgd"])
def test_without_weight_decay_equals_optax_alias(case):
    """adagrad / sgd without weight decay are optax.adagrad / optax.sgd themselves."""
    B = get_backend("jax")
    params, grads = _problem(5)
    cfg = _cfg(case, "constant", weight_decay=0.0)
    got, _ = _run(B, O.build(B, cfg), params, grads)
    tx = (optax.adagrad(cfg.lr, initial_accumulator_value=cfg.initial_accumulator, eps=cfg.eps) if case == "adagrad"
          else optax.sgd(cfg.lr, momentum=cfg.momentum))
    want = _optax_run(tx, params, grads)
    for k, v in _flat(B, got).items():
        assert rel_err(v, want[k]) <= FWD_TOL, (case, k)


# ----------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("cfg", list(SCHEDULES.values())[1:], ids=list(SCHEDULES)[1:])
def test_schedules_equal_learning_rate_bitwise_and_optax(backend, cfg):
    B = backend
    ours, want = O.from_config(cfg), _optax_schedule(cfg)
    for t in range(1, 14):
        step = B.asarray(float(t), dtype=B.float_dtype)
        got = B.to_numpy(B.asarray(ours(B.xp, step)))
        assert np.array_equal(got, B.to_numpy(B.asarray(learning_rate(B.xp, step, cfg)))), t
        assert abs(float(got) - float(want(t))) <= 1e-6 * cfg.lr, (t, float(got), float(want(t)))


def test_named_schedules():
    B = get_backend("torch")
    xp, lr = B.xp, 0.5
    t = B.asarray(3.0)
    pairs = [(O.constant(lr), O.schedule(lr)), (O.linear_warmup(lr, 5), O.schedule(lr, "constant", 5)),
             (O.warmup_cosine_decay(lr, 2, 4, 0.1), O.schedule(lr, "cosine", 2, 4, 0.1)),
             (O.warmup_linear_decay(lr, 2, 4, 0.1), O.schedule(lr, "linear", 2, 4, 0.1)),
             (O.cosine_decay(lr, 4), O.schedule(lr, "cosine", 0, 4)),
             (O.linear_decay(lr, 4), O.schedule(lr, "linear", 0, 4))]
    for a, b in pairs:
        assert float(B.to_numpy(B.asarray(a(xp, t)))) == float(B.to_numpy(B.asarray(b(xp, t))))
    assert O.constant(lr)(xp, t) == lr                     # a Python float: rounds as optim's lr always did
    assert float(B.to_numpy(O.linear_warmup(lr, 5)(xp, t))) == pytest.approx(lr * 3 / 5)
    with pytest.raises(ValueError, match="decay_steps"):
        O.schedule(lr, "cosine", 2, 0)
    with pytest.raises(ValueError, match="unknown schedule"):
        O.schedule(lr, "exp")


# ----------------------------------------------------------------------------- combinators
def test_chain_of_blocks_is_adamw(backend):
    """optax.adamw's own decomposition, chained from our blocks, is bitwise our fused AdamW."""
    B = backend
    cfg = SCHEDULES["warmup-linear"]
    params, grads = _problem(6)
    sched = O.from_config(cfg)
    tx = O.chain(O.identity(), O.scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps),
                 O.add_decayed_weights(cfg.weight_decay), O.scale_by_learning_rate(sched))
    got, state = _run(B, tx, params, grads)
    want, _ = _run(B, O.build(B, cfg), params, grads)
    _assert_bitwise(B, got, want)
    assert isinstance(state, tuple) and len(state) == 4 and set(state[1]) == {"step", "mu", "nu"}


def _labels(params):
    return {k: tree_map(lambda _, k=k: "table" if k == "item_emb" else "dense", v) for k, v in params.items()}


def _table_problem(seed=7, steps=4):
    rng = np.random.default_rng(seed)
    params, grads = _problem(seed, steps)
    params["item_emb"] = rng.standard_normal((6, 3)).astype(np.float32)
    for g in grads:
        table = rng.standard_normal((6, 3)).astype(np.float32)
        table[rng.random(6) < 0.4] = 0.0          # rows no id looked up this step
        table[0] = 0.0
        g["item_emb"] = table
    return params, grads


def test_partition_dense_adamw_beside_rowwise_table(backend):
    B = backend
    params, grads = _table_problem()
    dense_tx = O.build(B, BASE)
    table_tx = O.rowwise_adagrad(BASE.lr, eps=BASE.eps)
    got, state = _run(B, O.partition({"dense": dense_tx, "table": table_tx}, _labels), params, grads)
    # the same as each transform on its own part
    dense = {k: v for k, v in params.items() if k != "item_emb"}
    want_dense, want_dense_state = _run(B, dense_tx, dense, [{k: v for k, v in g.items() if k != "item_emb"}
                                                             for g in grads])
    want_table, _ = _run(B, table_tx, {"t": params["item_emb"]}, [{"t": g["item_emb"]} for g in grads])
    _assert_bitwise(B, {k: v for k, v in got.items() if k != "item_emb"}, want_dense)
    _assert_bitwise(B, got["item_emb"], want_table["t"])
    paths = [k for k, _ in tree_items(state)]
    assert "dense.mu.a" in paths and not any(p.startswith("dense.mu.item_emb") for p in paths)
    assert [p for p in paths if p.startswith("table.")] == ["table.acc.item_emb", "table.step"]
    _assert_bitwise(B, state["dense"], want_dense_state)
    # rows that never had a gradient are bit-identical
    never = ~np.any([g["item_emb"] != 0 for g in grads], axis=(0, 2))
    assert never[0] and np.array_equal(B.to_numpy(got["item_emb"])[never], params["item_emb"][never])
    with pytest.raises(ValueError, match="no transform"):
        O.partition({"dense": dense_tx}, _labels).init(B, B.asarray_tree(params))


@pytest.mark.parametrize("name", ["rowwise_adagrad", "lazy_adam"])
def test_rowwise_transforms_are_rowopt_bitwise(backend, name):
    B = backend
    cfg = dataclasses.replace(BASE, weight_decay=0.01)
    params, grads = _table_problem(8, steps=5)
    tx = (O.rowwise_adagrad(cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay) if name == "rowwise_adagrad"
          else O.lazy_adam(cfg.lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    got, state = _run(B, tx, {"t": params["item_emb"]}, [{"t": g["item_emb"]} for g in grads])
    values = B.asarray(params["item_emb"])
    rows = rowopt.init_row_state(B, name, *params["item_emb"].shape)
    for g in grads:
        touched = B.asarray(np.any(g["item_emb"] != 0, axis=1))
        values, rows = rowopt.reference_row_update(B, name, values, B.asarray(g["item_emb"]), rows, touched,
                                                   cfg.lr, cfg)
    _assert_bitwise(B, got["t"], values)
    _assert_bitwise(B, {k: v["t"] for k, v in state.items() if k != "step"}, rows)


def test_masked_passes_other_leaves_through(backend):
    B = backend
    params, grads = _problem(9, steps=3)
    mask = {"a": True, "b": [False], "c": {"d": True}}
    inner = O.sgd(0.1, momentum=0.9)
    p = B.asarray_tree(params)
    tx = O.masked(inner, mask)
    state = tx.init(B, p)
    alone = inner.init(B, {"a": p["a"], "c": p["c"]})
    for g in grads:
        g = B.asarray_tree(g)
        updates, state = tx.update(B, g, state, p)
        want, alone = inner.update(B, {"a": g["a"], "c": g["c"]}, alone, {"a": p["a"], "c": p["c"]})
        _assert_bitwise(B, updates["b"], g["b"])                     # untouched by the inner transform
        _assert_bitwise(B, {"a": updates["a"], "c": updates["c"]}, want)
    assert state["trace"]["b"] == [None]                              # no state for masked-out leaves
    callable_mask = O.masked(inner, lambda tree: tree_map(lambda x: x.ndim == 2, tree))
    s = callable_mask.init(B, p)
    assert s["trace"]["b"] == [None] and s["trace"]["a"] is not None


def test_apply_if_finite_skips_a_nan_step_and_resumes(backend):
    B = backend
    params, grads = _problem(10, steps=4)
    bad = tree_map(lambda g: g.copy(), grads[1])
    bad["a"][1, 2] = np.nan
    bad["c"]["d"][0, 0] = np.inf
    tx = O.apply_if_finite(O.build(B, BASE), max_consecutive_errors=3)
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    for i, g in enumerate([grads[0], grads[1], bad, grads[2], grads[3]]):
        before_p, before_inner = p, state["inner"]
        updates, state = tx.update(B, B.asarray_tree(g), state, p)
        p = O.apply_updates(B, p, updates)
        if i == 2:  # the NaN step: params and the inner state bit-identical, counters up
            _assert_bitwise(B, p, before_p)
            _assert_bitwise(B, state["inner"], before_inner)
            assert not bool(B.to_numpy(state["last_finite"]))
            assert float(B.to_numpy(state["notfinite_count"])) == 1.0
    assert float(B.to_numpy(state["notfinite_count"])) == 0.0 and float(B.to_numpy(state["total_notfinite"])) == 1.0
    # resuming: bitwise the trajectory that never saw the NaN step
    want, want_state = _run(B, O.build(B, BASE), params, grads)
    _assert_bitwise(B, p, want)
    _assert_bitwise(B, state["inner"], want_state)


def test_apply_if_finite_gives_up_after_max_consecutive_errors(backend):
    B = backend
    params, grads = _problem(11, steps=1)
    bad = tree_map(lambda g: np.full_like(g, np.nan), grads[0])
    tx = O.apply_if_finite(O.sgd(0.1), max_consecutive_errors=1)
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    u, state = tx.update(B, B.asarray_tree(bad), state, p)
    assert np.all(np.isfinite(_flat(B, O.apply_updates(B, p, u))["a"]))       # 1st: skipped
    u, state = tx.update(B, B.asarray_tree(bad), state, p)
    assert np.all(np.isnan(_flat(B, u)["a"]))                                  # 2nd > 1: applied, as optax


def test_multi_steps_equals_one_step_on_the_mean_gradient(backend):
    B = backend
    k = 3
    params, micro = _problem(12, steps=2 * k)
    tx = O.multi_steps(O.build(B, SCHEDULES["warmup-cosine"]), k)
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    means = []
    for group in range(2):
        gs = [B.asarray_tree(g) for g in micro[group * k:(group + 1) * k]]
        means.append(tree_map(lambda *x: ((x[0] + x[1]) + x[2]) / float(k), *gs))
        for i, g in enumerate(gs):
            before = p
            updates, state = tx.update(B, g, state, p)
            p = O.apply_updates(B, p, updates)
            if i < k - 1:
                _assert_bitwise(B, p, before)                              # micro-steps move nothing
    ref = O.build(B, SCHEDULES["warmup-cosine"])
    q = B.asarray_tree(params)
    s = ref.init(B, q)
    for g in means:
        u, s = ref.update(B, g, s, q)
        q = O.apply_updates(B, q, u)
    _assert_bitwise(B, p, q)
    _assert_bitwise(B, state["inner"], s)
    assert float(B.to_numpy(state["mini_step"])) == 0.0
    assert all(not np.any(v) for v in _flat(B, state["acc"]).values())


def test_wrappers_jit_on_jax():
    """apply_if_finite(multi_steps(adamw)) under jax.jit: the value-dependent choices are
    ``where`` selections, so one program serves every step; same numbers as eager."""
    B = get_backend("jax")
    params, grads = _problem(13, steps=4)
    grads[2]["a"][0, 0] = np.nan
    tx = O.apply_if_finite(O.multi_steps(O.build(B, SCHEDULES["warmup-cosine"]), 2))

    def step(g, s, p):
        u, s = tx.update(B, g, s, p)
        return O.apply_updates(B, p, u), s

    jitted = B.jit(step)
    p = q = B.asarray_tree(params)
    s = t = tx.init(B, p)
    for g in grads:
        g = B.asarray_tree(g)
        p, s = step(g, s, p)
        q, t = jitted(g, t, q)
    for k, v in _flat(B, q).items():
        assert rel_err(v, _flat(B, p)[k]) <= FWD_TOL, k


# ----------------------------------------------------------------------------- loss scaling
def _scaler_oracle(scale, good, grads_ok, ok, window):
    """train.apply_update's loss-scale rule, transcribed in Python floats."""
    good = good + 1.0
    grow = good >= window
    if not grads_ok:
        scale = scale * 0.5
    elif ok and grow:
        scale = scale * 2.0
    return scale, (good if ok and not grow else 0.0)


def test_loss_scale_state_machine(backend):
    B = backend
    window = 3
    state = O.init_loss_scale(B, 1024.0)
    assert state["scale"].dtype == B.xp.float32 and state["good_steps"].dtype == B.xp.float32
    scale, good = 1024.0, 0.0
    # (grads finite, update applied): grow after 3 clean steps, halve on overflow, a rejected
    # update (finite grads) leaves the scale and restarts the count
    events = [(1, 1), (1, 1), (1, 1), (0, 0), (1, 1), (1, 0), (1, 1), (1, 1), (1, 1), (0, 0), (0, 0)]
    seen = []
    for grads_ok, ok in events:
        state = O.update_loss_scale(B, state, B.asarray(bool(grads_ok)), B.asarray(bool(ok)), window=window)
        scale, good = _scaler_oracle(scale, good, grads_ok, ok, window)
        assert float(B.to_numpy(state["scale"])) == scale and float(B.to_numpy(state["good_steps"])) == good
        seen.append(scale)
    assert seen == [1024, 1024, 2048, 1024, 1024, 1024, 1024, 1024, 2048, 1024, 512]


def test_dynamic_loss_scaling_wrapper(backend):
    B = backend
    params, grads = _problem(14, steps=3)
    tx = O.dynamic_loss_scaling(O.sgd(0.1), initial_scale=8.0, window=2)
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    scaled = lambda g, s: tree_map(lambda x: x * s, g)  # noqa: E731  what the step's scaled loss gives
    for g in grads[:2]:
        u, state = tx.update(B, B.asarray_tree(scaled(g, 8.0)), state, p)
        assert rel_err(_flat(B, u)["a"], -0.1 * g["a"]) <= FWD_TOL        # unscaled before the step
    assert float(B.to_numpy(state["loss_scale"]["scale"])) == 16.0         # doubled after 2 good steps
    overflow = scaled(grads[2], 16.0)
    overflow["a"][0, 0] = np.inf                                              # the scaled loss overflowed
    before = p
    u, state = tx.update(B, B.asarray_tree(overflow), state, p)
    _assert_bitwise(B, O.apply_updates(B, p, u), before)
    assert float(B.to_numpy(state["loss_scale"]["scale"])) == 8.0           # halved, step skipped


# ----------------------------------------------------------------------------- optax on JAX
def test_from_optax_adamw_equals_builtin_adamw():
    B = get_backend("jax")
    cfg = SCHEDULES["warmup-cosine"]
    params, grads = _problem(15)
    sched = _optax_schedule(cfg)
    wrapped = O.from_optax(optax.adamw(lambda c: sched(c + 1), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                                       weight_decay=cfg.weight_decay))
    got, _ = _run(B, wrapped, params, grads)
    want, _ = _run(B, O.build(B, cfg), params, grads)
    for k, v in _flat(B, got).items():
        assert rel_err(v, _flat(B, want)[k]) <= FWD_TOL, k
    # "optax:adamw" from the config is the same optimizer
    named, _ = _run(B, O.build(B, dataclasses.replace(cfg, name="optax:adamw")), params, grads)
    for k, v in _flat(B, named).items():
        assert rel_err(v, _flat(B, want)[k]) <= FWD_TOL, k


def test_optax_objects_compose_with_our_wrappers():
    """An optax transform (wrapped by from_optax) inside apply_if_finite: its NamedTuple state is
    kept on a NaN step; a bare optax object is refused there with a message naming from_optax."""
    B = get_backend("jax")
    params, grads = _problem(16, steps=2)
    bad = tree_map(lambda g: np.full_like(g, np.nan), grads[0])
    with pytest.raises(TypeError, match="from_optax"):
        O.apply_if_finite(optax.adabelief(1e-2))
    tx = O.apply_if_finite(O.from_optax(optax.adabelief(1e-2)))
    p = B.asarray_tree(params)
    state = tx.init(B, p)
    u, state = tx.update(B, B.asarray_tree(grads[0]), state, p)
    p = O.apply_updates(B, p, u)
    inner = state["inner"]
    u, state = tx.update(B, B.asarray_tree(bad), state, p)
    _assert_bitwise(B, O.apply_updates(B, p, u), p)
    _assert_bitwise(B, state["inner"], inner)
    adabelief, _ = _run(B, O.build(B, dataclasses.replace(BASE, name="optax:adabelief")), params, grads)
    assert all(np.isfinite(v).all() for v in _flat(B, adabelief).values())


def test_optax_is_refused_on_torch():
    B = get_backend("torch")
    p = B.asarray_tree(_problem(0, 0)[0])
    with pytest.raises(ValueError, match=r"JAX backend only; this backend is 'torch'"):
        O.from_optax(optax.adamw(1e-3)).init(B, p)
    with pytest.raises(ConfigError, match=r"optim.name='optax:adamw'.*JAX backend only.*'torch'"):
        O.build(B, dataclasses.replace(BASE, name="optax:adamw"))
    torch_cfg = dataclasses.replace(Config(), optim=dataclasses.replace(BASE, name="optax:adamw"))
    assert "JAX backend only" in O.check_config(torch_cfg)
    jax_cfg = dataclasses.replace(torch_cfg, backend=dataclasses.replace(torch_cfg.backend, name="jax"))
    assert O.check_config(jax_cfg) is None
    problem = O.check_config(dataclasses.replace(BASE, name="optax:adamww"))
    assert "optim.name='optax:adamww'" in problem and "did you mean 'adamw'" in problem


# ----------------------------------------------------------------------------- registry
def test_registry_names_refusals_and_suggestions():
    B = get_backend("torch")
    assert O.check_config(BASE) is None
    problem = O.check_config(dataclasses.replace(BASE, name="adamx"))
    assert "did you mean 'adamw'" in problem and "optim.name" in problem
    with pytest.raises(ConfigError, match=r"optim.name='lionn'.*did you mean 'lion'"):
        O.build(B, dataclasses.replace(BASE, name="lionn"))
    with pytest.raises(ValueError, match="already registered"):
        O.register_optimizer("adamw")(lambda cfg, lr: O.sgd(lr))
    with pytest.raises(ValueError, match="reserved"):
        O.register_optimizer("optax:mine")

    def mine(cfg, lr):
        return O.sgd(lr, momentum=0.5)

    try:
        O.register_optimizer("test_sgd_half")(mine)
        O.register_optimizer("test_sgd_half")(mine)            # the same definition again: allowed
        assert "test_sgd_half" in O.names()
        got, _ = _run(B, O.build(B, dataclasses.replace(BASE, name="test_sgd_half")), *_problem(17, steps=2))
        want, _ = _run(B, O.sgd(BASE.lr, momentum=0.5), *_problem(17, steps=2))
        _assert_bitwise(B, got, want)
    finally:
        O.OPTIMIZERS.remove("test_sgd_half")
