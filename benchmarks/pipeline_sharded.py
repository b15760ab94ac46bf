"""``grf bench pipeline_sharded [--config NAME] [--set ...] [--json]``: what the pipelined step
hides of a row-sharded table's exchanges, on 2 local gloo ranks (CPU, one thread each).

Each row runs ``grf train --nproc 2`` for ``train.max_steps`` steps with the item table
row-sharded (``embedding.sharding = "row"``, lazy Adam, ``embedding.staleness = 1``) and
``train.prefetch`` 0 (every exchange in the step) or 2 (ids exchanged on the prefetch worker; the
due update and the next step's lookup on the sparse worker, docs/guides/negatives-and-overlap.md "Batches built ahead"), with
``GRF_FAULT_EXCHANGE_DELAY_S`` 0 (two ranks on one host: exchanges take microseconds) or
``delay`` seconds added to every all-to-all, standing in for a network's latency (a background
exchange's delay runs in the background). From OUT/timing.jsonl, over the steps after ``warmup``:

  step_s     median wall seconds between consecutive steps (rank 0)
  compute_s  median forward+backward seconds of the slowest rank
  busy       compute_s / step_s: the share of wall time the ranks compute (TurboGR: 94 % NPU busy)
  tokens_per_s   global input tokens per wall second (rank 0's epoch counter at the last step)

Compare rows within one invocation only (a shared machine's timings drift between runs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_CONFIG = "ml1m_hstu"
SHARDED = ["embedding.sharding=row", "embedding.optimizer=lazy_adam", "embedding.staleness=1", "train.max_steps=24",
           "train.epochs=1", "train.log_every=1", "train.eval_every=1000", "eval.max_users=64"]
COLUMNS = ["delay_ms", "prefetch", "steps", "step_s", "compute_s", "busy", "tokens_per_s"]


def summarise(timing_path: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in timing_path.read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "train" and "rank_compute_s" in r]
    if len(steps) <= warmup + 1:
        raise SystemExit(f"pipeline_sharded: {len(steps)} logged steps in {timing_path}; raise train.max_steps above "
                         f"warmup + 1 = {warmup + 1}")
    steps = steps[warmup:]
    step_s = float(np.median(np.diff([r["elapsed_s"] for r in steps])))
    compute_s = float(np.median([max(r["rank_compute_s"]) for r in steps[1:]]))
    return {"steps": len(steps) - 1, "step_s": step_s, "compute_s": compute_s, "busy": compute_s / step_s,
            "tokens_per_s": float(steps[-1]["tokens_per_s"])}


def run(json_lines: bool = False, sets: list[str] | None = None, config: str = DEFAULT_CONFIG, delay: float = 0.02,
        variants=None, warmup: int = 4) -> list[dict]:
    """``variants``: ``(delay seconds, prefetch)`` pairs (default: 0 and ``delay``, each with
    prefetch 0 and 2)."""
    variants = variants or [(d, p) for d in (0.0, delay) for p in (0, 2)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for d, prefetch in variants:
            folder = Path(tmp) / f"d{d}_p{prefetch}"
            cmd = [sys.executable, "-m", "gr_functional.cli", "train", "--config", config, "--quiet", "--fresh",
                   "--nproc", "2", "--out", str(folder)]
            for item in SHARDED + list(sets or []) + [f"train.prefetch={prefetch}"]:
                cmd += ["--set", item]
            env = dict(os.environ, OMP_NUM_THREADS="1", GRF_FAULT_EXCHANGE_DELAY_S=str(d))
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(f"pipeline_sharded: the run with delay {d} s, prefetch {prefetch} failed:\n"
                                 f"{r.stderr[-3000:]}")
            row = {"delay_ms": d * 1e3, "prefetch": prefetch, **summarise(folder / "timing.jsonl", warmup)}
            rows.append(row)
            if json_lines:
                print(json.dumps(row), flush=True)
            else:
                print(f"delay {row['delay_ms']:5.1f} ms  prefetch {prefetch}  step {row['step_s']:.3f} s  compute "
                      f"{row['compute_s']:.3f} s  busy {row['busy']:.1%}  {row['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
    return rows
