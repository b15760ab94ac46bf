"""The dynamic hash table against plain-Python oracles: the id map, insertion, LRU/LFU eviction,
admission, overflow, counters, save/load, and the per-id initial rows."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gr_functional.embedding.hashtable import HashTable, IdMap, hashed_init

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


# ----------------------------------------------------------------------------- IdMap
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "delete", "get"]), st.lists(INT64, max_size=12)), max_size=30))
def test_idmap_matches_a_dict(ops):
    m, oracle, nxt = IdMap(64), {}, 0
    for op, keys in ops:
        keys = list(dict.fromkeys(keys))
        if op == "put":
            keys = [k for k in keys if k not in oracle][: 40 - len(oracle)]
            vals = list(range(nxt, nxt + len(keys)))
            nxt += len(keys)
            m.put(np.asarray(keys, np.int64), np.asarray(vals, np.int32))
            oracle.update(zip(keys, vals))
        elif op == "delete":
            keys = [k for k in keys if k in oracle]
            m.delete(np.asarray(keys, np.int64))
            for k in keys:
                del oracle[k]
        got = m.get(np.asarray(keys, np.int64))
        assert got.tolist() == [oracle.get(k, -1) for k in keys]
        assert len(m) == len(oracle)
    everything = np.asarray(list(oracle), np.int64)
    assert m.get(everything).tolist() == [oracle[k] for k in oracle]


def test_idmap_long_stream_with_collisions_and_rebuilds():
    rng = np.random.default_rng(0)
    m, oracle = IdMap(1 << 10), {}
    colliding = (np.arange(400, dtype=np.int64) << 40)  # same low bits: stress the probing
    pool = np.concatenate([colliding, rng.integers(-(2**62), 2**62, size=400), [0, -1, 2**63 - 1, -(2**63)]])
    for step in range(300):
        keys = np.unique(rng.choice(pool, size=20))
        absent = np.asarray([k for k in keys if k not in oracle][: 700 - len(oracle)], np.int64)
        m.put(absent, np.arange(len(absent), dtype=np.int32) + step * 100)
        oracle.update({int(k): int(v) for k, v in zip(absent, np.arange(len(absent)) + step * 100)})
        present = np.asarray([k for k in keys if int(k) in oracle], np.int64)[:8]
        m.delete(present)
        for k in present:
            del oracle[int(k)]
        assert m.get(pool).tolist() == [oracle.get(int(k), -1) for k in pool]
    assert m.tombs < len(m.keys)


def test_idmap_refuses_more_than_it_can_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        IdMap(8).put(np.arange(7, dtype=np.int64), np.zeros(7, np.int32))


# ----------------------------------------------------------------------------- HashTable
class OracleTable:
    """The module docstring's rules, one id at a time (ties between victims break by id)."""

    def __init__(self, capacity, policy, min_count):
        self.capacity, self.policy, self.min_count = capacity, policy, min_count
        self.row_of, self.id_of, self.last, self.count = {}, {}, {}, {}
        self.seen, self.next_free = {}, 1
        self.c = dict(lookups=0, hits=0, inserts=0, evictions=0, rejected=0, overflow=0)

    def assign(self, ids, step):
        rows, fresh = [0] * len(ids), [False] * len(ids)
        protected, admitted = set(), []
        for i, x in enumerate(ids):
            if x == 0:
                continue
            self.c["lookups"] += 1
            if x in self.row_of:
                r = self.row_of[x]
                rows[i] = r
                self.last[r], self.count[r] = step, self.count[r] + 1
                protected.add(r)
                self.c["hits"] += 1
            else:
                self.seen[x] = self.seen.get(x, 0) + 1
                if self.min_count > 1 and self.seen[x] < self.min_count:
                    self.c["rejected"] += 1
                else:
                    admitted.append(i)
        for i in admitted:
            if self.next_free <= self.capacity:
                r = self.next_free
                self.next_free += 1
            else:
                cands = [r for r in self.id_of if r not in protected]
                if not cands:
                    self.c["overflow"] += 1
                    continue
                key = (lambda r: (self.last[r], self.id_of[r])) if self.policy == "lru" else (
                    lambda r: (self.count[r], self.last[r], self.id_of[r]))
                r = min(cands, key=key)
                del self.row_of[self.id_of.pop(r)]
                self.c["evictions"] += 1
            self.row_of[ids[i]], self.id_of[r] = r, ids[i]
            self.last[r], self.count[r] = step, 1
            protected.add(r)
            rows[i], fresh[i] = r, True
            self.c["inserts"] += 1
        return rows, fresh


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("min_count", [1, 3])
def test_hash_table_follows_the_oracle(policy, min_count):
    rng = np.random.default_rng(min_count * 7 + len(policy))
    capacity = 12
    table = HashTable(capacity, policy=policy, min_count=min_count, seed=5, sketch_width=1 << 12)
    oracle = OracleTable(capacity, policy, min_count)
    # Zipf-ish ids from a wide space, plus batches larger than the capacity (overflow)
    space = rng.integers(-(2**60), 2**60, size=40)
    for step in range(1, 120):
        if step % 10:
            ids = np.unique(space[np.minimum(rng.zipf(1.3, size=int(rng.integers(1, 20))) - 1, len(space) - 1)])
        else:
            ids = rng.choice(space, size=20, replace=False)  # more distinct ids than rows
        ids = rng.permutation(np.concatenate([ids, [0]]))
        got = table.assign(ids, step)
        rows, fresh = oracle.assign(ids.tolist(), step)
        assert got.rows.tolist() == rows and got.fresh.tolist() == fresh, step
        counters = table.counters()
        assert {k: counters[k] for k in oracle.c} == oracle.c
        assert counters["occupancy"] == len(oracle.row_of)
    assert oracle.c["evictions"] > 20 and (min_count == 1 or oracle.c["rejected"] > 0)
    assert oracle.c["overflow"] > 0 or min_count > 1
    ids = np.asarray(list(oracle.row_of), np.int64)
    assert table.lookup(ids).tolist() == [oracle.row_of[i] for i in ids.tolist()]
    assert table.lookup(np.asarray([0, 123456789], np.int64)).tolist() == [0, 0]


def test_save_load_continues_identically_and_refuses_another_config():
    rng = np.random.default_rng(3)
    a = HashTable(10, policy="lfu", min_count=2, seed=1)
    stream = [np.unique(rng.integers(1, 40, size=8)) for _ in range(60)]
    for step, ids in enumerate(stream[:30], 1):
        a.assign(ids, step)
    b = HashTable(10, policy="lfu", min_count=2, seed=1)
    b.load_state_dict(a.state_dict())
    for step, ids in enumerate(stream[30:], 31):
        x, y = a.assign(ids, step), b.assign(ids, step)
        assert np.array_equal(x.rows, y.rows) and np.array_equal(x.fresh, y.fresh)
    assert a.counters() == b.counters()
    with pytest.raises(ValueError, match="policy='lfu', this table 'lru'"):
        HashTable(10, policy="lru", min_count=2, seed=1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="capacity"):
        HashTable(11, policy="lfu", min_count=2, seed=1).load_state_dict(a.state_dict())


def test_hashed_init_is_a_function_of_seed_and_id():
    ids = np.asarray([5, -3, 2**62, 17], np.int64)
    rows = hashed_init(7, ids, 16)
    assert rows.dtype == np.float32 and rows.shape == (4, 16)
    assert np.array_equal(hashed_init(7, ids[::-1], 16), rows[::-1])        # order and company do not matter
    assert np.array_equal(hashed_init(7, ids[1:2], 16), rows[1:2])
    assert not np.array_equal(hashed_init(8, ids, 16), rows)
    big = hashed_init(0, np.arange(1, 12501, dtype=np.int64), 16).ravel()   # 200k values
    assert np.abs(big).max() <= 0.04
    assert abs(big.mean()) < 2e-4
    assert big.std() == pytest.approx(0.02 * 0.8796, rel=0.01)             # N(0,1) truncated to +-2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_table_rebuilt_from_its_export_evicts_as_the_original(policy):
    rng = np.random.default_rng(8)
    a = HashTable(10, policy=policy, seed=2)
    stream = [np.unique(rng.integers(1, 60, size=7)) for _ in range(80)]
    for step, ids in enumerate(stream[:40], 1):
        a.assign(ids, step)
    ex = a.export()
    b = HashTable(10, policy=policy, seed=2)
    order = rng.permutation(len(ex["ids"]))                     # other rows than the original's
    b.import_ids(ex["ids"][order], ex["last_used"][order], ex["count"][order])
    for step, ids in enumerate(stream[40:], 41):
        x, y = a.assign(ids, step), b.assign(ids, step)
        assert np.array_equal(x.rows > 0, y.rows > 0) and np.array_equal(x.fresh, y.fresh), step
        assert sorted(a.row_ids()[a.live_rows()].tolist()) == sorted(b.row_ids()[b.live_rows()].tolist())
