"""The JAX reference of the row-sharded exchange (``backends.dist_jax.make_sharded_table_ops``) run on
the gloo tests' scenario (tests/distributed/sharding_worker.py), one shard per forced host
device; writes each step's rows per rank and the final rows by id to an .npz.

    XLA_FLAGS=--xla_force_host_platform_device_count=R python -m tests.distributed.sharded_table_reference OUT R KIND
"""
from __future__ import annotations

import math
import sys

import numpy as np

from . import sharding_worker as W


def main(argv: list[str]) -> int:
    out, world, kind = argv[0], int(argv[1]), argv[2]
    import jax
    import jax.numpy as jnp

    from backends import get_backend
    from backends.dist_jax import make_sharded_table_ops
    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt
    from gr_functional.embedding.hashtable import HashTable, hashed_init
    from gr_functional.embedding.sharding import owners

    assert len(jax.devices()) == world, jax.devices()
    B = get_backend("jax")
    cfg = OptimConfig(lr=W.LR)
    lookup, push = make_sharded_table_ops(B, "lazy_adam", cfg)
    pool = W.pool(kind)
    if kind == "hash":
        tables = [HashTable(math.ceil(4 * W.POOL / world), seed=3) for _ in range(world)]
        n_rows = tables[0].capacity + 1
        values = np.zeros((world, n_rows, W.DIM), np.float32)
    else:  # dense: shard o holds ids o, o + R, ... at rows id // R + 1
        n_rows = W.NUM_ITEMS // world + 2
        values = np.zeros((world, n_rows, W.DIM), np.float32)
        dense = W.dense_rows()
        for i in pool:
            values[i % world, i // world + 1] = dense[i]
    values = jnp.asarray(values)
    state = {k: jnp.stack([v] * world) for k, v in rowopt.init_row_state(B, "lazy_adam", n_rows, W.DIM).items()}
    saved = {}
    for step in range(1, W.STEPS + 1):
        inputs = [W.inputs(kind, r, step) for r in range(world)]
        rows_of = {}
        for o in range(world):  # the owners map what they were asked for, as ShardedTable does
            asked = np.unique(np.concatenate([ids[owners(ids, world, kind) == o] for ids, _ in inputs]))
            if kind == "hash":
                got = tables[o].assign(asked, step)
                rows = got.rows
                if got.fresh.any():
                    values = values.at[o, rows[got.fresh]].set(hashed_init(3, asked[got.fresh], W.DIM))
                    state = {k: v.at[o, rows[got.fresh]].set(0.0) for k, v in state.items()}
            else:
                rows = (asked // world + 1).astype(np.int32)
            rows_of.update(zip(asked.tolist(), rows.tolist()))
        cap = max(1, max(int((owners(ids, world, kind) == o).sum()) for ids, _ in inputs for o in range(world)))
        req = np.zeros((world, world, cap), np.int32)
        grads = np.zeros((world, world, cap, W.DIM), np.float32)
        where = []
        for r, (ids, g) in enumerate(inputs):
            own = owners(ids, world, kind)
            slot = np.zeros(len(ids), np.int64)
            for o in range(world):
                mine = np.flatnonzero(own == o)
                req[r, o, :len(mine)] = [rows_of[int(i)] for i in ids[mine]]
                grads[r, o, :len(mine)] = g[mine]
                slot[mine] = np.arange(len(mine))
            where.append((own, slot))
        got = np.asarray(lookup(values, jnp.asarray(req)))
        for r, (own, slot) in enumerate(where):
            saved[f"rows{step}-{r}"] = got[r, own, slot]
        values, state = push(values, state, jnp.asarray(req), jnp.asarray(grads), np.float32(W.LR))
    final = np.zeros((len(pool), W.DIM), np.float32)
    values = np.asarray(values)
    for j, i in enumerate(pool):
        o = int(owners(np.asarray([i]), world, kind)[0])
        row = tables[o].lookup(np.asarray([i]))[0] if kind == "hash" else i // world + 1
        final[j] = values[o, row]
    saved["final"] = final
    np.savez(out, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
