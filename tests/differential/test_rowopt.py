"""Row-sparse optimizers (lazy Adam, row-wise Adagrad) and ``B.set_rows`` against float64 numpy
oracles, dense AdamW (optim.adamw_update, torch.optim.AdamW) restricted to the touched rows, and
across backends."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backends import get_backend
from gr_functional.config import OptimConfig
from gr_functional.embedding import rowopt
from .optim_oracle import adamw_init, adamw_update

from .common import FWD_TOL, rel_err

OPT = OptimConfig(lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.05)
N, D, SLOTS = 9, 4, 8


def _stream(seed=0, steps=6):
    """Per step: rows[SLOTS] (distinct touched rows, then padding slots at row 0), touched, grads."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        k = int(rng.integers(1, SLOTS))
        rows = np.zeros(SLOTS, np.int32)
        rows[:k] = rng.choice(np.arange(1, N), size=k, replace=False)
        touched = np.arange(SLOTS) < k
        out.append((rows, touched, rng.standard_normal((SLOTS, D)).astype(np.float32)))
    return out


def _oracle(name, table, stream, lr=OPT.lr, resets=None):
    """float64, one row at a time, written from the formulas in rowopt's docstring. Per step, the
    table and the state: ``{"values", "m", "v", "t"}`` or ``{"values", "acc"}``. ``resets[i]``:
    rows whose state is zeroed before step i."""
    p = table.astype(np.float64)
    m, v, t, acc = np.zeros_like(p), np.zeros_like(p), np.zeros(len(p)), np.zeros(len(p))
    b1, b2, eps, wd = OPT.beta1, OPT.beta2, OPT.eps, OPT.weight_decay
    out = []
    for i, (rows, touched, grads) in enumerate(stream):
        for r in (resets or {}).get(i, ()):
            m[r], v[r], t[r], acc[r] = 0.0, 0.0, 0.0, 0.0
        for r, on, g in zip(rows, touched, grads.astype(np.float64)):
            if not on:
                continue
            if name == "lazy_adam":
                t[r] += 1
                m[r] = b1 * m[r] + (1 - b1) * g
                v[r] = b2 * v[r] + (1 - b2) * g * g
                step = (m[r] / (1 - b1 ** t[r])) / (np.sqrt(v[r] / (1 - b2 ** t[r])) + eps)
                p[r] = p[r] - lr * (step + wd * p[r])
            else:
                g2 = g + wd * p[r]
                acc[r] += np.mean(g2 * g2)
                p[r] = p[r] - lr * g2 / (np.sqrt(acc[r]) + eps)
        state = {"m": m, "v": v, "t": t} if name == "lazy_adam" else {"acc": acc}
        out.append({"values": p.copy(), **{k: x.copy() for k, x in state.items()}})
    return out


def _ours(B, name, table, stream, lr=OPT.lr, resets=None, with_state=False):
    """The caller's loop: gather rows and state, ``row_update``, write both back. Per step the
    table (``with_state``: a dict of the table and the state leaves, as ``_oracle``)."""
    values = B.asarray(table.copy())
    state = rowopt.init_row_state(B, name, N, D)
    out = []
    for i, (rows, touched, grads) in enumerate(stream):
        if resets and i in resets:
            state = rowopt.reset_rows(B, state, B.asarray(np.asarray(resets[i], np.int32)))
        r = B.asarray(rows)
        new, new_state = rowopt.row_update(B, name, B.gather_rows(values, r), B.asarray(grads),
                                           rowopt.gather_state(B, state, r), B.asarray(touched), lr, OPT)
        values = B.set_rows(values, r, new)
        state = rowopt.scatter_state(B, state, r, new_state)
        got = B.to_numpy(values).copy()
        out.append({"values": got, **{k: B.to_numpy(x).copy() for k, x in state.items()}} if with_state else got)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_row_optimizers_match_the_float64_oracle(backend, name):
    table = np.random.default_rng(9).standard_normal((N, D)).astype(np.float32)
    table[0] = 0.0
    stream = _stream()
    for got, want in zip(_ours(backend, name, table, stream, with_state=True), _oracle(name, table, stream)):
        assert set(got) == set(want)
        for key in want:
            assert rel_err(got[key], want[key]) <= FWD_TOL, key
        assert np.array_equal(got["values"][0], table[0])  # the padding row is written back unchanged
        for key in set(want) - {"values"}:
            assert not got[key][0].any(), key                # ... and its state stays zero


@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_backends_agree(name):
    table = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)
    stream = _stream(5)
    a = _ours(get_backend("torch"), name, table, stream)
    b = _ours(get_backend("jax"), name, table, stream)
    for x, y in zip(a, b):
        assert rel_err(x, y) <= FWD_TOL
    assert not np.array_equal(a[-1], table)


@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_untouched_rows_are_bit_identical(backend, name):
    """After every step, each row the step did not touch is bit-identical to before: value and state."""
    table = np.random.default_rng(4).standard_normal((N, D)).astype(np.float32)
    stream = _stream(7)
    before = {"values": table, **{k: np.zeros(x.shape, np.float32) for k, x in
                                  rowopt.init_row_state(get_backend("torch"), name, N, D).items()}}
    for (rows, touched, _), after in zip(stream, _ours(backend, name, table, stream, with_state=True)):
        idle = np.setdiff1d(np.arange(N), rows[touched])
        assert idle.size and 0 in idle
        for key in after:
            assert np.array_equal(after[key][idle], before[key][idle]), key
            assert not np.array_equal(after[key][rows[touched]], before[key][rows[touched]]), key
        before = after


@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_untouched_slots_come_back_bit_identical(backend, name):
    """``row_update`` alone: slots with touched=False return their value and state unchanged
    (bitwise), whatever their gradient (NaN included); touched slots move."""
    rng = np.random.default_rng(21)
    U = 6
    values = rng.standard_normal((U, D)).astype(np.float32)
    grads = rng.standard_normal((U, D)).astype(np.float32)
    grads[4] = np.nan
    touched = np.asarray([True, False, True, False, False, True])
    if name == "lazy_adam":
        state = {"m": rng.standard_normal((U, D)), "v": rng.random((U, D)), "t": rng.integers(0, 5, U)}
    else:
        state = {"acc": rng.random(U)}
    state = {k: x.astype(np.float32) for k, x in state.items()}
    new, new_state = rowopt.row_update(backend, name, backend.asarray(values), backend.asarray(grads),
                                       backend.asarray_tree(state), backend.asarray(touched), OPT.lr, OPT)
    got = {"values": backend.to_numpy(new), **backend.to_numpy_tree(new_state)}
    old = {"values": values, **state}
    for key in old:
        assert got[key].shape == old[key].shape and got[key].dtype == old[key].dtype, key
        assert np.array_equal(got[key][~touched], old[key][~touched]), key
        assert np.all(np.isfinite(got[key])), key
    assert not np.any(got["values"][touched] == values[touched])


@pytest.mark.slow
@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_reset_rows(backend, name):
    """``reset_rows`` zeroes the state of its rows (repeats allowed) and nothing else; a reset row
    then starts over (lazy Adam's count restarts at 1), as the oracle with the same resets."""
    table = np.random.default_rng(31).standard_normal((N, D)).astype(np.float32)
    stream = _stream(32, steps=8)
    seen = np.unique(np.concatenate([rows[touched] for rows, touched, _ in stream[:4]]))
    resets = {4: [int(seen[0]), int(seen[-1]), int(seen[0])], 6: [int(seen[1])]}
    got = _ours(backend, name, table, stream, resets=resets, with_state=True)
    want = _oracle(name, table, stream, resets=resets)
    for g, w in zip(got, want):
        for key in w:
            assert rel_err(g[key], w[key]) <= FWD_TOL, key
    assert rel_err(got[-1]["values"], _oracle(name, table, stream)[-1]["values"]) > FWD_TOL  # resets matter

    state = backend.asarray_tree({k: np.ones(x.shape, np.float32) for k, x in
                                  rowopt.init_row_state(backend, name, N, D).items()})
    out = backend.to_numpy_tree(rowopt.reset_rows(backend, state, backend.asarray(np.asarray([2, 5, 2], np.int32))))
    for key, x in out.items():
        assert not x[[2, 5]].any() and np.all(np.delete(x, [2, 5], axis=0) == 1.0), key
    empty = rowopt.reset_rows(backend, backend.asarray_tree({k: np.ones(x.shape, np.float32) for k, x in out.items()}),
                              backend.asarray(np.zeros(0, np.int32)))
    assert all(np.all(backend.to_numpy(x) == 1.0) for x in empty.values())


@pytest.mark.slow
def test_lazy_adam_is_adamw_when_every_row_is_touched(backend):
    """The dense optimizer restricted to the touched rows, with all rows touched: our AdamW and
    torch.optim.AdamW over the whole table."""
    rng = np.random.default_rng(11)
    table = rng.standard_normal((N, D)).astype(np.float32)
    grads = [rng.standard_normal((N, D)).astype(np.float32) for _ in range(5)]
    rows, touched = np.arange(N, dtype=np.int32), np.ones(N, bool)
    ours = _ours(backend, "lazy_adam", table, [(rows, touched, g) for g in grads])[-1]

    p = {"t": backend.asarray(table)}
    state = adamw_init(backend, p)
    for g in grads:
        p, state = adamw_update(backend, {"t": backend.asarray(g)}, state, p, OPT)
    assert rel_err(ours, backend.to_numpy(p["t"])) <= FWD_TOL

    leaf = torch.tensor(table, requires_grad=True)
    opt = torch.optim.AdamW([leaf], lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps,
                            weight_decay=OPT.weight_decay)
    for g in grads:
        leaf.grad = torch.tensor(g)
        opt.step()
    assert rel_err(ours, leaf.detach().numpy()) <= FWD_TOL


def test_lazy_adam_counts_each_rows_own_updates(backend):
    """Each row follows torch.optim.AdamW run on that row alone, over the steps that touched it."""
    B = backend
    table = np.random.default_rng(12).standard_normal((N, D)).astype(np.float32)
    stream = _stream(13, steps=10)
    final = _ours(B, "lazy_adam", table, stream)[-1]
    for r in range(1, N):
        leaf = torch.tensor(table[r], requires_grad=True)
        opt = torch.optim.AdamW([leaf], lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps,
                                weight_decay=OPT.weight_decay)
        for rows, touched, grads in stream:
            hit = np.flatnonzero((rows == r) & touched)
            if hit.size:
                leaf.grad = torch.tensor(grads[hit[0]])
                opt.step()
        assert rel_err(final[r], leaf.detach().numpy()) <= FWD_TOL, r
    assert np.array_equal(final[0], table[0])  # row 0 (padding only) was never touched


def test_row_state_shapes():
    B = get_backend("torch")
    assert {k: tuple(v.shape) for k, v in rowopt.init_row_state(B, "lazy_adam", 7, 3).items()} == {
        "m": (7, 3), "v": (7, 3), "t": (7,)}
    assert {k: tuple(v.shape) for k, v in rowopt.init_row_state(B, "rowwise_adagrad", 7, 3).items()} == {"acc": (7,)}
    with pytest.raises(ValueError, match="unknown row-sparse optimizer 'sgd'"):
        rowopt.init_row_state(B, "sgd", 7, 3)


# ----------------------------------------------------------------------------- set_rows
@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch", "jax", "reference-torch", "reference-jax"])
def test_set_rows(name):
    """Rows replaced, a repeated row with identical values, other rows kept, an empty rows array."""
    from backends.base import Backend

    B = get_backend(name.rsplit("-", 1)[-1])
    set_rows = (lambda *a: Backend.set_rows(B, *a)) if name.startswith("reference") else B.set_rows
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows = np.asarray([4, 0, 0, 2], np.int32)  # row 0 twice, with the same values
    values = np.asarray([[9, 9], [0, 1], [0, 1], [7, 7]], np.float32)
    want = table.copy()
    want[[4, 0, 2]] = [[9, 9], [0, 1], [7, 7]]
    got = set_rows(B.asarray(table.copy()), B.asarray(rows), B.asarray(values))
    assert np.array_equal(B.to_numpy(got), want)
    same = set_rows(B.asarray(table.copy()), B.asarray(np.zeros(0, np.int32)), B.asarray(np.zeros((0, 2), np.float32)))
    assert np.array_equal(B.to_numpy(same), table)
    # 1-d leaves (lazy Adam's counts, Adagrad's accumulators) and 3-d tables
    vec = set_rows(B.asarray(np.zeros(5, np.float32)), B.asarray(np.asarray([3, 1], np.int32)),
                   B.asarray(np.asarray([2.0, 1.0], np.float32)))
    assert np.array_equal(B.to_numpy(vec), [0, 1, 0, 2, 0])
    cube = set_rows(B.asarray(np.zeros((3, 2, 2), np.float32)), B.asarray(np.asarray([1], np.int32)),
                    B.asarray(np.ones((1, 2, 2), np.float32)))
    assert np.array_equal(B.to_numpy(cube).sum(axis=(1, 2)), [0, 4, 0])


def test_torch_set_rows_writes_in_place():
    B = get_backend("torch")
    table = B.asarray(np.zeros((5, 3), np.float32))
    ptr = table.data_ptr()
    out = B.set_rows(table, B.asarray(np.asarray([1], np.int32)), B.asarray(np.ones((1, 3), np.float32)))
    assert out is table and out.data_ptr() == ptr and float(table[1].sum()) == 3.0
    # a parameter leaf that requires grad: written in place too, and nothing is recorded
    leaf = B.asarray(np.zeros((4, 2), np.float32)).requires_grad_(True)
    out = B.set_rows(leaf, B.asarray(np.asarray([0, 3], np.int32)), B.asarray(np.ones((2, 2), np.float32)))
    assert out is leaf and out.grad_fn is None and float(leaf.detach().sum()) == 4.0


def test_jax_set_rows_under_jit_with_a_donated_table():
    import jax

    B = get_backend("jax")
    step = jax.jit(B.set_rows, donate_argnums=0)
    table = B.asarray(np.zeros((6, 3), np.float32))
    values = np.asarray([[1] * 3, [2] * 3, [1] * 3], np.float32)
    out = step(table, B.asarray(np.asarray([5, 2, 5], np.int32)), B.asarray(values))
    assert np.array_equal(B.to_numpy(out).sum(axis=1), [0, 0, 6, 0, 0, 3])
