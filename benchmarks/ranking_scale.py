"""``grf bench ranking_scale [--config kuairand27k_rank_02b] [--set K=V] [--json] [--record]``: the
ranking model at the seeds' scale, measured on a real ``grf train`` run.

It launches ``grf train --config CONFIG --nproc dist.nproc`` (torchrun, one thread per rank) into a
temporary folder and summarises what the run wrote, one row: global tokens/s and seconds per step
after the first ``train.log_every`` steps (warm-up), MFU (``flops.ranking_step_flops`` of the
steps' real samples, rebuilt from the loader's plan, over ``dist.nproc`` x this machine's
one-thread fp32 matmul peak), each rank's peak RSS, the all-to-all bytes of the row-sharded table
per step (ids out, rows back, row gradients out, summed over ranks) and the dense all-reduce payload,
the ranks' compute imbalance over the epoch (``sum max / sum mean - 1``), the table's occupancy and
evictions, the parameter counts, the last logged loss and the test click AUC of the first
``eval.max_users`` users.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from backends import get_backend
from gr_functional.cli import _config_path
from gr_functional.configure import load_config
from gr_functional.flops import ranking_step_flops
from gr_functional.ranking.task import RankingTask, param_shapes
from gr_functional.step import TABLE

from .common import emit, machine, matmul_peak

DEFAULT_CONFIG = "kuairand27k_rank_02b"
COLUMNS = ["ranks", "steps", "tokens_per_s", "step_s", "mfu", "peak_rss_mb_max", "alltoall_mb_per_step",
           "allreduce_mb", "imbalance", "occupancy", "evictions", "params_total"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(json_lines: bool = False, sets=(), config: str = DEFAULT_CONFIG) -> list[dict]:
    path = _config_path(config)
    cfg = load_config(path, list(sets))
    if cfg.model.task != "ranking":
        raise SystemExit(f"grf bench ranking_scale: {config} is not a ranking config (model.task = \"ranking\")")
    R, log_every = cfg.dist.nproc, cfg.train.log_every
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "gr_functional.cli", "train", "--config", str(path), "--out", str(out),
                   "--quiet", *(["--nproc", str(R)] if R > 1 else []), *(a for s in sets for a in ("--set", s))]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"grf bench ranking_scale: grf train exited {done.returncode}:\n{done.stderr[-3000:]}")
        timing, metrics = _lines(out / "timing.jsonl"), _lines(out / "metrics.jsonl")
        final = json.loads((out / "eval.json").read_text())["last_epoch_test"]
    steps = [t for t in timing if t["kind"] == "train"]
    trained = [m for m in metrics if m["kind"] == "train"]
    if len(steps) < 2:
        raise SystemExit(f"grf bench ranking_scale: {len(steps)} logged step(s); train.max_steps must be at least "
                         f"2 x train.log_every ({log_every}) to leave a warm-up out")
    first, last = steps[0], steps[-1]
    window = range(first["step"] + 1, last["step"] + 1)          # the steps after the first logged one
    seconds = last["elapsed_s"] - first["elapsed_s"]
    # the window's real samples, from the loader's plan (the run's own data, split and seed)
    prepared = RankingTask().prepare(cfg, R)
    loader, samples = prepared.loader, prepared.payload[1].train
    plan = loader.plan(0)
    counts = samples.candidates(cfg.ranking.num_candidates)
    flops = sum(ranking_step_flops(cfg.ranking, loader.tokens[plan[s - 1]], counts[plan[s - 1]])["total"] for s in window)
    tokens = sum(int(loader.tokens[plan[s - 1]].sum()) for s in window)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                 # torchrun gives each rank one thread
    peak = matmul_peak(get_backend("torch"), n=1024) * R
    torch.set_num_threads(threads)
    shapes = param_shapes(cfg)
    dense = sum(int(np.prod(v)) for k, v in shapes.items() if k != TABLE)
    table = cfg.embedding.capacity * cfg.ranking.embed_dim
    emb_first, emb_last = trained[0].get("embedding") or {}, trained[-1].get("embedding") or {}
    exchange = sum((emb_last.get("exchange") or {}).values()) - sum((emb_first.get("exchange") or {}).values())
    epoch = [t for t in timing if t["kind"] == "epoch"][-1]
    row = {"bench": "ranking_scale", "config": config, "sets": list(sets), "ranks": R, "steps": len(window),
           "tokens_per_s": tokens / seconds, "step_s": seconds / len(window), "mfu": flops / seconds / peak,
           "matmul_peak_flops": peak, "flops_per_step": flops / len(window),
           "peak_rss_mb": last.get("rank_peak_rss_mb"), "peak_rss_mb_max": max(last.get("rank_peak_rss_mb") or [0.0]),
           "alltoall_mb_per_step": exchange / len(window) / 2**20, "allreduce_mb": 4 * dense / 2**20,
           "imbalance": epoch.get("imbalance"), "occupancy": (emb_last.get("table") or {}).get("occupancy"),
           "evictions": (emb_last.get("table") or {}).get("evictions"),
           "params_table": table, "params_dense": dense, "params_total": table + dense,
           "loss": trained[-1]["loss"], "test_click_auc": final.get("is_click/auc"),
           "batch_size": cfg.train.batch_size, "prefetch_hidden": (epoch.get("batch_build") or {}).get("hidden"),
           **machine()}
    emit(row, json_lines, COLUMNS)
    return [row]
