"""Row-wise table optimizers as transforms over a whole table: ``rowwise_adagrad``, ``lazy_adam``.

The formulas (``lazy_adam_rows``, ``rowwise_adagrad_rows``) are the ones the training step updates
gathered rows with (``embedding/rowopt.py``, the oracle of the backends' row kernels); here they act on a table gradient
``g[N, D]`` as ``value_and_grad`` gives it, so a table can sit in a ``partition`` beside dense
AdamW. A row is *touched* when its gradient row is not all zero (rows no id looked up get exact
zeros); untouched rows get a ``-0.0`` update and keep their state. One difference from rowopt,
where ``touched`` comes from the lookup: a looked-up row whose gradient is exactly zero counts
as untouched here (for rowwise_adagrad without weight decay the result is the same).

Every leaf given to these transforms must be 2-D ``[rows, dim]`` (float, master dtype); state
per leaf: ``rowwise_adagrad`` ``{"acc": [N]}``, ``lazy_adam`` ``{"m": [N, D], "v": [N, D],
"t": [N]}`` (``t``: the row's own update count), plus ``"step"`` (the schedule's count).

rowwise_adagrad (fbgemm EXACT_ROWWISE_ADAGRAD, L2 weight decay):
    ``g2 = g + wd p;  acc' = acc + mean_D(g2^2);  u = -(lr g2 / (sqrt(acc') + eps))``
lazy_adam (AdamW per row, bias correction by the row's own count):
    ``t' = t + 1; m' = b1 m + (1-b1) g; v' = b2 v + (1-b2) g^2;
      u = -(lr ((m' / (1-b1^t')) / (sqrt(v' / (1-b2^t')) + eps) + wd p))``
"""
from __future__ import annotations

from ..tree import tree_map
from .schedules import learning_rate_at
from .transform import GradientTransformation, counter
from ..contracts import Backend


# ----------------------------------------------------------------------------- the formulas, once
# Both the transforms below (a whole table's gradient) and the training step's row updates
# (embedding/rowopt.py: the gathered rows of a lookup) compute an update by these two functions.

def lazy_adam_rows(xp, g, m, v, t, p, lr, b1: float, b2: float, eps: float, weight_decay: float):
    """Lazy AdamW of rows: ``(delta[U, D], m', v', t')`` with ``p' = p - delta`` for every row
    (the caller keeps untouched rows). ``g, m, v, p [U, D]``, ``t [U]`` the rows' own counts."""
    t1 = t + 1.0
    m1 = b1 * m + (1.0 - b1) * g
    v1 = b2 * v + (1.0 - b2) * (g * g)
    tc = xp.reshape(t1, (-1, 1))
    c1 = 1.0 - b1 ** tc  # the dense AdamW's expressions, in its order: the same rounding
    c2 = 1.0 - b2 ** tc
    direction = (m1 / c1) / (xp.sqrt(v1 / c2) + eps)
    return lr * (direction + weight_decay * p), m1, v1, t1


def rowwise_adagrad_rows(xp, g, acc, p, lr, eps: float, weight_decay: float):
    """Row-wise Adagrad of rows: ``(delta[U, D], acc')`` with ``p' = p - delta``. ``acc [U]``."""
    g2 = g + weight_decay * p if weight_decay else g
    new_acc = acc + xp.mean(g2 * g2, axis=1)
    return lr * g2 / (xp.reshape(xp.sqrt(new_acc), (-1, 1)) + eps), new_acc


def _touched(B: Backend, g):
    """``[N]`` bool: rows of ``g[N, D]`` with a non-zero element."""
    return B.xp.any(g != 0, axis=1)


def _rows_only(B: Backend, u, touched):
    xp = B.xp
    return xp.where(xp.reshape(touched, (-1, 1)), u, -xp.zeros_like(u))


def rowwise_adagrad(learning_rate, eps: float = 1e-8, weight_decay: float = 0.0) -> GradientTransformation:
    """Row-wise Adagrad over ``[N, D]`` leaves (module docstring). State ``{"step", "acc"}``."""
    def init(B: Backend, params):
        xp = B.xp
        return {"step": counter(B), "acc": tree_map(lambda p: xp.zeros((p.shape[0],), dtype=p.dtype,
                                                                       device=B.array_device), params)}

    def update(B: Backend, updates, state, params=None):
        xp = B.xp
        if weight_decay and params is None:
            raise ValueError("rowwise_adagrad with weight decay needs params")
        step = state["step"] + 1.0
        lr = learning_rate_at(learning_rate, xp, step)

        def one(g, acc, p):
            touched = _touched(B, g)
            delta, new_acc = rowwise_adagrad_rows(xp, g, acc, p, lr, eps, weight_decay)
            return _rows_only(B, -delta, touched), xp.where(touched, new_acc, acc)

        ps = params if params is not None else tree_map(lambda g: None, updates)
        pairs = tree_map(lambda g, a, p: one(g, a, p), updates, state["acc"], ps)
        return (tree_map(lambda g, pr: pr[0], updates, pairs),
                {"step": step, "acc": tree_map(lambda g, pr: pr[1], updates, pairs)})

    return GradientTransformation(init, update)


def lazy_adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0) -> GradientTransformation:
    """Lazy (row-sparse) AdamW over ``[N, D]`` leaves (module docstring). State ``{"step", "m",
    "v", "t"}``; needs ``params`` (decoupled weight decay, computed as rowopt does)."""
    def init(B: Backend, params):
        xp = B.xp
        return {"step": counter(B), "m": tree_map(xp.zeros_like, params), "v": tree_map(xp.zeros_like, params),
                "t": tree_map(lambda p: xp.zeros((p.shape[0],), dtype=p.dtype, device=B.array_device), params)}

    def update(B: Backend, updates, state, params=None):
        xp = B.xp
        if params is None:
            raise ValueError("lazy_adam needs params: call update(B, updates, state, params)")
        step = state["step"] + 1.0
        lr = learning_rate_at(learning_rate, xp, step)

        def one(g, m, v, t, p):
            touched = _touched(B, g)
            keep = xp.reshape(touched, (-1, 1))
            delta, m1, v1, t1 = lazy_adam_rows(xp, g, m, v, t, p, lr, b1, b2, eps, weight_decay)
            return (_rows_only(B, -delta, touched), xp.where(keep, m1, m), xp.where(keep, v1, v),
                    xp.where(touched, t1, t))

        outs = tree_map(one, updates, state["m"], state["v"], state["t"], params)
        pick = lambda i: tree_map(lambda g, o: o[i], updates, outs)  # noqa: E731
        return pick(0), {"step": step, "m": pick(1), "v": pick(2), "t": pick(3)}

    return GradientTransformation(init, update)
