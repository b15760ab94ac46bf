"""``grf bench ranking [--config kuairand_rank] [--backend torch,jax] [--set K=V] [--json]``:
training-step time of GR's dlrm_v3 ranking model (``model.task = "ranking"``) in fp32, bf16 and
fp16, and with ``step.accumulate = 2``, on the config's real batches (dense or hash tables, as
configured).

Each variant trains ``steps`` optimizer steps (after ``warmup``) from the same initial parameters
on the same loader batches, through what ``grf train`` runs (``RankingSteps``: hash lookups, the
shared normaliser of accumulated micro-batches); rows report the median step seconds, the tokens
and candidates of a step, tokens/s and ``vs_fp32`` (this variant's tokens/s over the fp32 step's,
same backend, same run). 16-bit pays on accelerators with fast 16-bit matmuls; on a CPU without
them it costs casts. Quality is a training run's business (docs/guides/ranking.md "Ranking").
"""
from __future__ import annotations

import statistics
import time

from .common import backends_for, device_label, emit, machine

DEFAULT_CONFIG = "kuairand_rank"
COLUMNS = ["backend", "device", "config", "precision", "accumulate", "tokens", "candidates", "seconds",
           "tokens_per_s", "vs_fp32"]
VARIANTS = (("fp32", 1), ("bf16", 1), ("fp16", 1), ("fp32", 2))   # (backend.precision, train.accumulate)


def run(json_lines: bool = False, cfg=None, backends=None, variants=VARIANTS, steps: int = 6,
        warmup: int = 2) -> list[dict]:
    from gr_functional.config import replace
    from gr_functional.configure import load_config
    from gr_functional.ranking.data import RankingLoader, chronological_split, load_ranking_data
    from gr_functional.ranking.task import RankingSteps, init_params, make_host
    from gr_functional.step import init_opt_state

    if cfg is None:
        from gr_functional.cli import _config_path

        cfg = load_config(_config_path(DEFAULT_CONFIG))
    if cfg.model.task != "ranking":
        raise SystemExit("grf bench ranking: the config must set model.task = \"ranking\" (e.g. --config kuairand_rank)")
    seqs = load_ranking_data(cfg)
    samples = chronological_split(seqs, cfg.ranking.num_candidates).train
    host_info, rows = machine(), []
    for label, B in backends_for(cfg, backends):
        for precision, k in variants:
            vcfg = replace(cfg, backend={"precision": precision}, train={"accumulate": k})
            loader = RankingLoader(seqs, samples, vcfg.ranking, vcfg.train.batch_size, vcfg.train.seed,
                                   max_tokens=vcfg.train.max_tokens)
            host = make_host(vcfg)
            runner = RankingSteps(B, vcfg, loader, host)
            params = B.asarray_tree(init_params(vcfg, host))
            opt_state = init_opt_state(B, params, vcfg)
            times, tokens, candidates = [], 0, 0
            for i, micro in enumerate(runner.batches(0, 0, limit=warmup + steps)):
                t0 = time.perf_counter()
                params, opt_state, result = runner.run(params, opt_state, micro, i + 1, 0)
                float(result.metrics["loss"])  # synchronise
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    tokens += result.tokens
                    candidates += sum(int(b.cand_mask.sum()) for b in micro)
            if not times:
                raise SystemExit(f"grf bench ranking: an epoch has at most {warmup} step(s) of train.accumulate={k} "
                                 f"batches, none left to time after the warm-up; lower train.batch_size")
            seconds = statistics.median(times)
            rows.append({"bench": "ranking", "backend": label, "device": device_label(B), "config": cfg.data.dataset,
                         "precision": precision, "accumulate": k, "tokens": tokens / len(times),
                         "candidates": candidates / len(times), "seconds": seconds,
                         "tokens_per_s": tokens / len(times) / seconds, **host_info})
    for row in rows:
        ref = [r for r in rows if r["backend"] == row["backend"] and r["precision"] == "fp32" and r["accumulate"] == 1]
        row["vs_fp32"] = row["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else None
        emit(row, json_lines, COLUMNS)
    return rows
