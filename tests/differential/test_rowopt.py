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
from gr_functional.optim import adamw_init, adamw_update

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


def _oracle(name, table, stream, lr=OPT.lr):
    """float64, one row at a time, written from the formulas in rowopt's docstring."""
    p = table.astype(np.float64)
    m, v, t, acc = np.zeros_like(p), np.zeros_like(p), np.zeros(len(p)), np.zeros(len(p))
    b1, b2, eps, wd = OPT.beta1, OPT.beta2, OPT.eps, OPT.weight_decay
    tables = []
    for rows, touched, grads in stream:
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
        tables.append(p.copy())
    return tables


def _ours(B, name, table, stream, lr=OPT.lr):
    values = B.asarray(table.copy())
    state = rowopt.init_row_state(B, name, N, D)
    tables = []
    for rows, touched, grads in stream:
        r = B.asarray(rows)
        new, new_state = rowopt.row_update(B, name, B.gather_rows(values, r), B.asarray(grads),
                                           rowopt.gather_state(B, state, r), B.asarray(touched), lr, OPT)
        values = B.set_rows(values, r, new)
        state = rowopt.scatter_state(B, state, r, new_state)
        tables.append(B.to_numpy(values).copy())
    return tables


@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_row_optimizers_match_the_float64_oracle(backend, name):
    table = np.random.default_rng(9).standard_normal((N, D)).astype(np.float32)
    table[0] = 0.0
    stream = _stream()
    for got, want in zip(_ours(backend, name, table, stream), _oracle(name, table, stream)):
        assert rel_err(got, want) <= FWD_TOL
        assert np.array_equal(got[0], table[0])  # the padding row is written back unchanged


@pytest.mark.parametrize("name", rowopt.ROW_OPTIMIZERS)
def test_backends_agree(name):
    table = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)
    stream = _stream(5)
    a = _ours(get_backend("torch"), name, table, stream)
    b = _ours(get_backend("jax"), name, table, stream)
    for x, y in zip(a, b):
        assert rel_err(x, y) <= FWD_TOL


def test_untouched_rows_are_bit_identical(backend):
    table = np.random.default_rng(4).standard_normal((N, D)).astype(np.float32)
    stream = _stream(7)
    for (rows, touched, _), after in zip(stream, _ours(backend, "lazy_adam", table, stream)):
        never = np.setdiff1d(np.arange(N), np.concatenate([s[0][s[1]] for s in stream]))
        assert np.array_equal(after[never], table[never])


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


def test_lazy_adam_counts_each_rows_own_updates():
    """Each row follows torch.optim.AdamW run on that row alone, over the steps that touched it."""
    B = get_backend("torch")
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


def test_row_state_shapes():
    B = get_backend("torch")
    assert {k: tuple(v.shape) for k, v in rowopt.init_row_state(B, "lazy_adam", 7, 3).items()} == {
        "m": (7, 3), "v": (7, 3), "t": (7,)}
    assert {k: tuple(v.shape) for k, v in rowopt.init_row_state(B, "rowwise_adagrad", 7, 3).items()} == {"acc": (7,)}
    with pytest.raises(ValueError, match="unknown row-sparse optimizer 'sgd'"):
        rowopt.init_row_state(B, "sgd", 7, 3)


# ----------------------------------------------------------------------------- set_rows
@pytest.mark.parametrize("name", ["torch", "jax", "reference"])
def test_set_rows(name):
    from backends.base import Backend

    B = get_backend("torch") if name == "reference" else get_backend(name)
    set_rows = (lambda *a: Backend.set_rows(B, *a)) if name == "reference" else B.set_rows
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows = np.asarray([4, 0, 0, 2], np.int32)  # row 0 twice, with the same values
    values = np.asarray([[9, 9], [0, 1], [0, 1], [7, 7]], np.float32)
    want = table.copy()
    want[[4, 0, 2]] = [[9, 9], [0, 1], [7, 7]]
    got = set_rows(B.asarray(table.copy()), B.asarray(rows), B.asarray(values))
    assert np.array_equal(B.to_numpy(got), want)
    same = set_rows(B.asarray(table.copy()), B.asarray(np.zeros(0, np.int32)), B.asarray(np.zeros((0, 2), np.float32)))
    assert np.array_equal(B.to_numpy(same), table)


def test_torch_set_rows_writes_in_place():
    B = get_backend("torch")
    table = B.asarray(np.zeros((5, 3), np.float32))
    out = B.set_rows(table, B.asarray(np.asarray([1], np.int32)), B.asarray(np.ones((1, 3), np.float32)))
    assert out.data_ptr() == table.data_ptr() and float(table[1].sum()) == 3.0
