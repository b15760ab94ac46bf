"""Row-sparse optimizers: only the rows a step looks up are read, updated and written back.

Pure functions over a backend, optax-style. The step gathers the looked-up rows and their state
(``gather_state``), updates them (``row_update``) and writes both back (``B.set_rows``,
``scatter_state``); rows no step touches cost nothing, which is what makes a table of millions of
rows trainable. Per slot, ``touched[U]`` says whether the row is updated: capacity padding and
ids the table did not admit come back bit-identical (values and state).

lazy_adam, per touched row with ``t`` its own update count::

    t' = t + 1;  m' = b1 m + (1 - b1) g;  v' = b2 v + (1 - b2) g^2
    p' = p - lr * ((m' / (1 - b1^t')) / (sqrt(v' / (1 - b2^t')) + eps) + wd * p)

The same formula as dense AdamW (``optimizers.adamw``: decoupled weight decay), written once with
row-wise Adagrad in ``optimizers/rowwise.py`` (``lazy_adam_rows``, ``rowwise_adagrad_rows``). How it differs from dense
AdamW over the table: a row that a step does not look up keeps its moments (they do not decay),
gets no weight decay and no update from its stale momentum; and the bias correction counts the
row's own updates (TF's LazyAdam and torch's SparseAdam count the table's steps, which makes a
rarely seen row's first updates tiny). When every row is touched at every step it IS AdamW
(tests/differential/test_rowopt.py). State ``{"m": [N, D], "v": [N, D], "t": [N]}``.

rowwise_adagrad (fbgemm's EXACT_ROWWISE_ADAGRAD, L2 weight-decay mode), per touched row::

    g2 = g + wd * p;  acc' = acc + mean_D(g2^2);  p' = p - lr * g2 / (sqrt(acc') + eps)

One float of state per row (``{"acc": [N]}``): a quarter of a percent of Adam's at D = 256.

``lr`` is the step's scheduled learning rate (``optimizers.schedules.learning_rate`` of the global update count).

A row given to a new id (inserted, or taken from an evicted id) starts over: ``reset_rows`` zeroes
its state (lazy Adam's count included, so its bias correction restarts at t = 1).
"""
from __future__ import annotations

from ..config import OptimConfig
from ..optimizers.rowwise import lazy_adam_rows, rowwise_adagrad_rows
from ..tree import tree_map
from ..contracts import Backend

ROW_OPTIMIZERS = ("lazy_adam", "rowwise_adagrad")


def _check(name: str) -> None:
    if name not in ROW_OPTIMIZERS:
        raise ValueError(f"unknown row-sparse optimizer {name!r}; one of {', '.join(ROW_OPTIMIZERS)}")


def init_row_state(B: Backend, name: str, num_rows: int, dim: int) -> dict:
    """Zero state for a table of ``num_rows`` rows of width ``dim`` (master dtype)."""
    _check(name)
    xp, f = B.xp, B.float_dtype
    zeros = lambda *shape: xp.zeros(shape, dtype=f, device=B.array_device)  # noqa: E731
    if name == "lazy_adam":
        return {"m": zeros(num_rows, dim), "v": zeros(num_rows, dim), "t": zeros(num_rows)}
    return {"acc": zeros(num_rows)}


def gather_state(B: Backend, state: dict, rows) -> dict:
    """Each state leaf at ``rows[U]`` int32 -> ``[U, ...]``."""
    return tree_map(lambda s: B.gather_rows(s, rows), state)


def scatter_state(B: Backend, state: dict, rows, new: dict) -> dict:
    """``state`` with ``new``'s rows written at ``rows`` (``B.set_rows``: donates ``state``)."""
    return tree_map(lambda s, n: B.set_rows(s, rows, n), state, new)


def reset_rows(B: Backend, state: dict, rows) -> dict:
    """``state`` with every leaf zero at ``rows[U]`` int32 (rows re-initialised: newly inserted or
    taken from an evicted id); other rows unchanged. Rows may repeat. Donates ``state``
    (``B.set_rows``)."""
    xp = B.xp
    return tree_map(lambda s: B.set_rows(s, rows, xp.zeros((rows.shape[0],) + tuple(s.shape[1:]), dtype=s.dtype,
                                                           device=B.array_device)), state)


def row_update(B: Backend, name: str, values, grads, state_rows: dict, touched, lr, cfg: OptimConfig):
    """``(new_values[U, D], new_state_rows)`` of the gathered rows (module docstring formulas);
    untouched slots unchanged. Runs the backend's row kernel (``ops.row_update``:
    ``reference_row_update``, or fbgemm's fused TBE update, backends/row_kernels.py)."""
    _check(name)
    return B.row_update(name, values, grads, state_rows, touched, lr, cfg)


def reference_row_update(B: Backend, name: str, values, grads, state_rows: dict, touched, lr, cfg: OptimConfig):
    """``row_update`` as plain ``B.xp`` array code: the oracle of every row kernel."""
    _check(name)
    xp = B.xp
    keep = xp.reshape(touched, (-1, 1))
    if name == "lazy_adam":
        delta, m, v, t = lazy_adam_rows(xp, grads, state_rows["m"], state_rows["v"], state_rows["t"], values, lr,
                                        cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)
        new_state = {"m": xp.where(keep, m, state_rows["m"]), "v": xp.where(keep, v, state_rows["v"]),
                     "t": xp.where(touched, t, state_rows["t"])}
        return xp.where(keep, values - delta, values), new_state
    delta, acc = rowwise_adagrad_rows(xp, grads, state_rows["acc"], values, lr, cfg.eps, cfg.weight_decay)
    return xp.where(keep, values - delta, values), {"acc": xp.where(touched, acc, state_rows["acc"])}


def init_pending(B: Backend, k: int, dim: int) -> list:
    """k empty pending row updates ``{"rows": [1] int32 (0: no row), "grads": [1, dim]}``, oldest
    first (``embedding.staleness = k``): each step appends its own and applies the oldest."""
    xp = B.xp
    return [{"rows": xp.zeros((1,), dtype=xp.int32, device=B.array_device),
             "grads": xp.zeros((1, dim), dtype=B.float_dtype, device=B.array_device)} for _ in range(k)]


def refresh_rows(B: Backend, table, state: dict, pending: list, values, rows, fresh):
    """Semi-asynchronous updates (``embedding.staleness``): the rows a step looked up,
    ``rows[U]`` int32, take ``values[U, D]`` (the step's view of them: fresh rows at their initial
    value) and fresh rows (``fresh[U]`` bool: new ids, evicted rows given to another id) a zero
    state NOW, since the next steps read them before this step's update lands; and pending updates
    (``[{"rows": [n] int32, "grads": [n, D]}]``) of rows re-assigned this step are dropped (row set
    to 0), because their gradient belongs to the old id. ``(table, state, pending)``; donates
    table and state."""
    xp = B.xp
    table = B.set_rows(table, rows, values)
    fresh_rows = xp.where(fresh, rows, xp.zeros_like(rows))
    state = reset_rows(B, state, fresh_rows)
    # one flag per table row (row 0, the padding row, is never updated: flagging it changes nothing)
    flag = B.set_rows(xp.zeros((table.shape[0],), dtype=xp.int32, device=B.array_device), fresh_rows,
                      xp.ones(fresh_rows.shape, dtype=xp.int32, device=B.array_device))
    pending = [{"rows": xp.where(B.gather_rows(flag, p["rows"]) > 0, xp.zeros_like(p["rows"]), p["rows"]),
                "grads": p["grads"]} for p in pending]
    return table, state, pending
