"""Optimizers as composable transforms: optax's protocol, on ``B.xp`` (DESIGN "One shape").

    from gr_functional import optimizers as O

    tx = O.build(B, cfg.optim)                       # optim.name: adamw | adagrad | sgd | lion | optax:NAME
    tx = O.partition({"dense": tx, "table": O.rowwise_adagrad(lr)}, labels)
    tx = O.apply_if_finite(O.multi_steps(tx, 4))
    state = tx.init(B, params)
    updates, state = tx.update(B, grads, state, params)
    params = O.apply_updates(B, params, updates)

Modules, one concern each: ``transform`` (the protocol, chain, partition, masked,
apply_if_finite, scale_by_schedule), ``schedules`` (learning rate as a function of the update
number), ``optimizers`` (AdamW, Adagrad, SGD, Lion and their rules), ``rowwise`` (row-wise table
optimizers), ``accumulate`` (gradient accumulation), ``loss_scale`` (fp16 dynamic loss scaling),
``registry`` (names -> builders, ``build``, ``check_config``), ``optax_adapter`` (optax on JAX:
imported on first use only, since it imports optax and so jax).

Layering: imports only leaf utilities (tree, errors, registry; config for types) and no array
library. The step (step.py) builds its dense optimizer here (``build``) and takes its learning rate
from ``schedules``; each formula is written once (tests/differential/optim_oracle.py keeps the step's
first AdamW and schedule as the oracles they equal bit for bit).
"""
from __future__ import annotations

from .accumulate import multi_steps
from .loss_scale import dynamic_loss_scaling, init_loss_scale, unscale, update_loss_scale
from .optimizers import (Rule, adagrad, adam_rule, adamw, descent, direction_transform, lion, lion_rule, no_rule,
                         rss_rule, scale_by_adam, scale_by_lion, scale_by_rss, sgd, trace, trace_rule)
from .registry import OPTAX_PREFIX, OPTIMIZERS, build, check_config, names, register_optimizer
from .rowwise import lazy_adam, rowwise_adagrad
from .schedules import (Schedule, as_optax_schedule, constant, cosine_decay, from_config, linear_decay,
                        linear_warmup, schedule, warmup_cosine_decay, warmup_linear_decay)
from .transform import (GradientTransformation, add_decayed_weights, all_finite, apply_if_finite, apply_updates,
                        as_transform, chain, identity, masked, partition, scale, scale_by_learning_rate,
                        scale_by_schedule, select)


def from_optax(tx) -> GradientTransformation:
    """An ``optax.GradientTransformation`` as a transform of this protocol (JAX backend only:
    ValueError naming the backend elsewhere). Imports optax (``optax_adapter``) on first use."""
    from .optax_adapter import from_optax as wrap

    return wrap(tx)


def with_dict_state(tx) -> GradientTransformation:
    """An ``optax.GradientTransformation`` as a transform whose state is nested dicts, which
    ``grf train`` checkpoints and resumes bitwise (JAX backend only; ``optax_adapter``). What
    ``register_optimizer(NAME, optax=True)`` and ``optim.name = "optax:NAME"`` apply for you."""
    from .optax_adapter import with_dict_state as wrap

    return wrap(tx)


__all__ = [
    "GradientTransformation", "OPTAX_PREFIX", "OPTIMIZERS", "Rule", "Schedule", "adagrad", "adam_rule", "adamw",
    "add_decayed_weights", "all_finite", "apply_if_finite", "apply_updates", "as_optax_schedule", "as_transform",
    "build", "chain", "check_config", "constant", "cosine_decay", "descent", "direction_transform",
    "dynamic_loss_scaling", "from_config", "from_optax", "identity", "init_loss_scale", "lazy_adam", "linear_decay",
    "linear_warmup", "lion", "lion_rule", "masked", "multi_steps", "names", "no_rule", "partition",
    "register_optimizer", "rowwise_adagrad", "rss_rule", "scale", "scale_by_adam", "scale_by_learning_rate",
    "scale_by_lion", "scale_by_rss", "scale_by_schedule", "schedule", "select", "sgd", "trace", "trace_rule",
    "unscale", "update_loss_scale", "warmup_cosine_decay", "warmup_linear_decay", "with_dict_state",
]
