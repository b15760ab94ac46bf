"""HSTU as a flax.nnx module trained in a plain JAX loop with optax, on the real batches of a config.

The model is ``gr_functional.interop.flax_nnx.HSTU`` (the project's HSTU, parameters one-to-one with the
functional tree); the loop is the textbook nnx one: ``nnx.value_and_grad`` of the loss, an
``nnx.Optimizer`` over ``optax.adamw``. With the config's optimizer values (GR's AdamW: lr 1e-3,
betas 0.9 / 0.98, no weight decay) it follows ``grf train --backend jax`` step for step: same
initial parameters, same batches (negatives and dropout masks are data), same loss.

    python experiments/flax_optax_loop.py --config ml1m_hstu --steps 20
    grf train --config ml1m_hstu --backend jax --set train.max_steps=20 --set train.log_every=1 --out runs/jax20
    # the printed losses equal the "loss" of runs/jax20/metrics.jsonl's train records
"""
from __future__ import annotations

import argparse

import optax
from flax import nnx

import gr_functional as grf
from gr_functional.interop.flax_nnx import HSTU


def train(config: str, steps: int, sets=()) -> list[float]:
    """The losses of the first ``steps`` training steps of ``config`` (epoch 0, its order)."""
    exp = grf.prepare(config, ["backend.name=jax", *sets])
    cfg = exp.cfg
    hstu = HSTU(cfg.model, exp.init_params())
    o = cfg.optim
    optimizer = nnx.Optimizer(hstu, optax.adamw(o.lr, b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay),
                              wrt=nnx.Param)

    @nnx.jit
    def step(hstu, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch, cfg.loss))(hstu)
        optimizer.update(hstu, grads)
        return loss

    losses = []
    for i, batch in enumerate(exp.batches(epoch=0)):
        if i == steps:
            break
        losses.append(float(step(hstu, optimizer, hstu.backend.asarray_tree(batch))))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="ml1m_hstu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    for i, loss in enumerate(train(args.config, args.steps, args.set), 1):
        print(f"step {i}: loss {loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
