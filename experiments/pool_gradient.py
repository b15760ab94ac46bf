"""Research check: does a logQ-corrected shared pool estimate the full softmax's gradient?

The wide-negatives study (docs/guides/wide-negatives.md) found a shared pool of 2,048 uniform
negatives with the logQ correction .033 test HR@10 below the full softmax it should estimate,
at the same temperature. This script looks at one real batch through a trained model's eyes:

1. a pool holding every item once (logQ = log(N * 1/N) = 0) must give the full softmax's loss and
   gradients exactly (a wrong correction or mask would show here);
2. pools of R uniform draws, many times over: how far the mean loss and mean gradient (for the
   user vectors, which reach the model, and for the item table) are from the full softmax's,
   and how far a single draw's gradient is (the noise each step trains on).

    python experiments/pool_gradient.py [--run runs/negatives/hstu-full-t10-e20-s42]
        [--pools 512,2048,3952] [--private 128,512] [--draws 32] [--temperature T]
        [--record results/quality/pool-gradient.jsonl]

Written with the public API (``grf.prepare``, ``losses.get``), as a user would.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

import gr_functional as grf
from gr_functional import losses, model, results
from gr_functional.checkpoint import load_checkpoint


def loss_and_grads(B, params, batch, user, cfg, loss_fn):
    """``(loss, d loss / d user[T, D], d loss / d item_emb[N+1, D])`` of
    ``loss_fn(B, user, items, batch, cfg.loss)``, the user vectors held fixed."""
    import torch

    user = user.detach().requires_grad_(True)
    table = params["item_emb"].detach().requires_grad_(True)
    items = B.l2_normalize(table, cfg.model.l2_eps)
    value = loss_fn(B, user, items, batch, cfg.loss)
    g_user, g_items = torch.autograd.grad(value, (user, table))
    return float(value.detach()), g_user.double().numpy(), g_items.double().numpy()


def shared(name, ids, logq):
    """The registered loss ``name`` over the shared negatives ``ids[R]`` with ``logq[R]``."""
    def fn(B, user, items, batch, loss_cfg):
        b = dataclasses.replace(batch, shared_negatives=B.asarray(ids),
                                shared_logq=None if logq is None else B.asarray(logq))
        return losses.get(name).fn(B, user, items, b, dataclasses.replace(loss_cfg, name=name))
    return fn


def private(ids, logq: float):
    """Each position against its own negatives ``ids[T, R]``, every negative logit lowered by
    ``logq`` (0: GR's sampled softmax; log(R / N): its logQ-corrected form)."""
    def fn(B, user, items, batch, loss_cfg):
        xp = B.xp
        neg_ids = B.asarray(ids)
        pos = losses.positive_logits(B, user, items, batch.targets, loss_cfg.temperature)
        neg = B.sampled_logits(user, items, neg_ids) / loss_cfg.temperature - logq
        hit = xp.logical_or(neg_ids == xp.reshape(batch.targets, (-1, 1)), neg_ids == 0)
        return losses.softmax_nll(B, pos, neg, hit, batch.weights)
    return fn


def cosine(a, b) -> float:
    return float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def relative(a, b) -> float:
    """``|a - b| / |b|``."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/negatives/hstu-full-t10-e20-s42",
                    help="a finished run whose last checkpoint gives the model")
    ap.add_argument("--pools", default="512,2048,3952")
    ap.add_argument("--private", default="128,512", help="per-position negatives (logQ-corrected)")
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=None, help="default: the run's")
    ap.add_argument("--batch", type=int, default=0, help="which training batch of the last epoch")
    ap.add_argument("--record", default="", metavar="FILE",
                    help="write the rows as a results file (results/quality/pool-gradient.jsonl)")
    args = ap.parse_args()

    run = Path(args.run)
    params_np, _, ck_cfg, meta = load_checkpoint(run / "checkpoints" / "last.safetensors")
    overrides = [f"loss.temperature={args.temperature}"] if args.temperature else []
    exp = grf.prepare(run / "config.toml", overrides)
    cfg = exp.cfg
    B = exp.backend("torch")
    params = B.asarray_tree(params_np)
    batch = B.asarray_tree(next(exp.batches(epoch=cfg.train.epochs - 1, start=args.batch)))
    user = model.model_of(cfg.model).encode(B, params, batch, cfg.model).detach()
    n = cfg.model.num_items
    every = np.arange(1, n + 1, dtype=np.int32)
    print(f"{run.name} step {meta.get('step')}: batch {args.batch}, {int(batch.weights.sum())} supervised "
          f"positions, N = {n}, temperature {cfg.loss.temperature}")

    full = loss_and_grads(B, params, batch, user, cfg, shared("full_softmax", every, None))
    whole = loss_and_grads(B, params, batch, user, cfg, shared("shared_pool", every, np.zeros(n, np.float32)))
    exact = {"loss_diff": abs(whole[0] - full[0]), "user_grad_rel": relative(whole[1], full[1]),
             "item_grad_rel": relative(whole[2], full[2])}
    print(f"pool of every item, logQ 0 vs full softmax: |loss diff| {exact['loss_diff']:.2e}, "
          f"user grad rel {exact['user_grad_rel']:.2e}, item grad rel {exact['item_grad_rel']:.2e}")

    negatives = grf.batch.Negatives("pool", 0, "uniform")
    rng = np.random.default_rng(0)
    T = int(user.shape[0])

    def draws(kind, R):
        """One draw's loss function of ``kind`` with R negatives, and the share of items it names."""
        if kind == "pool":
            ids, logq = dataclasses.replace(negatives, count=R).draw_pool(rng, n)
            return shared("shared_pool", ids, logq), len(np.unique(ids)) / n
        ids = rng.integers(1, n + 1, size=(T, R), dtype=np.int32)
        return private(ids, np.log(R / n) if kind == "private-logq" else 0.0), len(np.unique(ids)) / n

    rows = []
    print(f"\n{'negatives':>18} {'loss bias':>10} {'loss sd':>8} {'user cos':>9} {'user 1-draw':>12} "
          f"{'item cos':>9} {'item 1-draw':>12} {'items hit':>10}")
    kinds = [("pool", int(r)) for r in args.pools.split(",")]
    kinds += [("private-logq", int(r)) for r in args.private.split(",")] + [("private", 128)]
    for kind, R in kinds:
        ls, gu, gi, one_u, one_i, hit = [], 0.0, 0.0, [], [], []
        for _ in range(args.draws):
            fn, share = draws(kind, R)
            value, g_user, g_items = loss_and_grads(B, params, batch, user, cfg, fn)
            ls.append(value)
            gu, gi = gu + g_user / args.draws, gi + g_items / args.draws
            one_u.append(cosine(g_user, full[1]))
            one_i.append(cosine(g_items, full[2]))
            hit.append(share)
        row = {"negatives": kind, "R": R, "loss_bias": float(np.mean(ls) - full[0]), "loss_sd": float(np.std(ls)),
               "user_mean_cos": cosine(gu, full[1]), "user_one_cos": float(np.mean(one_u)),
               "item_mean_cos": cosine(gi, full[2]), "item_one_cos": float(np.mean(one_i)),
               "items_hit": float(np.mean(hit))}
        rows.append(row)
        print(f"{kind + ' ' + str(R):>18} {row['loss_bias']:10.4f} {row['loss_sd']:8.4f} {row['user_mean_cos']:9.5f} "
              f"{row['user_one_cos']:12.4f} {row['item_mean_cos']:9.5f} {row['item_one_cos']:12.4f} "
              f"{row['items_hit']:10.3f}")
    if args.record:
        common = {"run": run.name, "step": meta.get("step"), "batch": args.batch,
                  "temperature": cfg.loss.temperature, "draws": args.draws, "full_loss": full[0]}
        every_row = {"negatives": "every item once", "R": n, "loss_bias": whole[0] - full[0], "loss_sd": 0.0,
                     "user_mean_cos": cosine(whole[1], full[1]), "user_one_cos": cosine(whole[1], full[1]),
                     "item_mean_cos": cosine(whole[2], full[2]), "item_one_cos": cosine(whole[2], full[2]),
                     "items_hit": 1.0}
        command = "python experiments/pool_gradient.py " + " ".join(sys.argv[1:])
        print(f"recorded {results.write(args.record, command, [{**common, **r} for r in [every_row, *rows]])}")

if __name__ == "__main__":
    main()
