"""Research experiment: does HSTU's relative attention bias matter, and which half of it?

Trains the same HSTU four times, changing only the relative attention bias (position + time,
position only, time only, none), and prints a table of test metrics. Written the way a user
writes an experiment: a config, overrides, the public runner, any backend.

    python experiments/rab_ablation.py --config experiments/configs/ml1m_hstu.toml --backend torch \
        [--set train.epochs=40] [--out runs/rab_ablation]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gr_functional import report
from gr_functional.configure import load_config
from gr_functional.runner import train

VARIANTS = {
    "pos+time": ["model.pos_bias=true", "model.time_bias=true"],
    "pos only": ["model.pos_bias=true", "model.time_bias=false"],
    "time only": ["model.pos_bias=false", "model.time_bias=true"],
    "none": ["model.pos_bias=false", "model.time_bias=false"],
}
KEYS = ["hr@10", "ndcg@10", "hr@50", "hr@200", "mrr"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="experiments/configs/ml1m_hstu.toml")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/rab_ablation")
    args = ap.parse_args()
    rows = {}
    for name, overrides in VARIANTS.items():
        cfg = load_config(args.config, args.set + overrides + [f"backend.name={args.backend}"])
        out = Path(args.out) / name.replace(" ", "_").replace("+", "_")
        rows[name] = train(cfg, out, progress=False)
        print(f"{name}: " + json.dumps({k: round(rows[name][k], 4) for k in KEYS}), flush=True)
    # the same table `grf report OUT` prints: the bias switches are the config keys that differ
    print()
    print(report.summary_table(report.find_runs([args.out]), KEYS))
    (Path(args.out) / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
