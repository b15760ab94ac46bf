"""``grf bench negatives [--config C] [--backend torch,jax] [--json]``: training-step time of GR's
sampled softmax (R private uniform negatives per position) against shared pools of negatives
(``loss.name = "shared_pool"``: one pool per batch, one ``[T, D] x [D, R]`` product) and against
16-bit negatives (``loss.negatives_precision``), on the config's real batches.

Each variant trains ``steps`` steps (after ``warmup``) from the same initial parameters on the
same users; rows report the median step seconds, tokens/s and ``vs_sampled`` (this variant's
tokens/s over the sampled softmax's, measured in the same run) and ``negative_bytes``: the bytes
of the negative rows the loss reads per step (``[T, R, D]`` private or ``[R, D]`` pooled values at 4
or 2 bytes each, plus a 4-byte scale per sequence or per pool when 16-bit), mean over the timed
steps. Quality is a training run's
business: docs/guides/negatives-and-overlap.md "Negatives" has the HR@10 of each variant with the commands.
"""
from __future__ import annotations

import statistics
import time

from .common import backends_for, device_label, emit, machine

COLUMNS = ["backend", "device", "config", "loss", "negatives", "sampler", "precision", "negative_bytes", "tokens",
           "seconds", "tokens_per_s", "vs_sampled"]
# (loss.name, num_negatives, sampler, negatives_precision): GR's recipe first (the reference of vs_sampled)
VARIANTS = (("sampled_softmax", 128, "uniform", "fp32"), ("sampled_softmax", 128, "uniform", "fp16"),
            ("shared_pool", 512, "uniform", "fp32"), ("shared_pool", 1024, "uniform", "fp32"),
            ("shared_pool", 1024, "uniform", "fp16"), ("shared_pool", 2048, "uniform", "fp32"),
            ("shared_pool", 1024, "popularity", "fp32"))


def negative_bytes(batch, embed_dim: int, precision: str) -> int:
    """Bytes of the negative rows one step's loss reads: every sampled or pooled id's ``D`` values
    at 4 (fp32) or 2 (16-bit) bytes, plus one fp32 scale per user sequence (private negatives) or
    per pool when 16-bit."""
    private = batch.negatives is not None
    ids = batch.layout.num_tokens() * batch.negatives.shape[1] if private else batch.shared_negatives.shape[0]
    if precision == "fp32":
        return ids * embed_dim * 4
    import numpy as np

    return ids * embed_dim * 2 + 4 * (int(np.count_nonzero(batch.layout.lengths)) if private else 1)


def run(json_lines: bool = False, cfg=None, backends=None, variants=VARIANTS, steps: int = 8,
        warmup: int = 2) -> list[dict]:
    import gr_functional as grf
    from gr_functional.config import replace
    from gr_functional.configure import load_config
    from gr_functional.data.batching import TrainLoader
    from gr_functional.step import init_opt_state, make_train_step

    cfg = cfg or load_config(None)
    exp = grf.prepare(cfg)
    n_items = exp.cfg.model.num_items
    host, rows = machine(), []
    for label, B in backends_for(exp.cfg, backends):
        for name, count, sampler, precision in variants:
            vcfg = replace(exp.cfg, loss={"name": name, "num_negatives": min(count, n_items), "sampler": sampler,
                                          "negatives_precision": precision})
            loader = TrainLoader.from_config(exp.splits.train, vcfg)
            step_fn = make_train_step(B, vcfg)
            params = B.asarray_tree(exp.init_params())
            opt_state = init_opt_state(B, params, vcfg)
            times, tokens, payload = [], 0, 0
            for i, batch in enumerate(loader.epoch(0)):
                if i == warmup + steps:
                    break
                t0 = time.perf_counter()
                params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
                float(m["loss"])  # synchronise
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    tokens += batch.layout.num_tokens()
                    payload += negative_bytes(batch, vcfg.model.embed_dim, precision)
            seconds = statistics.median(times)
            rows.append({"bench": "negatives", "backend": label, "device": device_label(B),
                         "config": exp.cfg.data.dataset, "loss": name, "negatives": min(count, n_items),
                         "sampler": sampler, "precision": precision, "negative_bytes": payload / len(times),
                         "tokens": tokens / len(times), "seconds": seconds,
                         "tokens_per_s": tokens / len(times) / seconds, **host})
    for row in rows:
        ref = [r for r in rows if r["backend"] == row["backend"] and r["loss"] == "sampled_softmax"
               and r["precision"] == "fp32"]
        row["vs_sampled"] = row["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else None
        emit(row, json_lines, COLUMNS)
    return rows
