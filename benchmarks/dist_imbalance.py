"""``grf bench dist_imbalance [--config NAME] [--set ...] [--json]``: measured wall-time imbalance
of a 2-rank gloo run (CPU) with and without dynamic load balancing.

For each ``dist.balance`` policy (none, kk, lookahead) it runs ``grf train --nproc 2`` (torchrun,
gloo, 1 thread per rank) for ``train.max_steps`` steps on the config (default below: the
synthetic KuaiRand-like dataset, whose per-user lengths follow the real KuaiRand-27K distribution
scaled to ``synthetic_max_events``; long-tailed) and reads OUT/timing.jsonl, where every step
records each rank's forward+backward seconds (``rank_compute_s``) and input tokens. Reported per
policy, over the steps after the first (warm-up):

  imbalance_mean   mean over steps of max/mean - 1 of the ranks' compute seconds
  waste            sum_steps(max) / sum_steps(mean) - 1: share of rank time spent waiting for
                   the slowest rank (the throughput lost to imbalance)
  token_imbalance  mean over steps of max/mean - 1 of the ranks' input tokens (what the cost
                   model sees; noise-free)
  cpu_imbalance_mean, cpu_waste   the same over main-thread CPU seconds (``rank_cpu_s``): the
                   ranks' work without the time a shared machine preempted them
  step_max_ms      mean over steps of the slowest rank's compute milliseconds

The cost model is ``dist.cost_a/cost_b`` of the config (0, 0: the FLOP stand-in); pass
``--set dist.cost_a=... --set dist.cost_b=...`` from ``grf bench calibrate`` to use a fitted one.
Timings on a shared machine are noisy: compare policies within one invocation only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

POLICIES = ("none", "kk", "lookahead")
DEFAULT_SETS = ["data.dataset=synthetic", "data.synthetic_users=1200", "data.synthetic_max_events=400",
                "model.max_len=200", "model.embed_dim=32", "model.num_blocks=2", "model.num_heads=2",
                "model.dqk=16", "model.dv=16", "loss.num_negatives=128", "train.batch_size=8",
                "train.max_steps=80", "train.epochs=1", "train.eval_every=100", "train.log_every=1",
                "eval.max_users=8", "dist.lookahead=8"]


def summarise(timing_path: Path, skip: int = 1) -> dict:
    rows = [json.loads(line) for line in timing_path.read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "train" and "rank_compute_s" in r][skip:]
    t = np.array([r["rank_compute_s"] for r in steps], dtype=np.float64)       # [S, R] wall
    c = np.array([r["rank_cpu_s"] for r in steps], dtype=np.float64)           # [S, R] CPU
    tok = np.array([r["rank_tokens"] for r in steps], dtype=np.float64)

    def imb(x):
        return x.max(1) / x.mean(1) - 1

    return {"steps": len(steps),
            "imbalance_mean": float(np.mean(imb(t))), "imbalance_p95": float(np.percentile(imb(t), 95)),
            "waste": float(t.max(1).sum() / t.mean(1).sum() - 1),
            "cpu_imbalance_mean": float(np.mean(imb(c))), "cpu_waste": float(c.max(1).sum() / c.mean(1).sum() - 1),
            "token_imbalance": float(np.mean(imb(tok))),
            "step_max_ms": float(t.max(1).mean() * 1e3)}


def run(json_lines: bool = False, sets: list[str] | None = None, config: str = "quickstart") -> dict:
    sets = list(DEFAULT_SETS) + list(sets or [])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            folder = Path(tmp) / policy
            cmd = [sys.executable, "-m", "gr_functional.cli", "train", "--config", config, "--quiet", "--fresh",
                   "--nproc", "2", "--out", str(folder)]
            for item in sets + [f"dist.balance={policy}"]:
                cmd += ["--set", item]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(f"dist_imbalance: the {policy} run failed:\n{r.stderr[-3000:]}")
            out[policy] = summarise(folder / "timing.jsonl")
            row = {"policy": policy, **out[policy]}
            if json_lines:
                print(json.dumps(row), flush=True)
            else:
                print(f"{policy:10s} steps={row['steps']:3d}  wall imbalance mean {row['imbalance_mean']:.3f} "
                      f"p95 {row['imbalance_p95']:.3f} waste {row['waste']:.3f}  CPU imbalance mean "
                      f"{row['cpu_imbalance_mean']:.3f} waste {row['cpu_waste']:.3f}  token imbalance "
                      f"{row['token_imbalance']:.3f}  slowest rank {row['step_max_ms']:.1f} ms/step", flush=True)
    return out


if __name__ == "__main__":
    run(json_lines="--json" in sys.argv, sets=[a for a in sys.argv[1:] if a != "--json"])
