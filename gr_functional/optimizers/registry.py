"""Optimizers by name: ``optim.name`` in a config picks one, ``build`` makes its transform.

    @register_optimizer("my_opt")
    def my_opt(cfg: OptimConfig, learning_rate) -> GradientTransformation: ...

A builder gets the ``OptimConfig`` and the learning rate (a number, or the schedule of
``optim.schedule``: ``schedules.from_config``, a function ``(xp, t)`` of the 1-based update
number) and returns a transform. An optax builder (JAX backend only) returns an optax
transformation, a chain included, and gets the learning rate as optax wants it (a number, or
``count -> lr`` of optax's 0-based count)::

    @register_optimizer("clipped_adabelief", optax=True)
    def clipped_adabelief(cfg, learning_rate):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adabelief(learning_rate, b1=cfg.beta1))

Its state is kept as nested dicts (``optax_adapter.with_dict_state``), so ``grf train``
checkpoints and resumes it bitwise, as ``"optax:NAME"``. Shipped: ``adamw``,
``adagrad``, ``sgd`` (``optim.momentum``, ``optim.nesterov``; momentum 0 = plain SGD), ``lion``
(``beta1``/``beta2``). ``"optax:NAME"`` (JAX backend only) builds ``optax.NAME(learning_rate=
schedule, ...)`` with the config's matching hyper-parameters (``optax_adapter``); the prefix is
reserved, so no registered name starts with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError
from ..registry import Registry
from . import optimizers as opt
from .schedules import from_config
from .transform import GradientTransformation, is_optax
from ..contracts import Backend

if TYPE_CHECKING:
    from ..config import OptimConfig

OPTAX_PREFIX = "optax:"

OPTIMIZERS: Registry[Callable] = Registry(
    "optimizer", config_key="optim.name",
    how="Set optim.name to one of them (or 'optax:' and an optax optimizer's name on the JAX backend), or register one with "
        "@gr_functional.optimizers.register_optimizer(NAME) in a module passed to grf train --plugin")


# names whose builders return optax transformations (register_optimizer(..., optax=True))
OPTAX_BUILDERS: set[str] = set()
# the optim.* keys only some optimizers read; a user's key the chosen one does not read is refused
OPTIMIZER_KEYS = ("beta1", "beta2", "eps", "weight_decay", "momentum", "nesterov", "initial_accumulator")
READS: dict[str, tuple[str, ...]] = {}


def register_optimizer(name: str, *, replace: bool = False, optax: bool = False, reads: tuple | None = None):
    """Decorator: register ``builder(cfg: OptimConfig, learning_rate) -> GradientTransformation`` as
    ``optim.name = name``.

    Args:
      name: the ``optim.name`` value (not starting with "optax:", reserved for optax's own).
      replace: replace another definition registered under ``name``.
      optax: the builder returns an ``optax.GradientTransformation`` (a chain included) and gets
        optax's learning rate (module docstring); JAX backend only.
      reads: which of ``OPTIMIZER_KEYS`` the builder reads; a config that sets another one is refused
        by name (None: not declared, nothing refused).
    Returns:
      the decorator. Raises ValueError for a taken name, a reserved one or an unknown key in ``reads``.
    """
    unknown = set(reads or ()) - set(OPTIMIZER_KEYS)
    if unknown:
        raise ValueError(f"register_optimizer({name!r}, reads=...): {sorted(unknown)} are not optimizer keys; "
                         f"the keys some optimizers read: {', '.join(OPTIMIZER_KEYS)}")
    if not isinstance(name, str) or not name or name.startswith(OPTAX_PREFIX):
        raise ValueError(f"optimizer name {name!r}: a non-empty name not starting with {OPTAX_PREFIX!r} "
                         f"(reserved for optax's optimizers)")

    def decorate(builder: Callable) -> Callable:
        OPTIMIZERS.add(name, builder, replace=replace)
        (OPTAX_BUILDERS.add if optax else OPTAX_BUILDERS.discard)(name)
        READS.pop(name, None) if reads is None else READS.__setitem__(name, tuple(reads))
        return builder

    return decorate


def names() -> tuple[str, ...]:
    return OPTIMIZERS.names()


def _optim(cfg) -> "OptimConfig":
    return getattr(cfg, "optim", cfg)


def check_config(cfg) -> str | None:
    """Why ``cfg.optim.name`` cannot be built (a message naming ``optim.name``), or None. ``cfg``:
    a whole ``Config`` (its ``backend.name`` is checked for ``optax:``) or an ``OptimConfig``."""
    name = _optim(cfg).name
    backend = getattr(getattr(cfg, "backend", None), "name", None)
    if isinstance(name, str) and name.startswith(OPTAX_PREFIX):
        if backend is not None and backend != "jax":
            return optax_refusal(name, backend)
        from .optax_adapter import optax_problem  # imports optax: only for an optax name on JAX

        return optax_problem(name[len(OPTAX_PREFIX):])
    if name not in OPTIMIZERS:
        return OPTIMIZERS.unknown_message(name)
    if name in OPTAX_BUILDERS and backend is not None and backend != "jax":
        return optax_refusal(name, backend)
    return None


def unread_keys(name: str) -> set[str]:
    """The ``OPTIMIZER_KEYS`` that optimizer ``name`` does not read (empty when it did not declare
    them); for ``"optax:NAME"``, those optax.NAME takes no keyword for."""
    if name.startswith(OPTAX_PREFIX):
        from .optax_adapter import optax_reads  # imports optax: only for an optax name

        reads = optax_reads(name[len(OPTAX_PREFIX):])
    else:
        reads = READS.get(name)
    return set() if reads is None else set(OPTIMIZER_KEYS) - set(reads)


def optax_refusal(name: str, backend: str) -> str:
    return (f"optim.name={name!r} is an optax optimizer, which runs on the JAX backend only (this backend: "
            f"{backend!r}); set backend.name=jax, or optim.name to one of {', '.join(names())}")


def build(B: Backend, optim_cfg) -> GradientTransformation:
    """The transform of ``optim_cfg.name`` (an ``OptimConfig``, or a ``Config``) with its schedule,
    for backend ``B``. ConfigError naming ``optim.name`` for an unknown name or an optax name off
    JAX."""
    optim = _optim(optim_cfg)
    name = optim.name
    schedule = from_config(optim)
    if name.startswith(OPTAX_PREFIX):
        if B.name != "jax":
            raise ConfigError(optax_refusal(name, B.name))
        from .optax_adapter import build_optax  # imports optax (and jax): only when one is asked for

        return build_optax(B, name[len(OPTAX_PREFIX):], optim, schedule)
    builder = OPTIMIZERS.get_or(name, lambda msg: ConfigError(f"optim.name={name!r}: {msg}"))
    if name in OPTAX_BUILDERS:
        if B.name != "jax":
            raise ConfigError(optax_refusal(name, B.name))
        from .optax_adapter import as_optax_schedule, with_dict_state  # imports optax: only when asked for

        return with_dict_state(builder(optim, as_optax_schedule(schedule, B.xp)))
    tx = builder(optim, schedule)
    if is_optax(tx):
        raise ConfigError(f"optim.name={name!r}: its builder returned an optax transformation; register it with "
                          f"@register_optimizer({name!r}, optax=True), which keeps optax's state so that runs "
                          f"checkpoint and resume, and passes the learning rate as optax wants it")
    return tx


# ----------------------------------------------------------------------------- shipped
@register_optimizer("adamw", reads=("beta1", "beta2", "eps", "weight_decay"))
def _adamw(cfg: "OptimConfig", learning_rate) -> GradientTransformation:
    return opt.adamw(learning_rate, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)


@register_optimizer("adagrad", reads=("initial_accumulator", "eps", "weight_decay"))
def _adagrad(cfg: "OptimConfig", learning_rate) -> GradientTransformation:
    return opt.adagrad(learning_rate, initial_accumulator_value=cfg.initial_accumulator, eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


@register_optimizer("sgd", reads=("momentum", "nesterov", "weight_decay"))
def _sgd(cfg: "OptimConfig", learning_rate) -> GradientTransformation:
    # momentum 0 is plain SGD (no trace state); with nesterov the trace is kept even at 0
    momentum = cfg.momentum if (cfg.momentum or cfg.nesterov) else None
    return opt.sgd(learning_rate, momentum=momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)


@register_optimizer("lion", reads=("beta1", "beta2", "weight_decay"))
def _lion(cfg: "OptimConfig", learning_rate) -> GradientTransformation:
    return opt.lion(learning_rate, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)
