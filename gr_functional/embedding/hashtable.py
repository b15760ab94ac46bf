"""A dynamic hash embedding table's host side: raw int64 id -> row, with insertion, eviction and
admission, all vectorised numpy and deterministic.

``IdMap`` is an open-addressing hash map (linear probing, splitmix64 hash, slot states kept apart
from the keys so every int64 is a valid id). ``HashTable`` gives ids rows 1..capacity of a table
whose values live with the backend (row 0 is reserved: the padding id and ids that were not
admitted read it). One ``assign`` call per training step, with the step's distinct ids:

  - a present id keeps its row (a hit);
  - an absent id is counted (a count-min sketch, when ``min_count`` > 1) and admitted once seen in
    ``min_count`` steps; admitted ids take free rows (lowest first), then rows evicted from ids
    NOT used in this step: "lru" the least recently used (smallest last step, then smallest id),
    "lfu" the least frequently used (fewest steps since insertion, then least recent, then
    smallest id); when nothing is evictable the id reads row 0 this step ("overflow");
  - a row given to an id is "fresh": the caller re-initialises its value and optimizer state.

Determinism: the result of a call is a function of the table's state and the call's ids (in
their order), so a run, its resumed twin (``state_dict``), every backend and every rank map the
same ids to the same rows. Which ids are evicted never depends on row numbers (ties break by
id), so a table rebuilt from its ids and their use statistics (``export`` / ``from_export``, as a
re-sharded checkpoint does) evicts exactly as the original would. The mapping runs on the host, beside the negatives and dropout masks,
because ids are data: the model stays a pure function of rows (README "Sparse embeddings" has the
measurement against a device-side map).

Costs: a lookup or insert is a few vectorised passes over the ids (one per probing round; the
map keeps at most 3/4 of its slots used, so rounds are few); a call that evicts also scans the
per-row arrays once (O(capacity); "lfu" sorts its candidates, O(capacity log capacity)).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

_EMPTY, _FULL, _TOMB = 0, 1, 2
_MAX_LOAD = 0.75
POLICIES = ("lru", "lfu")


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijective, well-mixed hash."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _as_key(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).view(np.uint64)


class IdMap:
    """int64 key -> int32 value, open addressing with linear probing over ``num_slots`` (a power
    of two). ``put`` takes absent, distinct keys; deleted slots become tombstones, and the map
    rehashes itself (deterministically, in slot order) when used + tombstone slots pass 3/4."""

    def __init__(self, num_slots: int):
        if num_slots < 2 or num_slots & (num_slots - 1):
            raise ValueError(f"IdMap: num_slots must be a power of two >= 2, got {num_slots}")
        self.keys = np.zeros(num_slots, np.int64)
        self.values = np.zeros(num_slots, np.int32)
        self.slot_state = np.zeros(num_slots, np.uint8)
        self.live = 0
        self.tombs = 0

    @property
    def mask(self) -> np.uint64:
        return np.uint64(len(self.keys) - 1)

    def __len__(self) -> int:
        return self.live

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(_as_key(keys)) & self.mask).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        keys = np.asarray(keys, dtype=np.int64)
        slot = np.full(len(keys), -1, np.int64)
        pos = self._home(keys)
        active = np.arange(len(keys))
        size = len(self.keys)
        while active.size:
            p = pos[active]
            state = self.slot_state[p]
            found = (state == _FULL) & (self.keys[p] == keys[active])
            slot[active[found]] = p[found]
            go_on = ~found & (state != _EMPTY)
            active = active[go_on]
            pos[active] = (p[go_on] + 1) % size
        return slot

    def get(self, keys) -> np.ndarray:
        """int32 value of each key, -1 where absent."""
        slot = self._find(keys)
        out = np.full(len(slot), -1, np.int32)
        hit = slot >= 0
        out[hit] = self.values[slot[hit]]
        return out

    def put(self, keys, values) -> None:
        """Insert ``keys`` (absent from the map and distinct) with ``values``. Where several new
        keys probe to the same free slot in one round, the first in input order takes it."""
        keys = np.asarray(keys, dtype=np.int64)
        values = np.asarray(values, dtype=np.int32)
        if not keys.size:
            return
        size = len(self.keys)
        if self.live + len(keys) > _MAX_LOAD * size:
            raise ValueError(f"IdMap of {size} slots cannot hold {self.live + len(keys)} keys "
                             f"(at most {int(_MAX_LOAD * size)})")
        if self.live + self.tombs + len(keys) > _MAX_LOAD * size:
            self.rebuild()
        pos = self._home(keys)
        pending = np.arange(len(keys))
        while pending.size:
            p = pos[pending]
            free = self.slot_state[p] != _FULL
            slots, first = np.unique(p[free], return_index=True)  # first claimant per slot
            winners = pending[free][first]
            self.tombs -= int((self.slot_state[slots] == _TOMB).sum())
            self.keys[slots] = keys[winners]
            self.values[slots] = values[winners]
            self.slot_state[slots] = _FULL
            won = np.zeros(len(keys), bool)
            won[winners] = True
            pending = pending[~won[pending]]
            pos[pending] = (pos[pending] + 1) % size
        self.live += len(keys)

    def delete(self, keys) -> None:
        """Remove present ``keys`` (their slots become tombstones)."""
        slot = self._find(keys)
        if (slot < 0).any():
            raise KeyError(f"IdMap.delete: keys {np.asarray(keys)[slot < 0][:3].tolist()} are not present")
        self.slot_state[slot] = _TOMB
        self.live -= len(slot)
        self.tombs += len(slot)

    def rebuild(self) -> None:
        """Rehash the live entries into clean slots (drops tombstones)."""
        full = np.flatnonzero(self.slot_state == _FULL)
        keys, values = self.keys[full], self.values[full]
        self.keys[:] = 0
        self.values[:] = 0
        self.slot_state[:] = _EMPTY
        self.live = self.tombs = 0
        self.put(keys, values)

    def state_dict(self) -> dict:
        return {"keys": self.keys.copy(), "values": self.values.copy(), "slot_state": self.slot_state.copy(),
                "counts": np.asarray([self.live, self.tombs], np.int64)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["keys"]) != len(self.keys):
            raise ValueError(f"IdMap state has {len(state['keys'])} slots, this map {len(self.keys)}")
        self.keys = np.array(state["keys"], np.int64)
        self.values = np.array(state["values"], np.int32)
        self.slot_state = np.array(state["slot_state"], np.uint8)
        self.live, self.tombs = (int(x) for x in state["counts"])


class CountMinSketch:
    """Sightings per id in bounded memory: ``depth`` rows of ``width`` (a power of two) int32
    counters; an estimate never undercounts (collisions can only add)."""

    def __init__(self, width: int, depth: int = 4, seed: int = 0):
        self.table = np.zeros((depth, width), np.int32)
        self.salts = mix64(np.arange(1, depth + 1, dtype=np.uint64) + np.uint64(seed) * np.uint64(depth + 1))

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one sighting of each id; returns the estimates after counting."""
        keys = _as_key(ids)
        mask = np.uint64(self.table.shape[1] - 1)
        est = None
        for row, salt in zip(self.table, self.salts):
            h = (mix64(keys ^ salt) & mask).astype(np.int64)
            np.add.at(row, h, 1)
            est = row[h] if est is None else np.minimum(est, row[h])
        return est


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Rows of one ``assign`` call: ``rows[n]`` int32 (0 = not admitted / padding id) and
    ``fresh[n]`` bool (the row was given to its id in this call)."""

    rows: np.ndarray
    fresh: np.ndarray


_COUNTERS = ("lookups", "hits", "inserts", "evictions", "rejected", "overflow")


class HashTable:
    """Ids -> rows 1..``capacity`` (module docstring). Per row: the id it holds, whether it is
    live, the step it was last used in and the number of steps it was used in since insertion."""

    def __init__(self, capacity: int, *, policy: str = "lru", min_count: int = 1, seed: int = 0,
                 sketch_width: int = 0):
        if capacity < 1:
            raise ValueError(f"HashTable: capacity must be >= 1, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"HashTable: policy must be one of {POLICIES}, got {policy!r}")
        self.capacity, self.policy, self.min_count, self.seed = capacity, policy, int(min_count), int(seed)
        self.map = IdMap(1 << max(1, math.ceil(math.log2(2 * capacity))))
        self.row_id = np.zeros(capacity + 1, np.int64)
        self.live = np.zeros(capacity + 1, bool)
        self.last_used = np.zeros(capacity + 1, np.int64)
        self.count = np.zeros(capacity + 1, np.int64)
        self.next_free = 1  # rows next_free..capacity have never held an id
        width = sketch_width or max(1024, 1 << math.ceil(math.log2(4 * capacity)))
        self.sketch = CountMinSketch(width, seed=self.seed) if self.min_count > 1 else None
        self.totals = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ the step's call
    def assign(self, ids, step: int) -> Assignment:
        """Rows for the DISTINCT int64 ``ids`` of one step (module docstring rules)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.zeros(len(ids), np.int32)
        fresh = np.zeros(len(ids), bool)
        real = np.flatnonzero(ids != 0)
        found = self.map.get(ids[real])
        hit = found >= 0
        hit_rows = found[hit]
        rows[real[hit]] = hit_rows
        self.last_used[hit_rows] = step
        self.count[hit_rows] += 1
        self.totals["lookups"] += len(real)
        self.totals["hits"] += int(hit.sum())

        absent = real[~hit]
        if self.sketch is not None and absent.size:
            admitted = self.sketch.add(ids[absent]) >= self.min_count
            self.totals["rejected"] += int((~admitted).sum())
            absent = absent[admitted]
        if not absent.size:
            return Assignment(rows, fresh)
        new_rows = self._free_rows(len(absent))
        if len(new_rows) < len(absent):
            new_rows = np.concatenate([new_rows, self._evict(len(absent) - len(new_rows), hit_rows)])
        placed = absent[:len(new_rows)]
        self.totals["overflow"] += len(absent) - len(placed)
        self.map.put(ids[placed], new_rows)
        self.row_id[new_rows] = ids[placed]
        self.live[new_rows] = True
        self.last_used[new_rows] = step
        self.count[new_rows] = 1
        rows[placed] = new_rows
        fresh[placed] = True
        self.totals["inserts"] += len(placed)
        return Assignment(rows, fresh)

    def _free_rows(self, n: int) -> np.ndarray:
        take = min(n, self.capacity + 1 - self.next_free)
        out = np.arange(self.next_free, self.next_free + take, dtype=np.int32)
        self.next_free += take
        return out

    def _evict(self, n: int, protected: np.ndarray) -> np.ndarray:
        """Up to ``n`` victim rows, in eviction order, among live rows not in ``protected``; their
        ids leave the map."""
        eligible = self.live.copy()
        eligible[0] = False
        eligible[protected] = False
        cand = np.flatnonzero(eligible)
        n = min(n, len(cand))
        if n == 0:
            return np.zeros(0, np.int32)
        ids = self.row_id[cand]
        if self.policy == "lru":
            last = self.last_used[cand]
            if n < len(cand):  # only the rows at or below the n-th smallest last use can be picked
                cut = np.partition(last, n - 1)[n - 1]
                keep = last <= cut
                cand, ids, last = cand[keep], ids[keep], last[keep]
            victims = cand[np.lexsort((ids, last))[:n]]
        else:
            victims = cand[np.lexsort((ids, self.last_used[cand], self.count[cand]))[:n]]
        self.map.delete(self.row_id[victims])
        self.live[victims] = False
        self.totals["evictions"] += n
        return victims.astype(np.int32)

    # ------------------------------------------------------------------ reading
    def lookup(self, ids) -> np.ndarray:
        """Rows of ``ids`` (0 where absent, and for id 0); no counting, no insertion."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = self.map.get(ids)
        return np.where((rows < 0) | (ids == 0), 0, rows).astype(np.int32)

    def row_ids(self) -> np.ndarray:
        """``[capacity + 1]`` int64: the id each row holds (0 where the row is free)."""
        return np.where(self.live, self.row_id, 0)

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.live)

    def counters(self) -> dict:
        """Cumulative counts: lookups (non-padding ids assigned), hits, inserts, evictions,
        rejected (below min_count), overflow (no row to give), and occupancy, capacity, hit_rate."""
        out = dict(self.totals)
        out.update(occupancy=int(self.live.sum()), capacity=self.capacity,
                   hit_rate=self.totals["hits"] / self.totals["lookups"] if self.totals["lookups"] else 0.0)
        return out

    # ------------------------------------------------------------------ row-independent form
    def export(self) -> dict:
        """The live ids in row order with their use statistics (``ids``, ``rows``, ``last_used``,
        ``count``), the sketch and the counters: everything eviction depends on, without row
        numbers (a re-sharded or merged table is rebuilt from it with ``import_ids``)."""
        rows = self.live_rows()
        out = {"ids": self.row_id[rows].copy(), "rows": rows.astype(np.int32), "last_used": self.last_used[rows].copy(),
               "count": self.count[rows].copy(), "totals": np.asarray([self.totals[k] for k in _COUNTERS], np.int64)}
        if self.sketch is not None:
            out["sketch"] = self.sketch.table.copy()
        return out

    def import_ids(self, ids, last_used, count) -> np.ndarray:
        """Insert ``ids`` (absent, distinct) with their use statistics into free rows, in the
        given order; returns their rows. The table then evicts as the exporting one would."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = self._free_rows(len(ids))
        if len(rows) < len(ids):
            raise ValueError(f"import of {len(ids)} ids into a table with {len(rows)} free rows "
                             f"(capacity {self.capacity})")
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
        """Every array (numpy), counters and the table's configuration."""
        state = {"config": self._config(), "map": self.map.state_dict(), "row_id": self.row_id.copy(),
                 "live": self.live.copy(), "last_used": self.last_used.copy(), "count": self.count.copy(),
                 "next_free": np.asarray(self.next_free, np.int64),
                 "totals": np.asarray([self.totals[k] for k in _COUNTERS], np.int64)}
        if self.sketch is not None:
            state["sketch"] = self.sketch.table.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``; a table saved with another capacity, policy, min_count, seed
        or sketch width is refused (its rows would mean something else)."""
        saved = np.asarray(state["config"], np.int64)
        names = ("capacity", "policy", "min_count", "seed", "sketch_width")
        for name, a, b in zip(names, saved, self._config()):
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


def hashed_init(seed: int, ids, dim: int, std: float = 0.02, bound: float = 2.0) -> np.ndarray:
    """``[n, dim]`` float32: each row a function of (seed, id) only, N(0, 1) truncated to
    [-bound, bound] times ``std`` (the dense table's truncated normal). A counter-based generator
    (splitmix64 of seed, id and column -> 53-bit uniform in (0, 1)) through the truncated normal's
    inverse CDF, so the same id starts with the same row on every backend, rank and resume,
    whatever else the step inserts. About 50 M values/s here."""
    from scipy.special import ndtr, ndtri

    keys = mix64(_as_key(ids) ^ mix64(np.asarray([seed], np.uint64)))[:, None]
    cols = np.arange(dim, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        bits = mix64(keys + cols * np.uint64(0x9E3779B97F4A7C15))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    lo, hi = ndtr(-bound), ndtr(bound)
    return (ndtri(lo + u * (hi - lo)) * std).astype(np.float32)
