"""``grf bench embedding``: the sparse side's costs on this machine (docs/guides/sparse-embeddings.md "Sparse embeddings").

Sections (one JSON line per measurement with ``--json``):

- ``step``: ids/s of one step's table work, lookup + row-sparse update, for a batch of ``n`` ids
  drawn Zipf-like (a = 1.2) from a 2^60 id space, on a table of ``rows`` x ``dim`` fp32 (torch, CPU):
  ``nn_embedding_sparse_adam`` (``nn.Embedding(sparse=True)`` forward, backward of a sum, torch's
  ``SparseAdam`` step: the library baseline, ids pre-mapped to rows), ``dense_lazy_adam`` (our
  path on a dense table: dedup, gather, ``rowopt.row_update``, ``set_rows``), ``hash_lazy_adam``
  (the same plus ``HashTable.assign`` of the raw ids), and ``jax_take`` (``jnp.take`` of the
  deduplicated rows, for scale). ``ratio_vs_nn_embedding`` compares with the baseline.
- ``map``: where the id -> row map should run: the same linear-probing ``get`` of ``n`` ids in a
  map holding ``keys`` keys, as numpy on the host (``IdMap``, what the pipeline uses) and as torch
  tensor ops (what a device-side op would run; CPU here), ids/s of each.
- ``memory``: peak RSS while ``stream_ids`` distinct raw ids stream through a table of
  ``capacity`` rows (evicting), against the RSS of the empty process: the host side stays bounded
  by the capacity, not by the id range or the stream (the row values, ``capacity x dim x 4`` bytes
  per fp32 array, are reported as ``value_bytes``, not allocated here).
- ``dedup``: ids named per step before and after dedup on real ML-1M batches (``ml1m_hstu``: 128
  sequences, 128 sampled negatives per position) and the bytes of the rows gathered (fp32, D = 50).
- ``exchange``: bytes a row-sharded table's all-to-all moves per step, measured by running it
  (``ShardedTable`` on gloo, ``ranks`` processes on this machine) on the real ML-1M batches,
  each rank taking its data-parallel share (``dist.balance = "kk"``): ids, rows and gradients,
  intra-/inter-node (``node_size`` 2 when 4 ranks), flat or hierarchical, fp32 or fp16, and what
  the same exchange would move without dedup (every id reference sent: ``*_no_dedup``).
- ``row_kernel``: the row-wise Adagrad update of ``rows`` gathered rows of width ``dim`` (torch,
  CPU) through each ``ops.row_update`` that loads here: ``reference`` (array code) and
  ``fbgemm`` (fbgemm's TBE, fbgemm-gpu-cpu here); ``ratio_vs_reference`` > 1 is faster.
"""
from __future__ import annotations

import json
import resource
import time

import numpy as np

from gr_functional.embedding.hashtable import HashTable, IdMap, mix64


def _zipf_ids(rng, n: int, distinct: int, a: float = 1.2) -> np.ndarray:
    """``n`` raw int64 ids: Zipf ranks over ``distinct`` items, each rank hashed into 2^60."""
    ranks = np.minimum(rng.zipf(a, size=n), distinct).astype(np.uint64)
    return (mix64(ranks) >> np.uint64(4)).astype(np.int64)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _emit(record: dict, json_lines: bool) -> None:
    if json_lines:
        print(json.dumps(record))
    else:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))


# ----------------------------------------------------------------------------- step
def bench_step(rows: int, dim: int, n: int, repeats: int, json_lines: bool) -> None:
    import torch

    from backends import get_backend
    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt
    from gr_functional.embedding.lookup import unique_ids

    B = get_backend("torch")
    opt = OptimConfig(lr=1e-3)
    rng = np.random.default_rng(0)
    raw = _zipf_ids(rng, n, distinct=rows * 4)
    table = HashTable(rows, seed=0)
    table.assign(np.unique(raw), step=1)  # warm: a steady-state step mostly hits
    raw = _zipf_ids(rng, n, distinct=rows * 4)
    dense_ids = (raw.view(np.uint64) % np.uint64(rows - 1)).astype(np.int64) + 1

    emb = torch.nn.Embedding(rows, dim, sparse=True)
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    ids_t = torch.from_numpy(dense_ids)

    def baseline():
        sparse_adam.zero_grad()
        emb(ids_t).sum().backward()
        sparse_adam.step()

    values = B.asarray(np.zeros((rows + 1, dim), np.float32))
    state = rowopt.init_row_state(B, "lazy_adam", rows + 1, dim)

    def ours(ids, mapper):
        nonlocal values, state
        uniq, _ = unique_ids([ids])
        r = B.asarray(mapper(uniq))
        got = B.gather_rows(values, r)
        grads = torch.ones_like(got)  # d(sum)/d(row) summed over repeats: the shape of the work
        new, new_state = rowopt.row_update(B, "lazy_adam", got, grads, rowopt.gather_state(B, state, r),
                                           torch.ones(len(uniq), dtype=torch.bool), 1e-3, opt)
        values = B.set_rows(values, r, new)
        state = rowopt.scatter_state(B, state, r, new_state)

    step_no = [1]

    def hash_rows(uniq):
        step_no[0] += 1
        return table.assign(uniq, step_no[0]).rows

    t_base = _best(baseline, repeats)
    t_dense = _best(lambda: ours(dense_ids, lambda u: u.astype(np.int32)), repeats)
    t_hash = _best(lambda: ours(raw, hash_rows), repeats)
    unique = len(np.unique(raw))
    common = {"section": "step", "rows": rows, "dim": dim, "ids": n, "unique": unique}
    for impl, t in (("nn_embedding_sparse_adam", t_base), ("dense_lazy_adam", t_dense), ("hash_lazy_adam", t_hash)):
        _emit({**common, "impl": impl, "ids_per_s": n / t, "ratio_vs_nn_embedding": t_base / t}, json_lines)
    try:
        import jax
        import jax.numpy as jnp

        jtable = jnp.zeros((rows + 1, dim), jnp.float32)
        take = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
        jr = jnp.asarray(np.unique(dense_ids).astype(np.int32))
        take(jtable, jr).block_until_ready()
        t_jax = _best(lambda: take(jtable, jr).block_until_ready(), repeats)
        _emit({**common, "impl": "jax_take", "ids_per_s": n / t_jax, "ratio_vs_nn_embedding": t_base / t_jax},
              json_lines)
    except ImportError:
        pass


# ----------------------------------------------------------------------------- map placement
def _torch_get(torch, keys_t, values_t, state_t, query):
    """The linear-probing ``IdMap.get`` in torch tensor ops (what a device-side map would run)."""
    size = keys_t.numel()
    q = query.view(torch.int64)
    x = q.clone()
    # splitmix64 in int64 arithmetic (wrapping multiply; logical shifts emulated by masking)
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685)):
        x = x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))
        x = x * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    pos = x & (size - 1)
    out = torch.full_like(q, -1)
    active = torch.arange(q.numel())
    while active.numel():
        p = pos[active]
        st = state_t[p]
        found = (st == 1) & (keys_t[p] == q[active])
        out[active[found]] = values_t[p[found]].long()
        go = ~found & (st != 0)
        active = active[go]
        pos[active] = (p[go] + 1) % size
    return out


def bench_map(keys: int, n: int, repeats: int, json_lines: bool) -> None:
    import torch

    rng = np.random.default_rng(1)
    stored = np.unique(rng.integers(-(2**62), 2**62, size=keys))
    m = IdMap(1 << int(np.ceil(np.log2(2 * len(stored)))))
    m.put(stored, np.arange(len(stored), dtype=np.int32))
    query = np.concatenate([rng.choice(stored, n // 2), rng.integers(-(2**62), 2**62, size=n - n // 2)])
    k_t, v_t, s_t = (torch.from_numpy(a) for a in (m.keys, m.values, m.slot_state))
    q_t = torch.from_numpy(query)
    want = m.get(query)
    got = _torch_get(torch, k_t, v_t, s_t, q_t).numpy()
    if not np.array_equal(got.astype(np.int32), want):
        raise AssertionError("the torch map disagrees with IdMap")
    t_np = _best(lambda: m.get(query), repeats)
    t_torch = _best(lambda: _torch_get(torch, k_t, v_t, s_t, q_t), repeats)
    for impl, t in (("numpy_host", t_np), ("torch_ops", t_torch)):
        _emit({"section": "map", "impl": impl, "keys": len(stored), "ids": n, "ids_per_s": n / t,
               "ratio_vs_numpy": t_np / t}, json_lines)


# ----------------------------------------------------------------------------- memory
def _rss_mb() -> float:
    """Resident set size now (Linux /proc; elsewhere the process peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bench_memory(capacity: int, stream_ids: int, chunk: int, dim: int, json_lines: bool) -> None:
    before = _rss_mb()
    table = HashTable(capacity, policy="lru", seed=0)
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    step, seen, peak, at_capacity = 0, 0, _rss_mb(), None
    while seen < stream_ids:
        step += 1
        # every chunk is new ids (a counter hashed into 2^60): the worst case for the table
        ids = (mix64(np.arange(seen, seen + chunk, dtype=np.uint64) + np.uint64(1)) >> np.uint64(4)).astype(np.int64)
        table.assign(ids[rng.permutation(len(ids))], step)
        seen += chunk
        peak = max(peak, _rss_mb())
        if at_capacity is None and seen >= capacity:
            at_capacity = peak
    seconds = time.perf_counter() - t0
    c = table.counters()
    _emit({"section": "memory", "capacity": capacity, "stream_ids": seen, "chunk": chunk,
           "rss_before_mb": before, "peak_rss_at_capacity_mb": at_capacity, "peak_rss_mb": peak,
           "host_bytes_per_row": (peak - before) * 2**20 / capacity, "value_bytes_fp32": capacity * dim * 4,
           "dim": dim, "evictions": c["evictions"], "inserts_per_s": c["inserts"] / seconds}, json_lines)


# ----------------------------------------------------------------------------- dedup
def bench_dedup(batches: int, json_lines: bool) -> None:
    import gr_functional as grf
    from gr_functional.embedding.lookup import batch_ids, unique_ids

    exp = grf.prepare("ml1m_hstu")
    ids = uniq = 0
    for i, batch in enumerate(exp.batches(0)):
        if i == batches:
            break
        u, refs = unique_ids(batch_ids(batch))
        ids += refs
        uniq += len(u)
    row = 4 * exp.cfg.model.embed_dim
    _emit({"section": "dedup", "dataset": "ml-1m", "batches": batches, "ids_per_step": ids / batches,
           "unique_per_step": uniq / batches, "bytes_before": ids / batches * row,
           "bytes_after": uniq / batches * row, "reduction": ids / max(uniq, 1)}, json_lines)


def _exchange_rank(rank: int, world: int, port: int, steps: int, scenarios: list, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import gr_functional as grf
    from backends import get_backend
    from backends.dist_torch import init
    from gr_functional.config import DistConfig, OptimConfig, replace
    from gr_functional.data.batching import TrainLoader
    from gr_functional.embedding.lookup import batch_ids, unique_ids
    from gr_functional.embedding.sharding import ShardedTable

    exp = grf.prepare("ml1m_hstu")
    cfg = replace(exp.cfg, dist={"nproc": world})
    loader = TrainLoader.from_config(exp.splits.train, cfg, world)
    comm = init(DistConfig(backend="gloo", timeout_s=300))
    B = get_backend("torch")
    D = cfg.model.embed_dim
    results = []
    for node_size, hierarchical, precision in scenarios:
        table = ShardedTable(B, comm, kind="hash", dim=D, num_items=cfg.model.num_items, seed=0,
                             node_size=node_size, hierarchical=hierarchical, precision=precision)
        refs_total = 0
        for step in range(steps):
            ids, refs = unique_ids(batch_ids(loader.rank_batch(0, step, rank).batch))
            refs_total += refs
            rows, pending = table.lookup(ids, step + 1)
            table.update(pending, B.xp.zeros_like(rows), 0.0, OptimConfig())
        results.append({"bytes": table.bytes, "refs": refs_total})
    total = comm.all_reduce_sum([v for r in results for v in (*r["bytes"].values(), r["refs"])])
    if rank == 0:
        keys = list(results[0]["bytes"])
        with open(out, "w") as f:
            for i, (node_size, hierarchical, precision) in enumerate(scenarios):
                part = total[i * (len(keys) + 1):(i + 1) * (len(keys) + 1)]
                f.write(json.dumps({"node_size": node_size, "hierarchical": hierarchical, "precision": precision,
                                    **{k: float(v) / steps for k, v in zip(keys, part)},
                                    "refs": float(part[-1]) / steps}) + "\n")
    comm.shutdown()


def bench_exchange(world: int, steps: int, json_lines: bool) -> None:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    node = 2 if world >= 4 else 1
    scenarios = [(node, False, "fp32"), (node, False, "fp16"), (node, True, "fp32"), (node, True, "fp16")]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/exchange.jsonl"
        mp.spawn(_exchange_rank, args=(world, port, steps, scenarios, out), nprocs=world)
        rows = [json.loads(line) for line in open(out)]
    dim = 50  # ml1m_hstu
    for r in rows:
        row_bytes = dim * 4 if r["precision"] == "fp32" else dim * 2 + 4
        total = sum(r[f"{w}_{s}"] for w in ("ids", "rows", "grads") for s in ("intra", "inter"))
        no_dedup = r["refs"] * (world - 1) / world * (8 + 2 * row_bytes)  # a reference's owner is another rank w.p. (R-1)/R
        _emit({"section": "exchange", "dataset": "ml-1m", "ranks": world, **{k: r[k] for k in (
            "node_size", "hierarchical", "precision")}, "bytes_per_step": total,
            "inter_node_bytes_per_step": r["ids_inter"] + r["rows_inter"] + r["grads_inter"],
            "bytes_per_step_no_dedup": no_dedup, "dedup_reduction": no_dedup / max(total, 1)}, json_lines)


def bench_row_kernel(rows: int, dim: int, repeats: int, json_lines: bool) -> None:
    import torch

    from backends import BackendUnavailable, get_backend
    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt

    gen = torch.Generator().manual_seed(0)
    values, grads = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    acc, touched, cfg = torch.rand(rows, generator=gen), torch.ones(rows, dtype=torch.bool), OptimConfig(lr=0.01)
    t_ref = None
    for kernel in ("reference", "fbgemm"):
        try:
            B = get_backend("torch", ops={"row_update": kernel})
        except BackendUnavailable as exc:
            _emit({"section": "row_kernel", "kernel": kernel, "skipped": str(exc)}, json_lines)
            continue
        update = lambda: rowopt.row_update(B, "rowwise_adagrad", values, grads, {"acc": acc}, touched,  # noqa: E731
                                           0.01, cfg)
        update()  # warm-up (fbgemm builds its table once)
        t = _best(update, repeats)
        t_ref = t_ref or t
        _emit({"section": "row_kernel", "kernel": kernel, "rows": rows, "dim": dim, "ms": t * 1e3,
               "ratio_vs_reference": t_ref / t}, json_lines)


def run(json_lines: bool = False, quick: bool = False) -> None:
    """All sections; ``quick`` shrinks every size (tests)."""
    if quick:
        bench_step(rows=20_000, dim=16, n=5_000, repeats=2, json_lines=json_lines)
        bench_map(keys=20_000, n=5_000, repeats=2, json_lines=json_lines)
        bench_memory(capacity=5_000, stream_ids=40_000, chunk=2_000, dim=16, json_lines=json_lines)
        bench_dedup(batches=2, json_lines=json_lines)
        bench_row_kernel(rows=1_000, dim=16, repeats=2, json_lines=json_lines)
        return
    for n in (10_000, 100_000):
        bench_step(rows=1_000_000, dim=64, n=n, repeats=5, json_lines=json_lines)
    for n in (100_000, 1_000_000):
        bench_map(keys=4_000_000, n=n, repeats=3, json_lines=json_lines)
    bench_memory(capacity=4_000_000, stream_ids=32_000_000, chunk=1_000_000, dim=256, json_lines=json_lines)
    bench_dedup(batches=10, json_lines=json_lines)
    for rows, dim in ((4_096, 64), (32_768, 256)):
        bench_row_kernel(rows, dim, repeats=10, json_lines=json_lines)
    for world in (2, 4):
        bench_exchange(world, steps=5, json_lines=json_lines)
