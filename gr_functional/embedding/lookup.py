"""The per-step lookup plan of the item table: dedup, id -> row mapping, and the batch rewritten.

A training step names item ids in four places: the input tokens, the targets, the sampled
negatives ``[T, R]`` and the shared negatives ``[R]``. With a row-sparse optimizer the step does
not read the whole table: the host collects the DISTINCT ids of the step (of all its
micro-batches, and in a data-parallel run of the whole global batch, so every rank reads and
updates the same rows), maps them to table rows (``EmbeddingHost``: identity for a dense table, a
``HashTable`` for a dynamic one) and rewrites every id in the batch as a local index into those
rows. The device then gathers U rows once, the model runs unchanged on a ``[U, D]`` "table", and
the gradient comes back already summed per unique row (dedup of the backward for free).

Local index 0 is the padding id; ids 1..U are the step's distinct ids in increasing order; the
slots are padded to a capacity from the ladder (``jagged.round_up_capacity``) so JAX compiles one
program per capacity. A ``Lookup`` carries, per slot:

  rows     [S] int32    table row read (0 = the padding row, for slot 0, capacity padding and
                        ids the table did not admit: they read a zero row and train nothing)
  touched  [S] bool     the row is updated by this step (a real, admitted id)
  fresh    [S] bool     the row was (re)assigned to its id this step: its value is ``init`` and its
                        optimizer state restarts from zero (a first sighting or an evicted row)
  init     [S, D] float32  the initial value of fresh rows (zeros elsewhere)

Counters (ids named before and after dedup, bytes) are host numbers in ``LookupStats``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..batch import HSTUBatch
from ..config import Config
from ..errors import ConfigError
from ..jagged import round_up_capacity
from .hashtable import HashTable, hashed_init
from ..contracts import Backend

# Ids are deduplicated and localised with arrays indexed by id (linear time) when the largest id
# is small against the work (a catalogue like ML-1M's); otherwise by sorting (any int64 id).
_BINCOUNT_MAX_ID = 1 << 26


def _small_ids(largest: int, work: int) -> bool:
    return largest < min(_BINCOUNT_MAX_ID, max(64 * work, 1 << 16))


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The rows one step reads and updates (module docstring); arrays (numpy or a backend's)."""

    rows: Any
    touched: Any
    fresh: Any
    init: Any


@dataclasses.dataclass(frozen=True)
class LookupStats:
    """Host counts of one step's lookup: ``ids`` (id references in the batch, padding excluded),
    ``unique`` (distinct ids = rows gathered), ``row_bytes`` (bytes of one row)."""

    ids: int
    unique: int
    row_bytes: int

    @property
    def bytes_before(self) -> int:
        return self.ids * self.row_bytes

    @property
    def bytes_after(self) -> int:
        return self.unique * self.row_bytes


def padded_lookup(rows: np.ndarray, fresh: np.ndarray, init: np.ndarray, dim: int) -> Lookup:
    """The ``Lookup`` of a step's distinct ids: ``rows[n]`` int32 their table rows (0 = none),
    ``fresh[n]`` which were (re)assigned this step, ``init[k, dim]`` the fresh ones' values; slot 0
    is the padding id and the slots are padded to the ladder capacity (module docstring)."""
    n = len(rows)
    slots = round_up_capacity(n + 1)
    out_rows = np.zeros(slots, np.int32)
    out_rows[1:n + 1] = rows
    out_fresh = np.zeros(slots, bool)
    out_fresh[1:n + 1] = fresh
    out_init = np.zeros((slots, dim), np.float32)
    out_init[1:n + 1][np.asarray(fresh, bool)] = init
    return Lookup(out_rows, out_rows > 0, out_fresh, out_init)


def looked_up_rows(B: Backend, table, lookup: Lookup):
    """``[S, D]``: ONE gather of a step's rows from ``table`` (fresh rows at their initial value):
    what a step differentiates and a row-sparse optimizer updates."""
    xp = B.xp
    got = B.gather_rows(table, lookup.rows)
    return xp.where(xp.reshape(lookup.fresh, (-1, 1)), lookup.init, got)


def batch_ids(batch: HSTUBatch) -> list[np.ndarray]:
    """Every id array of ``batch`` (numpy; padding zeros included)."""
    arrays = [np.asarray(batch.tokens.values), np.asarray(batch.targets)]
    for extra in (batch.negatives, batch.shared_negatives):
        if extra is not None:
            arrays.append(np.asarray(extra))
    return arrays


def unique_ids(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """``(ids, references)``: the distinct non-zero ids of ``arrays`` in increasing order
    (int64) and how many non-zero entries named them."""
    flat = [np.ravel(a) for a in arrays if np.size(a)]
    if not flat:
        return np.zeros(0, np.int64), 0
    hi = max(int(a.max()) for a in flat)
    lo = min(int(a.min()) for a in flat)
    if 0 <= lo and _small_ids(hi, sum(a.size for a in flat)):
        counts = np.zeros(hi + 1, np.int64)
        for a in flat:
            counts += np.bincount(a, minlength=hi + 1)
        counts[0] = 0
        ids = np.flatnonzero(counts).astype(np.int64)
        return ids, int(counts.sum())
    cat = np.concatenate(flat).astype(np.int64)
    cat = cat[cat != 0]
    return np.unique(cat), int(cat.size)


def _by_search(ids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Local indices of ``x`` by binary search in ``ids``; an id outside ``ids`` is an error."""
    pos = np.minimum(np.searchsorted(ids, x.astype(np.int64)), max(len(ids) - 1, 0))
    found = (ids[pos] == x) if len(ids) else np.zeros(x.shape, bool)
    missing = ~found & (x != 0)
    if missing.any():
        raise ValueError(f"localize: ids {x[missing].ravel()[:3].tolist()} of the batch are not in the step's "
                         f"id list")
    return np.where(x == 0, 0, pos + 1).astype(np.int32)


def local_indexer(ids: np.ndarray):
    """``x -> local indices`` for the increasing ``ids``: a table lookup where the ids are small
    (linear time), a binary search otherwise."""
    if not (len(ids) and ids[0] > 0 and _small_ids(int(ids[-1]), len(ids))):
        return lambda x: _by_search(ids, x)
    lut = np.zeros(int(ids[-1]) + 1, np.int32)
    lut[ids] = np.arange(1, len(ids) + 1, dtype=np.int32)

    def index(x):
        if x.size and (int(x.max()) >= len(lut) or int(x.min()) < 0):
            return _by_search(ids, x)
        out = lut[x]
        if np.any((out == 0) & (x != 0)):
            return _by_search(ids, x)  # an id outside ``ids``: the search names it
        return out

    return index


def localize(batch: HSTUBatch, ids: np.ndarray, lookup: Lookup | None = None) -> HSTUBatch:
    """``batch`` with every id replaced by its local index (0 for padding, ``1 + position in
    ids``), and ``lookup`` attached. ``ids``: increasing int64, holding every non-zero id of the batch."""
    index = local_indexer(np.asarray(ids, dtype=np.int64))

    def local(x):
        return None if x is None else index(np.asarray(x))

    tokens = dataclasses.replace(batch.tokens, values=local(batch.tokens.values))
    return dataclasses.replace(batch, tokens=tokens, targets=local(batch.targets),
                               negatives=local(batch.negatives), shared_negatives=local(batch.shared_negatives),
                               lookup=lookup)


class EmbeddingHost:
    """The host side of a run's item table: maps each step's ids to rows, in step order.

    kind "dense": row = id (the table has num_items + 1 rows). kind "hash": a ``HashTable`` of
    ``embedding.capacity`` rows (default num_items); fresh rows get ``hashed_init(train.seed, id)``
    or, with ``embedding.init = "dense"``, the row ``dense_rows[id]`` the dense table starts with.
    Stateful (the hash table and counters), checkpointed with ``state_dict``; deterministic for
    a given sequence of steps.
    """

    def __init__(self, cfg: Config, num_items: int, dense_rows: np.ndarray | None = None, dim: int | None = None):
        e = cfg.embedding
        self.kind, self.dim, self.seed = e.kind, dim or cfg.model.embed_dim, cfg.train.seed
        self.num_items = num_items
        self.sparse = e.optimizer != "adamw"
        self.init = e.init
        self.dense_rows = dense_rows
        if e.kind == "hash":
            self.capacity = e.capacity or num_items
            self.table = HashTable(self.capacity, policy=e.policy, min_count=e.min_count, seed=self.seed)
            if e.init == "dense" and dense_rows is None:
                raise ValueError("embedding.init='dense' needs the dense table's initial rows (dense_rows)")
        else:
            self.capacity = num_items
            self.table = None
        self.totals = {"steps": 0, "ids": 0, "unique": 0}

    @property
    def rows(self) -> int:
        """Rows of the table, the padding row 0 included."""
        return self.capacity + 1

    # ------------------------------------------------------------------ one step
    def plan(self, ids: np.ndarray, references: int, step: int) -> tuple[Lookup, LookupStats]:
        """The ``Lookup`` of a step naming the distinct ``ids`` (increasing int64, 0 excluded)
        ``references`` times; inserts and evicts in a hash table (step = the optimizer step)."""
        n = len(ids)
        if self.table is None:
            if n and (ids[0] < 1 or ids[-1] > self.num_items):
                bad = ids[(ids < 1) | (ids > self.num_items)][:3]
                raise ValueError(f"ids {bad.tolist()} are outside 1..{self.num_items} of the dense item table; "
                                 f"use embedding.kind='hash' for raw ids")
            lookup = padded_lookup(ids.astype(np.int32), np.zeros(n, bool), np.zeros((0, self.dim)), self.dim)
        else:
            got = self.table.assign(ids, step)
            new = ids[got.fresh]
            init = self.initial_rows(new) if new.size else np.zeros((0, self.dim), np.float32)
            lookup = padded_lookup(got.rows, got.fresh, init, self.dim)
        self.totals["steps"] += 1
        self.totals["ids"] += references
        self.totals["unique"] += n
        return lookup, LookupStats(references, n, 4 * self.dim)

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        """``[n, D]`` float32: the value a hash row starts with for each id."""
        if self.init == "dense":
            if ids.min() < 1 or ids.max() >= len(self.dense_rows):
                raise ConfigError(f"embedding.init='dense': id {int(ids.max())} has no row in the dense table "
                                  f"(ids 1..{len(self.dense_rows) - 1}); use embedding.init='hashed' for raw ids")
            return self.dense_rows[ids]
        return hashed_init(self.seed, ids, self.dim)

    def prepare(self, batches: Sequence[HSTUBatch], step: int, ids: np.ndarray | None = None,
                references: int | None = None) -> tuple[list[HSTUBatch], LookupStats]:
        """The micro-batches of one step rewritten to local ids, each carrying the step's
        ``Lookup``. ``ids``/``references`` (the global batch's, in a data-parallel run) default to
        those of ``batches``."""
        if ids is None:
            ids, references = unique_ids([a for b in batches for a in batch_ids(b)])
        lookup, stats = self.plan(ids, references, step)
        return [localize(b, ids, lookup) for b in batches], stats

    # ------------------------------------------------------------------ evaluation
    def eval_rows(self, ids) -> np.ndarray:
        """Rows of ``ids`` without inserting (0 = not in the table: reads the zero padding row)."""
        ids = np.asarray(ids)
        if self.table is None:
            return ids.astype(np.int32)
        return self.table.lookup(ids.astype(np.int64).ravel()).reshape(ids.shape)

    def counters(self) -> dict:
        """Cumulative counts for metrics.jsonl: lookups before/after dedup and, for a hash
        table, inserts, evictions, hit rate and occupancy."""
        out = {"ids": self.totals["ids"], "unique": self.totals["unique"]}
        if self.table is not None:
            out.update(self.table.counters())
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """numpy arrays (checkpoint tensors ``host.embedding.*``)."""
        state = {"totals": np.asarray([self.totals[k] for k in ("steps", "ids", "unique")], np.int64)}
        if self.table is not None:
            state["table"] = self.table.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        steps, ids, unique = (int(x) for x in np.asarray(state["totals"]))
        self.totals = {"steps": steps, "ids": ids, "unique": unique}
        if self.table is not None:
            if "table" not in state:
                raise ValueError("the checkpoint has no hash-table state (it was written with embedding.kind='dense')")
            self.table.load_state_dict(state["table"])


def dense_init_rows(cfg: Config) -> np.ndarray:
    """The rows the dense item table starts with (``model.init_params``), for a dense table
    spread over shards and for ``embedding.init = "dense"``."""
    from ..model import init_params

    return init_params(cfg.model, seed=cfg.train.seed)["item_emb"]


def make_host(cfg: Config, dense_rows: np.ndarray | None = None) -> EmbeddingHost:
    """The run's ``EmbeddingHost`` (``cfg.model.num_items`` resolved). ``dense_rows``: the dense
    table's initial rows, computed (``dense_init_rows``) when ``embedding.init = "dense"`` needs
    them and none are given."""
    if cfg.embedding.kind == "hash" and cfg.embedding.init == "dense" and dense_rows is None:
        dense_rows = dense_init_rows(cfg)
    return EmbeddingHost(cfg, cfg.model.num_items, dense_rows)


def table_params(params: dict, host: EmbeddingHost) -> dict:
    """``params`` (numpy, ``model.init_params``) with the item table sized for ``host``: a hash
    table starts as ``host.rows`` zero rows (a row gets its value when an id is assigned to it)."""
    if host.table is None:
        return params
    return {**params, "item_emb": np.zeros((host.rows, host.dim), np.float32)}


def localize_histories(histories) -> tuple[list, np.ndarray, int]:
    """``(local, ids, references)`` for raw id sequences (any int64, e.g. a stream's 60-bit ids):
    each sequence as int32 local indices 1..U into ``ids`` (the distinct ids, increasing), so the
    batch built from them (``make_batch(local, ..., num_items=U)``) never holds a raw id; then
    ``host.plan(ids, references, step)`` gives the rows and ``dataclasses.replace(batch,
    lookup=...)`` attaches them."""
    arrays = [np.asarray(h, dtype=np.int64) for h in histories]
    ids, refs = unique_ids(arrays)
    index = local_indexer(ids)
    return [index(a) for a in arrays], ids, refs
