"""How many updates a run makes, and the decay of its schedule resolved from them. The optimizer
formulas themselves live once, in ``gr_functional.optimizers`` (the step composes them there).
"""
from __future__ import annotations

from .config import replace
from .errors import ConfigError


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
