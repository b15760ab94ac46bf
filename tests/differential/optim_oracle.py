"""The step's AdamW and learning-rate schedule as first written (gr_functional/optim.py before the
one optimizer path): oracles that the package's single implementation (``optimizers.adamw``,
``optimizers.schedules``) must equal bit for bit, so moving the formulas changed no number.

``state = adamw_init(B, params)``; ``params, state = adamw_update(B, grads, state, params, cfg)``:
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    p = p - lr_t * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * p)
with lr_t = ``learning_rate(t)``.
"""
from __future__ import annotations

import math

from gr_functional.config import OptimConfig
from gr_functional.tree import tree_map


def adamw_init(B, params: dict) -> dict:
    xp = B.xp
    return {
        "step": B.asarray(0.0, dtype=B.float_dtype),
        "mu": tree_map(xp.zeros_like, params),
        "nu": tree_map(xp.zeros_like, params),
    }


def learning_rate(xp, t, cfg: OptimConfig):
    """The learning rate of update number ``t`` (1-based; a 0-d float array or a number).

    Linear warmup ``lr * min(1, t / warmup_steps)``, then ``constant``, or a decay over
    ``decay_steps`` updates to ``lr * end_lr_factor``: ``cosine`` (``end + (lr - end) * (1 +
    cos(pi p)) / 2``) or ``linear`` (``lr - (lr - end) p``), ``p = min(1, (t - warmup_steps) /
    decay_steps)``. Equal to optax's ``warmup_cosine_decay_schedule(0, lr, warmup_steps,
    warmup_steps + decay_steps, end)`` (and the linear/constant joins) evaluated at count t, so
    the first update already gets lr / warmup_steps rather than 0."""
    W, lr = cfg.warmup_steps, cfg.lr
    if cfg.schedule == "constant" and W == 0:
        return lr
    after = lr
    if cfg.schedule != "constant":
        if cfg.decay_steps < 1:
            raise ValueError("optim.decay_steps = 0 (decay over the run) is resolved by the run loop "
                             "(gr_functional.optim.resolve_schedule); call it with the steps per epoch first")
        p = xp.clip((t - W) / cfg.decay_steps, 0.0, 1.0)
        shape = (1.0 + xp.cos(math.pi * p)) / 2.0 if cfg.schedule == "cosine" else 1.0 - p
        end = lr * cfg.end_lr_factor
        after = end + (lr - end) * shape
    if W == 0:
        return after
    return xp.where(t < W, lr * t / W, after)


def adamw_update(B, grads: dict, state: dict, params: dict, cfg: OptimConfig):
    """One AdamW step at the scheduled learning rate (``learning_rate`` of the new step count)."""
    xp = B.xp
    b1, b2 = cfg.beta1, cfg.beta2
    step = state["step"] + 1.0
    lr = learning_rate(xp, step, cfg)
    mu = tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
    c1 = 1.0 - b1 ** step
    c2 = 1.0 - b2 ** step

    def apply(p, m, v):
        direction = (m / c1) / (xp.sqrt(v / c2) + cfg.eps)
        return p - lr * (direction + cfg.weight_decay * p)

    new_params = tree_map(apply, params, mu, nu)
    return new_params, {"step": step, "mu": mu, "nu": nu}
