"""``grf bench stream [--config C] [--set ...] [--json]``: HSTU training on the KuaiRand-27K-shaped
stream (``gr_functional.data.stream``: the 27,285 real per-user lengths, 322M events, raw 60-bit
ids drawn Zipf-like over 32M videos; never materialised) with a hash embedding table, on torch.

It is the scale check of the sparse side: memory must be bounded by the table's capacity, not by
the id range or the number of interactions. Every ``train.log_every`` steps a row reports the
interval's tokens/s, the host-side share of the wall time (stream windows, id localisation,
dedup + hash-table assignment, batch building), this process's RSS and peak RSS, the table's
occupancy / inserts / evictions / hit rate, and dedup: item ids a step's sequences name (history
inputs and targets; the in-batch negatives are rows of those) against distinct ids looked up, as
fp32 row bytes. ``train.max_steps`` steps (default
100); the model and table come from the config (``experiments/configs/kuairand27k_stream.toml``
is the preset: hash table, row-wise Adagrad, in-batch negatives, sequences of ``model.max_len``
events). Quality is not measured: the stream's ids are random (the Zipf popularity is its only
structure).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from .common import emit, machine

DEFAULT_CONFIG = "kuairand27k_stream"   # grf bench stream without --config
COLUMNS = ["step", "tokens_per_s", "host_share", "rss_mb", "peak_rss_mb", "occupancy", "capacity", "inserts",
           "evictions", "hit_rate", "ids_per_step", "unique_per_step", "bytes_before", "bytes_after"]


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process, bytes (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def run(json_lines: bool = False, cfg=None, backends=None, steps: int | None = None, stream=None) -> list[dict]:
    from backends import get_backend
    from gr_functional import losses
    from gr_functional.batch import make_batch
    from gr_functional.config import load_config, replace
    from gr_functional.data.stream import KuaiRandStream
    from gr_functional.embedding.lookup import localize_histories, make_host, table_params
    from gr_functional.model import init_params
    from gr_functional.runner import validate
    from gr_functional.train import init_opt_state, make_train_step

    cfg = cfg or load_config(f"experiments/configs/{DEFAULT_CONFIG}.toml")
    if not cfg.model.num_items:  # the hash table holds the rows; the dense table it replaces is a stub
        cfg = replace(cfg, model={"num_items": 1})
    validate(cfg)
    if cfg.embedding.kind != "hash":
        raise SystemExit("grf bench stream: set embedding.kind=hash (a dense table cannot hold 32M raw ids)")
    if backends and backends != ["torch"]:
        raise SystemExit("grf bench stream: runs on torch (--backend torch)")
    steps = steps or cfg.train.max_steps or 100
    log_every = max(1, cfg.train.log_every)
    stream = stream or KuaiRandStream(window=cfg.model.max_len, seed=cfg.train.seed)
    B = get_backend("torch")
    host = make_host(cfg)
    params = B.asarray_tree(table_params(init_params(cfg.model, seed=cfg.train.seed), host))
    opt_state = init_opt_state(B, params, cfg)
    step_fn = make_train_step(B, cfg)
    negatives = losses.negatives_for(cfg)
    rng = np.random.default_rng(cfg.train.seed)
    rows, info = [], machine()
    tokens = names = unique = 0
    host_s = 0.0
    t_interval = time.perf_counter()
    for step, (hist, times) in enumerate(stream.batches(0, cfg.train.batch_size), start=1):
        if step > steps:
            break
        t0 = time.perf_counter()
        local, ids, refs = localize_histories(hist)                   # raw 60-bit ids stay on the host
        batch = make_batch(local, times, cfg.model, rng=rng, num_items=len(ids), negatives=negatives)
        lookup, stats = host.plan(ids, refs, step)
        batch = dataclasses.replace(batch, lookup=lookup)
        host_s += time.perf_counter() - t0
        params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
        if not bool(m["finite"]):
            scalars = {k: float(v) for k, v in m.items() if getattr(v, "ndim", 1) == 0}
            raise SystemExit(f"grf bench stream: step {step} was not finite: {scalars}")
        tokens += batch.layout.num_tokens()
        names += stats.ids
        unique += stats.unique
        if step % log_every == 0 or step == steps:
            now = time.perf_counter()
            n = step - (rows[-1]["step"] if rows else 0)
            rss, peak = _rss()
            c = host.counters()
            row_bytes = 4 * cfg.model.embed_dim
            rows.append({"bench": "stream", "step": step, "tokens_per_s": tokens / (now - t_interval),
                         "host_share": host_s / (now - t_interval), "rss_mb": rss / 2**20, "peak_rss_mb": peak / 2**20,
                         "occupancy": c["occupancy"], "capacity": c["capacity"], "inserts": c["inserts"],
                         "evictions": c["evictions"], "hit_rate": c["hit_rate"], "ids_per_step": names / n,
                         "unique_per_step": unique / n, "bytes_before": names / n * row_bytes,
                         "bytes_after": unique / n * row_bytes, "loss": float(m["loss"]),
                         "config": {"embed_dim": cfg.model.embed_dim, "max_len": cfg.model.max_len,
                                    "batch_size": cfg.train.batch_size, "num_blocks": cfg.model.num_blocks,
                                    "optimizer": cfg.embedding.optimizer}, **info})
            emit(rows[-1], json_lines, COLUMNS)
            tokens = names = unique = 0
            host_s = 0.0
            t_interval = time.perf_counter()
    return rows
