"""A dynamic hash embedding table's host side: raw int64 id -> row, with insertion, eviction and
admission, all vectorised numpy and deterministic. The row values live with the backend.

``IdMap`` is an open-addressing hash map (linear probing, splitmix64 hash, slot states kept apart
from the keys so every int64 is a valid id). ``HashTable`` gives ids rows 1..capacity of a table
whose values live with the backend (row 0 is reserved: the padding id 0 and ids that were not
admitted read it, and it is never given to an id). One ``assign`` call per training step, with
the step's DISTINCT ids in the order insertions should happen:

  - a present id keeps its row (a hit): its last use becomes ``step``, its use count grows by 1;
  - an absent id is counted once in a count-min sketch (4 rows, seeded hashes; only kept when
    ``min_count`` > 1, since with 1 every id is admitted at first sight) and admitted when its
    estimate, read after the whole call's increments, reaches ``min_count``; otherwise it reads
    row 0 ("rejected");
  - admitted ids, in input order, take free rows (lowest first), then rows evicted from ids NOT
    used in this call: "lru" the least recently used (smallest last step, then smallest id),
    "lfu" the least frequently used (fewest steps used since insertion, then least recent, then
    smallest id); when nothing is left to evict the id reads row 0 ("overflow");
  - a row given to an id is "fresh" (last use = step, count = 1): the caller re-initialises its
    value and optimizer state, e.g. with ``hashed_init``.

Determinism: every result is a function of the table's state and the call's ids (in their order):
integer arithmetic only, no randomness, no dict or set iteration order, no dependence on the
machine, thread count or numpy build. A run, its resumed twin (``state_dict`` /
``load_state_dict``), every backend and every rank therefore map the same ids to the same rows.
Victim ties break by id, not by row number, so a table rebuilt from its ids and their use
statistics in any row order (``export`` / ``import_ids``, as a re-sharded checkpoint does)
evicts exactly the ids the original would.

Why on the host: ids are data, produced by the numpy pipeline beside the negatives and dropout
masks; the map is stateful, integer-only work with data-dependent shapes (probing rounds, how
many ids are new, how many rows to evict), which on a device costs a host sync per round. On the
host it runs ahead of the step in the pipeline's queue, and the model stays a pure function of
rows. ``benchmarks/embedding_map.py`` runs the same algorithm as numpy and as torch tensor ops on
the CPU: numpy's get/put were 2-7x faster than single-threaded torch at 10k-1M ids against 1M-4M
keys (12-31 M ids/s get, 6-10 M ids/s put, one core); torch with 2 threads on the shared 2-core
machine was 5-190x slower than numpy (its threads wait for each other). Dedup is the exception:
``torch.unique`` (one thread) was ~2.5x faster than ``np.unique(return_inverse=True)``. No
accelerator was measured: a device map would still pay a host sync per probing round and the
id transfer.

Costs (n = ids in a call, C = capacity, S = map slots = next power of two >= 2C):
  - ``IdMap.get`` / ``put``: one vectorised pass over the ids per probing round; the map keeps
    live + tombstone slots at most 3/4 of S, so rounds are few and shrink geometrically (figures
    above; ``put`` also keeps an int32 scratch of S slots to pick each round's first claimant in
    O(n) instead of sorting: 4-7x faster than a stable argsort at 10k-1M ids);
  - ``HashTable.assign``: a ``get`` of the non-zero ids, a ``put`` of the admitted ones, and when
    it evicts one O(C) scan of the per-row arrays (eligibility mask, ``np.partition`` on the
    primary key) plus a lexsort of the rows at or below the cut (O(k log k), k >= victims);
  - memory: S * 17 bytes for the map (keys, values, states, scratch) + C * 25 bytes per-row
    arrays + 16 * width bytes of sketch; independent of the id range and of the stream length.
"""
from __future__ import annotations

import dataclasses

import numpy as np

_EMPTY, _FULL, _TOMB = 0, 1, 2
_MAX_LOAD = 0.75
_UNCLAIMED = np.iinfo(np.int32).max
_U64 = (1 << 64) - 1
POLICIES = ("lru", "lfu")


# ----------------------------------------------------------------------------- hashing
def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijective, well-mixed hash.
    Any shape; returns uint64 of the same shape (a numpy scalar for a scalar)."""
    x = np.array(x, dtype=np.uint64)  # a copy: the steps below work in place (half the memory traffic)
    shifted = np.empty_like(x)
    with np.errstate(over="ignore"):
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(x, np.uint64(shift), out=shifted)
            x ^= shifted
            x *= np.uint64(mult)
        np.right_shift(x, np.uint64(31), out=shifted)
        x ^= shifted
    return x if x.ndim else x[()]  # a scalar in, a scalar out (as numpy's own ufuncs do)


def _as_key(ids) -> np.ndarray:
    """int64 ids reinterpreted (not converted) as uint64, so negative ids hash like any other."""
    return np.asarray(ids, dtype=np.int64).view(np.uint64)


def _u64(seed: int) -> np.uint64:
    """A Python int seed (negative too) as uint64, two's complement."""
    return np.uint64(int(seed) & _U64)


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= max(n, 2) (exact integer arithmetic, no float log)."""
    return 1 << max(1, (int(n) - 1).bit_length())


# ----------------------------------------------------------------------------- IdMap
class IdMap:
    """int64 key -> int32 value, open addressing with linear probing over ``num_slots`` (a power
    of two) slots: ``keys[S]`` int64, ``values[S]`` int32, ``slot_state[S]`` uint8 (0 empty,
    1 full, 2 tombstone). ``put`` takes absent, distinct keys; ``delete`` present, distinct ones,
    whose slots become tombstones; the map rehashes its live entries (in slot order, so
    deterministically) when live + tombstone slots would pass 3/4 of the slots."""

    def __init__(self, num_slots: int):
        if num_slots < 2 or num_slots & (num_slots - 1):
            raise ValueError(f"IdMap: num_slots must be a power of two >= 2, got {num_slots}")
        self.keys = np.zeros(num_slots, np.int64)
        self.values = np.zeros(num_slots, np.int32)
        self.slot_state = np.zeros(num_slots, np.uint8)
        self.live = 0
        self.tombs = 0
        self._claim = None  # put's scratch, allocated on first use, never saved

    @property
    def num_slots(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.live

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """int64 home slot of each key."""
        return (mix64(_as_key(keys)) & np.uint64(self.num_slots - 1)).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """int64 slot of each key, -1 where absent. A probe stops at the key or at an empty slot
        (tombstones are stepped over); the load limit guarantees an empty slot exists."""
        slot = np.full(len(keys), -1, np.int64)
        pos = self._home(keys)
        active = np.arange(len(keys))
        last = self.num_slots - 1
        while active.size:
            p = pos[active]
            state = self.slot_state[p]
            found = (state == _FULL) & (self.keys[p] == keys[active])
            slot[active[found]] = p[found]
            go_on = ~found & (state != _EMPTY)
            active = active[go_on]
            pos[active] = (p[go_on] + 1) & last
        return slot

    def get(self, keys) -> np.ndarray:
        """``keys[n]`` int64 -> ``[n]`` int32 values, -1 where absent."""
        slot = self._find(np.asarray(keys, dtype=np.int64))
        out = np.full(len(slot), -1, np.int32)
        hit = slot >= 0
        out[hit] = self.values[slot[hit]]
        return out

    def put(self, keys, values) -> None:
        """Insert ``keys[n]`` int64 (absent from the map and distinct) with ``values[n]`` int32.
        Each round every pending key looks at its current slot; of the keys that find the same
        empty or tombstone slot, the first in input order takes it and the others probe on."""
        keys = np.asarray(keys, dtype=np.int64)
        values = np.asarray(values, dtype=np.int32)
        if not keys.size:
            return
        size = self.num_slots
        if self.live + len(keys) > _MAX_LOAD * size:
            raise ValueError(f"IdMap of {size} slots cannot hold {self.live + len(keys)} keys "
                             f"(at most {int(_MAX_LOAD * size)})")
        if self.live + self.tombs + len(keys) > _MAX_LOAD * size:
            self.rebuild()
        pos = self._home(keys)
        pending = np.arange(len(keys), dtype=np.int32)
        while pending.size:
            p = pos[pending]
            free = self.slot_state[p] != _FULL
            slots, winners, lost = self._first_claimants(p[free], pending[free])
            self.tombs -= int(np.count_nonzero(self.slot_state[slots] == _TOMB))
            self.keys[slots] = keys[winners]
            self.values[slots] = values[winners]
            self.slot_state[slots] = _FULL
            moves = ~free
            moves[np.flatnonzero(free)[lost]] = True
            pending = pending[moves]
            pos[pending] = (p[moves] + 1) & (size - 1)
        self.live += len(keys)

    def _first_claimants(self, slots: np.ndarray, index: np.ndarray):
        """Of the pending keys ``index[k]`` (int32, increasing) that want ``slots[k]``, the one
        with the smallest index per slot wins: returns (won slots, winning indices, lost mask).
        ``np.minimum.at`` into a scratch of all slots is O(k), where sorting would be O(k log k)."""
        if self._claim is None:
            self._claim = np.full(self.num_slots, _UNCLAIMED, np.int32)
        np.minimum.at(self._claim, slots, index)
        won = self._claim[slots] == index
        self._claim[slots] = _UNCLAIMED
        return slots[won], index[won], ~won

    def delete(self, keys) -> None:
        """Remove present, distinct ``keys[n]`` int64 (their slots become tombstones)."""
        slot = self._find(np.asarray(keys, dtype=np.int64))
        if (slot < 0).any():
            raise KeyError(f"IdMap.delete: keys {np.asarray(keys)[slot < 0][:3].tolist()} are not present")
        self.slot_state[slot] = _TOMB
        self.live -= len(slot)
        self.tombs += len(slot)

    def rebuild(self) -> None:
        """Rehash the live entries, in slot order, into clean slots (drops the tombstones)."""
        full = np.flatnonzero(self.slot_state == _FULL)
        keys, values = self.keys[full], self.values[full]
        self.keys[:] = 0
        self.values[:] = 0
        self.slot_state[:] = _EMPTY
        self.live = self.tombs = 0
        self.put(keys, values)

    def state_dict(self) -> dict:
        """``keys``, ``values``, ``slot_state`` (copies) and ``counts`` = [live, tombstones] int64."""
        return {"keys": self.keys.copy(), "values": self.values.copy(), "slot_state": self.slot_state.copy(),
                "counts": np.asarray([self.live, self.tombs], np.int64)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["keys"]) != self.num_slots:
            raise ValueError(f"IdMap state has {len(state['keys'])} slots, this map {self.num_slots}")
        self.keys = np.array(state["keys"], np.int64)
        self.values = np.array(state["values"], np.int32)
        self.slot_state = np.array(state["slot_state"], np.uint8)
        self.live, self.tombs = (int(x) for x in state["counts"])
        if (self.live, self.tombs) != (int((self.slot_state == _FULL).sum()), int((self.slot_state == _TOMB).sum())):
            raise ValueError("IdMap state: counts do not match slot_state (a corrupted or mixed-up state)")


# ----------------------------------------------------------------------------- admission
class CountMinSketch:
    """Sightings per id in bounded memory: ``table[depth, width]`` int32 counters (width a power
    of two), one seeded splitmix64 hash per row; an estimate never undercounts (collisions can
    only add)."""

    def __init__(self, width: int, depth: int = 4, seed: int = 0):
        if width < 1 or width & (width - 1):
            raise ValueError(f"CountMinSketch: width must be a power of two, got {width}")
        self.table = np.zeros((depth, width), np.int32)
        with np.errstate(over="ignore"):
            self.salts = mix64(np.arange(1, depth + 1, dtype=np.uint64) + _u64(seed) * np.uint64(depth + 1))

    def _cells(self, ids: np.ndarray) -> list:
        keys = _as_key(ids)
        mask = np.uint64(self.table.shape[1] - 1)
        return [(mix64(keys ^ salt) & mask).astype(np.int64) for salt in self.salts]

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one sighting of each of ``ids[n]`` (distinct int64); returns ``[n]`` int32
        estimates read after all n increments."""
        cells = self._cells(ids)
        for row, h in zip(self.table, cells):
            np.add.at(row, h, 1)  # distinct ids may share a cell: each sighting counts
        return np.min([row[h] for row, h in zip(self.table, cells)], axis=0) if len(cells[0]) else np.zeros(0, np.int32)

    def without(self, ids: np.ndarray) -> np.ndarray:
        """A copy of ``table`` as it was before ``add(ids)``."""
        table = self.table.copy()
        for row, h in zip(table, self._cells(ids)):
            np.subtract.at(row, h, 1)
        return table


# ----------------------------------------------------------------------------- HashTable
@dataclasses.dataclass(frozen=True)
class Assignment:
    """Rows of one ``assign`` call: ``rows[n]`` int32 (0 = padding id or not admitted) and
    ``fresh[n]`` bool (the row was given to its id in this call)."""

    rows: np.ndarray
    fresh: np.ndarray


@dataclasses.dataclass(frozen=True)
class Undo:
    """What one ``assign`` changed, to read the table as it was before it (``HashTable.before``):
    the counters and ``next_free`` before, the hit rows' and the victims' use statistics before
    (and the victims' ids), and the ids counted in the sketch."""

    totals: dict
    next_free: int
    hit_rows: np.ndarray
    hit_last_used: np.ndarray
    hit_count: np.ndarray
    victims: np.ndarray
    victim_ids: np.ndarray
    victim_last_used: np.ndarray
    victim_count: np.ndarray
    sketched: np.ndarray


_COUNTERS = ("lookups", "hits", "inserts", "evictions", "rejected", "overflow")
_NO_VICTIMS = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
_CONFIG = ("capacity", "policy", "min_count", "seed", "sketch_width")


class HashTable:
    """Ids -> rows 1..``capacity`` (module docstring). Per row (``[capacity + 1]``, row 0 unused):
    ``row_id`` int64 (the id it holds; 0 for a row never used), ``live`` bool, ``last_used``
    int64 (step of last use), ``count`` int64 (steps used in since insertion).

    ``sketch_width``: count-min sketch width (a power of two; default the next power of two
    >= 4 * capacity, at least 1024); the sketch exists only when ``min_count`` > 1."""

    def __init__(self, capacity: int, *, policy: str = "lru", min_count: int = 1, seed: int = 0,
                 sketch_width: int = 0):
        if capacity < 1:
            raise ValueError(f"HashTable: capacity must be >= 1, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"HashTable: policy must be one of {POLICIES}, got {policy!r}")
        if min_count < 1:
            raise ValueError(f"HashTable: min_count must be >= 1, got {min_count}")
        self.capacity, self.policy, self.min_count, self.seed = int(capacity), policy, int(min_count), int(seed)
        self.map = IdMap(_pow2_at_least(2 * capacity))
        self.row_id = np.zeros(capacity + 1, np.int64)
        self.live = np.zeros(capacity + 1, bool)
        self.last_used = np.zeros(capacity + 1, np.int64)
        self.count = np.zeros(capacity + 1, np.int64)
        # Rows are handed out in order and a victim's row is refilled at once, so live rows are
        # always exactly 1..next_free-1: "free rows" is a counter, not a list.
        self.next_free = 1
        width = sketch_width or max(1024, _pow2_at_least(4 * capacity))
        self.sketch = CountMinSketch(width, seed=self.seed) if self.min_count > 1 else None
        self.totals = dict.fromkeys(_COUNTERS, 0)
        self.undo: Undo | None = None  # the last ``assign``'s changes (``before``)

    # ------------------------------------------------------------------ the step's call
    def assign(self, ids, step: int) -> Assignment:
        """Rows for the DISTINCT int64 ``ids[n]`` of one step (module docstring rules); the
        caller deduplicates (duplicates would corrupt the map). Returns ``Assignment``."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"HashTable.assign: ids must be 1-D, got shape {ids.shape}")
        rows = np.zeros(len(ids), np.int32)
        fresh = np.zeros(len(ids), bool)
        totals, next_free = dict(self.totals), self.next_free
        real = np.flatnonzero(ids != 0)
        found = self.map.get(ids[real])
        hit = found >= 0
        hit_rows = found[hit]
        rows[real[hit]] = hit_rows
        hit_last_used, hit_count = self.last_used[hit_rows], self.count[hit_rows]
        self._touch(hit_rows, step)
        evicted = _NO_VICTIMS
        self.totals["lookups"] += len(real)
        self.totals["hits"] += len(hit_rows)

        admitted = self._admit(real[~hit], ids)
        if admitted.size:
            new_rows = self._rows_for(len(admitted), protected=hit_rows)
            # rows below the old next_free were evicted; their ids and statistics stay until _insert
            victims = new_rows[new_rows < next_free]
            evicted = (victims, self.row_id[victims], self.last_used[victims], self.count[victims])
            placed = admitted[:len(new_rows)]
            self.totals["overflow"] += len(admitted) - len(placed)
            self._insert(ids[placed], new_rows, step)
            rows[placed] = new_rows
            fresh[placed] = True
        sketched = ids[real[~hit]] if self.sketch is not None else np.zeros(0, np.int64)
        self.undo = Undo(totals, next_free, hit_rows, hit_last_used, hit_count, *evicted, sketched)
        return Assignment(rows, fresh)

    def _touch(self, rows: np.ndarray, step: int) -> None:
        self.last_used[rows] = step
        self.count[rows] += 1  # rows are distinct (ids are), so fancy += counts each once

    def _admit(self, absent: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The positions among ``absent`` (positions into ``ids``) whose ids pass admission."""
        if self.sketch is None or not absent.size:
            return absent
        ok = self.sketch.add(ids[absent]) >= self.min_count
        self.totals["rejected"] += int(np.count_nonzero(~ok))
        return absent[ok]

    def _rows_for(self, n: int, protected: np.ndarray) -> np.ndarray:
        """Up to ``n`` rows (int32) for new ids: free rows first, then victims."""
        rows = self._free_rows(n)
        if len(rows) < n:
            rows = np.concatenate([rows, self._evict(n - len(rows), protected)])
        return rows

    def _insert(self, ids: np.ndarray, rows: np.ndarray, step: int) -> None:
        self.map.put(ids, rows)
        self.row_id[rows] = ids
        self.live[rows] = True
        self.last_used[rows] = step
        self.count[rows] = 1
        self.totals["inserts"] += len(rows)

    def _free_rows(self, n: int) -> np.ndarray:
        take = min(n, self.capacity + 1 - self.next_free)
        out = np.arange(self.next_free, self.next_free + take, dtype=np.int32)
        self.next_free += take
        return out

    def _evict(self, n: int, protected: np.ndarray) -> np.ndarray:
        """Up to ``n`` victim rows (int32, in eviction order) among live rows not in
        ``protected`` (the rows this call already uses); their ids leave the map. Picking the n
        smallest at once equals picking one at a time, since a refilled row is protected."""
        eligible = self.live.copy()
        eligible[0] = False
        eligible[protected] = False
        cand = np.flatnonzero(eligible)
        n = min(n, len(cand))
        if n == 0:
            return np.zeros(0, np.int32)
        if self.policy == "lru":
            order = (self.last_used[cand], self.row_id[cand])
        else:
            order = (self.count[cand], self.last_used[cand], self.row_id[cand])
        victims = cand[_smallest(order, n)]
        self.map.delete(self.row_id[victims])
        self.live[victims] = False
        self.totals["evictions"] += n
        return victims.astype(np.int32)

    # ------------------------------------------------------------------ reading
    def lookup(self, ids) -> np.ndarray:
        """``ids`` int64 (flattened) -> ``[n]`` int32 rows, 0 where absent and for id 0; no
        insertion, no counting (evaluation)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        rows = self.map.get(ids)
        return np.where((rows < 0) | (ids == 0), 0, rows).astype(np.int32)

    def row_ids(self) -> np.ndarray:
        """``[capacity + 1]`` int64: the id each row holds (0 where the row is free, and row 0)."""
        return np.where(self.live, self.row_id, 0)

    def live_rows(self) -> np.ndarray:
        """int64 indices of the rows that hold an id, increasing."""
        return np.flatnonzero(self.live)

    def counters(self, undo: Undo | None = None) -> dict:
        """Cumulative ints: lookups (non-zero ids passed to ``assign``), hits, inserts, evictions,
        rejected (absent, below min_count), overflow (admitted, no row to give); and occupancy
        (live rows now), capacity, hit_rate (hits / lookups, 0.0 before any lookup). With the
        last ``assign``'s ``undo``: as they were before it (live rows are always 1..next_free-1)."""
        out = dict(self.totals if undo is None else undo.totals)
        live = int(np.count_nonzero(self.live)) if undo is None else undo.next_free - 1
        out.update(occupancy=live, capacity=self.capacity,
                   hit_rate=out["hits"] / out["lookups"] if out["lookups"] else 0.0)
        return out

    def before(self, undo: Undo) -> "HashTable":
        """A copy of this table as it was before the ``assign`` that recorded ``undo`` (its last
        one): what a checkpoint holds when that call ran ahead of the step it serves (the map
        itself is rebuilt from the ids, as ``import_ids`` does)."""
        old = HashTable(self.capacity, policy=self.policy, min_count=self.min_count, seed=self.seed,
                        sketch_width=self.sketch.table.shape[1] if self.sketch is not None else 0)
        row_id, live = self.row_id.copy(), self.live.copy()
        last_used, count = self.last_used.copy(), self.count.copy()
        taken = np.arange(undo.next_free, self.next_free)
        live[taken], row_id[taken] = False, 0
        live[undo.victims], row_id[undo.victims] = True, undo.victim_ids
        last_used[undo.victims], count[undo.victims] = undo.victim_last_used, undo.victim_count
        last_used[undo.hit_rows], count[undo.hit_rows] = undo.hit_last_used, undo.hit_count
        rows = np.flatnonzero(live)
        old.import_ids(row_id[rows], last_used[rows], count[rows])
        old.totals = dict(undo.totals)
        if self.sketch is not None:
            old.sketch.table = self.sketch.without(undo.sketched)
        return old

    # ------------------------------------------------------------------ row-independent form
    def export(self) -> dict:
        """The live ids in row order with their use statistics (``ids``, ``rows``, ``last_used``,
        ``count``), the sketch and the counters (``totals``): everything eviction depends on, so
        a re-sharded or merged table rebuilt with ``import_ids`` evicts as this one would."""
        rows = self.live_rows()
        out = {"ids": self.row_id[rows].copy(), "rows": rows.astype(np.int32), "last_used": self.last_used[rows].copy(),
               "count": self.count[rows].copy(), "totals": np.asarray([self.totals[k] for k in _COUNTERS], np.int64)}
        if self.sketch is not None:
            out["sketch"] = self.sketch.table.copy()
        return out

    def import_ids(self, ids, last_used, count) -> np.ndarray:
        """Insert ``ids[n]`` (absent, distinct int64) with their use statistics (``[n]`` int64)
        into free rows, in the given order; returns their ``[n]`` int32 rows. No counters move."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) > self.capacity + 1 - self.next_free:
            raise ValueError(f"import of {len(ids)} ids into a table with {self.capacity + 1 - self.next_free} "
                             f"free rows (capacity {self.capacity})")
        rows = self._free_rows(len(ids))
        self.map.put(ids, rows)
        self.row_id[rows] = ids
        self.live[rows] = True
        self.last_used[rows] = last_used
        self.count[rows] = count
        return rows

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> np.ndarray:
        sketch = self.sketch.table.shape[1] if self.sketch is not None else 0
        return np.asarray([self.capacity, POLICIES.index(self.policy), self.min_count, self.seed, sketch], np.int64)

    def state_dict(self) -> dict:
        """numpy arrays only: ``config`` int64 [capacity, policy index, min_count, seed, sketch
        width (0 without a sketch)], ``map`` (``IdMap.state_dict``), the per-row arrays,
        ``next_free``, ``totals`` int64 (counters in ``_COUNTERS`` order) and ``sketch``."""
        state = {"config": self._config(), "map": self.map.state_dict(), "row_id": self.row_id.copy(),
                 "live": self.live.copy(), "last_used": self.last_used.copy(), "count": self.count.copy(),
                 "next_free": np.asarray(self.next_free, np.int64),
                 "totals": np.asarray([self.totals[k] for k in _COUNTERS], np.int64)}
        if self.sketch is not None:
            state["sketch"] = self.sketch.table.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``: later ``assign`` calls return what the saved table's would.
        A state saved with another capacity, policy, min_count, seed or sketch width is refused
        with a ValueError naming the key (its rows would mean something else)."""
        saved = np.asarray(state["config"], np.int64)
        for name, a, b in zip(_CONFIG, saved, self._config()):
            if a != b:
                shown = (lambda v: POLICIES[int(v)]) if name == "policy" else int
                raise ValueError(f"hash table state has {name}={shown(a)!r}, this table {shown(b)!r}: "
                                 f"resume with the original embedding settings")
        self.map.load_state_dict(state["map"])
        self.row_id = np.array(state["row_id"], np.int64)
        self.live = np.array(state["live"], bool)
        self.last_used = np.array(state["last_used"], np.int64)
        self.count = np.array(state["count"], np.int64)
        self.next_free = int(state["next_free"])
        self.totals = {k: int(v) for k, v in zip(_COUNTERS, state["totals"])}
        if self.sketch is not None:
            self.sketch.table = np.array(state["sketch"], np.int32)


def _smallest(keys: tuple, n: int) -> np.ndarray:
    """Indices of the ``n`` smallest entries by ``keys`` (primary key first, ties by the next;
    the last key must be unique), in that order. ``np.partition`` on the primary key drops
    everything above the n-th smallest before the lexsort: O(m) + O(k log k) for m candidates,
    k of them at or below the cut."""
    primary = keys[0]
    if n < len(primary):
        cut = np.partition(primary, n - 1)[n - 1]
        keep = np.flatnonzero(primary <= cut)
    else:
        keep = np.arange(len(primary))
    order = np.lexsort(tuple(k[keep] for k in reversed(keys)))
    return keep[order[:n]]


# ----------------------------------------------------------------------------- initial rows
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hashed_init(seed: int, ids, dim: int, std: float = 0.02, bound: float = 2.0) -> np.ndarray:
    """``ids[n]`` int64 -> ``[n, dim]`` float32: row i a function of (seed, ids[i]) only, N(0, 1)
    truncated to [-bound, bound] times ``std`` (the dense table's truncated normal), so an id
    starts with the same row on every backend, rank and resume, whatever else the step inserts.

    A counter-based generator: splitmix64 of (mix of seed and id) + column * golden ratio, top 53
    bits -> a uniform strictly inside (0, 1) -> the truncated normal's inverse CDF
    (``ndtri(Phi(-b) + u (Phi(b) - Phi(-b)))``), which has exactly the distribution rejection
    sampling gives. Bitwise reproducible for a given numpy/scipy build (the only floating point is
    scipy's ndtri in float64, rounded to float32). About 25-30 M values/s on one core here."""
    from scipy.special import ndtr, ndtri

    with np.errstate(over="ignore"):
        keys = mix64(_as_key(ids) ^ mix64(np.asarray([_u64(seed)], np.uint64)))[:, None]
        cols = np.arange(dim, dtype=np.uint64)[None, :]
        bits = mix64(keys + cols * _GOLDEN)
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    lo, hi = ndtr(-bound), ndtr(bound)
    return (ndtri(lo + u * (hi - lo)) * std).astype(np.float32)
