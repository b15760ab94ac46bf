"""Row-wise sharding of an embedding table over ranks, served by all-to-all exchanges.

Each id has an owner rank (``owners``: a hash of the id for hash tables, ``id % R`` for dense
ones); the owner holds its row and the row's optimizer state, and nobody else does. A step on
rank q that needs the distinct ids ``u_q``:

  1. sends each id to its owner (``route``: ``all_to_all`` of int64 ids, grouped by destination;
     stateless, so with ``train.prefetch`` it runs ahead of the step on the prefetch worker); the
     owner deduplicates what all ranks asked for, maps the ids to its rows (inserting / evicting
     in its shard's ``HashTable``: stateful; in the step, or with staleness >= 1 during the step
     before, see ``land``) and gathers them (fresh rows at their initial value);
  2. sends each requester the rows it asked for (the reverse all-to-all of ``[n, D]`` rows);
  3. after the backward, sends the rows' gradients to the owners, which SUM them per id (the
     same sum an all-reduce of a replicated table's gradient gives) and apply the row-sparse
     optimizer to their rows.

``hierarchical`` makes the exchange two-level (TurboGR's hierarchical all-to-all): ranks
``[n*G, (n+1)*G)`` form node n (G = ``node_size``); an id first travels inside its node to the rank whose local index
is the owner's (which merges the node's duplicate requests), then across nodes between ranks of
the same local index, so each id crosses the network at most once per node, and gradients are
pre-summed inside the node. ``precision`` "fp16" / "bf16" sends rows and gradients as 16-bit
values with one fp32 scale per row (``encode``), halving the exchanged bytes.

With ``staleness`` k >= 1 (semi-asynchronous updates) the owner queues the summed gradients and
applies them k steps late, and the gradients' last hop is exchanged in the background on a second
process group, overlapping the next step's lookup and compute.

Every hop counts the bytes a rank sends to OTHER ranks (``ShardedTable.bytes``), split into
intra-node and inter-node by ``node_size`` (every rank its own node when 0), for ``grf bench
embedding`` and metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..config import OptimConfig, replace
from ..tree import tree_map
from . import rowopt
from .hashtable import HashTable, hashed_init, mix64
from .lookup import EmbeddingHost, dense_init_rows
from ..contracts import Backend, Comm, is_mesh

_OWNER_SALT = np.uint64(0x2545F4914F6CDD1D)
PRECISIONS = ("fp32", "fp16", "bf16")


def owners(ids, world: int, kind: str = "hash") -> np.ndarray:
    """The owner rank of each id: ``id % world`` for a dense table (rows spread evenly),
    a salted splitmix64 hash of the id for a hash table (any int64 id)."""
    ids = np.asarray(ids, dtype=np.int64)
    if kind == "dense":
        return ids % world
    return (mix64(ids.view(np.uint64) ^ _OWNER_SALT) % np.uint64(world)).astype(np.int64)


# ----------------------------------------------------------------------------- one hop
@dataclasses.dataclass
class Hop:
    """One all-to-all hop of a request, as both ends see it.

    Sender side: ``order`` (its items in destination-major order: ``items[order]`` is what it
    sends), ``send[R]`` items per destination. Receiver side: ``recv[R]`` items per source,
    ``unique`` (the distinct ids received, sorted) and ``inverse`` (each received item's index in
    ``unique``)."""

    order: np.ndarray
    send: np.ndarray
    recv: np.ndarray
    unique: np.ndarray
    inverse: np.ndarray


def _hop(comm: Comm, ids: np.ndarray, dest: np.ndarray, world: int) -> Hop:
    order = np.argsort(dest, kind="stable")
    send = np.bincount(dest, minlength=world).astype(np.int64)
    recv = comm.exchange_counts(send)
    got = comm.all_to_all(ids[order], send, recv)
    unique, inverse = np.unique(np.asarray(got, dtype=np.int64), return_inverse=True)
    return Hop(order, send, recv, unique, inverse.reshape(-1))


def encode(B: Backend, rows, precision: str):
    """``(payload, scale)``: rows ``[n, D]`` as 16-bit values of ``rows / scale`` (``scale[n]`` =
    the row's max |value|, 1 for a zero row), the payload viewed as int16 so any transport
    carries it; fp32 sends the rows themselves (scale None)."""
    if precision == "fp32":
        return rows, None
    xp = B.xp
    scale = xp.max(xp.abs(rows), axis=1)
    scale = xp.where(scale > 0, scale, xp.ones_like(scale))
    low = B.cast(rows / xp.reshape(scale, (-1, 1)), "float16" if precision == "fp16" else "bfloat16")
    return B.bitcast(low, "int16"), scale


def decode(B: Backend, payload, scale, precision: str):
    """Inverse of ``encode`` (fp32 rows)."""
    if precision == "fp32":
        return payload
    low = B.bitcast(payload, "float16" if precision == "fp16" else "bfloat16")
    return B.cast(low, "float32") * B.xp.reshape(scale, (-1, 1))


# ----------------------------------------------------------------------------- the shard
@dataclasses.dataclass
class Pending:
    """What ``ShardedTable.lookup`` leaves for ``update``: the hops, and the owner's rows."""

    hops: list
    rows: np.ndarray        # owner: shard rows of the last hop's unique ids (0 = not admitted)
    fresh: np.ndarray       # owner: rows (re)initialised by this lookup
    values: object = None   # owner: their values as looked up [n, D] (fresh rows at their init)
    admitted: np.ndarray = None  # requester: which of its ids got a row (the others read zeros)
    step: int = 0
    sent: dict = dataclasses.field(default_factory=dict)  # bytes this lookup sent, counted on use


class ShardedTable:
    """This rank's shard of a row-sharded table (``owners`` decides the rows it holds) and the
    exchange serving every rank's lookups. The shard of a hash table has ``ceil(capacity / R)``
    rows; of a dense table ``num_items // R + 2``. New rows start as the unsharded table's would
    (``hashed_init`` of the id, or ``dense_rows[id]``), so sharded == unsharded."""

    def __init__(self, B: Backend, comm: Comm, *, kind: str, dim: int, num_items: int, capacity: int = 0, seed: int = 0,
                 policy: str = "lru", min_count: int = 1, optimizer: str = "lazy_adam", dense_rows=None,
                 node_size: int = 0, hierarchical: bool = False, precision: str = "fp32", staleness: int = 0):
        R = comm.world_size
        if precision not in PRECISIONS:
            raise ValueError(f"exchange precision {precision!r} is not one of {PRECISIONS}")
        if node_size and R % node_size:
            raise ValueError(f"node_size={node_size} must divide the world size {R}")
        if hierarchical and not node_size:
            raise ValueError("a hierarchical exchange needs node_size (ranks per node)")
        self.B, self.comm, self.kind, self.dim, self.seed = B, comm, kind, dim, seed
        self.world, self.rank, self.optimizer = R, comm.rank, optimizer
        self.node_size, self.hierarchical, self.precision = node_size, hierarchical, precision
        self.dense_rows = dense_rows
        if kind == "hash":
            self.table = HashTable(math.ceil((capacity or num_items) / R), policy=policy, min_count=min_count,
                                   seed=seed)
            n_rows = self.table.capacity + 1
        else:
            self.table = None
            n_rows = num_items // R + 2
        values = np.zeros((n_rows, dim), np.float32)
        if kind == "dense":
            mine = np.arange(self.rank, num_items + 1, R)
            mine = mine[mine > 0]
            values[self._dense_rows_of(mine)] = dense_rows[mine]
        self.values = B.asarray(values)
        self.state = rowopt.init_row_state(B, optimizer, n_rows, dim)
        # embedding.staleness = k: the owner's k pending row updates (summed over ranks), oldest first
        self.staleness = staleness
        self.pending = rowopt.init_pending(B, staleness, dim)
        self._in_flight = None  # the newest queued update's gradient exchange, still running
        self._landed = None     # the due update ``land`` applied: (rows, values, state) before it
        self._served = 0        # the step of the last lookup (it may run ahead of the step trained)
        self._trained = 0       # the step of the last update queued
        self.bytes = dict.fromkeys(("ids_intra", "ids_inter", "rows_intra", "rows_inter", "grads_intra",
                                    "grads_inter"), 0)

    def _dense_rows_of(self, ids: np.ndarray) -> np.ndarray:
        return (ids // self.world + 1).astype(np.int32)

    def _ids_of_rows(self, rows: np.ndarray, table=None) -> np.ndarray:
        """The id each shard row holds (0 for row 0 and free rows) in ``table`` (default the
        shard's hash table)."""
        rows = np.asarray(rows, np.int64)
        if self.table is None:
            return np.where(rows > 0, (rows - 1) * self.world + self.rank, 0)
        return (table or self.table).row_ids()[rows]

    def _ahead(self) -> bool:
        """A lookup ran ahead of the step trained last (``land``): the hash table holds its ids."""
        return self.table is not None and self._served > self._trained

    def _trained_table(self):
        """The hash table as of the last trained step (before a lookup that ran ahead; None for a
        dense shard): what checkpoints and evaluation see, so they equal a run without the worker."""
        if self.table is None or not self._ahead():
            return self.table
        return self.table.before(self.table.undo)

    def counters(self) -> dict:
        """The hash shard's ``HashTable.counters`` as of the last trained step ({} when dense)."""
        if self.table is None:
            return {}
        return self.table.counters(self.table.undo if self._ahead() else None)

    def _rows_of_ids(self, ids: np.ndarray) -> np.ndarray:
        """This shard's row of each id it holds (0 for id 0 and absent ids)."""
        ids = np.asarray(ids, np.int64)
        rows = self._dense_rows_of(ids) if self.table is None else self.table.lookup(ids)
        return np.where(ids > 0, rows, 0).astype(np.int32)

    # ------------------------------------------------------------------ routes
    def _node(self, ranks):
        return np.asarray(ranks) // (self.node_size or 1)

    def _count(self, what: str, counts: np.ndarray, row_bytes: int, into: dict | None = None) -> None:
        """Bytes this rank sends to other ranks (its chunk to itself never leaves it), added to
        ``into`` (default ``self.bytes``)."""
        into = self.bytes if into is None else into
        peers = np.arange(self.world)
        same = self._node(peers) == self._node(self.rank)
        other = peers != self.rank
        for key, n in ((f"{what}_intra", counts[same & other]), (f"{what}_inter", counts[~same])):
            into[key] = into.get(key, 0) + int(n.sum()) * row_bytes

    def count_bytes(self, pending: Pending) -> None:
        """Add what ``pending``'s lookup sent to ``self.bytes`` (when its step runs)."""
        for key, n in pending.sent.items():
            self.bytes[key] += n
        pending.sent = {}

    def route(self, ids: np.ndarray, comm: Comm | None = None) -> list:
        """The hops carrying ``ids`` (this rank's distinct ids, int64 increasing) to their owners:
        the id exchange of a lookup, stateless (an id's owner is a function of the id), so it may
        run ahead of the step, on the prefetch worker's ``comm`` (default: the table's). Collective.
        The hops' bytes are counted when ``lookup`` uses them."""
        comm = comm or self.comm
        own = owners(ids, self.world, self.kind)
        if self.hierarchical:
            G = self.node_size
            hop1 = _hop(comm, ids, self._node(self.rank) * G + own % G, self.world)
            hop2 = _hop(comm, hop1.unique, owners(hop1.unique, self.world, self.kind), self.world)
            return [hop1, hop2]
        return [_hop(comm, ids, own, self.world)]

    def _row_bytes(self) -> int:
        return self.dim * 4 if self.precision == "fp32" else self.dim * 2 + 4

    def _send(self, what: str, rows, send, recv, later: bool = False, comm: Comm | None = None, into: dict | None = None):
        """``rows`` (destination-major, ``send[r]`` for rank r) through one all-to-all in the
        exchange precision (rows and their scales), counted as ``what`` (into ``into``); the rows
        received, or with ``later`` a function returning them (the exchange runs in the background
        meanwhile: ``comm.all_to_all_start``). ``comm``: default the table's."""
        comm = comm or self.comm
        payload, scale = encode(self.B, rows, self.precision)
        self._count(what, send, self._row_bytes(), into)
        if later:
            got = comm.all_to_all_start(payload, send, recv)
            got_scale = None if scale is None else comm.all_to_all_start(scale, send, recv)
            return lambda: decode(self.B, got(), None if got_scale is None else got_scale(), self.precision)
        got = comm.all_to_all(payload, send, recv)
        got_scale = None if scale is None else comm.all_to_all(scale, send, recv)
        return decode(self.B, got, got_scale, self.precision)

    def _back(self, hop: Hop, values, comm: Comm | None = None, into: dict | None = None):
        """Rows for ``hop.unique`` back to the senders; returns them in the sender's item order."""
        B = self.B
        expanded = B.gather_rows(values, B.asarray(hop.inverse.astype(np.int32)))
        arrived = self._send("rows", expanded, hop.recv, hop.send, comm=comm, into=into)
        inv = np.empty_like(hop.order)
        inv[hop.order] = np.arange(len(hop.order))
        return B.gather_rows(arrived, B.asarray(inv.astype(np.int32)))

    def _forward_grads(self, hop: Hop, grads, later: bool = False):
        """Gradients in the sender's item order to the receivers, summed there per unique id
        (with ``later``: a function returning the sums, the exchange in the background)."""
        B = self.B
        sent = B.gather_rows(grads, B.asarray(hop.order.astype(np.int32)))
        arrived = self._send("grads", sent, hop.send, hop.recv, later)
        total = lambda got: B.segment_sum(got, B.asarray(hop.inverse.astype(np.int32)), len(hop.unique))  # noqa: E731
        return (lambda: total(arrived())) if later else total(arrived)

    def _settle(self) -> None:
        """Wait for the gradient exchange still in flight (staleness) and queue its sums (zeros
        for a skipped step: its rows are already dropped and a checkpoint must stay finite)."""
        if self._in_flight is not None:
            finish, ok = self._in_flight
            g = finish()
            self.pending[-1] = {**self.pending[-1], "grads": self.B.xp.where(ok, g, self.B.xp.zeros_like(g))}
            self._in_flight = None

    # ------------------------------------------------------------------ a step
    def lookup(self, ids, step: int, hops: list | None = None, comm: Comm | None = None, count: bool = True):
        """``(rows[U, D], pending)``: the rows of this rank's distinct non-zero ``ids`` (int64,
        sorted), from their owners; ``hops``: their ``route`` when it ran ahead (else routed
        now). Collective: every rank calls it once per step, on ``comm`` (default the table's; the
        sparse worker's lane when it runs ahead of its step, see ``land``). ``count`` False leaves
        the bytes it sent in ``pending.sent`` for ``count_bytes`` when the step runs."""
        ids = np.asarray(ids, dtype=np.int64)
        hops = self.route(ids) if hops is None else hops
        mine = hops[-1].unique
        fresh = np.zeros(len(mine), bool)
        if self.table is None:
            rows = self._dense_rows_of(mine)
        else:
            got = self.table.assign(mine, step)
            rows, fresh = got.rows, got.fresh
        self._served = step
        pending = Pending(hops, rows, fresh, step=step)
        for hop in hops:
            self._count("ids", hop.send, 8, pending.sent)
        out = self.serve(pending, comm)
        if count:
            self.count_bytes(pending)
        return out, pending

    def serve(self, pending: Pending, comm: Comm | None = None):
        """The rows ``[U, D]`` of ``pending``'s ids, read from this shard's current values (fresh
        rows at their initial value) and sent back to the requesters (``pending.values`` and
        ``.admitted`` are set). ``lookup`` calls it; called again, it re-reads rows an update
        changed since (a skipped step, ``queue``). Collective."""
        B, xp = self.B, self.B.xp
        mine, rows, fresh = pending.hops[-1].unique, pending.rows, pending.fresh
        values = B.gather_rows(self.values, B.asarray(rows))
        if fresh.any():
            init = np.zeros((len(mine), self.dim), np.float32)
            init[fresh] = (hashed_init(self.seed, mine[fresh], self.dim) if self.dense_rows is None
                           else self.dense_rows[mine[fresh]])
            values = xp.where(xp.reshape(B.asarray(fresh), (-1, 1)), B.asarray(init), values)
        out = values
        flags = (rows > 0).astype(np.int64)
        for hop in reversed(pending.hops):
            out = self._back(hop, out, comm, pending.sent)
            flags = self._back_flags(hop, flags, comm)
        pending.values, pending.admitted = values, flags.astype(bool)
        return out

    def _back_flags(self, hop: Hop, flags: np.ndarray, comm: Comm | None = None) -> np.ndarray:
        """Host flags of ``hop.unique`` back to the senders, in the sender's item order."""
        got = (comm or self.comm).all_to_all(flags[hop.inverse], hop.recv, hop.send)
        out = np.empty_like(got)
        out[hop.order] = got
        return out

    def update(self, pending: Pending, grads, lr, cfg: OptimConfig, ok=True) -> None:
        """Push this rank's row gradients ``grads[U, D]`` (``lookup``'s order) to the owners,
        which sum them per id and apply the row-sparse optimizer to their rows (``ok`` False:
        a skipped step, only fresh rows' initial values are written). With ``staleness = k`` the
        owner applies the update queued k steps ago instead and queues this one (``land`` then
        ``queue``), as a replicated table does. Collective."""
        B, xp = self.B, self.B.xp
        if self.staleness:
            self.land(pending, lr, cfg)
            self.queue(pending, grads, ok)
            return
        g = grads
        for hop in pending.hops:
            g = self._forward_grads(hop, g)
        rows = B.asarray(pending.rows)
        fresh = B.asarray(pending.fresh)
        ok = B.asarray(ok) if isinstance(ok, bool) else ok
        keep = lambda n, o: xp.where(ok, n, o)  # noqa: E731
        touched = rows > 0
        old_state = tree_map(lambda s: xp.where(xp.reshape(fresh, (-1,) + (1,) * (s.ndim - 1)), xp.zeros_like(s), s),
                             rowopt.gather_state(B, self.state, rows))
        new, new_state = rowopt.row_update(B, self.optimizer, pending.values, g, old_state, touched, lr, cfg)
        self.values = B.set_rows(self.values, rows, keep(new, pending.values))
        self.state = rowopt.scatter_state(B, self.state, rows, tree_map(keep, new_state, old_state))
        self._trained = pending.step

    def land(self, pending: Pending, lr, cfg: OptimConfig) -> None:
        """Staleness k >= 1, the first half of step i's update (needs nothing step i computes):
        wait for the last queued gradients' exchange, write step i's looked-up rows (fresh rows
        at their initial value, a zero state; ``rowopt.refresh_rows`` drops queued updates of
        re-assigned rows) and apply the update due now (queued k steps ago) at ``lr`` (update
        i's). Step i+1's lookup may follow at once: it reads exactly what it would after step i.
        So ``land`` and the next lookup can run on a worker while step i computes
        (``execution.RankSteps``); if step i is then skipped, ``queue`` takes the due update back."""
        B = self.B
        self._settle()
        rows, fresh = B.asarray(pending.rows), B.asarray(pending.fresh)
        self.values, self.state, queue = rowopt.refresh_rows(B, self.values, self.state, self.pending,
                                                             pending.values, rows, fresh)
        due = queue[0]["rows"]
        values, old_state = B.gather_rows(self.values, due), rowopt.gather_state(B, self.state, due)
        new, new_state = rowopt.row_update(B, self.optimizer, values, queue[0]["grads"], old_state, due > 0, lr, cfg)
        self.values = B.set_rows(self.values, due, new)
        self.state = rowopt.scatter_state(B, self.state, due, new_state)
        self.pending, self._landed = queue[1:], (due, values, old_state)

    def queue(self, pending: Pending, grads, ok=True) -> None:
        """Staleness k >= 1, the second half of step i's update: this rank's row gradients to the
        owners, the last hop in the background until the next ``land`` (or ``export``) waits for
        it (step i's gradients travel while step i+1 looks up and computes), queued as update i
        (zeros, and no rows, for a skipped step). A skipped step (``ok`` False) also takes back
        the due update ``land`` applied, as the synchronous rule has it (a skipped step drops its
        own gradient and the update due at it): a lookup made since read the rows with it, so
        ``serve`` it again. Collective."""
        B, xp = self.B, self.B.xp
        g = grads
        for i, hop in enumerate(pending.hops):
            g = self._forward_grads(hop, g, later=i == len(pending.hops) - 1)
        ok = B.asarray(ok) if isinstance(ok, bool) else ok
        rows = B.asarray(pending.rows)
        if not bool(ok):  # restore the due rows (never fresh rows: refresh dropped those from the queue)
            due, values, old_state = self._landed
            self.values = B.set_rows(self.values, due, values)
            self.state = rowopt.scatter_state(B, self.state, due, old_state)
        mine = xp.where(xp.logical_and(rows > 0, ok), rows, xp.zeros_like(rows))
        self.pending, self._in_flight = [*self.pending, {"rows": mine, "grads": None}], (g, ok)
        self._landed, self._trained = None, pending.step

    # ------------------------------------------------------------------ checkpoints
    def export(self) -> dict:
        """This shard as numpy, without row numbers: ``ids`` (in row order), ``values[L, D]``,
        ``state`` (per-row optimizer state), and for a hash shard ``last_used``, ``count``,
        ``totals`` (its counters) and ``sketch``. Checkpoints keep one per rank; ``load`` rebuilds
        any number of shards from them."""
        B = self.B
        self._settle()
        table = self._trained_table()
        if table is None:
            ids = np.arange(self.rank, self.dense_rows.shape[0], self.world, dtype=np.int64)
            ids = ids[ids > 0]
            rows = self._dense_rows_of(ids)
            out = {}
        else:
            out = table.export()
            ids, rows = out.pop("ids"), out.pop("rows")
        r = B.asarray(rows.astype(np.int32))
        out.update(ids=ids, bytes=np.asarray(list(self.bytes.values()), np.int64),
                   values=B.to_numpy(B.gather_rows(self.values, r)),
                   state={k: B.to_numpy(B.gather_rows(v, r)) for k, v in self.state.items()})
        if self.staleness:  # the queued updates by id (slot 0 the oldest), row-independent as the rest
            slots = [np.full(len(p["rows"]), i, np.int32) for i, p in enumerate(self.pending)]
            out.update(pending_slot=np.concatenate(slots),
                       pending_ids=np.concatenate([self._ids_of_rows(B.to_numpy(p["rows"]), table)
                                                   for p in self.pending]),
                       pending_grads=np.concatenate([B.to_numpy(p["grads"]) for p in self.pending]))
        return out


    def export_all(self, comm: Comm) -> list | None:
        """Every rank's ``export`` on rank 0 (rank order; None elsewhere): a checkpoint's
        ``shards``. Collective."""
        return comm.gather(self.export())

    def load(self, shards: list) -> None:
        """Take this rank's rows from ``shards`` (every old rank's ``export``, any world size): the
        ids this rank owns, in (old rank, old row) order, with their values, optimizer state and
        use statistics. With the same world size the shard comes back exactly (sketch, counters);
        after re-sharding the counters start from the old totals on rank 0 and the admission
        sketches are summed (a count-min sketch may only over-count)."""
        B = self.B
        cat = lambda key: np.concatenate([np.asarray(s[key]) for s in shards])  # noqa: E731
        ids = cat("ids").astype(np.int64)
        mine = owners(ids, self.world, self.kind) == self.rank
        same = len(shards) == self.world
        sent = (np.asarray(shards[self.rank]["bytes"]) if same else
                (sum(np.asarray(s["bytes"]) for s in shards) if self.rank == 0 else np.zeros(len(self.bytes))))
        self.bytes = dict(zip(self.bytes, (int(x) for x in sent)))
        if self.table is None:
            rows = self._dense_rows_of(ids[mine])
        else:
            rows = self.table.import_ids(ids[mine], cat("last_used")[mine], cat("count")[mine])
            totals = (np.asarray(shards[self.rank]["totals"]) if same else
                      (sum(np.asarray(s["totals"]) for s in shards) if self.rank == 0 else np.zeros(6, np.int64)))
            self.table.totals = dict(zip(self.table.totals, (int(x) for x in totals)))
            if self.table.sketch is not None:
                self.table.sketch.table = np.array(shards[self.rank]["sketch"] if same else
                                                   sum(np.asarray(s["sketch"]) for s in shards), np.int32)
        r = B.asarray(np.asarray(rows, np.int32))
        self.values = B.set_rows(self.values, r, B.asarray(cat("values")[mine]))
        self.state = {k: B.set_rows(v, r, B.asarray(np.concatenate([np.asarray(s["state"][k]) for s in shards])[mine]))
                      for k, v in self.state.items()}
        if self.staleness:
            self._load_pending(shards)

    def _load_pending(self, shards: list) -> None:
        """The queued updates of the ids this rank owns, per slot. With the same world size the
        shard's own queue comes back entry for entry; re-sharded, each slot takes every old
        shard's entries of ids this rank now owns (old rank order; one id is in at most one shard
        per slot), or a padding entry (row 0) when there are none."""
        B = self.B
        own = [shards[self.rank]] if len(shards) == self.world else shards
        slot, ids, grads = (np.concatenate([np.asarray(s[key]) for s in own])
                            for key in ("pending_slot", "pending_ids", "pending_grads"))
        ids = ids.astype(np.int64)
        if len(shards) != self.world:
            mine = (ids > 0) & (owners(ids, self.world, self.kind) == self.rank)
            slot, ids, grads = slot[mine], ids[mine], grads[mine]
        self.pending = []
        for i in range(self.staleness):
            take = slot == i
            if not take.any():
                self.pending.append(rowopt.init_pending(B, 1, self.dim)[0])
                continue
            self.pending.append({"rows": B.asarray(self._rows_of_ids(ids[take])), "grads": B.asarray(grads[take])})

    # ------------------------------------------------------------------ reading
    def rows_of(self, ids) -> np.ndarray:
        """This shard's values (numpy) of ids it owns and holds (zeros for others), in the live
        table (including a lookup that ran ahead of its step: tests read it between steps)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = self._dense_rows_of(ids) if self.table is None else self.table.lookup(ids)
        rows = np.where(owners(ids, self.world, self.kind) == self.rank, rows, 0)
        return self.B.to_numpy(self.B.gather_rows(self.values, self.B.asarray(rows.astype(np.int32))))


# ----------------------------------------------------------------------------- runs and checkpoints
def make_sharded(B: Backend, cfg, comm: Comm, dense_rows=None, dim: int | None = None, num_items: int | None = None) -> ShardedTable:
    """This rank's shard for ``cfg.embedding`` (``sharding = "row"``); ``dense_rows``: the dense
    table's initial rows (needed by kind "dense" and by ``init = "dense"``; computed when not given).
    ``dim`` / ``num_items``: the table's (default the retrieval HSTU's ``model.embed_dim`` /
    ``model.num_items``; the ranking task's merged table has its own)."""
    if is_mesh(comm):  # ranks on the devices of a JAX mesh: their table lives there (backends/dist_jax.py)
        return comm.sharded_table(B, cfg, dense_rows)
    e = cfg.embedding
    need_rows = e.kind == "dense" or e.init == "dense"
    if need_rows and dense_rows is None:
        dense_rows = dense_init_rows(cfg)
    return ShardedTable(B, comm, kind=e.kind, dim=dim or cfg.model.embed_dim, num_items=num_items or cfg.model.num_items,
                        capacity=e.capacity, seed=cfg.train.seed, policy=e.policy, min_count=e.min_count,
                        optimizer=e.optimizer, dense_rows=dense_rows if need_rows else None,
                        node_size=e.node_size, hierarchical=e.hierarchical, precision=e.exchange,
                        staleness=e.staleness)


def assemble(shards: list, dim: int):
    """``(ids[L], values[L, D])`` of the whole table from every rank's ``export`` (evaluation)."""
    ids = np.concatenate([np.asarray(s["ids"], np.int64) for s in shards])
    values = np.concatenate([np.asarray(s["values"], np.float32).reshape(-1, dim) for s in shards])
    return ids, values


def assemble_table(cfg, shards: list, dim: int | None = None, num_items: int | None = None):
    """``(table[L + 1, D] numpy, host)``: the whole table from every rank's ``export``, for
    evaluation on one process: a dense table indexed by id (host None), or a hash table's rows
    with an ``EmbeddingHost`` whose id map finds them (``retrieval.task.evaluate(host=...)``).
    ``dim`` / ``num_items``: as ``make_sharded``'s."""
    D, N = dim or cfg.model.embed_dim, num_items or cfg.model.num_items
    ids, values = assemble(shards, D)
    if cfg.embedding.kind == "dense":
        table = np.zeros((N + 1, D), np.float32)
        table[ids] = values
        return table, None
    host = EmbeddingHost(replace(cfg, embedding={"capacity": max(len(ids), 1), "min_count": 1}), N, dim=D)
    rows = host.table.import_ids(ids, np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64))
    table = np.zeros((host.rows, D), np.float32)
    table[rows] = values
    return table, host


def gathered_view(B: Backend, cfg, comm: Comm, shard: ShardedTable, dim: int | None = None, num_items: int | None = None):
    """``view(run) -> (params, host)`` for ``hooks.Evaluation``, called on every rank: the shards
    gathered to rank 0 as one table (``assemble_table``; ``dim`` / ``num_items`` as there) in the
    run's params as ``"item_emb"`` (step.TABLE) with its host; (None, None) on the other ranks."""
    def view(run):
        shards = shard.export_all(comm)
        if not comm.is_main:
            return None, None
        table, host = assemble_table(cfg, shards, dim, num_items)
        return {**run.params, "item_emb": B.asarray(table)}, host

    return view
