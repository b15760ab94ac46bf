"""The dense optimizers as transforms: AdamW, Adagrad, SGD (momentum, Nesterov), Lion.

Each is a *rule* (how a gradient becomes a direction, with its moments) under one descent step::

    t' = t + 1;  d, moments' = rule(g, moments, t');  u = -(lr(t') * (d + wd * p))

``lr`` a number or a schedule of ``t'`` (``schedules``), ``wd`` decoupled weight decay (AdamW's:
added to the direction, scaled by the learning rate, as optax's ``add_decayed_weights`` before
``scale_by_learning_rate``). State: one dict ``{"step": 0-d float (master dtype), **moments}``
with moments trees like params: stable checkpoint paths (``opt.step``, ``opt.mu.*``) and the
schedule's count beside the moments, so a resume continues both exactly.

Why one fused transform per optimizer and not optax's ``chain(scale_by_adam(), ...)``: AdamW must
stay bitwise the step's first AdamW (tests/differential/optim_oracle.py) (and its checkpoints' keys ``step``/``mu``/``nu``); the rules
are also exposed as chainable transforms (``scale_by_adam``, ``scale_by_rss``, ``trace``,
``scale_by_lion``) for composing one's own.

Rules (per leaf, fp32 in the master dtype; optax's semantics):
- adam:  ``mu' = b1 mu + (1-b1) g; nu' = b2 nu + (1-b2) g^2;
          d = (mu' / (1-b1^t')) / (sqrt(nu' / (1-b2^t')) + eps)``          (optax.scale_by_adam)
- rss:   ``s' = g^2 + s  (s_0 = initial_accumulator_value);
          d = where(s' > 0, 1 / sqrt(s' + eps), 0) * g``                    (optax.scale_by_rss)
- trace: ``tr' = g + m tr;  d = g + m tr' (nesterov) or tr'``              (optax.trace)
- lion:  ``d = sign((1-b1) g + b1 mu);  mu' = (1-b2) g + b2 mu``           (optax.scale_by_lion)
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ..tree import tree_map
from .schedules import learning_rate_at
from .transform import GradientTransformation, counter
from ..contracts import Backend


class Rule(NamedTuple):
    """``init(B, params) -> {name: tree like params}``; ``direction(B, grads, moments, step) ->
    (direction tree, new moments)``, ``step`` the 1-based number of this update (0-d float)."""

    init: Callable
    direction: Callable


# ----------------------------------------------------------------------------- rules
def adam_rule(b1: float, b2: float, eps: float) -> Rule:
    def init(B: Backend, params):
        xp = B.xp
        return {"mu": tree_map(xp.zeros_like, params), "nu": tree_map(xp.zeros_like, params)}

    def direction(B: Backend, grads, moments, step):
        xp = B.xp
        # the expressions and their order are the first AdamW's (optim_oracle.py): bitwise the same numbers
        mu = tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, moments["mu"], grads)
        nu = tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), moments["nu"], grads)
        c1 = 1.0 - b1 ** step
        c2 = 1.0 - b2 ** step
        d = tree_map(lambda m, v: (m / c1) / (xp.sqrt(v / c2) + eps), mu, nu)
        return d, {"mu": mu, "nu": nu}

    return Rule(init, direction)


def rss_rule(initial_accumulator_value: float, eps: float) -> Rule:
    def init(B: Backend, params):
        xp = B.xp
        return {"sum_of_squares": tree_map(lambda p: xp.full_like(p, initial_accumulator_value), params)}

    def direction(B: Backend, grads, moments, step):
        xp = B.xp
        acc = tree_map(lambda g, s: g * g + s, grads, moments["sum_of_squares"])
        # s' == 0 (a zero start and zero gradients so far): no step rather than 0 / sqrt(eps)
        d = tree_map(lambda s, g: xp.where(s > 0, 1.0 / xp.sqrt(s + eps), xp.zeros_like(s)) * g, acc, grads)
        return d, {"sum_of_squares": acc}

    return Rule(init, direction)


def trace_rule(decay: float, nesterov: bool = False) -> Rule:
    def init(B: Backend, params):
        return {"trace": tree_map(B.xp.zeros_like, params)}

    def direction(B: Backend, grads, moments, step):
        new = tree_map(lambda g, t: g + decay * t, grads, moments["trace"])
        d = tree_map(lambda g, t: g + decay * t, grads, new) if nesterov else new
        return d, {"trace": new}

    return Rule(init, direction)


def lion_rule(b1: float, b2: float) -> Rule:
    def init(B: Backend, params):
        return {"mu": tree_map(B.xp.zeros_like, params)}

    def direction(B: Backend, grads, moments, step):
        xp = B.xp
        d = tree_map(lambda g, m: xp.sign((1.0 - b1) * g + b1 * m), grads, moments["mu"])
        mu = tree_map(lambda g, m: (1.0 - b2) * g + b2 * m, grads, moments["mu"])
        return d, {"mu": mu}

    return Rule(init, direction)


def no_rule() -> Rule:
    """The gradient itself (plain SGD): no moments."""
    return Rule(lambda B, params: {}, lambda B, grads, moments, step: (grads, {}))


# ----------------------------------------------------------------------------- transforms from rules
def direction_transform(rule: Rule) -> GradientTransformation:
    """The rule's direction as the updates (no learning rate, no sign): a chainable block.
    State ``{"step", **moments}``."""
    def init(B: Backend, params):
        return {"step": counter(B), **rule.init(B, params)}

    def update(B: Backend, updates, state, params=None):
        step = state["step"] + 1.0
        d, moments = rule.direction(B, updates, {k: v for k, v in state.items() if k != "step"}, step)
        return d, {"step": step, **moments}

    return GradientTransformation(init, update)


def descent(rule: Rule, learning_rate, weight_decay: float = 0.0, *, decay_always: bool = False,
            name: str = "optimizer") -> GradientTransformation:
    """``u = -(lr(t') * (d + wd * p))`` of the rule's direction ``d`` (module docstring).

    ``weight_decay == 0`` skips the decay term (and ``params`` are then not needed) unless
    ``decay_always``: AdamW keeps ``d + 0.0 * p`` to stay bitwise the step's first AdamW (tests/differential/optim_oracle.py)."""
    with_decay = decay_always or weight_decay != 0.0

    def init(B: Backend, params):
        return {"step": counter(B), **rule.init(B, params)}

    def update(B: Backend, updates, state, params=None):
        if with_decay and params is None:
            raise ValueError(f"{name} with weight decay needs params: call update(B, updates, state, params)")
        step = state["step"] + 1.0
        lr = learning_rate_at(learning_rate, B.xp, step)
        d, moments = rule.direction(B, updates, {k: v for k, v in state.items() if k != "step"}, step)
        if with_decay:
            # -(lr * x) then p + u: bitwise p - lr * x (negation is exact)
            out = tree_map(lambda d_, p: -(lr * (d_ + weight_decay * p)), d, params)
        else:
            out = tree_map(lambda d_: -(lr * d_), d)
        return out, {"step": step, **moments}

    return GradientTransformation(init, update)


# ----------------------------------------------------------------------------- building blocks
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's bias-corrected direction (optax.scale_by_adam, eps_root 0). State ``{"step", "mu", "nu"}``."""
    return direction_transform(adam_rule(b1, b2, eps))


def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """Adagrad's direction (optax.scale_by_rss). State ``{"step", "sum_of_squares"}``."""
    return direction_transform(rss_rule(initial_accumulator_value, eps))


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum (optax.trace). State ``{"step", "trace"}``."""
    return direction_transform(trace_rule(decay, nesterov))


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's sign direction (optax.scale_by_lion). State ``{"step", "mu"}``."""
    return direction_transform(lion_rule(b1, b2))


# ----------------------------------------------------------------------------- optimizers
def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4) -> GradientTransformation:
    """AdamW (optax.adamw; torch.optim.AdamW), the step's dense optimizer: bitwise the first AdamW
    (tests/differential/optim_oracle.py) on every backend for the same learning rate (a number, or
    ``schedules.from_config(cfg)``). State exactly ``{"step": 0-d float, "mu": tree, "nu": tree}``,
    checkpoint-compatible with every run since the first."""
    return descent(adam_rule(b1, b2, eps), learning_rate, weight_decay, decay_always=True, name="adamw")


def adagrad(learning_rate, initial_accumulator_value: float = 0.1, eps: float = 1e-7,
            weight_decay: float = 0.0) -> GradientTransformation:
    """Adagrad (optax.adagrad; with ``weight_decay`` also optax's ``add_decayed_weights`` before the
    learning rate). State ``{"step", "sum_of_squares"}``."""
    return descent(rss_rule(initial_accumulator_value, eps), learning_rate, weight_decay, name="adagrad")


def sgd(learning_rate, momentum: float | None = None, nesterov: bool = False,
        weight_decay: float = 0.0) -> GradientTransformation:
    """SGD (optax.sgd): heavy-ball ``momentum`` (None: plain, no state but ``step``), optionally
    Nesterov; ``weight_decay`` decoupled (SGDW). State ``{"step", "trace"}`` with momentum."""
    if nesterov and momentum is None:
        raise ValueError("sgd: nesterov=True needs a momentum")
    rule = no_rule() if momentum is None else trace_rule(momentum, nesterov)
    return descent(rule, learning_rate, weight_decay, name="sgd")


def lion(learning_rate, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3) -> GradientTransformation:
    """Lion (optax.lion). State ``{"step", "mu"}``."""
    return descent(lion_rule(b1, b2), learning_rate, weight_decay, name="lion")
