"""The AUC a perfect model reaches on the kuairand-rank-synthetic test candidates: the generator's
own click probabilities scored against the drawn clicks (docs/guides/ranking.md "Ranking"). Only the click task
has a clean ceiling: the other actions' probabilities are conditioned on the drawn click, which a
model does not see for a candidate.

    python tools/ranking_ceiling.py [--config experiments/configs/kuairand_rank.toml]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when run as a script
from gr_functional.configure import load_config  # noqa: E402
from gr_functional.data.ranking_metrics import auc, gauc  # noqa: E402
from gr_functional.data.sources.kuairand_ranking_synthetic import synthetic_ranking  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiments/configs/kuairand_rank.toml")
    args = ap.parse_args()
    cfg = load_config(args.config)
    d, C = cfg.data, cfg.ranking.num_candidates
    seqs = synthetic_ranking(d.synthetic_users, d.synthetic_items, d.synthetic_max_events, d.zipf_a, seed=d.seed,
                             min_events=3 * C + 1, truth=True)
    out = {}
    for split, back in (("valid", C), ("test", 0)):
        rows = np.concatenate([np.arange(e - back - C, e - back) for e in seqs.offsets[1:]])
        owners = np.repeat(np.arange(len(seqs.users)), C)
        clicks = (seqs.columns["action_weights"][rows] & 1).astype(np.float64)
        p = seqs.columns["p_is_click"][rows]
        out[split] = {"is_click/auc": auc(p, clicks), "is_click/gauc": gauc(p, clicks, owners)[0]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
