"""Batches built ahead on a background thread (train.prefetch) are bitwise the synchronous ones,
in the same order, with the same loader position at every hand-out; failures and early stops
behave as on the synchronous path."""
import threading
import time

import numpy as np
import pytest

from gr_functional.batch import Negatives
from gr_functional.config import ModelConfig
from gr_functional.data import TrainLoader, leave_one_out, make_synthetic
from gr_functional.data.batching import RankSplit
from gr_functional.data.prefetch import Prefetch, PrefetchStats
from gr_functional.tree import tree_items

CFG = ModelConfig(max_len=20, embed_dim=8, num_blocks=2, num_heads=1, dqk=8, dv=8, input_dropout=0.2,
                  linear_dropout=0.1)


@pytest.fixture(scope="module")
def data():
    return leave_one_out(make_synthetic(num_users=150, num_items=200, max_events=60, seed=3)).train


def _leaves(batch):
    return {k: np.asarray(v) for k, v in tree_items(batch) if v is not None}


def _assert_same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for key in la:
        assert la[key].dtype == lb[key].dtype and np.array_equal(la[key], lb[key]), key


@pytest.mark.parametrize("kind", ["sampled", "in_batch"])
def test_prefetched_epoch_is_the_synchronous_epoch(data, kind):
    sync = TrainLoader(data, CFG, 16, seed=5, negatives=Negatives(kind, 6))
    ahead = TrainLoader(data, CFG, 16, seed=5, negatives=Negatives(kind, 6))
    stats = PrefetchStats()
    for e, start in ((0, 0), (1, 3)):
        positions = []
        for a, b in zip(sync.epoch(e, start), ahead.epoch(e, start, prefetch=3, stats=stats), strict=True):
            _assert_same(a, b)
            assert sync.position == ahead.position  # the next batch to hand out, not the next to build
            positions.append(ahead.position)
        assert positions[-1] == (e + 1, 0) and sync.position == ahead.position == (e + 1, 0)
    assert stats.items == sync.steps_in_epoch(0) + sync.steps_in_epoch(1) - 3
    assert stats.build_s > 0 and 0.0 <= stats.hidden <= 1.0


def test_prefetched_rank_epoch_is_the_synchronous_one(data):
    split = RankSplit(world_size=2, policy="lookahead", lookahead=4)
    loaders = [TrainLoader(data, CFG, 16, seed=1, split=split) for _ in range(2)]
    for rank in (0, 1):
        sync = loaders[0].rank_epoch(0, 0, rank=rank, with_ids=True)
        ahead = loaders[1].rank_epoch(0, 0, rank=rank, with_ids=True, prefetch=2)
        for a, b in zip(sync, ahead, strict=True):
            _assert_same(a.batch, b.batch)
            assert np.array_equal(a.rank_tokens, b.rank_tokens) and np.array_equal(a.step_ids[0], b.step_ids[0])


def test_stopping_early_keeps_the_position_of_the_last_batch_handed_out(data):
    loader = TrainLoader(data, CFG, 16, seed=5)
    it = loader.epoch(0, prefetch=4)
    for _ in range(3):
        next(it)
    time.sleep(0.2)  # let the worker run ahead
    assert loader.position == (0, 3)
    it.close()
    assert loader.position == (0, 3)
    assert not [t for t in threading.enumerate() if t.name == "grf-prefetch"]


def test_a_failure_while_building_is_raised_at_its_item():
    def items():
        yield 1
        yield 2
        raise ValueError("malformed line 7")

    got = []
    with pytest.raises(ValueError, match="malformed line 7"):
        for x in Prefetch(items(), 2):
            got.append(x)
    assert got == [1, 2]


def test_a_slow_consumer_never_lets_the_worker_run_more_than_depth_ahead():
    built = []

    def items():
        for i in range(20):
            built.append(i)
            yield i

    with Prefetch(items(), 2) as it:
        assert next(it) == 0
        time.sleep(0.3)
        # one handed out, two in the queue, one built and waiting for a free slot
        assert len(built) <= 4
    with pytest.raises(ValueError, match="depth"):
        Prefetch(iter(()), 0)
