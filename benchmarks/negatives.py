"""``grf bench negatives [--config C] [--backend torch,jax] [--json]``: training-step time and
memory of every way the project scores negatives, on the config's real batches: GR's sampled softmax
(R private uniform negatives per position; 128 is GR's recipe, 512-2,048 the wide variants), shared
pools (``shared_pool``: one pool per batch, one ``[T, D] x [D, R]`` product, logQ), the mixed pool
(``mixed_pool``: in-batch positives plus a uniform pool), the full-catalogue softmax
(``full_softmax``), and 16-bit negatives (``loss.negatives_precision``).

Each variant trains ``steps`` steps (after ``warmup``) from the same initial parameters on the
same users; rows report the median step seconds, tokens/s and ``vs_sampled`` (this variant's
tokens/s over GR's recipe's, measured in the same run), ``negative_bytes``: the bytes of the
negative rows the loss reads per step (``[T, R, D]`` private or ``[R, D]`` pooled values at 4
or 2 bytes each, plus a 4-byte scale per sequence or per pool when 16-bit), mean over the timed
steps, and ``step_peak_mb``: the resident memory the timed steps added on top of what the
process held before them (Linux: free heap returned with ``malloc_trim`` and the peak reset through
``/proc/self/clear_refs`` before each variant, then ``VmHWM - VmRSS``; ``None`` where that is not
available). A variant whose R exceeds the catalogue is run with R = N (the config check refuses more).
Quality is a training run's business: docs/guides/wide-negatives.md has the HR@10 of each with the
commands.
"""
from __future__ import annotations

import ctypes
import gc
import statistics
import time

from .common import backends_for, device_label, emit, machine, rss

COLUMNS = ["backend", "device", "config", "loss", "negatives", "sampler", "precision", "negative_bytes", "tokens",
           "seconds", "tokens_per_s", "vs_sampled", "step_peak_mb"]
# (loss.name, num_negatives, sampler, negatives_precision): GR's recipe first (the reference of vs_sampled)
VARIANTS = (("sampled_softmax", 128, "uniform", "fp32"), ("sampled_softmax", 128, "uniform", "fp16"),
            ("sampled_softmax", 512, "uniform", "fp32"), ("sampled_softmax", 2048, "uniform", "fp32"),
            ("shared_pool", 512, "uniform", "fp32"), ("shared_pool", 1024, "uniform", "fp32"),
            ("shared_pool", 1024, "uniform", "fp16"), ("shared_pool", 2048, "uniform", "fp32"),
            ("shared_pool", 4096, "uniform", "fp32"), ("shared_pool", 1024, "popularity", "fp32"),
            ("mixed_pool", 1024, "uniform", "fp32"), ("full_softmax", 0, "uniform", "fp32"))
BATCH_NEGATIVES = 128  # mixed_pool's in-batch positives (loss.batch_negatives' default)


def _memory_probe():
    """``(start, added)``: ``start()`` returns free heap to the OS and resets the peak resident
    set; ``added()`` is the MB the peak then rose above the resident set at ``start``. Both no-ops
    (``added`` None) where Linux's /proc or glibc is missing."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        rss()
    except (OSError, AttributeError):
        return (lambda: None), (lambda: None)
    base = {}

    def start():
        gc.collect()
        trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        base["rss"] = rss()[0]

    return start, (lambda: (rss()[1] - base["rss"]) / 2**20)


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
    start, added = _memory_probe()
    for label, B in backends_for(exp.cfg, backends):
        for name, count, sampler, precision in variants:
            count = n_items if name == "full_softmax" else min(count, n_items)
            vcfg = replace(exp.cfg, loss={"name": name, "num_negatives": count, "sampler": sampler,
                                          "negatives_precision": precision, "batch_negatives": BATCH_NEGATIVES})
            loader = TrainLoader.from_config(exp.splits.train, vcfg)
            step_fn = make_train_step(B, vcfg)
            params = B.asarray_tree(exp.init_params())
            opt_state = init_opt_state(B, params, vcfg)
            times, tokens, payload = [], 0, 0
            start()
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
                         "config": exp.cfg.data.dataset, "loss": name,
                         "negatives": count + (BATCH_NEGATIVES if name == "mixed_pool" else 0),
                         "sampler": sampler, "precision": precision, "negative_bytes": payload / len(times),
                         "tokens": tokens / len(times), "seconds": seconds,
                         "tokens_per_s": tokens / len(times) / seconds, "step_peak_mb": added(), **host})
            del params, opt_state, step_fn, loader
    for row in rows:
        ref = [r for r in rows if r["backend"] == row["backend"] and r["loss"] == "sampled_softmax"
               and r["precision"] == "fp32"]
        row["vs_sampled"] = row["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else None
        emit(row, json_lines, COLUMNS)
    return rows
