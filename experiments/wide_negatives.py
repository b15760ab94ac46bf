"""Research experiment: how many negatives, of which kind, at which temperature, does HSTU need on ML-1M?

GR's recipe scores each position against 128 private uniform negatives. This study trains the
same HSTU (or HSTU-large) under GR's tie order (``data.ties = "shuffle"``) with each way of
scoring negatives the project ships (docs/guides/wide-negatives.md has the question, the
results and the answer), and records the runs with ``grf report``. The epoch of each run and the
winner of the grid are chosen on validation HR@10 only; test metrics are read at that epoch.

    python experiments/wide_negatives.py --list
    python experiments/wide_negatives.py --only gr,full-t05 --epochs 20 [--model large] [--seed 42]
        [--backend torch] [--set KEY=VALUE ...] [--out runs/negatives]

Runs resume where they stopped (a finished one is only re-evaluated from its output files), so
two processes with disjoint ``--only`` lists share a 2-core machine, one torch thread each.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gr_functional import report
from gr_functional.configure import load_config
from gr_functional.runner import train

MODELS = {"hstu": "experiments/configs/ml1m_hstu.toml", "large": "experiments/configs/ml1m_hstu_large.toml"}
# name -> overrides of the base config (GR's recipe: sampled_softmax, 128 negatives, temperature 0.05)
GRID = {
    "gr": [],
    "sampled-512": ["loss.num_negatives=512"],
    "sampled-2048": ["loss.num_negatives=2048"],
    "pool-2048": ["loss.name=shared_pool", "loss.num_negatives=2048"],
    "mixed-1024": ["loss.name=mixed_pool", "loss.num_negatives=1024", "loss.batch_negatives=128"],
    "full-t03": ["loss.name=full_softmax", "loss.temperature=0.03"],
    "full-t05": ["loss.name=full_softmax", "loss.temperature=0.05"],
    "full-t10": ["loss.name=full_softmax", "loss.temperature=0.1"],
    "full-t20": ["loss.name=full_softmax", "loss.temperature=0.2"],
    "gr-t10": ["loss.temperature=0.1"],
    "sampled-512-t10": ["loss.num_negatives=512", "loss.temperature=0.1"],
    "full-t07": ["loss.name=full_softmax", "loss.temperature=0.07"],
    # the pools at the full softmax's temperature (at GR's 0.05 they are .03 behind)
    "pool-2048-t10": ["loss.name=shared_pool", "loss.num_negatives=2048", "loss.temperature=0.1"],
    # a pool covering most of the catalogue each step (experiments/pool_gradient.py: a pool of
    # 2,048 names 40% of the items, and its item-table gradient is the one far from the full softmax's;
    # one of R = N names 63%)
    "pool-3952-t10": ["loss.name=shared_pool", "loss.num_negatives=3952", "loss.temperature=0.1"],
    "mixed-1024-t10": ["loss.name=mixed_pool", "loss.num_negatives=1024", "loss.batch_negatives=128",
                       "loss.temperature=0.1"],
    # beyond negatives: the optimiser's pace (at 20 epochs GR's recipe is still climbing)
    "gr-lr2": ["optim.lr=2e-3"],
    "full-t10-lr2": ["loss.name=full_softmax", "loss.temperature=0.1", "optim.lr=2e-3"],
    "full-t10-b32": ["loss.name=full_softmax", "loss.temperature=0.1", "train.batch_size=32"],
    "gr-b32": ["train.batch_size=32"],
    # a cosine decay to 0 that ends with the run (optim.decay_steps = 0)
    "gr-lr2-cos": ["optim.lr=2e-3", "optim.schedule=cosine", "optim.decay_steps=0"],
    "full-t10-lr2-cos": ["loss.name=full_softmax", "loss.temperature=0.1", "optim.lr=2e-3",
                         "optim.schedule=cosine", "optim.decay_steps=0"],
    # faster convergence within 20 epochs: a higher peak learning rate decayed to 0, more updates
    # (batch 32: 189 per epoch), lighter dropout (an under-trained model needs less of it)
    "gr-lr4-cos": ["optim.lr=4e-3", "optim.schedule=cosine", "optim.decay_steps=0"],
    "gr-b32-lr2-cos": ["train.batch_size=32", "optim.lr=2e-3", "optim.schedule=cosine", "optim.decay_steps=0"],
    "gr-drop10": ["model.input_dropout=0.1", "model.linear_dropout=0.1"],
    "sampled-512-lr2-cos": ["loss.num_negatives=512", "optim.lr=2e-3", "optim.schedule=cosine",
                            "optim.decay_steps=0"],
}
KEYS = ["hr@10", "ndcg@10", "hr@50", "hr@200", "mrr"]


def run_dir(out: str, model: str, name: str, epochs: int, seed: int, backend: str) -> Path:
    suffix = "" if backend == "torch" else f"-{backend}"
    return Path(out) / f"{model}-{name}-e{epochs}-s{seed}{suffix}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="hstu")
    ap.add_argument("--only", default=",".join(GRID), help="comma-separated grid names (--list shows them)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/negatives")
    ap.add_argument("--list", action="store_true", help="print the grid and exit")
    args = ap.parse_args()
    if args.list:
        for name, overrides in GRID.items():
            print(f"{name:14s} {' '.join(overrides) or '(GR recipe)'}")
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise SystemExit(f"--only: unknown grid name(s) {', '.join(unknown)}; the grid: {', '.join(GRID)}")
    dirs = []
    for name in names:
        sets = ["data.ties=shuffle", f"train.epochs={args.epochs}", f"train.seed={args.seed}",
                f"backend.name={args.backend}"] + GRID[name] + args.set
        out = run_dir(args.out, args.model, name, args.epochs, args.seed, args.backend)
        result = train(load_config(MODELS[args.model], sets), out, progress=False)
        print(f"{out.name}: " + json.dumps({k: round(result[k], 4) for k in KEYS if k in result}), flush=True)
        dirs.append(out)
    # the table `grf report DIRS` prints: the losses are the config keys that differ
    print()
    print(report.summary_table(report.find_runs([str(d) for d in dirs]), KEYS))


if __name__ == "__main__":
    main()
