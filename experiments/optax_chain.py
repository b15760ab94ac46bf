"""An optax chain as a run's optimizer: registered by name, trained by ``grf.fit``, checkpointed and
resumed bitwise like the built-in ones (JAX backend). Run it (again to resume after a kill):

    python experiments/optax_chain.py runs/optax-chain [key=value ...]

The five lines that matter are the registration and the config; ``optax=True`` tells the registry
that the builder returns an optax transformation, so its state is kept as dicts a checkpoint holds
and ``learning_rate`` arrives as optax wants it (a number or ``count -> lr``: the config's
``optim.lr`` and schedule). tests/reliability/test_optimizers_train.py kills and resumes it.
"""
import sys

import optax

import gr_functional as grf
from gr_functional.optimizers import register_optimizer


@register_optimizer("clipped_adabelief", optax=True)
def clipped_adabelief(cfg, learning_rate):
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adabelief(learning_rate, b1=cfg.beta1, b2=cfg.beta2))


if __name__ == "__main__":  # a resume or `grf eval` imports this file again: train only when run
    out, sets = (sys.argv[1] if len(sys.argv) > 1 else "runs/optax-chain"), sys.argv[2:]
    cfg = grf.load_config("quickstart", ["backend.name=jax", "optim.name=clipped_adabelief", *sets])
    print(grf.fit(cfg, out))
