"""optax on the JAX backend: any ``optax.GradientTransformation`` as a transform of this protocol.

This module imports optax at module level, and optax imports jax: seconds of import time, and
absent on torch-only installs. So nothing imports it at module level; ``as_transform``, ``build``
(``optim.name = "optax:NAME"``) and ``check_config`` import it inside the function, on first use.
(It names no array library itself: the layering test's rule holds.)

The wrapped transform ignores ``B`` except to refuse a backend other than JAX: optax's math is
jax.numpy, and torch tensors are not jax arrays. Its state is optax's own (NamedTuples), which
``transform.select`` / ``map_tree`` enter, so ``apply_if_finite``, ``multi_steps`` and the loss
scaler wrap it like any other. ``optim.name = "optax:NAME"`` (``build_optax``) keeps that state as
nested dicts instead (``with_dict_state``), which ``grf train`` checkpoints and resumes exactly.
"""
from __future__ import annotations

import inspect

import optax

from ..errors import ConfigError
from ..registry import did_you_mean
from .schedules import as_optax_schedule
from .transform import GradientTransformation
from ..contracts import Backend

# optax keyword -> OptimConfig field: what "optax:NAME" passes when NAME's signature takes it
CONFIG_KWARGS = {"b1": "beta1", "b2": "beta2", "eps": "eps", "weight_decay": "weight_decay",
                 "momentum": "momentum", "nesterov": "nesterov",
                 "initial_accumulator_value": "initial_accumulator"}


def require_jax(B: Backend, what: str) -> None:
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

    def init(B: Backend, params):
        require_jax(B, what)
        return tx.init(params)

    def update(B: Backend, updates, state, params=None):
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


def optax_reads(name: str) -> tuple[str, ...] | None:
    """The ``OptimConfig`` fields ``optax:NAME`` passes (``CONFIG_KWARGS`` its signature takes);
    None when optax has no such optimizer (``optax_problem`` says so)."""
    fn = getattr(optax, name, None)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return tuple(field for k, field in CONFIG_KWARGS.items() if k in params)


def build_optax(B: Backend, name: str, cfg, learning_rate) -> GradientTransformation:
    """``optax.NAME(learning_rate=..., **matching)`` with a state ``grf train`` checkpoints
    (``with_dict_state``): the schedule shifted to optax's 0-based count
    (``schedules.as_optax_schedule``), and of ``CONFIG_KWARGS`` those NAME takes."""
    require_jax(B, f"optim.name='optax:{name}'")
    problem = optax_problem(name)
    if problem:
        raise ConfigError(problem)
    fn = getattr(optax, name)
    params = inspect.signature(fn).parameters
    kwargs = {k: getattr(cfg, field) for k, field in CONFIG_KWARGS.items() if k in params}
    return with_dict_state(fn(learning_rate=as_optax_schedule(learning_rate, B.xp), **kwargs))


# ----------------------------------------------------------------------------- grf train's state
def _as_dict(node):
    """optax's state tree as nested dicts, as a checkpoint stores it: NamedTuple fields by name, a
    tuple's items as "t0", "t1", ... (optax's chains), lists as lists (they mirror parameter lists);
    arrays as they are. Empty parts (``EmptyState()``, None) are left out, as a checkpoint would
    drop them, so a state read back has the same structure as one made here."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return _non_empty({field: _as_dict(getattr(node, field)) for field in node._fields})
    if isinstance(node, tuple):
        return _non_empty({f"t{i}": _as_dict(x) for i, x in enumerate(node)})
    if isinstance(node, list):
        return [_as_dict(x) for x in node]
    if isinstance(node, dict):
        return _non_empty({k: _as_dict(v) for k, v in node.items()})
    return {} if node is None else node


def _non_empty(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if not (isinstance(v, dict) and not v)}


def _from_dict(stored, template):
    """``_as_dict``'s inverse, the structure taken from ``template`` (optax's state of the same
    parameters, ``jax.eval_shape(tx.init, ...)``): the parts left out come back empty."""
    stored = {} if stored is None else stored
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_from_dict(stored.get(f), getattr(template, f)) for f in template._fields))
    if isinstance(template, tuple):
        return tuple(_from_dict(stored.get(f"t{i}"), x) for i, x in enumerate(template))
    if isinstance(template, list):
        return [_from_dict(x, t) for x, t in zip(stored, template)]
    if isinstance(template, dict):
        return {k: _from_dict(stored.get(k), v) for k, v in template.items()}
    if template is None:
        return None
    return stored


def with_dict_state(tx) -> GradientTransformation:
    """``tx`` (an ``optax.GradientTransformation``) as a transform whose state ``grf train`` can
    checkpoint and resume: ``{"step": int32 update count, "optax": optax's state as nested dicts}``
    (``_as_dict``). Each update rebuilds optax's NamedTuples from the structure of ``tx.init`` on
    the update's shapes (``jax.eval_shape``: no arrays are made), so a resumed run continues with
    the exact state it saved."""
    import jax

    base = from_optax(tx)

    def init(B: Backend, params):
        return {"step": B.xp.asarray(0, dtype=B.xp.int32), "optax": _as_dict(base.init(B, params))}

    def update(B: Backend, updates, state, params=None):
        template = jax.eval_shape(tx.init, updates)
        new_updates, inner = base.update(B, updates, _from_dict(state["optax"], template), params)
        return new_updates, {"step": state["step"] + 1, "optax": _as_dict(inner)}

    return GradientTransformation(init, update)
