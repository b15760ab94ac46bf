"""How a run executes its steps: ``LocalSteps`` in one process, ``RankSteps`` on one rank of a
data-parallel run (gradients all-reduced inside the step; with a row-sharded table, the id
exchange where batches are built), ``MeshSteps`` for several ranks on one process's devices (a
JAX mesh). ``make_steps`` chooses; a task's own runner (ranking's
``RankingSteps``) has the same two methods: ``batches(epoch, start, limit)`` and ``run(params,
opt_state, micro, step, epoch) -> (params, opt_state, hooks.StepResult)``.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, cast

import numpy as np

from .config import Config
from .data.prefetch import PrefetchStats, Worker
from .embedding.lookup import Lookup, LookupStats, batch_ids, localize, unique_ids
from .hooks import StepResult
from .step import Objective, make_dist_train_step, make_sharded_dist_step, make_train_step, rank_scales
from .contracts import Backend, Comm, MeshComm, RankComm, is_mesh


def step_groups(batches, k: int):
    """Consecutive groups of ``k`` batches (the last group of an epoch may be shorter)."""
    group = []
    for b in batches:
        group.append(b)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def lookup_record(host, stats) -> dict | None:
    """A step's lookup numbers for metrics.jsonl (None without row-sparse embeddings)."""
    if stats is None:
        return None
    return {"ids": stats.ids, "unique": stats.unique, "bytes_before": stats.bytes_before,
            "bytes_after": stats.bytes_after, "table": host.counters()}


class LocalSteps:
    """Steps of a one-process run: ``step.accumulate`` loader batches per optimizer step. With
    row-sparse embeddings, ``host`` (``embedding.lookup.EmbeddingHost``) maps each step's ids to
    table rows, in step order, before the step runs."""

    def __init__(self, B: Backend, cfg: Config, loader, host=None):
        self.B, self.loader, self.k = B, loader, cfg.train.accumulate
        self.prefetch, self.prefetch_stats = cfg.train.prefetch, PrefetchStats()
        self.host = host if host is not None and host.sparse else None
        self.fn = make_train_step(B, cfg)

    def batches(self, epoch: int, start: int, limit: int | None = None):
        """The steps of epoch ``epoch`` from batch ``start``: lists of micro-batches, at most
        ``limit`` of them (the steps ``train.max_steps`` leaves)."""
        steps = step_groups(self.loader.epoch(epoch, start, prefetch=self.prefetch, stats=self.prefetch_stats), self.k)
        return itertools.islice(steps, limit)

    def run(self, params, opt_state, micro, step: int, epoch: int):
        stats = None
        tokens = sum(b.layout.num_tokens() for b in micro)
        if self.host is not None:
            micro, stats = self.host.prepare(micro, step)
        dev = [self.B.asarray_tree(b) for b in micro]
        params, opt_state, m = self.fn(params, opt_state, dev if self.k > 1 else dev[0])
        return params, opt_state, StepResult(step, epoch, m, tokens, embedding=lookup_record(self.host, stats))


TABLE_COUNTERS = ("lookups", "hits", "inserts", "evictions", "rejected", "overflow", "occupancy")


def table_record(refs, unique, row_bytes: int, counters: dict, capacity: int, exchange: dict) -> dict:
    """metrics.jsonl's ``embedding`` record of a step with a row-sharded table, summed over ranks:
    id references and distinct ids (``LookupStats``), the hash shards' counters (``{}`` for a
    dense table) with their total capacity and hit rate, and the bytes each hop sent."""
    stats = LookupStats(int(refs), int(unique), row_bytes)
    table = {k: int(v) for k, v in counters.items()}
    if table:
        table.update(capacity=int(capacity), hit_rate=table["hits"] / table["lookups"] if table["lookups"] else 0.0)
    return {"ids": stats.ids, "unique": stats.unique, "bytes_before": stats.bytes_before,
            "bytes_after": stats.bytes_after, "table": table, "exchange": {k: int(v) for k, v in exchange.items()}}


def global_step_rows(host, step_ids: list, step: int, ids: "BatchIds"):
    """``(localize, stats)``: a data-parallel step's table rows for the ids of the whole global step
    (``step_ids``: ``RankBatch.step_ids`` of its micro-batches), which every rank maps the same
    way, so every rank holds the same rows; ``localize(batch)`` rewrites a rank's batch to them."""
    unique, _ = unique_ids([s[0] for s in step_ids])
    lookup, stats = host.plan(unique, sum(s[1] for s in step_ids), step)
    return (lambda batch: ids.localize(batch, unique, lookup)), stats


@dataclasses.dataclass(frozen=True)
class BatchIds:
    """How a task's batches name the ids of its sparse table (default: the retrieval HSTU's
    ``HSTUBatch``): ``of(batch)`` its id arrays (0 = padding), ``localize(batch, ids, lookup=None)``
    the batch with every id replaced by its local index 1 + position in ``ids`` and ``lookup``
    attached; ``join(batches)``: the micro-batches of one step as the step takes them (ranking's
    shared attention normaliser)."""

    of: Callable = batch_ids
    localize: Callable = localize
    join: Callable = list


@dataclasses.dataclass
class Routed:
    """One step of a rank whose item table is row-sharded, prepared where batches are built:
    ``micro`` (its ``RankBatch``es), ``batches`` (theirs, ids rewritten to local indices into
    ``ids``), ``ids`` (its distinct ids, int64 increasing), ``refs`` (how many ids the batches
    named) and ``hops`` (``ShardedTable.route``: the ids already exchanged with their owners)."""

    micro: list
    batches: list
    ids: np.ndarray
    refs: int
    hops: list


class RankSteps:
    """Steps of one rank of a data-parallel run: its share of each global batch; gradients are
    all-reduced inside the step (``step.make_dist_train_step``). With a row-sharded table
    (``shard``), each step's id dedup, localisation and id exchange run where its batches are
    built: ahead of the step on the prefetch worker (on a process group of its own,
    ``comm.lane()``) when ``train.prefetch > 0``. The row exchange must see the updates due
    before the step: synchronous (``embedding.staleness = 0``) it stays in the step; with
    staleness k >= 1 the update due at step i needs nothing step i computes, so a second worker
    (``ahead``) lands it and looks up step i+1's rows (on another lane) while step i computes,
    and step i only queues its gradients (``ShardedTable.land`` / ``queue``); the run is bitwise
    the one without workers (checkpoints hold the table as of the last trained step:
    ``ShardedTable.export``) except the exchanged-bytes counters after a skipped step (the rows
    read again are counted). Workers run only where ``comm.concurrent_groups`` (gloo).

    A task other than retrieval gives its ``objective`` and its batches' ``ids`` (``BatchIds``);
    its loader has ``rank_epoch`` (ranking/data.py ``RankingLoader``)."""

    def __init__(self, B: Backend, cfg: Config, loader, comm: RankComm, host=None, shard=None, objective: Objective | None = None,
                 ids: BatchIds = BatchIds()):
        self.B, self.loader, self.comm, self.k, self.ids = B, loader, comm, cfg.train.accumulate, ids
        self.prefetch, self.prefetch_stats = cfg.train.prefetch, PrefetchStats()
        self.host = host if host is not None and host.sparse and shard is None else None
        self.shard, self.log_every = shard, cfg.train.log_every
        # the workers' exchanges run beside the main thread's, on their own process groups
        workers = shard is not None and bool(self.prefetch) and getattr(comm, "concurrent_groups", True)
        self.lane = comm.lane() if workers else None
        self.ahead = workers and cfg.embedding.staleness >= 1
        if self.ahead:
            self.serve_lane, self.worker, self._next = comm.lane(), Worker("grf-sparse"), None
        self.fn = (make_dist_train_step(B, cfg, comm, objective) if shard is None
                   else make_sharded_dist_step(B, cfg, comm, shard, objective))

    def batches(self, epoch: int, start: int, limit: int | None = None):
        """This rank's steps of epoch ``epoch`` from batch ``start``, at most ``limit`` (the steps
        ``train.max_steps`` leaves: a worker that exchanges ids must stop where every rank's does)."""
        # torch runs exact shapes: no padded slots, so a rank's work is its sequences' work
        if self.shard is not None:
            return self.loader.rank_epoch(epoch, start, rank=self.comm.rank, capacity="exact", prefetch=self.prefetch,
                                          stats=self.prefetch_stats, group=self.k, finish=self._route, limit=limit,
                                          pairs=self.ahead)
        steps = step_groups(self.loader.rank_epoch(epoch, start, rank=self.comm.rank, capacity="exact",
                                               with_ids=self.host is not None, prefetch=self.prefetch,
                                               stats=self.prefetch_stats), self.k)
        return itertools.islice(steps, limit)

    def _route(self, micro: list) -> Routed:
        ids, refs = unique_ids([a for rb in micro for a in self.ids.of(rb.batch)])
        return Routed(micro, self.ids.join([self.ids.localize(rb.batch, ids) for rb in micro]), ids, refs,
                      self.shard.route(ids, self.lane))

    def run(self, params, opt_state, micro, step: int, epoch: int):
        self.comm.step = step
        self.comm.progress("step")
        if self.shard is not None:
            return self._run_sharded(params, opt_state, micro, step, epoch)
        batches, stats = [rb.batch for rb in micro], None
        if self.host is not None:
            localize, stats = global_step_rows(self.host, [rb.step_ids for rb in micro], step, self.ids)
            batches = [localize(b) for b in batches]
        dev = [self.B.asarray_tree(b) for b in self.ids.join(batches)]
        params, opt_state, m = self.fn(params, opt_state, dev, [rb.tokens for rb in micro],
                                       sum(rb.global_tokens for rb in micro))
        return params, opt_state, StepResult(
            step, epoch, m, sum(int(rb.rank_tokens.sum()) for rb in micro),  # global, as one process counts
            rank_tokens=[int(x) for x in sum(rb.rank_tokens for rb in micro)],
            rank_compute_s=np.asarray(m["rank_compute_s"]), embedding=lookup_record(self.host, stats))


    def _run_sharded(self, params, opt_state, routed: Routed, step: int, epoch: int):
        """A step with a row-sharded table: this rank's ids (not the global batch's) are looked
        up from their owners; the table's counters are summed over ranks on logged steps."""
        B, xp = self.B, self.B.xp
        routed, after = routed if self.ahead else (routed, None)
        micro, ids, refs = routed.micro, routed.ids, routed.refs
        if self.ahead and self._next is not None and self._next[0] == step:  # looked up during the last step
            _, rows, pending = self._next
            self.shard.count_bytes(pending)
        else:
            rows, pending = self.shard.lookup(ids, step, routed.hops)
        self._next = None
        # only ``touched`` matters here: ids without a row get no gradient (train._loss)
        touched = Lookup(None, np.concatenate([[False], pending.admitted]), None, None)
        batches = [dataclasses.replace(b, lookup=touched) for b in routed.batches]
        rows = xp.concat([xp.zeros((1, rows.shape[1]), dtype=rows.dtype, device=B.array_device), rows], axis=0)
        dev = [B.asarray_tree(b) for b in batches]
        ahead, box = None, {}
        if self.ahead:
            def ahead(land):  # land step i's due update, then look up step i+1's rows, while step i computes
                def tick():
                    land()
                    if after is not None:
                        return self.shard.lookup(after.ids, step + 1, after.hops, comm=self.serve_lane, count=False)
                future = self.worker.submit(tick)
                return lambda: box.setdefault("next", future.result())
        params, opt_state, m = self.fn(params, opt_state, dev, [rb.tokens for rb in micro],
                                       sum(rb.global_tokens for rb in micro), rows, pending, ahead)
        if box.get("next") is not None:
            next_rows, next_pending = box["next"]
            if not bool(m["finite"]):  # the skipped step took its due update back: read the rows again
                next_rows = self.shard.serve(next_pending)
            self._next = (step + 1, next_rows, next_pending)
        record = None
        if step % self.log_every == 0:
            c = self.shard.counters()
            keys = [k for k in TABLE_COUNTERS if k in c]
            total = self.comm.all_reduce_sum([refs, len(ids), *(c[k] for k in keys), *self.shard.bytes.values()])
            record = table_record(total[0], total[1], 4 * rows.shape[1], dict(zip(keys, total[2:2 + len(keys)])),
                                  self.shard.table.capacity * self.comm.world_size if keys else 0,
                                  dict(zip(self.shard.bytes, total[2 + len(keys):])))
        return params, opt_state, StepResult(
            step, epoch, m, sum(int(rb.rank_tokens.sum()) for rb in micro),
            rank_tokens=[int(x) for x in sum(rb.rank_tokens for rb in micro)],
            rank_compute_s=np.asarray(m["rank_compute_s"]), embedding=record)


class MeshSteps:
    """Steps of a run whose ranks are the devices of a JAX mesh (``comm.mesh``, backends/dist_jax.py),
    over one process or several: this process's ranks' shares of each global batch, padded to one
    capacity for every rank (``TrainLoader.ranks_epoch``), go to the mesh's step
    (``comm.train_step``) with their token weights (``step.rank_scales``): the shares, weights and
    update of the torch ranks' ``RankSteps``. With a hash table, the rows of the global step's ids
    as ``RankSteps``."""

    def __init__(self, B: Backend, cfg: Config, loader, comm: MeshComm, host=None, shard=None):
        self.loader, self.comm, self.k, self.ids = loader, comm, cfg.train.accumulate, BatchIds()
        self.prefetch, self.prefetch_stats = cfg.train.prefetch, PrefetchStats()
        self.host = host if host is not None and host.sparse and shard is None else None
        self.shard, self.log_every = shard, cfg.train.log_every
        self.fn = comm.train_step(B, cfg) if shard is None else comm.table_step(B, cfg)

    def batches(self, epoch: int, start: int, limit: int | None = None):
        """The steps of epoch ``epoch`` from batch ``start`` (lists of micro-batches, each a list
        of this process's ranks' ``RankBatch``es, every rank's with a row-sharded table), at most
        ``limit`` of them."""
        # a row-sharded table plans every rank's requests: every rank's share is built
        ranks = self.comm.local_ranks if self.shard is None else None
        steps = step_groups(self.loader.ranks_epoch(epoch, start, ranks=ranks,
                                                    with_ids=self.host is not None, prefetch=self.prefetch,
                                                    stats=self.prefetch_stats), self.k)
        return itertools.islice(steps, limit)

    def run(self, params, opt_state, micro, step: int, epoch: int):
        self.comm.step = step
        if self.shard is not None:
            return self._run_sharded(params, opt_state, micro, step, epoch)
        batches, stats = [[rb.batch for rb in ranks] for ranks in micro], None
        if self.host is not None:
            localize, stats = global_step_rows(self.host, [ranks[0].step_ids for ranks in micro], step, self.ids)
            batches = [[localize(b) for b in ranks] for ranks in batches]
        scales, G = self._scales(micro, range(len(micro[0])))
        params, opt_state, m = self.fn(params, opt_state, batches, scales, G)
        return params, opt_state, self._result(m, micro, step, epoch, lookup_record(self.host, stats))

    def _result(self, m, micro, step: int, epoch: int, embedding) -> StepResult:
        rank_tokens = sum(ranks[0].rank_tokens for ranks in micro)  # every rank's, global
        return StepResult(step, epoch, m, int(rank_tokens.sum()), rank_tokens=[int(x) for x in rank_tokens],
                          embedding=embedding)

    def _scales(self, micro, which) -> tuple[list, float]:
        """``([len(which), k] rank_scales, G)`` of the ranks at positions ``which`` of each micro-batch."""
        G = sum(ranks[0].global_tokens for ranks in micro)
        return [rank_scales([ranks[i].tokens for ranks in micro], G, self.comm.world_size) for i in which], G

    def _run_sharded(self, params, opt_state, micro, step: int, epoch: int):
        """A step with the item table row-sharded over the mesh (``MeshTable``): each rank's
        distinct ids (of all its micro-batches), the owners' rows planned on the host, the
        batches localised to them; the table's record summed over ranks on logged steps, as
        ``RankSteps._run_sharded`` logs it."""
        R, shard = self.comm.world_size, self.shard
        ids = [unique_ids([a for ranks in micro for a in self.ids.of(ranks[r].batch)]) for r in range(R)]
        plan, admitted = shard.plan([u for u, _ in ids], step)
        slots = plan["perm"].shape[1] + 1
        lookups = []
        for ok in admitted:
            touched = np.zeros(slots, bool)
            touched[1:1 + len(ok)] = ok
            lookups.append(Lookup(None, touched, None, None))
        here = self.comm.local_ranks  # micro holds every rank's share; this process trains its own
        batches = [[self.ids.localize(ranks[r].batch, ids[r][0], lookups[r]) for r in here] for ranks in micro]
        scales, G = self._scales(micro, here)
        params, opt_state, m, shard.values, shard.state = self.fn(params, opt_state, batches, scales, G,
                                                                 shard.values, shard.state, plan)
        record = None
        if step % self.log_every == 0:
            c = shard.counters()
            record = table_record(sum(r for _, r in ids), sum(len(u) for u, _ in ids), 4 * shard.dim,
                                  {k: c[k] for k in TABLE_COUNTERS if k in c},
                                  shard.owners[0].table.capacity * R if c else 0, shard.bytes)
        return params, opt_state, self._result(m, micro, step, epoch, record)


def make_steps(B: Backend, cfg: Config, loader, comm: Comm, host=None, shard=None):
    """The step runner of this process: one place chooses between one process, one rank of
    torch's, and the ranks of a JAX mesh."""
    if comm.world_size == 1:
        return LocalSteps(B, cfg, loader, host)
    if is_mesh(comm):
        return MeshSteps(B, cfg, loader, comm, host, shard)
    return RankSteps(B, cfg, loader, cast(RankComm, comm), host, shard)

