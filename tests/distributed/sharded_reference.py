"""The JAX data-parallel reference, run as a subprocess by test_jax_sharded.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.distributed.sharded_reference OUT.npz SETS...

Trains ``train.max_steps`` steps of the tiny config (``--set``-style SETS) with
``backends.dist_jax.make_sharded_train_step`` over 2 forced host devices: each device ("rank") takes its
``dist.balance`` share of every global batch (``TrainLoader.rank_batches(capacity="common")``),
gradients are ``psum``-med. Writes the final params (tree paths -> arrays) to OUT.npz. XLA reads
XLA_FLAGS once, when JAX starts, hence a separate process.
"""
from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str]) -> None:
    import jax

    from backends import get_backend
    from backends.dist_jax import make_sharded_train_step, stack_rank_batches
    from gr_functional import model
    from gr_functional.configure import load_config
    from gr_functional.data import batching, split
    from gr_functional.retrieval.task import load_sequences, resolve
    from gr_functional.step import init_opt_state, rank_scales
    from gr_functional.tree import tree_items

    from ..reliability.common import ROOT

    out, sets = argv[0], argv[1:]
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"need 2 jax devices, got {devices}: set XLA_FLAGS=--xla_force_host_platform_device_count=2")
    R = 2
    cfg = load_config(ROOT / "experiments" / "configs" / "quickstart.toml", sets)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    train_loader = batching.TrainLoader.from_config(split.leave_one_out(data).train, cfg, world_size=R)
    B = get_backend("jax")
    params = B.asarray_tree(model.init_params(cfg.model, seed=cfg.train.seed))
    opt_state = init_opt_state(B, params, cfg)
    step = make_sharded_train_step(B, cfg, devices[:R])
    done, epoch = 0, 0
    while done < cfg.train.max_steps:
        for s in range(train_loader.steps_in_epoch(epoch)):
            parts = train_loader.rank_batches(epoch, s, capacity="common")
            G = parts[0].global_tokens
            scales = [rank_scales([p.tokens], G, R) for p in parts]   # [R, 1]
            params, opt_state, m = step(params, opt_state, [stack_rank_batches([p.batch for p in parts])], scales, G)
            assert bool(m["finite"]), f"step {done + 1} not finite"
            done += 1
            if done == cfg.train.max_steps:
                break
        epoch += 1
    np.savez(out, **{k: np.asarray(v) for k, v in tree_items(B.to_numpy_tree(params))})


if __name__ == "__main__":
    main(sys.argv[1:])
