"""A loss of one's own, end to end: BPR (pairwise) instead of GR's sampled softmax.

As a plugin of `grf train` (the name goes into config.toml and every checkpoint; a resume
under another loss is refused):

    grf train --config ml1m_hstu --plugin experiments/bpr_loss.py --set loss.name=bpr --out runs/ml1m_bpr
    grf train ... --set loss.name=bpr --set loss.bpr_margin=0.5     # its own key, checked and recorded

As a script: a look at the new loss on real batches of the config's data, on two backends,
before training with it (same params, same batches: the losses agree to float rounding):

    python experiments/bpr_loss.py --config ml1m_hstu --batches 3
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import gr_functional as grf


# The loss's own hyper-parameter is a config key: `--set loss.bpr_margin=0.5` is checked (a number
# >= 0), recorded in config.toml and every checkpoint, compared on resume and shown by grf report.
@grf.config.register_keys("loss", when="loss.name=bpr")
@dataclass(frozen=True)
class BPRKeys:
    bpr_margin: float = grf.config.key(0.0, ge=0.0, help="bpr: the positive's logit must beat each negative's by "
                                                          "this much (0 = plain BPR)")


@grf.losses.register("bpr", negatives="sampled")
def bpr(B, user, items, batch, cfg):
    """BPR: mean over sampled negatives of -log sigmoid(pos - neg - loss.bpr_margin), weighted
    over positions.

    user[T, D], items[N+1, D] (L2-normalised), batch.targets[T], batch.negatives[T, R] int32."""
    xp = B.xp
    pos = grf.losses.positive_logits(B, user, items, batch.targets, cfg.temperature)     # [T]
    neg = B.sampled_logits(user, items, batch.negatives) / cfg.temperature                # [T, R]
    margin = xp.reshape(pos, (-1, 1)) - neg
    if cfg.bpr_margin:
        margin = margin - cfg.bpr_margin
    # -log sigmoid(m) = log(1 + e^-m) = logsumexp([0, -m]): stable for any margin
    per_pair = B.logsumexp(xp.stack([xp.zeros_like(margin), -margin]), axis=0)            # [T, R]
    hit = batch.negatives == xp.reshape(batch.targets, (-1, 1))                           # the target itself
    per_pair = xp.where(hit, xp.zeros_like(per_pair), per_pair)
    per_position = xp.mean(per_pair, axis=1)
    total = xp.sum(batch.weights)
    return xp.sum(per_position * batch.weights) / xp.maximum(total, xp.ones_like(total))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ml1m_hstu", help="config file or packaged name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--batches", type=int, default=3, help="real training batches to evaluate the loss on")
    args = p.parse_args(argv)

    exp = grf.prepare(args.config, ["loss.name=bpr", *args.set])      # real data, real batches
    params_np = exp.init_params()
    print(f"{exp.data.describe()}; {exp.loader.steps_per_epoch} batches per epoch")
    losses = {}
    for name in args.backends.split(","):
        B = exp.backend(name)
        params = B.asarray_tree(params_np)
        losses[name] = [float(grf.model.loss_fn(B, params, B.asarray_tree(batch), exp.cfg.model, loss=exp.cfg.loss))
                        for _, batch in zip(range(args.batches), exp.batches(epoch=0))]
    for name, values in losses.items():
        print(f"{name:>6}: bpr loss of the first {len(values)} batches: {', '.join(f'{v:.6f}' for v in values)}")
    return losses


if __name__ == "__main__":
    main()
