"""Learning-rate schedules: pure functions ``schedule(xp, t) -> lr`` of the update number.

``t`` is the 1-based number of the update being made (a 0-d float array, the optimizer state's
``"step"`` after its increment, or a Python number), the step's convention:
the first update already gets ``lr / warmup_steps`` rather than 0. As functions, ours equal optax's
(``warmup_cosine_decay_schedule(0, lr, W, W + D, end)`` and the linear/constant joins) at the same
number; but an optax optimizer calls its schedule with the 0-based count ``t - 1``, so an optax
optimizer on our schedule gets ``count -> schedule(xp, count + 1)`` (``as_optax_schedule``).

The numerics are those of the step's first schedule operation for operation (the same expressions
in the same order; tests/differential/optim_oracle.py keeps it as the oracle):
linear warmup ``lr * t / W`` for ``t < W``, then ``constant`` lr, or a decay over ``D`` updates to
``end = lr * end_lr_factor``: ``cosine`` ``end + (lr - end) * (1 + cos(pi p)) / 2`` or ``linear``
``end + (lr - end) * (1 - p)``, ``p = clip((t - W) / D, 0, 1)``. A schedule without warmup or decay
returns the Python float ``lr`` (so ``lr * x`` rounds as it always has).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..config import OptimConfig

Schedule = Callable[[Any, Any], Any]   # (xp, t) -> lr: a Python float or a 0-d array

KINDS = ("constant", "cosine", "linear")


def schedule(lr: float, kind: str = "constant", warmup_steps: int = 0, decay_steps: int = 0,
             end_lr_factor: float = 0.0) -> Schedule:
    """The schedule of ``optim.schedule = kind`` (module docstring); every named one below is this."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; one of {', '.join(KINDS)}")
    if kind != "constant" and decay_steps < 1:
        raise ValueError(f"a {kind!r} schedule decays over decay_steps updates; got decay_steps={decay_steps} (in a "
                         f"config, optim.decay_steps = 0 means over the run: the run loop resolves it from the steps "
                         f"per epoch, gr_functional.optim.resolve_schedule)")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    W = warmup_steps

    if kind == "constant" and W == 0:
        def constant_lr(xp, t):
            return lr
        constant_lr.constant_value = lr   # lets an optax adapter pass the float itself
        return constant_lr

    def lr_at(xp, t):
        after = lr
        if kind != "constant":
            p = xp.clip((t - W) / decay_steps, 0.0, 1.0)
            shape = (1.0 + xp.cos(math.pi * p)) / 2.0 if kind == "cosine" else 1.0 - p
            end = lr * end_lr_factor
            after = end + (lr - end) * shape
        if W == 0:
            return after
        return xp.where(t < W, lr * t / W, after)

    return lr_at


def constant(lr: float) -> Schedule:
    """``lr`` at every update."""
    return schedule(lr)


def linear_warmup(lr: float, warmup_steps: int) -> Schedule:
    """``lr * t / warmup_steps`` up to ``lr``, then ``lr``."""
    return schedule(lr, "constant", warmup_steps)


def warmup_cosine_decay(lr: float, warmup_steps: int, decay_steps: int, end_lr_factor: float = 0.0) -> Schedule:
    """Linear warmup then a cosine decay to ``lr * end_lr_factor`` over ``decay_steps`` updates
    (``optax.warmup_cosine_decay_schedule(0, lr, W, W + D, lr * end_lr_factor)`` at ``t``)."""
    return schedule(lr, "cosine", warmup_steps, decay_steps, end_lr_factor)


def warmup_linear_decay(lr: float, warmup_steps: int, decay_steps: int, end_lr_factor: float = 0.0) -> Schedule:
    """Linear warmup then a linear decay to ``lr * end_lr_factor`` over ``decay_steps`` updates."""
    return schedule(lr, "linear", warmup_steps, decay_steps, end_lr_factor)


def cosine_decay(lr: float, decay_steps: int, end_lr_factor: float = 0.0) -> Schedule:
    return schedule(lr, "cosine", 0, decay_steps, end_lr_factor)


def linear_decay(lr: float, decay_steps: int, end_lr_factor: float = 0.0) -> Schedule:
    return schedule(lr, "linear", 0, decay_steps, end_lr_factor)


def from_config(cfg: "OptimConfig") -> Schedule:
    """The schedule of an ``OptimConfig`` (``lr, schedule, warmup_steps, decay_steps,
    end_lr_factor``): the step's learning rate of update ``t`` is ``from_config(cfg)(xp, t)``."""
    return schedule(cfg.lr, cfg.schedule, cfg.warmup_steps, cfg.decay_steps, cfg.end_lr_factor)


def learning_rate(xp, t, cfg: "OptimConfig"):
    """The learning rate of update ``t`` (1-based) under ``cfg``'s schedule: what the step and the
    row-sparse table update with (``from_config(cfg)(xp, t)``)."""
    return from_config(cfg)(xp, t)


def learning_rate_at(learning_rate, xp, t):
    """``learning_rate`` (a number or a schedule) at update ``t``."""
    return learning_rate(xp, t) if callable(learning_rate) else learning_rate


def as_optax_schedule(learning_rate, xp):
    """``learning_rate`` (a number or a schedule) as optax wants it: a number stays a number; a
    schedule becomes ``count -> schedule(xp, count + 1)`` (optax's count is 0-based)."""
    if not callable(learning_rate):
        return learning_rate
    if hasattr(learning_rate, "constant_value"):
        return learning_rate.constant_value
    return lambda count: learning_rate(xp, count + 1.0)
