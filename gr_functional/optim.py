"""AdamW as a pair of pure functions over parameter pytrees (optax style).

``state = adamw_init(B, params)``; ``params, state = adamw_update(B, grads, state, params, cfg)``.
Matches torch.optim.AdamW and optax.adamw (tests/differential/test_optim.py proves it):
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    p = p - lr_t * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * p)
with lr_t = ``learning_rate(t)`` (``optim.schedule``; constant ``optim.lr`` by default).
"""
from __future__ import annotations

import math

from .config import OptimConfig, replace
from .errors import ConfigError
from .tree import tree_map


def adamw_init(B, params: dict) -> dict:
    xp = B.xp
    return {
        "step": B.asarray(0.0, dtype=B.float_dtype),
        "mu": tree_map(xp.zeros_like, params),
        "nu": tree_map(xp.zeros_like, params),
    }


def run_updates(steps_per_epoch: int, cfg) -> int:
    """The number of optimizer updates a run of ``cfg`` makes: ``ceil(steps_per_epoch /
    train.accumulate) * train.epochs``, capped by ``train.max_steps`` when that is set."""
    tc = cfg.train
    total = -(-steps_per_epoch // tc.accumulate) * tc.epochs
    return min(total, tc.max_steps) if tc.max_steps else total


def resolve_schedule(cfg, steps_per_epoch: int):
    """``cfg`` with ``optim.decay_steps = 0`` under a decaying schedule made concrete: the decay
    ends with the run (its updates minus the warmup). Resolved once the data gives the steps per
    epoch and recorded in the run's config.toml, so ``--set train.epochs=20`` on a recipe keeps its
    shape: a cosine over 20 epochs there, over 101 at the recipe's default."""
    o = cfg.optim
    if o.schedule == "constant" or o.decay_steps > 0:
        return cfg
    updates = run_updates(steps_per_epoch, cfg)
    decay = updates - o.warmup_steps
    if decay < 1:
        raise ConfigError(f"optim.decay_steps = 0 decays over the run after the warmup, but the run makes "
                          f"{updates} update(s) and optim.warmup_steps = {o.warmup_steps}; lower the warmup "
                          f"or set optim.decay_steps >= 1")
    return replace(cfg, optim={"decay_steps": decay})


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
