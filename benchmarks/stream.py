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

from .common import emit, machine, rss as _rss

DEFAULT_CONFIG = "kuairand27k_stream"   # grf bench stream without --config
COLUMNS = ["step", "tokens_per_s", "host_share", "rss_mb", "peak_rss_mb", "occupancy", "capacity", "inserts",
           "evictions", "hit_rate", "ids_per_step", "unique_per_step", "bytes_before", "bytes_after"]


def run(json_lines: bool = False, cfg=None, backends=None, steps: int | None = None, stream=None) -> list[dict]:
    from backends import get_backend
    from gr_functional import losses
    from gr_functional.batch import make_batch
    from gr_functional.config import replace
    from gr_functional.configure import load_config
    from gr_functional.data.stream import KuaiRandStream
    from gr_functional.embedding.lookup import localize_histories, make_host, table_params
    from gr_functional.model import init_params
    from gr_functional.configure import validate
    from gr_functional.step import init_opt_state, make_train_step

    cfg = cfg or load_config(f"experiments/configs/{DEFAULT_CONFIG}.toml")
    if not cfg.model.num_items:  # the hash table holds the rows; the dense table it replaces is a stub
        cfg = replace(cfg, model={"num_items": 1})
    validate(cfg)
    if cfg.embedding.kind != "hash":
        raise SystemExit("grf bench stream: set embedding.kind=hash (a dense table cannot hold 32M raw ids)")
    if backends and backends != ["torch"]:
        raise SystemExit("grf bench stream: runs on torch (--backend torch)")
    if cfg.embedding.sharding == "row":
        return run_sharded(cfg, json_lines, steps)
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


# ----------------------------------------------------------------------------- row-sharded, several ranks
SHARDED_COLUMNS = ["step", "ranks", "tokens_per_s", "step_s", "mfu", "host_share", "peak_rss_mb_max", "occupancy",
                   "evictions", "alltoall_mb_per_step", "allreduce_mb_per_step", "imbalance"]


def run_sharded(cfg, json_lines: bool = False, steps: int | None = None, quiet: bool = False) -> list[dict]:
    """The stream on ``dist.nproc`` local ranks (gloo, one thread each; 1 rank too, for scaling
    comparisons): the item table row-sharded over them
    (``embedding.sharding = "row"``, hash kind), each global batch of ``train.batch_size`` windows
    split over ranks by ``dist.balance`` (costs a L^2 + b L), this rank's windows built on a
    prefetch thread (``train.prefetch``) while the previous step computes, ids exchanged with their
    owners by all-to-all, dense gradients all-reduced. Rank 0 prints a row every
    ``train.log_every`` steps: global tokens/s, model FLOPs (``gr_functional.flops``: matrix
    products of the blocks and the in-batch loss, forward + backward) over the summed fp32 matmul
    peak of the ranks (``mfu``), the largest rank's peak RSS, the table, and per step the
    all-to-all bytes (ids out, rows back, row gradients out: ``ShardedTable.bytes``) and the dense
    all-reduce payload (the dense gradients' bytes, each rank's share of a ring all-reduce sends
    2 (R-1)/R of it)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from gr_functional.config import replace

    if not cfg.model.num_items:  # the hash table holds the rows; the dense table it replaces is a stub
        cfg = replace(cfg, model={"num_items": 1})
    steps = steps or cfg.train.max_steps or 100
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.jsonl"
        mp.spawn(_sharded_rank, args=(cfg, steps, port, out, json_lines, quiet), nprocs=cfg.dist.nproc)
        return [json.loads(line) for line in open(out)]


def _sharded_rank(rank: int, cfg, steps: int, port: int, out: str, json_lines: bool, quiet: bool) -> None:
    import json
    import math
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.dist.nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)  # one core per rank, as a rank owns one device: 1, 2, 4 ranks compare
    from backends import get_backend
    from backends.dist_torch import init
    from gr_functional import balance, losses
    from gr_functional.batch import make_batch
    from gr_functional.data.batching import RankSplit
    from gr_functional.data.prefetch import Prefetch, PrefetchStats
    from gr_functional.data.stream import KuaiRandStream
    from gr_functional.embedding.lookup import localize_histories
    from gr_functional.embedding.sharding import make_sharded
    from gr_functional.flops import train_step_flops
    from gr_functional.model import init_params
    from gr_functional.step import init_opt_state, make_sharded_dist_step
    from gr_functional.tree import tree_items

    from .common import machine, matmul_peak

    comm = init(cfg.dist)
    R = comm.world_size
    calls, blocking = [0], comm._run

    def counted(what, fn):  # blocking collectives per step (each costs a latency: the scaling model)
        calls[0] += 1
        return blocking(what, fn)

    comm._run = counted
    B = get_backend("torch")
    peak = float(comm.all_reduce_sum([matmul_peak(B, n=1024)])[0])       # every rank's fp32 matmul rate, summed
    link = _measure_link(comm, R)
    dense = {k: v for k, v in init_params(cfg.model, seed=cfg.train.seed).items() if k != "item_emb"}
    params = B.asarray_tree(dense)
    opt_state = init_opt_state(B, params, cfg)
    shard = make_sharded(B, cfg, comm)
    step_fn = make_sharded_dist_step(B, cfg, comm, shard)
    dense_bytes = 4 * sum(int(np.size(v)) for _, v in tree_items(dense))
    split = RankSplit.from_config(cfg, R)
    negatives = losses.negatives_for(cfg)
    stream = KuaiRandStream(window=cfg.model.max_len, seed=cfg.train.seed)

    def prepared():  # built on the prefetch thread: the global batch's plan and this rank's batch
        for step, (hist, times) in enumerate(stream.batches(0, cfg.train.batch_size), start=1):
            if step > steps:
                return
            lengths = np.asarray([len(h) - 1 for h in hist])               # inputs (= supervised) per window
            assign = balance.karmarkar_karp(split.costs(lengths), R, equal_count=True)
            mine = np.flatnonzero(assign == rank)
            local, ids, refs = localize_histories([hist[i] for i in mine])
            batch = make_batch(local, [times[i] for i in mine], cfg.model, rng=np.random.default_rng((cfg.train.seed, step)),
                               num_items=len(ids), negatives=negatives)
            yield step, lengths, assign, batch, ids

    stats = PrefetchStats()
    source = Prefetch(prepared(), cfg.train.prefetch, stats) if cfg.train.prefetch else prepared()
    rows, totals = [], None
    t_int, tok_int, flop_int, lookup_s = time.perf_counter(), 0, 0, 0.0
    bytes_start = dict(shard.bytes)
    compute, uniq, calls[0] = np.zeros(R), 0, 0
    for step, lengths, assign, batch, ids in source:
        t0 = time.perf_counter()
        rows_local, pending = shard.lookup(ids, step)
        rows_local = B.xp.concat([B.xp.zeros((1, rows_local.shape[1]), dtype=rows_local.dtype), rows_local], axis=0)
        lookup_s += time.perf_counter() - t0
        local_tokens = float(np.asarray(batch.weights).sum())
        params, opt_state, m = step_fn(params, opt_state, [B.asarray_tree(batch)], [local_tokens], float(lengths.sum()),
                                       rows_local, pending)
        if not bool(m["finite"]):
            raise SystemExit(f"grf bench stream: step {step} was not finite (rank {rank})")
        compute += np.asarray(m["rank_compute_s"])
        uniq += len(ids)
        tok_int += int(lengths.sum())
        flop_int += train_step_flops(cfg.model, lengths, num_params=0, num_negatives=cfg.loss.num_negatives)["total"]
        if step % cfg.train.log_every == 0 or step == steps:
            n_steps = step - (rows[-1]["step"] if rows else 0)
            # + the dense gradients' all-reduce buckets (asynchronous, not through _run)
            collectives = calls[0] / n_steps + math.ceil(dense_bytes / comm.bucket_bytes)
            sent = {k: shard.bytes[k] - bytes_start[k] for k in shard.bytes}
            c = shard.table.counters()
            rss = _rss()[1]
            vec = comm.all_reduce_sum([sum(sent.values()), c["occupancy"], c["evictions"], lookup_s, uniq])
            rss_all = comm.gather(rss)
            elapsed = time.perf_counter() - t_int
            if rank == 0:
                rows.append({"bench": "stream_sharded", "step": step, "ranks": R, "tokens_per_s": tok_int / elapsed,
                             "step_s": elapsed / n_steps, "mfu": flop_int / elapsed / peak,
                             "host_share": float(vec[3]) / R / elapsed, "peak_rss_mb_max": max(rss_all) / 2**20,
                             "peak_rss_mb": [r / 2**20 for r in rss_all], "occupancy": int(vec[1]),
                             "capacity": shard.table.capacity * R, "evictions": int(vec[2]),
                             "alltoall_mb_per_step": float(vec[0]) / n_steps / 2**20,
                             "allreduce_mb_per_step": dense_bytes / 2**20,
                             "imbalance": float(compute.max() / max(compute.mean(), 1e-12) - 1.0),
                             "compute_s": float(compute.mean()) / n_steps, "lookup_s": float(vec[3]) / R / n_steps,
                             "unique_per_rank": float(vec[4]) / R / n_steps, "link": link,
                             "tokens_per_rank": tok_int / n_steps / R, "collectives_per_step": collectives,
                             "prefetch_hidden": stats.hidden, "loss": float(m["loss"]), "matmul_peak_flops": peak,
                             "params": {"table": shard.table.capacity * R * cfg.model.embed_dim,
                                        "dense": dense_bytes // 4},
                             "config": {"embed_dim": cfg.model.embed_dim, "max_len": cfg.model.max_len,
                                        "batch_size": cfg.train.batch_size, "num_blocks": cfg.model.num_blocks,
                                        "balance": cfg.dist.balance, "exchange": cfg.embedding.exchange}, **machine()})
                if not quiet:
                    emit(rows[-1], json_lines, SHARDED_COLUMNS)
            t_int, tok_int, flop_int, lookup_s = time.perf_counter(), 0, 0, 0.0
            bytes_start, compute, uniq, calls[0] = dict(shard.bytes), np.zeros(R), 0, 0
    if rank == 0:
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    comm.shutdown()


def _measure_link(comm, R: int) -> dict:
    """This machine's all-to-all between the ranks (gloo over loopback): ``latency_s`` (median of
    8-byte exchanges) and ``bandwidth_Bps`` (bytes a rank sends to others per second, 4 MB rows);
    the scaling model's local parameters (benchmarks/scaling.py)."""
    if R == 1:
        return {"latency_s": 0.0, "bandwidth_Bps": float("inf")}
    counts = np.ones(R, np.int64)

    def timed(rows: int, width: int, repeats: int) -> float:
        x = np.zeros((rows * R, width), np.float32)
        times = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_to_all(x, counts * rows, counts * rows)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    latency = timed(1, 2, 20)
    big = timed(1024, 1024, 5)                            # 4 MB to every other rank
    sent = 4 * 1024 * 1024 * (R - 1)
    return {"latency_s": latency, "bandwidth_Bps": sent / max(big - latency, 1e-9)}
