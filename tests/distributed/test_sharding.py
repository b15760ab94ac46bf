"""Row-wise sharded tables (gr_functional/embedding/sharding.py) on 2 and 4 gloo ranks equal one
unsharded table: every lookup, and every row after a stream of gradient pushes and lazy Adam
updates (fp32, <= 1e-6); the hierarchical exchange equals the flat one and sends fewer id bytes
across nodes; fp16 / bf16 exchanges stay within their rounding and send fewer bytes."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from . import sharding_worker as W
from .common import ROOT, free_port, rank_env, wait_all


# Every scenario of a world size runs in ONE launch of its ranks (process start-up dominates)
# (KIND:NODE_SIZE:HIERARCHICAL:PRECISION[:STALENESS])
SCENARIOS = {2: ["hash:0:0:fp32", "hash:0:0:fp16", "hash:0:0:bf16", "hash:0:0:fp16:1"],
             4: ["hash:2:1:fp32", "hash:2:0:fp32", "dense:0:0:fp32", "hash:2:1:fp32:2"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """world -> the folder its ranks wrote (``{scenario}-rank{r}.npz``, ``-bytes{r}.json``)."""
    folders, procs = {}, {}
    for world, scenarios in SCENARIOS.items():
        out = folders[world] = tmp_path_factory.mktemp(f"world{world}")
        port = free_port()
        procs[world] = [subprocess.Popen([sys.executable, "-m", "tests.distributed.sharding_worker", str(out),
                                          *scenarios], cwd=ROOT, env=rank_env(r, world, port),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                        for r in range(world)]
        for rank, (rc, _, err) in enumerate(wait_all(procs[world], timeout=300)):
            assert rc == 0, f"world {world} rank {rank} exited {rc}:\n{err[-3000:]}"
    return folders


def _run(launched, world, kind="hash", node_size=0, hierarchical=False, precision="fp32", staleness=0):
    tag = f"{kind}-{node_size}-{int(hierarchical)}-{precision}" + (f"-{staleness}" if staleness else "")
    out = launched[world]
    ranks = [dict(np.load(out / f"{tag}-rank{r}.npz")) for r in range(world)]
    sent = [json.loads((out / f"{tag}-bytes{r}.json").read_text()) for r in range(world)]
    return ranks, {k: sum(b[k] for b in sent) for k in sent[0]}


def _reference(kind, world, staleness=0):
    """One unsharded table: the union of all ranks' ids each step, gradients summed over ranks
    and applied ``staleness`` steps later (the last ``staleness`` never)."""
    from backends import get_backend
    from gr_functional.config import OptimConfig
    from gr_functional.embedding import rowopt
    from gr_functional.embedding.hashtable import hashed_init

    B = get_backend("torch")
    ids_all = W.pool(kind)
    index = {int(x): i for i, x in enumerate(ids_all)}
    values = W.dense_rows()[ids_all] if kind == "dense" else hashed_init(3, ids_all, W.DIM)
    values = B.asarray(values)
    state = rowopt.init_row_state(B, "lazy_adam", len(ids_all), W.DIM)
    looked, queue = [], []
    for step in range(1, W.STEPS + 1):
        per_rank = [W.inputs(kind, r, step) for r in range(world)]
        looked.append([B.to_numpy(B.gather_rows(values, B.asarray(np.asarray([index[int(i)] for i in ids], np.int32))))
                       for ids, _ in per_rank])
        union = np.unique(np.concatenate([ids for ids, _ in per_rank]))
        g = np.zeros((len(union), W.DIM), np.float32)
        for ids, grads in per_rank:
            g[np.searchsorted(union, ids)] += grads
        queue.append((B.asarray(np.asarray([index[int(i)] for i in union], np.int32)), g))
        if len(queue) <= staleness:
            continue
        rows, g = queue.pop(0)
        new, new_state = rowopt.row_update(B, "lazy_adam", B.gather_rows(values, rows), B.asarray(g),
                                           rowopt.gather_state(B, state, rows), B.asarray(np.ones(rows.shape[0], bool)),
                                           W.LR, OptimConfig(lr=W.LR))
        values = B.set_rows(values, rows, new)
        state = rowopt.scatter_state(B, state, rows, new_state)
    return looked, B.to_numpy(values)


@pytest.mark.slow
@pytest.mark.parametrize("world, kind, node_size, hierarchical", [
    (2, "hash", 0, False), (4, "hash", 2, True), (4, "dense", 0, False)])
def test_sharded_table_equals_one_table(launched, world, kind, node_size, hierarchical):
    ranks, _ = _run(launched, world, kind, node_size, hierarchical)
    looked, final = _reference(kind, world)
    for step in range(W.STEPS):
        for r in range(world):
            got, want = ranks[r][f"rows{step + 1}"], looked[step][r]
            assert np.max(np.abs(got - want)) <= 1e-6, (step, r)
    shards = sum(rk["final"] for rk in ranks)  # each id lives on exactly one rank, zeros elsewhere
    seen = np.isin(W.pool(kind), np.concatenate([W.inputs(kind, r, s)[0] for r in range(world)
                                                 for s in range(1, W.STEPS + 1)]))
    assert seen.sum() > 50 and np.max(np.abs(shards[seen] - final[seen])) <= 1e-6


@pytest.mark.parametrize("world, node_size, hierarchical, precision, staleness, tol", [
    (4, 2, True, "fp32", 2, 1e-6), (2, 0, False, "fp16", 1, 2e-3)])
def test_stale_updates_equal_one_table_updated_late(launched, world, node_size, hierarchical, precision,
                                                    staleness, tol):
    """embedding.staleness = k on a sharded table (its gradients' last hop exchanged in the
    background until the next update): every lookup and the final rows equal one table whose
    summed updates land k steps late (fp16: within its rounding, relative to each row's size)."""
    ranks, _ = _run(launched, world, "hash", node_size, hierarchical, precision, staleness)
    looked, final = _reference("hash", world, staleness)
    sync, _ = _reference("hash", world)
    for step in range(W.STEPS):
        for r in range(world):
            got, want = ranks[r][f"rows{step + 1}"], looked[step][r]
            scale = np.abs(want).max(axis=-1, keepdims=True) if precision != "fp32" else 1.0
            assert np.max(np.abs(got - want) / scale) <= tol, (step, r)
    assert max(np.max(np.abs(looked[s][r] - sync[s][r])) for s in range(W.STEPS) for r in range(world)) > 1e-3
    shards = sum(rk["final"] for rk in ranks)
    seen = np.isin(W.pool("hash"), np.concatenate([W.inputs("hash", r, s)[0] for r in range(world)
                                                   for s in range(1, W.STEPS + 1)]))
    scale = np.abs(final[seen]).max(axis=-1, keepdims=True) if precision != "fp32" else 1.0
    assert np.max(np.abs(shards[seen] - final[seen]) / scale) <= tol


def test_hierarchical_exchange_sends_fewer_ids_across_nodes(launched):
    flat, flat_bytes = _run(launched, 4, node_size=2)
    hier, hier_bytes = _run(launched, 4, node_size=2, hierarchical=True)
    for a, b in zip(flat, hier):
        assert np.max(np.abs(a["final"] - b["final"])) <= 1e-6
    assert hier_bytes["ids_inter"] < flat_bytes["ids_inter"]
    assert hier_bytes["grads_inter"] < flat_bytes["grads_inter"]


@pytest.mark.parametrize("precision, tol", [("fp16", 2e-3), ("bf16", 1.6e-2)])
def test_16_bit_exchange(launched, precision, tol):
    low, low_bytes = _run(launched, 2, precision=precision)
    full, full_bytes = _run(launched, 2)
    for a, b in zip(low, full):
        for key in a:
            scale = np.abs(b[key]).max(axis=-1, keepdims=True) + 1e-12
            assert np.max(np.abs(a[key] - b[key]) / scale) <= tol, key
    assert low_bytes["rows_intra"] + low_bytes["rows_inter"] < 0.7 * (full_bytes["rows_intra"] + full_bytes["rows_inter"])


@pytest.mark.slow
@pytest.mark.parametrize("world, kind", [(2, "hash")])  # 4 ranks, dense: run by hand (tests/distributed/sharded_table_reference.py)
def test_jax_shard_map_reference_agrees(tmp_path, world, kind):
    """backends.dist_jax.make_sharded_table_ops (shard_map + jax.lax.all_to_all over forced host
    devices) serves the same rows and ends with the same table as one unsharded table, which the
    gloo ranks match too (test_sharded_table_equals_one_table)."""
    from .common import subprocess_env

    npz = tmp_path / "jax.npz"
    r = subprocess.run([sys.executable, "-m", "tests.distributed.sharded_table_reference", str(npz), str(world), kind],
                       cwd=ROOT, env=subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={world}"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = dict(np.load(npz))
    looked, final = _reference(kind, world)
    for step in range(W.STEPS):
        for rank in range(world):
            assert np.max(np.abs(got[f"rows{step + 1}-{rank}"] - looked[step][rank])) <= 1e-6, (step, rank)
    seen = np.isin(W.pool(kind), np.concatenate([W.inputs(kind, q, s)[0] for q in range(world)
                                                 for s in range(1, W.STEPS + 1)]))
    assert np.max(np.abs(got["final"][seen] - final[seen])) <= 1e-6
