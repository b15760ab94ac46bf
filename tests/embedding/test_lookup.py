"""The per-step lookup plan: dedup of every id a batch names, localisation, and the host's rows."""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional.batch import Negatives, make_batch
from gr_functional.config import Config, EmbeddingConfig, ModelConfig, TrainConfig
from gr_functional.embedding.lookup import EmbeddingHost, batch_ids, localize, unique_ids

MODEL = ModelConfig(num_items=500, embed_dim=8, num_blocks=1, dqk=4, dv=4, max_len=12, input_dropout=0.0,
                    linear_dropout=0.0)


def _batch(seed=0, negatives=Negatives("sampled", 6)):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 14, size=7)
    hist = [rng.integers(1, 501, size=n) for n in lengths]
    times = [np.sort(rng.integers(0, 10**6, size=n)) for n in lengths]
    return make_batch(hist, times, MODEL, rng=rng, num_items=500, negatives=negatives)


@pytest.mark.parametrize("offset", [0, 1 << 40])
def test_unique_ids_counts_references_and_drops_padding(offset):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 50, size=(30, 4)), rng.integers(0, 50, size=17)]
    arrays = [np.where(a == 0, 0, a + offset) for a in arrays]  # both the bincount and the sort path
    ids, refs = unique_ids(arrays)
    flat = np.concatenate([a.ravel() for a in arrays])
    assert ids.tolist() == sorted(set(flat.tolist()) - {0})
    assert refs == int((flat != 0).sum())
    empty, none = unique_ids([np.zeros(5, np.int32)])
    assert empty.size == 0 and none == 0


@pytest.mark.parametrize("kind", ["sampled", "in_batch"])
def test_localize_maps_every_id_to_its_slot_and_keeps_padding(kind):
    batch = _batch(negatives=Negatives(kind, 6))
    ids, _ = unique_ids(batch_ids(batch))
    local = localize(batch, ids)
    for before, after in zip(batch_ids(batch), batch_ids(local)):
        before, after = np.asarray(before), np.asarray(after)
        assert after.dtype == np.int32
        assert np.array_equal(after == 0, before == 0)
        assert np.array_equal(ids[after[after > 0] - 1], before[before > 0])


def test_localize_refuses_an_id_outside_the_list():
    batch = _batch()
    ids, _ = unique_ids(batch_ids(batch))
    with pytest.raises(ValueError, match="not in the step's id list"):
        localize(batch, ids[1:])


def _cfg(**embedding):
    return Config(model=MODEL, train=TrainConfig(seed=3), embedding=EmbeddingConfig(**embedding))


def test_dense_host_rows_are_the_ids_and_all_are_touched():
    host = EmbeddingHost(_cfg(optimizer="lazy_adam"), 500)
    ids = np.array([3, 7, 499], np.int64)
    lookup, stats = host.plan(ids, 10, step=1)
    assert lookup.rows.tolist()[:4] == [0, 3, 7, 499] and not lookup.rows[4:].any()
    assert lookup.touched.tolist()[:4] == [False, True, True, True] and not lookup.touched[4:].any()
    assert not lookup.fresh.any()
    assert (stats.ids, stats.unique, stats.bytes_before, stats.bytes_after) == (10, 3, 320, 96)
    with pytest.raises(ValueError, match="outside 1..500"):
        host.plan(np.array([501], np.int64), 1, step=2)


def test_hash_host_initialises_fresh_rows_from_the_id_only():
    cfg = _cfg(kind="hash", capacity=4, optimizer="lazy_adam")
    a, b = EmbeddingHost(cfg, 500), EmbeddingHost(cfg, 500)
    la, _ = a.plan(np.array([10, 20], np.int64), 2, step=1)
    lb, _ = b.plan(np.array([20], np.int64), 1, step=1)
    assert la.fresh[1:3].all() and lb.fresh[1]
    assert np.array_equal(la.init[2], lb.init[1])          # id 20's row starts the same in both tables
    again, _ = a.plan(np.array([10, 20], np.int64), 2, step=2)
    assert not again.fresh.any() and np.array_equal(again.rows[1:3], la.rows[1:3])


def test_hash_host_dense_init_reproduces_the_dense_rows():
    dense = np.random.default_rng(0).standard_normal((501, 8)).astype(np.float32)
    host = EmbeddingHost(_cfg(kind="hash", capacity=600, optimizer="lazy_adam", init="dense"), 500, dense)
    ids = np.array([5, 77, 500], np.int64)
    lookup, _ = host.plan(ids, 3, step=1)
    assert np.array_equal(lookup.init[1:4], dense[ids])


def test_host_state_round_trips():
    cfg = _cfg(kind="hash", capacity=3, optimizer="lazy_adam", policy="lfu")
    a = EmbeddingHost(cfg, 500)
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        a.plan(np.unique(rng.integers(1, 20, size=4)).astype(np.int64), 4, step)
    b = EmbeddingHost(cfg, 500)
    b.load_state_dict(a.state_dict())
    assert b.counters() == a.counters()
    for step in range(6, 12):
        ids = np.unique(rng.integers(1, 20, size=4)).astype(np.int64)
        la, _ = a.plan(ids, 4, step)
        lb, _ = b.plan(ids, 4, step)
        assert np.array_equal(la.rows, lb.rows) and np.array_equal(la.fresh, lb.fresh)
