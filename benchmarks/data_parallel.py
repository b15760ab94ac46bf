"""``grf bench data_parallel [--config NAME] [--set ...] [--json] [--record]``: tokens/s of the same
training run on 1, 2 and 4 JAX devices of one process (``--devices N``, a mesh) beside 1, 2 and 4
torch processes (``--nproc N``, gloo), all on this machine, in one invocation.

Each cell runs ``grf train`` for ``train.max_steps`` steps (default below: the synthetic
KuaiRand-like dataset, long-tailed lengths) and reads OUT/timing.jsonl and metrics.jsonl:
``tokens_per_s`` is the input tokens of the steps after the first half over the wall time they
took (the first half holds most of JAX's compilations, one per capacity of the ladder, and the
ranks' warm-up), and ``vs_one`` its ratio to the same backend's one-device (one-process) cell.
JAX still compiles a new capacity now and then in the timed half; on CPU its absolute tokens/s
are not the torch path's (``grf bench throughput`` compares the backends' steady state).

On a CPU host this measures the overhead of data parallelism, not a speed-up: the JAX devices
are XLA host devices sharing the same cores (one process, XLA's thread pool), and the torch
ranks share them too (each gets ``cores / N`` threads, at least 1). A ratio below 1 is the cost
of splitting a batch, padding the shares to one capacity (JAX) and the all-reduce. On a host
with N accelerators the same commands scale out; nothing here measured that.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_CONFIG = "quickstart"
DEFAULT_SETS = ["data.dataset=synthetic", "data.synthetic_users=1200", "data.synthetic_max_events=400",
                "model.max_len=200", "model.embed_dim=32", "model.num_blocks=2", "model.num_heads=2",
                "model.dqk=16", "model.dv=16", "loss.num_negatives=128", "train.batch_size=32",
                "train.max_steps=120", "train.epochs=4", "train.eval_every=100", "train.log_every=1",
                "eval.max_users=8"]
CELLS = (("jax", 1), ("jax", 2), ("jax", 4), ("torch", 1), ("torch", 2), ("torch", 4))


def summarise(out: Path, skip_fraction: float = 0.5) -> dict:
    """``{"steps", "tokens_per_s"}`` of a run folder: input tokens of the steps after the first
    ``skip_fraction`` over the wall seconds between their logged ends."""
    timing = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in timing if r.get("kind") == "train"}
    tokens = {r["step"]: r["tokens"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if (r := json.loads(line)).get("kind") == "train"}
    steps = sorted(set(elapsed) & set(tokens))
    if len(steps) < 3:
        raise ValueError(f"{out}: {len(steps)} logged steps; the benchmark needs train.log_every=1 and >= 3 steps")
    first = steps[max(1, int(len(steps) * skip_fraction)) - 1]
    kept = [s for s in steps if s > first]
    return {"steps": len(kept),
            "tokens_per_s": sum(tokens[s] for s in kept) / max(elapsed[kept[-1]] - elapsed[first], 1e-9)}


def _command(backend: str, n: int, out: Path, config: str, sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "gr_functional.cli", "train", "--config", config, "--quiet", "--fresh",
           "--backend", backend, "--out", str(out)]
    cmd += ["--devices", str(n)] if backend == "jax" else ["--nproc", str(n)]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def run(json_lines: bool = False, sets: list[str] | None = None, config: str = DEFAULT_CONFIG,
        cells=CELLS) -> list[dict]:
    sets = list(DEFAULT_SETS) + list(sets or [])
    cores = os.cpu_count() or 1
    rows, base = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend, n in cells:
            out = Path(tmp) / f"{backend}-{n}"
            threads = cores if backend == "jax" else max(1, cores // n)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            env.pop("XLA_FLAGS", None)  # grf asks XLA for the devices itself
            r = subprocess.run(_command(backend, n, out, config, sets), capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(f"data_parallel: {backend} x {n} failed:\n{r.stderr[-3000:]}")
            row = {"bench": "data_parallel", "backend": backend, "ranks": n,
                   "how": f"--devices {n}" if backend == "jax" else f"--nproc {n}", "threads_per_rank": threads,
                   **summarise(out)}
            base.setdefault(backend, row["tokens_per_s"])
            row["vs_one"] = row["tokens_per_s"] / base[backend]
            rows.append(row)
            if json_lines:
                print(json.dumps(row), flush=True)
            else:
                print(f"{backend:6s} {row['how']:12s} {row['tokens_per_s']:9.0f} tokens/s  x{row['vs_one']:.2f} of "
                      f"one  ({row['steps']} steps timed)", flush=True)
    return rows


if __name__ == "__main__":
    run(json_lines="--json" in sys.argv, sets=[a for a in sys.argv[1:] if a != "--json"])
