"""Row-sparse optimizers: only the rows a step looks up are read, updated and written back.

Pure functions over a backend, optax-style. The step gathers the looked-up rows and their state
(``gather_state``), updates them (``row_update``) and writes both back (``B.set_rows``,
``scatter_state``); rows no step touches cost nothing, which is what makes a table of millions of
rows trainable. Per slot, ``touched[U]`` says whether the row is updated: capacity padding and
ids the table did not admit come back bit-identical (values and state).

lazy_adam, per touched row with ``t`` its own update count::

    t' = t + 1;  m' = b1 m + (1 - b1) g;  v' = b2 v + (1 - b2) g^2
    p' = p - lr * ((m' / (1 - b1^t')) / (sqrt(v' / (1 - b2^t')) + eps) + wd * p)

The same formula as ``optim.adamw_update`` (decoupled weight decay). How it differs from dense
AdamW over the table: a row that a step does not look up keeps its moments (they do not decay),
gets no weight decay and no update from its stale momentum; and the bias correction counts the
row's own updates (TF's LazyAdam and torch's SparseAdam count the table's steps, which makes a
rarely seen row's first updates tiny). When every row is touched at every step it IS AdamW
(tests/differential/test_rowopt.py). State ``{"m": [N, D], "v": [N, D], "t": [N]}``.

rowwise_adagrad (fbgemm's EXACT_ROWWISE_ADAGRAD, L2 weight-decay mode), per touched row::

    g2 = g + wd * p;  acc' = acc + mean_D(g2^2);  p' = p - lr * g2 / (sqrt(acc') + eps)

One float of state per row (``{"acc": [N]}``): a quarter of a percent of Adam's at D = 256.

``lr`` is the step's scheduled learning rate (``optim.learning_rate`` of the global update count).

A row given to a new id (inserted, or taken from an evicted id) starts over: ``reset_rows`` zeroes
its state (lazy Adam's count included, so its bias correction restarts at t = 1).
"""
from __future__ import annotations

from ..config import OptimConfig
from ..tree import tree_map

ROW_OPTIMIZERS = ("lazy_adam", "rowwise_adagrad")


def _check(name: str) -> None:
    if name not in ROW_OPTIMIZERS:
        raise ValueError(f"unknown row-sparse optimizer {name!r}; one of {', '.join(ROW_OPTIMIZERS)}")


def init_row_state(B, name: str, num_rows: int, dim: int) -> dict:
    """Zero state for a table of ``num_rows`` rows of width ``dim`` (master dtype)."""
    _check(name)
    xp, f = B.xp, B.float_dtype
    zeros = lambda *shape: xp.zeros(shape, dtype=f, device=B.array_device)  # noqa: E731
    if name == "lazy_adam":
        return {"m": zeros(num_rows, dim), "v": zeros(num_rows, dim), "t": zeros(num_rows)}
    return {"acc": zeros(num_rows)}


def gather_state(B, state: dict, rows) -> dict:
    """Each state leaf at ``rows[U]`` int32 -> ``[U, ...]``."""
    return tree_map(lambda s: B.gather_rows(s, rows), state)


def scatter_state(B, state: dict, rows, new: dict) -> dict:
    """``state`` with ``new``'s rows written at ``rows`` (``B.set_rows``: donates ``state``)."""
    return tree_map(lambda s, n: B.set_rows(s, rows, n), state, new)


def reset_rows(B, state: dict, rows) -> dict:
    """``state`` with every leaf zero at ``rows[U]`` int32 (rows re-initialised: newly inserted or
    taken from an evicted id); other rows unchanged. Rows may repeat. Donates ``state``
    (``B.set_rows``)."""
    xp = B.xp
    return tree_map(lambda s: B.set_rows(s, rows, xp.zeros((rows.shape[0],) + tuple(s.shape[1:]), dtype=s.dtype,
                                                           device=B.array_device)), state)


def row_update(B, name: str, values, grads, state_rows: dict, touched, lr, cfg: OptimConfig):
    """``(new_values[U, D], new_state_rows)`` of the gathered rows (module docstring formulas);
    untouched slots unchanged."""
    _check(name)
    xp = B.xp
    keep = xp.reshape(touched, (-1, 1))
    if name == "lazy_adam":
        b1, b2 = cfg.beta1, cfg.beta2
        t = state_rows["t"] + 1.0
        m = b1 * state_rows["m"] + (1.0 - b1) * grads
        v = b2 * state_rows["v"] + (1.0 - b2) * (grads * grads)
        tc = xp.reshape(t, (-1, 1))
        c1 = 1.0 - b1 ** tc  # as optim.adamw_update writes it: the same rounding as dense AdamW
        c2 = 1.0 - b2 ** tc
        direction = (m / c1) / (xp.sqrt(v / c2) + cfg.eps)
        new = values - lr * (direction + cfg.weight_decay * values)
        new_state = {"m": xp.where(keep, m, state_rows["m"]), "v": xp.where(keep, v, state_rows["v"]),
                     "t": xp.where(touched, t, state_rows["t"])}
        return xp.where(keep, new, values), new_state
    g = grads + cfg.weight_decay * values if cfg.weight_decay else grads
    acc = state_rows["acc"] + xp.mean(g * g, axis=1)
    new = values - lr * g / (xp.reshape(xp.sqrt(acc), (-1, 1)) + cfg.eps)
    return xp.where(keep, new, values), {"acc": xp.where(touched, acc, state_rows["acc"])}
