"""optax on the JAX backend: any ``optax.GradientTransformation`` as a transform of this protocol.

This module imports optax at module level, and optax imports jax: seconds of import time, and
absent on torch-only installs. So nothing imports it at module level; ``as_transform``, ``build``
(``optim.name = "optax:NAME"``) and ``check_config`` import it inside the function, on first use.
(It names no array library itself: the layering test's rule holds.)

The wrapped transform ignores ``B`` except to refuse a backend other than JAX: optax's math is
jax.numpy, and torch tensors are not jax arrays. Its state is optax's own (NamedTuples), which
``transform.select`` / ``map_tree`` enter, so ``apply_if_finite``, ``multi_steps`` and the loss
scaler wrap it like any other.
"""
from __future__ import annotations

import inspect

import optax

from ..errors import ConfigError
from ..registry import did_you_mean
from .schedules import as_optax_schedule
from .transform import GradientTransformation

# optax keyword -> OptimConfig field: what "optax:NAME" passes when NAME's signature takes it
CONFIG_KWARGS = {"b1": "beta1", "b2": "beta2", "eps": "eps", "weight_decay": "weight_decay",
                 "momentum": "momentum", "nesterov": "nesterov",
                 "initial_accumulator_value": "initial_accumulator"}


def require_jax(B, what: str) -> None:
    """``ValueError`` naming the backend unless ``B`` is the JAX backend."""
    name = getattr(B, "name", type(B).__name__)
    if name != "jax":
        raise ValueError(f"{what} is an optax transformation, which runs on the JAX backend only; this backend "
                         f"is {name!r}. Use a transform of gr_functional.optimizers (adamw, adagrad, sgd, lion, "
                         f"...) on {name!r}, or run with backend.name=jax")


def from_optax(tx) -> GradientTransformation:
    """``tx`` (an ``optax.GradientTransformation``) as ``(init(B, params), update(B, updates, state,
    params))``; JAX backend only (ValueError naming the backend otherwise, at init/update)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"from_optax needs an optax.GradientTransformation, got {tx!r}")
    what = f"from_optax({type(tx).__name__})"

    def init(B, params):
        require_jax(B, what)
        return tx.init(params)

    def update(B, updates, state, params=None):
        require_jax(B, what)
        return tx.update(updates, state, params)

    return GradientTransformation(init, update)


def _optimizers() -> list[str]:
    """optax's public callables that take a ``learning_rate`` (its optimizers)."""
    out = []
    for name in dir(optax):
        fn = getattr(optax, name)
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        try:
            if "learning_rate" in inspect.signature(fn).parameters:
                out.append(name)
        except (TypeError, ValueError):
            continue
    return out


def optax_problem(name: str) -> str | None:
    """Why ``optax:NAME`` cannot be built (naming ``optim.name``), or None."""
    fn = getattr(optax, name, None) if name else None
    if fn is None or not callable(fn):
        return (f"optim.name='optax:{name}': optax {optax.__version__} has no optimizer {name!r}"
                f"{did_you_mean(name, _optimizers())}; optax optimizers: {', '.join(_optimizers())}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "learning_rate" not in params:
        return f"optim.name='optax:{name}': optax.{name} takes no learning_rate, it is not an optimizer"
    return None


def build_optax(B, name: str, cfg, learning_rate) -> GradientTransformation:
    """``from_optax(optax.NAME(learning_rate=..., **matching))``: the schedule shifted to optax's
    0-based count (``schedules.as_optax_schedule``), and of ``CONFIG_KWARGS`` those NAME takes."""
    require_jax(B, f"optim.name='optax:{name}'")
    problem = optax_problem(name)
    if problem:
        raise ConfigError(problem)
    fn = getattr(optax, name)
    params = inspect.signature(fn).parameters
    kwargs = {k: getattr(cfg, field) for k, field in CONFIG_KWARGS.items() if k in params}
    return from_optax(fn(learning_rate=as_optax_schedule(learning_rate, B.xp), **kwargs))
