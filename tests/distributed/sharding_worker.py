"""One rank of the row-sharding tests (tests/distributed/test_sharding.py): a stream of lookups and
gradient pushes through ``ShardedTable`` on a gloo process group; writes what it saw to an .npz.

Usage (env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets them); each scenario
KIND:NODE_SIZE:HIERARCHICAL:PRECISION[:STALENESS] runs on the same process group, one after the
other:
    python -m tests.distributed.sharding_worker OUT hash:0:0:fp32 hash:0:0:fp16 ...
"""
from __future__ import annotations

import json
import sys

import numpy as np

STEPS, DIM, POOL, PER_RANK, NUM_ITEMS, LR = 6, 8, 300, 40, 400, 0.05


def pool(kind: str) -> np.ndarray:
    """The ids the stream draws from: raw 60-bit ids (hash) or 1..NUM_ITEMS (dense)."""
    from gr_functional.embedding.hashtable import mix64

    if kind == "dense":
        return np.arange(1, NUM_ITEMS + 1, dtype=np.int64)
    return (mix64(np.arange(1, POOL + 1, dtype=np.uint64)) >> np.uint64(4)).astype(np.int64)


def inputs(kind: str, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's distinct ids (sorted, Zipf-skewed so ranks share popular ids) and their grads."""
    rng = np.random.default_rng((rank, step))
    ids = pool(kind)
    pick = np.minimum(rng.zipf(1.3, size=PER_RANK) - 1, len(ids) - 1)
    mine = np.unique(ids[pick])
    return mine, rng.standard_normal((len(mine), DIM)).astype(np.float32)


def dense_rows() -> np.ndarray:
    return np.random.default_rng(99).standard_normal((NUM_ITEMS + 1, DIM)).astype(np.float32) * 0.02


def main(argv: list[str]) -> int:
    out, scenarios = argv[0], argv[1:]
    from backends import get_backend
    from backends.dist_torch import init
    from gr_functional.config import DistConfig, OptimConfig
    from gr_functional.embedding.sharding import ShardedTable

    comm = init(DistConfig(backend="gloo", timeout_s=60))
    B = get_backend("torch")
    for scenario in scenarios:
        kind, node_size, hierarchical, precision, *stale = scenario.split(":")
        table = ShardedTable(B, comm, kind=kind, dim=DIM, num_items=NUM_ITEMS, capacity=4 * POOL, seed=3,
                             dense_rows=dense_rows() if kind == "dense" else None, node_size=int(node_size),
                             hierarchical=hierarchical == "1", precision=precision,
                             staleness=int(stale[0]) if stale else 0)
        saved = {}
        for step in range(1, STEPS + 1):
            ids, grads = inputs(kind, comm.rank, step)
            rows, pending = table.lookup(ids, step)
            saved[f"rows{step}"] = B.to_numpy(rows)
            table.update(pending, B.asarray(grads), LR, OptimConfig(lr=LR))
        saved["final"] = table.rows_of(pool(kind))
        tag = scenario.replace(":", "-")
        np.savez(f"{out}/{tag}-rank{comm.rank}.npz", **saved)
        with open(f"{out}/{tag}-bytes{comm.rank}.json", "w") as f:
            json.dump(table.bytes, f)
    comm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
