"""The dynamic hash table against plain-Python oracles: the id map (a dict), insertion, admission
(a Python count-min sketch), LRU/LFU eviction, overflow, counters (a row-list table written from
the module docstring's rules), save/load, and the per-id initial rows."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from gr_functional.embedding.hashtable import HashTable, IdMap, hashed_init, mix64

M64 = (1 << 64) - 1
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SPECIAL = [0, -1, 1, 2**62, 2**63 - 1, -(2**63)]


def py_mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (the oracle's hash)."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def colliding_keys(num_slots: int, count: int, seed: int = 0) -> list[int]:
    """``count`` distinct int64 keys that all hash to the same home slot of a ``num_slots`` map."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=count * num_slots * 4, dtype=np.int64))
    home = mix64(keys.view(np.uint64)) & np.uint64(num_slots - 1)
    same = keys[home == home[0]]
    assert len(same) >= count
    return same[:count].tolist()


def test_mix64_is_splitmix64():
    # splitmix64 seeded with 0 first outputs 0xE220A8397B1DCDAF: the finaliser of the golden gamma
    assert int(mix64(np.uint64(0x9E3779B97F4A7C15))) == 0xE220A8397B1DCDAF
    xs = np.asarray([0, 1, 2**63, M64, 12345678901234567], np.uint64)
    assert mix64(xs).tolist() == [py_mix64(int(x)) for x in xs]


# ----------------------------------------------------------------------------- IdMap
COLLIDING_64 = colliding_keys(64, 30)
KEYS = st.one_of(INT64, st.sampled_from(SPECIAL), st.sampled_from(COLLIDING_64))


def run_idmap_ops(m: IdMap, oracle: dict, ops, nxt: int = 0) -> int:
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
        assert got.dtype == np.int32 and got.tolist() == [oracle.get(k, -1) for k in keys]
        assert len(m) == len(oracle)
    return nxt


OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "delete", "get"]), st.lists(KEYS, max_size=12)), max_size=40)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(OPS, OPS)
def test_idmap_matches_a_dict_and_survives_save_load(ops, more):
    m, oracle = IdMap(64), {}
    nxt = run_idmap_ops(m, oracle, ops)
    everything = np.asarray(list(oracle) + COLLIDING_64 + SPECIAL, np.int64)
    assert m.get(everything).tolist() == [oracle.get(k, -1) for k in everything.tolist()]
    loaded = IdMap(64)
    loaded.load_state_dict(m.state_dict())
    twin = dict(oracle)
    run_idmap_ops(m, oracle, more, nxt)
    run_idmap_ops(loaded, twin, more, nxt)
    for a, b in zip(m.state_dict().values(), loaded.state_dict().values()):
        assert np.array_equal(a, b)


def test_idmap_same_home_keys_take_consecutive_slots_in_input_order():
    keys = COLLIDING_64[:6]
    m = IdMap(64)
    home = int(mix64(np.asarray(keys[:1], np.int64).view(np.uint64))[0] & np.uint64(63))
    m.put(np.asarray(keys, np.int64), np.arange(6, dtype=np.int32))
    slots = [(home + i) % 64 for i in range(6)]
    assert m.keys[slots].tolist() == keys and m.values[slots].tolist() == list(range(6))
    m.delete(np.asarray(keys[1:3], np.int64))                 # tombstones in the middle of the run
    assert m.get(np.asarray(keys, np.int64)).tolist() == [0, -1, -1, 3, 4, 5]
    m.put(np.asarray(keys[1:3][::-1], np.int64), np.asarray([7, 8], np.int32))  # reclaimed, first comer first
    assert m.keys[slots].tolist() == [keys[0], keys[2], keys[1], *keys[3:]]


class CountingIdMap(IdMap):
    rebuilds = 0

    def rebuild(self):
        self.rebuilds += 1
        super().rebuild()


@pytest.mark.slow
def test_idmap_long_stream_with_collisions_and_rebuilds():
    rng = np.random.default_rng(0)
    m, oracle = CountingIdMap(1 << 10), {}
    pool = np.asarray(colliding_keys(1 << 10, 150, seed=1) + SPECIAL +
                      rng.integers(-(2**62), 2**62, size=1500).tolist(), np.int64)
    for step in range(400):
        keys = np.unique(rng.choice(pool, size=40))
        absent = np.asarray([k for k in keys.tolist() if k not in oracle][: 700 - len(oracle)], np.int64)
        values = np.arange(len(absent), dtype=np.int32) + step * 100
        m.put(absent, values)
        oracle.update(zip(absent.tolist(), values.tolist()))
        present = np.asarray([k for k in keys.tolist() if k in oracle][:12], np.int64)
        m.delete(present)
        for k in present.tolist():
            del oracle[k]
        assert m.get(pool).tolist() == [oracle.get(k, -1) for k in pool.tolist()]
        assert m.live + m.tombs <= 0.75 * len(m.keys)
    assert m.rebuilds >= 3


def test_idmap_refuses_overfilling_and_absent_deletes():
    with pytest.raises(ValueError, match="cannot hold"):
        IdMap(8).put(np.arange(7, dtype=np.int64), np.zeros(7, np.int32))
    with pytest.raises(KeyError, match="not present"):
        IdMap(8).delete(np.asarray([5], np.int64))
    with pytest.raises(ValueError, match="power of two"):
        IdMap(48)


# ----------------------------------------------------------------------------- HashTable
class OracleTable:
    """The module docstring's rules, one id at a time, over per-row Python lists: free rows
    found by scanning, victims by ``min`` (ties by id), admission by a Python count-min sketch
    whose estimates are read after the call's increments."""

    def __init__(self, capacity, policy, min_count, seed=0, width=0):
        self.capacity, self.policy, self.min_count = capacity, policy, min_count
        self.row_of = {}
        self.row_id = [0] * (capacity + 1)
        self.live = [False] * (capacity + 1)
        self.last = [0] * (capacity + 1)
        self.count = [0] * (capacity + 1)
        width = width or max(1024, 1 << (4 * capacity - 1).bit_length())
        self.width, self.sketch = width, [[0] * width for _ in range(4)]
        self.salts = [py_mix64(d + seed * 5) for d in range(1, 5)]
        self.c = dict(lookups=0, hits=0, inserts=0, evictions=0, rejected=0, overflow=0)

    def cells(self, x):
        return [py_mix64((x & M64) ^ s) & (self.width - 1) for s in self.salts]

    def victim_key(self, r):
        if self.policy == "lru":
            return (self.last[r], self.row_id[r])
        return (self.count[r], self.last[r], self.row_id[r])

    def assign(self, ids, step):
        rows, fresh = [0] * len(ids), [False] * len(ids)
        used, absent = set(), []
        for i, x in enumerate(ids):
            if x == 0:
                continue
            self.c["lookups"] += 1
            if x in self.row_of:
                r = self.row_of[x]
                rows[i] = r
                self.last[r], self.count[r] = step, self.count[r] + 1
                used.add(r)
                self.c["hits"] += 1
            else:
                absent.append(i)
        admitted = absent
        if self.min_count > 1:
            for i in absent:
                for d, cell in enumerate(self.cells(ids[i])):
                    self.sketch[d][cell] += 1
            admitted = [i for i in absent
                        if min(self.sketch[d][c] for d, c in enumerate(self.cells(ids[i]))) >= self.min_count]
            self.c["rejected"] += len(absent) - len(admitted)
        for i in admitted:
            free = [r for r in range(1, self.capacity + 1) if not self.live[r]]
            if free:
                r = free[0]
            else:
                cands = [r for r in range(1, self.capacity + 1) if r not in used]
                if not cands:
                    self.c["overflow"] += 1
                    continue
                r = min(cands, key=self.victim_key)
                del self.row_of[self.row_id[r]]
                self.c["evictions"] += 1
            self.row_of[ids[i]], self.row_id[r], self.live[r] = r, ids[i], True
            self.last[r], self.count[r] = step, 1
            used.add(r)
            rows[i], fresh[i] = r, True
            self.c["inserts"] += 1
        return rows, fresh

    def counters(self):
        out = dict(self.c, occupancy=sum(self.live), capacity=self.capacity)
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        return out


def assert_agree(table, oracle, ids, step):
    got = table.assign(np.asarray(ids, np.int64), step)
    rows, fresh = oracle.assign(list(ids), step)
    assert got.rows.dtype == np.int32 and got.fresh.dtype == bool
    assert got.rows.tolist() == rows, step
    assert got.fresh.tolist() == fresh, step
    assert table.counters() == oracle.counters(), step
    assert table.live_rows().tolist() == [r for r in range(1, oracle.capacity + 1) if oracle.live[r]]
    assert table.row_ids().tolist() == [x if live else 0 for x, live in zip(oracle.row_id, oracle.live)]


def stream(rng, capacity, steps, pool_size):
    """Zipf-ish batches of distinct ids (any int64, 0 among them) in shuffled order; every 7th
    batch names more distinct ids than the table has rows."""
    pool = np.concatenate([rng.integers(-(2**63), 2**63 - 1, size=pool_size - 4, dtype=np.int64),
                           np.asarray([-1, 2**63 - 1, -(2**63), 3], np.int64)])
    for step in range(1, steps + 1):
        if step % 7:
            pick = np.minimum(rng.zipf(1.4, size=int(rng.integers(1, capacity + 3))) - 1, pool_size - 1)
            ids = np.unique(pool[rng.permutation(pool_size)[pick] if step % 3 == 0 else pick])
        else:
            ids = rng.choice(pool, size=min(2 * capacity + 3, pool_size), replace=False)
        if step % 2:
            ids = np.concatenate([ids, [0]])
        yield step, rng.permutation(ids)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("min_count", [1, 3])
@pytest.mark.parametrize("capacity,width", [(7, 16), (40, 0)])   # width 16: sketch collisions
def test_hash_table_follows_the_oracle(policy, min_count, capacity, width):
    rng = np.random.default_rng(min_count * 7 + len(policy) + capacity)
    table = HashTable(capacity, policy=policy, min_count=min_count, seed=5, sketch_width=width)
    oracle = OracleTable(capacity, policy, min_count, seed=5, width=width)
    for step, ids in stream(rng, capacity, 150, pool_size=5 * capacity):
        assert_agree(table, oracle, ids.tolist(), step)
    c = oracle.c
    assert c["evictions"] > 3 * capacity and c["overflow"] > 0 and c["hits"] > 0
    assert (c["rejected"] > 0) == (min_count > 1)
    ids = np.asarray(list(oracle.row_of) + [0, 123456789], np.int64)
    assert table.lookup(ids).tolist() == [oracle.row_of.get(i, 0) for i in ids.tolist()]
    assert table.counters() == oracle.counters()                  # lookup counts nothing


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["lru", "lfu"]), st.integers(1, 3),
       st.lists(st.lists(st.sampled_from([0, -5, 1, 2, 3, 4, 7, 9, 2**62, -(2**63)]), max_size=10), max_size=25))
def test_hash_table_follows_the_oracle_on_any_stream(capacity, policy, min_count, batches):
    table = HashTable(capacity, policy=policy, min_count=min_count, seed=9, sketch_width=8)
    oracle = OracleTable(capacity, policy, min_count, seed=9, width=8)
    for step, ids in enumerate(batches, 1):
        assert_agree(table, oracle, list(dict.fromkeys(ids)), step)


# ----------------------------------------------------------------------------- determinism
def through_npz(state: dict) -> dict:
    """A state dict through an .npz file (numpy arrays only; nested dicts flattened by path)."""
    flat = {}

    def walk(prefix, d):
        for k, v in d.items():
            walk(f"{prefix}{k}/", v) if isinstance(v, dict) else flat.__setitem__(prefix + k, v)

    walk("", state)
    buf = io.BytesIO()
    np.savez(buf, **flat)
    buf.seek(0)
    out: dict = {}
    with np.load(buf) as f:
        for path in f.files:
            *parents, leaf = path.split("/")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = f[path]
    return out


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        same_state(a[k], b[k]) if isinstance(a[k], dict) else np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy,min_count", [("lfu", 2), ("lru", 1)])
def test_save_load_mid_stream_continues_identically(policy, min_count):
    rng = np.random.default_rng(3)
    batches = list(stream(rng, 10, 80, pool_size=50))
    a = HashTable(10, policy=policy, min_count=min_count, seed=1)
    for step, ids in batches[:40]:
        a.assign(ids, step)
    saved = a.state_dict()
    b = HashTable(10, policy=policy, min_count=min_count, seed=1)
    b.load_state_dict(through_npz(saved))
    for step, ids in batches[40:]:
        x, y = a.assign(ids, step), b.assign(ids, step)
        assert np.array_equal(x.rows, y.rows) and np.array_equal(x.fresh, y.fresh), step
    assert a.counters() == b.counters() and a.counters()["evictions"] > 0
    assert same_state(a.state_dict(), b.state_dict())
    assert not same_state(saved, a.state_dict())                  # the saved state is a copy


def test_two_tables_given_the_same_stream_agree():
    rng = np.random.default_rng(4)
    a, b = (HashTable(30, policy="lfu", min_count=2, seed=7) for _ in range(2))
    for step, ids in stream(rng, 30, 60, pool_size=150):
        x, y = a.assign(ids, step), b.assign(ids, step)
        assert np.array_equal(x.rows, y.rows) and np.array_equal(x.fresh, y.fresh)
    assert same_state(a.state_dict(), b.state_dict())


@pytest.mark.parametrize("other,key", [
    (dict(capacity=11), "capacity"), (dict(policy="lru"), "policy"), (dict(min_count=3), "min_count"),
    (dict(seed=2), "seed"), (dict(sketch_width=2048), "sketch_width")])
def test_a_load_into_another_configuration_is_refused(other, key):
    config = dict(capacity=10, policy="lfu", min_count=2, seed=1, sketch_width=1024)
    a = HashTable(**config)
    a.assign(np.arange(1, 6, dtype=np.int64), 1)
    config.update(other)
    capacity = config.pop("capacity")
    with pytest.raises(ValueError, match=f"{key}="):
        HashTable(capacity, **config).load_state_dict(a.state_dict())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_table_rebuilt_from_its_export_evicts_as_the_original(policy):
    rng = np.random.default_rng(8)
    a = HashTable(10, policy=policy, seed=2)
    batches = [np.unique(rng.integers(1, 60, size=7)) for _ in range(80)]
    for step, ids in enumerate(batches[:40], 1):
        a.assign(ids, step)
    ex = a.export()
    b = HashTable(10, policy=policy, seed=2)
    order = rng.permutation(len(ex["ids"]))                     # other rows than the original's
    b.import_ids(ex["ids"][order], ex["last_used"][order], ex["count"][order])
    for step, ids in enumerate(batches[40:], 41):
        x, y = a.assign(ids, step), b.assign(ids, step)
        assert np.array_equal(x.rows > 0, y.rows > 0) and np.array_equal(x.fresh, y.fresh), step
        assert sorted(a.row_ids()[a.live_rows()].tolist()) == sorted(b.row_ids()[b.live_rows()].tolist())


@pytest.mark.parametrize("policy,min_count", [("lru", 1), ("lfu", 2)])
def test_before_reads_the_table_as_it_was_before_the_last_assign(policy, min_count):
    """``before(undo)`` (a lookup that ran ahead of its step, checkpointed before it): the export,
    counters and row ids before each assign of a stream with evictions, rejections and
    overflow; and the rolled-back copy continues exactly as the original did."""
    rng = np.random.default_rng(5)
    a = HashTable(12, policy=policy, min_count=min_count, seed=3)
    batches = list(stream(rng, 12, 60, pool_size=40))
    for step, ids in batches:
        ex, counters, row_ids = a.export(), a.counters(), a.row_ids().copy()
        want = a.assign(ids, step)
        old = a.before(a.undo)
        got = old.export()
        assert all(np.array_equal(got[k], ex[k]) for k in ex), step
        assert a.counters(a.undo) == counters == old.counters()
        assert np.array_equal(old.row_ids(), row_ids)
        again = old.assign(ids, step)
        assert np.array_equal(again.rows, want.rows) and np.array_equal(again.fresh, want.fresh), step
        after = old.export()
        assert all(np.array_equal(after[k], v) for k, v in a.export().items()), step
    assert a.counters()["evictions"] > 0
    assert min_count == 1 or a.counters()["rejected"] > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="policy"):
        HashTable(4, policy="fifo")
    with pytest.raises(ValueError, match="capacity"):
        HashTable(0)
    with pytest.raises(ValueError, match="power of two"):
        HashTable(4, min_count=2, sketch_width=1000)


# ----------------------------------------------------------------------------- hashed_init
def test_hashed_init_is_a_function_of_seed_and_id():
    ids = np.asarray([5, -3, 2**62, 17, 2**63 - 1, -(2**63)], np.int64)
    rows = hashed_init(7, ids, 16)
    assert rows.dtype == np.float32 and rows.shape == (6, 16)
    perm = np.asarray([3, 0, 5, 1, 4, 2])
    assert np.array_equal(hashed_init(7, ids[perm], 16), rows[perm])           # order does not matter
    assert np.array_equal(hashed_init(7, ids[1:2], 16), rows[1:2])             # nor company
    others = np.concatenate([np.arange(100, 200, dtype=np.int64), ids[2:4]])
    assert np.array_equal(hashed_init(7, others, 16)[-2:], rows[2:4])
    assert np.array_equal(hashed_init(7, ids, 4), rows[:, :4])                 # column j depends on j only
    assert not np.isin(hashed_init(8, ids, 16), rows).any()                   # another seed, other values
    assert hashed_init(-1, ids, 3).shape == (6, 3)


def test_hashed_init_values_are_pinned():
    """Checkpoints and resumed runs rely on these values: a change of formula must be deliberate."""
    got = hashed_init(0, np.asarray([1, -1], np.int64), 3)
    want = [[-0.00099045655, 0.012767465, -0.0062042568], [-0.010137859, 0.0071528759, 0.010248425]]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_hashed_init_is_a_truncated_normal():
    x = hashed_init(0, np.arange(1, 12501, dtype=np.int64), 16).ravel().astype(np.float64)  # 200k values
    assert np.abs(x).max() <= 0.04
    assert abs(x.mean()) < 2e-4
    assert x.std() == pytest.approx(0.02 * 0.8796, rel=0.01)                  # N(0,1) truncated to +-2
    assert stats.kstest(x, stats.truncnorm(-2, 2, scale=0.02).cdf).pvalue > 1e-3
