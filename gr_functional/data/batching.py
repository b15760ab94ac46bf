"""Batching: jagged training batches with a resumable position, and evaluation batches.

Every random draw is a pure function of ``(seed, epoch)`` (user order) and ``(seed, epoch, step)``
(negatives, dropout masks), so a run resumed from ``state_dict()`` sees exactly the batches an
uninterrupted run would have seen, on any backend. Nothing is padded to ``max_len``: a batch holds
``sum(min(L_u - 1, max_len))`` real tokens, rounded up to a capacity of the short
``round_up_capacity`` ladder so JAX compiles one program per capacity.

Data-parallel training (``RankSplit``, docs/guides/distributed.md "Distributed training"). Every rank builds the
same GLOBAL batch as a single-process run (same users in the same order, drawn from the same
``default_rng((seed, epoch, step))``, so the same negatives and dropout masks) and then slices
its own sequences out of it, each with its per-token negatives and masks (``slice_batch``). Why:
the N-rank update is then the single-process update up to float summation order, with no
per-rank random stream to keep in sync; the price is that each rank draws the whole global
batch's negatives and masks on the host (cheap next to the model: numpy draws over T x R ints).
Which rank trains which sequence is ``RankSplit.policy``: "none" (equal-count contiguous
slices), "kk" (equal-count Karmarkar-Karp on ``cost_a L^2 + cost_b L``; global batches
unchanged), "lookahead" (``balance.plan_epoch``: sequences move between nearby global batches).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

import numpy as np

from .. import balance
from ..batch import HSTUBatch, Negatives, make_batch
from ..config import DistBalance, ModelConfig, choices
from ..embedding.lookup import batch_ids, unique_ids
from ..jagged import Jagged, round_up_capacity, tile_capacities, tile_counts
from ..errors import DataError
from .sequences import SequenceData
from .prefetch import Prefetch, PrefetchStats, timed
from .split import EvalSet


DIST_BALANCE = choices(DistBalance)  # declared once, in gr_functional/config.py
CAPACITIES = ("exact", "ladder")


@dataclasses.dataclass(frozen=True)
class RankSplit:
    """How each global batch's sequences are divided among ``world_size`` data-parallel ranks.

    policy: "none" | "kk" | "lookahead" (module docstring). Every policy gives each rank the same
    number of sequences (counts differ by at most one): a per-sequence constant cost (padded
    attention slots, kernel launches) then cancels, and JAX's stacked per-rank batches share
    one capacity. cost_a, cost_b: ``cost = a L^2 + b L`` per sequence of L input tokens.
    token_cap: max input tokens per rank per global batch (0 = none). lookahead: global batches
    per planning window.
    """

    world_size: int
    policy: str = "kk"
    cost_a: float = 1.0
    cost_b: float = 0.0
    token_cap: int = 0
    lookahead: int = 16

    def __post_init__(self):
        if self.world_size < 1:
            raise DataError(f"world size must be >= 1, got {self.world_size}")
        if self.policy not in DIST_BALANCE:
            raise DataError(f"dist.balance={self.policy!r} is not one of {', '.join(DIST_BALANCE)}")
        if self.lookahead < 1:
            raise DataError(f"dist.lookahead={self.lookahead} must be >= 1")
        if self.token_cap < 0 or self.cost_a < 0 or self.cost_b < 0:
            raise DataError("dist.rank_token_cap, dist.cost_a and dist.cost_b must be >= 0")

    @classmethod
    def from_config(cls, cfg, world_size: int, dims: tuple[int, int, int, int] | None = None) -> "RankSplit":
        """From ``cfg.dist``; ``cost_a = cost_b = 0`` takes ``balance.flop_cost_coefficients`` of
        ``dims`` = (width, heads, dqk, dv) (default the retrieval HSTU's, ``cfg.model``'s)."""
        d, m = cfg.dist, cfg.model
        a, b = d.cost_a, d.cost_b
        if a == 0.0 and b == 0.0:
            a, b = balance.flop_cost_coefficients(*(dims or (m.embed_dim, m.num_heads, m.dqk, m.dv)))
        return cls(int(world_size), d.balance, float(a), float(b), int(d.rank_token_cap), int(d.lookahead))

    def costs(self, tokens) -> np.ndarray:
        return balance.cost(tokens, self.cost_a, self.cost_b)

    def assign(self, tok, where: str) -> np.ndarray:
        """``[n] int64``: the rank of each sequence of one global batch of ``tok[n]`` input tokens
        (policies "none" and "kk"; "lookahead" plans whole epochs: ``TrainLoader``). ``where``
        names the batch in errors (e.g. "epoch 0 step 3")."""
        tok = np.asarray(tok)
        R = self.world_size
        cap = self.token_cap or None
        if self.policy == "none":
            # contiguous equal-count slices, as np.array_split
            counts = [len(x) for x in np.array_split(np.arange(len(tok)), R)]
            assign = np.repeat(np.arange(R), counts)
            if cap is not None:
                over = np.flatnonzero(np.bincount(assign, weights=tok, minlength=R) > cap)
                if over.size:
                    raise DataError(f"dist.rank_token_cap={cap}: rank {over[0]} gets "
                                    f"{int(tok[assign == over[0]].sum())} tokens in {where} "
                                    f"with dist.balance='none'; use dist.balance='kk' (it respects the cap) or "
                                    f"raise the cap")
            return assign
        c = self.costs(tok)
        try:
            return balance.karmarkar_karp(c, R, equal_count=True, cap=cap, sizes=tok, refine_result=True)
        except ValueError:
            try:  # KK's repair pass can fail where LPT with the same limits succeeds
                return balance.greedy_lpt(c, R, equal_count=True, cap=cap, sizes=tok)
            except ValueError:
                raise DataError(f"dist.rank_token_cap={cap}: the {int(tok.sum())} tokens of {where} "
                                f"cannot be split into {R} equal-count shares under the cap; raise "
                                f"dist.rank_token_cap or lower train.batch_size") from None

    def schedule_key(self) -> str | None:
        """What fixes the global batches beyond (seed, batch_size, max_tokens): None unless
        "lookahead", whose batches depend on the world size, window, costs and cap."""
        if self.policy != "lookahead":
            return None
        return (f"lookahead R={self.world_size} window={self.lookahead} a={self.cost_a!r} b={self.cost_b!r} "
                f"cap={self.token_cap}")


@dataclasses.dataclass(frozen=True)
class RankBatch:
    """One rank's share of a global batch.

      batch          the task's batch (numpy) of this rank's sequences, with their masks (HSTUBatch:
                     and negatives; ranking's RankingBatch)
      global_tokens  float: supervised tokens of the whole global batch (the loss denominator)
      tokens         float: supervised tokens of ``batch``
      rank_tokens    [R] int64 input tokens of every rank's share
      rank_costs     [R] float64 cost-model value of every rank's share
      step_ids       (ids, references) of the whole global batch (``embedding.lookup.unique_ids``),
                     when asked for (row-sparse embeddings: every rank maps the same rows), else None
    """

    batch: HSTUBatch
    global_tokens: float
    tokens: float
    rank_tokens: np.ndarray
    rank_costs: np.ndarray
    step_ids: tuple | None = None


def slice_batch(batch: HSTUBatch, seqs, *, capacity: str | tuple[int, int] = "ladder") -> HSTUBatch:
    """The sub-batch of ``batch`` (numpy) holding sequences ``seqs`` (indices, in that order) with
    exactly their per-token values: ids, times, targets, weights, negatives[T, R], input_keep[T, D],
    block_keep[N, T, H*dv]. Times keep the global batch's origin (attention sees differences only).

    capacity: "ladder" (``round_up_capacity`` of the tokens, b_cap = sequences: the JAX choice),
    "exact" (t_cap = tokens, b_cap = sequences, at least 1: torch runs exact shapes, and the
    padded-dense reference attention costs b_cap * max_len^2, so no empty slots), or an explicit
    ``(t_cap, b_cap)`` (equal shapes on every rank, for stacking). A batch with a tile plan
    gets one for the slice too, with ladder capacities or, for a 4-tuple
    ``(t_cap, b_cap, p_cap, nc_cap)``, those.
    """
    L = batch.tokens
    off = np.asarray(L.offsets).astype(np.int64)
    seqs = [int(b) for b in seqs]
    n_seq = len(seqs)
    parts = [np.arange(off[b], off[b + 1]) for b in seqs]
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(rows)
    if capacity == "exact":
        t_cap, b_cap = max(n, 1), max(n_seq, 1)
    elif capacity == "ladder":
        t_cap, b_cap = round_up_capacity(n), round_up_capacity(n_seq, 1)
    elif isinstance(capacity, tuple):
        t_cap, b_cap = capacity[:2]
    else:
        raise ValueError(f"capacity must be one of {CAPACITIES} or (t_cap, b_cap), got {capacity!r}")
    values = np.asarray(L.values)
    tokens = Jagged.from_sequences([values[p] for p in parts], max_len=L.max_len, t_cap=t_cap, b_cap=b_cap)
    if L.tiles is not None:
        p_cap, nc_cap = capacity[2:] if isinstance(capacity, tuple) and len(capacity) == 4 else (None, None)
        tokens = tokens.with_tiles(L.tiles.tile, p_cap=p_cap, nc_cap=nc_cap)

    def take(x, axis=0):
        if x is None:
            return None
        x = np.asarray(x)
        shape = list(x.shape)
        shape[axis] = t_cap
        out = np.zeros(shape, dtype=x.dtype)
        index = [slice(None)] * x.ndim
        index[axis] = slice(0, n)
        out[tuple(index)] = np.take(x, rows, axis=axis)
        return out

    # shared_negatives, shared_logq and lookup belong to the whole batch: every slice keeps them
    return dataclasses.replace(batch, tokens=tokens, ts=take(batch.ts), query_ts=take(batch.query_ts),
                               targets=take(batch.targets), weights=take(batch.weights),
                               negatives=take(batch.negatives), input_keep=take(batch.input_keep),
                               block_keep=take(batch.block_keep, axis=1))


def common_capacity(batch: HSTUBatch, assign: np.ndarray, world: int) -> tuple:
    """One capacity for every rank's slice of ``batch`` (``assign[b]``: the rank of sequence b):
    ``(t_cap, b_cap[, p_cap, nc_cap])``, the ladder capacities of the largest share (and of its
    tile plan), so the slices stack into ``[R, ...]`` arrays (``slice_batch(capacity=...)``)."""
    lengths = np.asarray(batch.tokens.lengths)[:len(assign)].astype(np.int64)
    tok = np.bincount(assign, weights=lengths, minlength=world)
    counts = np.bincount(assign, minlength=world)
    capacity = (round_up_capacity(int(tok.max())), round_up_capacity(int(counts.max()), 1))
    if batch.tokens.tiles is not None:
        per_rank = [tile_counts(lengths[assign == r], batch.tokens.tiles.tile) for r in range(world)]
        capacity += tile_capacities(max(c for c, _ in per_rank), max(p for _, p in per_rank))
    return capacity


def split_for_ranks(batch: HSTUBatch, num_seqs: int, world: int) -> list[HSTUBatch]:
    """``batch``'s first ``num_seqs`` sequences in ``world`` contiguous, near-equal parts at one
    capacity (``common_capacity``): an evaluation batch scored by the ranks of a mesh."""
    assign = np.repeat(np.arange(world), [len(p) for p in np.array_split(np.arange(num_seqs), world)])
    capacity = common_capacity(batch, assign, world)
    return [slice_batch(batch, np.flatnonzero(assign == r), capacity=capacity) for r in range(world)]


def _pairs(source) -> Iterator:
    """``(position, item)`` -> ``(position, (item, next item or None))``."""
    before = None
    for position, item in source:
        if before is not None:
            yield before[0], (before[1], item)
        before = (position, item)
    if before is not None:
        yield before[0], (before[1], None)


def advance(n: int, e: int, start_step: int, make, moved, prefetch: int, stats, group: int = 0, finish=None,
            limit: int | None = None, pairs: bool = False) -> Iterator:
    """The items of epoch ``e`` (``n`` batches) from batch ``start_step``: ``make(step)`` each, or with
    ``group = k`` ``finish([k consecutive ones])`` (the last group may be shorter), at most ``limit``
    items, built ``prefetch`` ahead on a worker (``finish`` runs there too); ``pairs``: ``(item,
    next item or None)``. ``moved((epoch, step))`` is told the position after each item as it is
    handed out, and (e + 1, 0) once the epoch's batches are all out (a loader's resumable position)."""
    size = max(group, 1)

    def items():  # (position after the item, item): built on the worker, applied on hand-out
        s, count = start_step, 0
        while s < n and (limit is None or count < limit):
            end = min(s + size, n)
            made = [make(j) for j in range(s, end)]
            yield ((e, end) if end < n else (e + 1, 0)), (finish(made) if group else made[0])
            s, count = end, count + 1

    built = Prefetch(items(), prefetch, stats) if prefetch else timed(items(), stats)
    source = _pairs(built) if pairs else built
    try:
        for position, item in source:
            moved(position)
            yield item
        if limit is None or start_step + limit * size >= n:  # the epoch's batches all handed out
            moved((e + 1, 0))
    finally:
        built.close()


def consecutive_batches(order: np.ndarray, tokens: np.ndarray, batch_size: int, max_tokens: int = 0) -> list:
    """``order`` cut into consecutive batches of ``batch_size``, or with ``max_tokens > 0`` of as
    many entries as fit that many ``tokens[entry]`` (at most ``batch_size``; an entry alone may not
    fit, the loaders refuse such budgets)."""
    if not max_tokens:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    steps, start, total = [], 0, 0
    for i, t in enumerate(tokens[order].tolist()):
        if i > start and (total + t > max_tokens or i - start >= batch_size):
            steps.append(order[start:i])
            start, total = i, 0
        total += t
    steps.append(order[start:])
    return steps


class TrainLoader:
    """Epochs of training batches over the users of ``data`` (use ``leave_one_out(...).train``).

    Each epoch visits every user exactly once in the order ``default_rng((seed, epoch)).permutation``.
    A step holds ``batch_size`` users (the last batch of an epoch may hold fewer), or, when
    ``max_tokens > 0``, as many users in that order as fit ``max_tokens`` input tokens (and at most
    ``batch_size``). Batches are ``make_batch(train=True)`` with ``b_cap=batch_size`` and
    ``t_cap=round_up_capacity(tokens)``.

    The position (``epoch``, ``step``) names the next batch to produce; iterating advances it
    before each batch is handed out, so a checkpoint written after a train step stores the right
    place to resume from.

    ``split`` (a ``RankSplit``, data-parallel runs): ``rank_epoch`` yields one rank's share of
    each global batch (``RankBatch``). With policy "lookahead" the epoch's global batches come
    from ``balance.plan_epoch`` instead of consecutive slices of the permutation.
    """

    def __init__(self, data: SequenceData, model_cfg: ModelConfig, batch_size: int, seed: int,
                 num_items: int | None = None, *, max_tokens: int = 0, split: RankSplit | None = None,
                 negatives: Negatives = Negatives()):
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (numpy seeds with (seed, epoch, step)), got {seed}")
        lengths = data.lengths()
        if len(lengths) == 0:
            raise DataError(f"{data.name or 'training data'}: no users to train on")
        short = np.flatnonzero(lengths < 2)
        if short.size:
            raise DataError(f"{data.name or 'training data'}: user row {short[0]} (id {data.user_ids[short[0]]}) has "
                            f"{lengths[short[0]]} event(s); training needs >= 2. Pass leave_one_out(data).train, "
                            f"which drops such users")
        self.data = data
        self.model_cfg = model_cfg
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_items = int(num_items or model_cfg.num_items or data.num_items)
        self.max_tokens = int(max_tokens)
        self.negatives = negatives
        # Input tokens per user: make_batch feeds s[:-1], truncated to the most recent max_len.
        self.tokens = np.minimum(lengths - 1, model_cfg.max_len).astype(np.int64)
        if self.max_tokens and self.max_tokens < int(self.tokens.max()):
            raise DataError(f"max_tokens={self.max_tokens} is smaller than one user's {int(self.tokens.max())} "
                            f"training tokens; use max_tokens >= model.max_len={model_cfg.max_len} or 0 (off)")
        self.split = split
        if split is not None:
            self._check_split(split)
        self._epoch = 0
        self._step = 0
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None
        self._plan_lock = threading.RLock()  # plans are cached; a prefetch thread reads them too
        self._assign_cache: tuple[int, list[np.ndarray]] | None = None

    @classmethod
    def from_config(cls, data: SequenceData, cfg, world_size: int = 1) -> "TrainLoader":
        """From a full ``Config``: ``model``, ``train.batch_size``, ``train.seed``, ``train.max_tokens``
        and the negatives of ``loss.name``; with ``world_size > 1`` also ``dist.*`` (the rank split)."""
        from ..losses import negatives_for

        split = RankSplit.from_config(cfg, world_size) if world_size > 1 else None
        num_items = cfg.model.num_items or data.num_items
        popularity = np.bincount(data.items, minlength=num_items + 1) if cfg.loss.sampler == "popularity" else None
        return cls(data, cfg.model, cfg.train.batch_size, cfg.train.seed, num_items,
                   max_tokens=cfg.train.max_tokens, split=split, negatives=negatives_for(cfg, popularity))

    def _check_split(self, split: RankSplit) -> None:
        R = split.world_size
        if split.token_cap and split.token_cap < int(self.tokens.max()):
            raise DataError(f"dist.rank_token_cap={split.token_cap} is smaller than one user's "
                            f"{int(self.tokens.max())} training tokens; use >= model.max_len="
                            f"{self.model_cfg.max_len} or 0 (no cap)")
        if split.policy == "lookahead":
            if self.max_tokens:
                raise DataError("dist.balance='lookahead' plans fixed-count global batches and cannot be combined "
                                "with train.max_tokens; set train.max_tokens=0 or use dist.balance='kk'")
            if self.batch_size % R:
                raise DataError(f"dist.balance='lookahead' needs train.batch_size={self.batch_size} to be a multiple "
                                f"of the world size {R} (every rank trains batch_size / {R} sequences)")

    # ------------------------------------------------------------------ schedule
    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def num_users(self) -> int:
        return len(self.tokens)

    def plan(self, epoch: int) -> list[np.ndarray]:
        """User rows of each step of ``epoch`` (``[B_s] int64`` arrays that partition all users)."""
        with self._plan_lock:
            return self._plan(epoch)

    def _plan(self, epoch: int) -> list[np.ndarray]:
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        order = np.random.default_rng((self.seed, epoch)).permutation(self.num_users)
        if self.split is not None and self.split.policy == "lookahead":
            return self._plan_lookahead(epoch, order)
        steps = consecutive_batches(order, self.tokens, self.batch_size, self.max_tokens)
        self._plan_cache = (epoch, steps)
        return steps

    def _plan_lookahead(self, epoch: int, order: np.ndarray) -> list[np.ndarray]:
        """Global batches of ``balance.plan_epoch(policy="lookahead")``; each batch's users are
        rank-major (rank 0's, then rank 1's, ...), and the rank of each is cached."""
        sp = self.split
        R = sp.world_size
        cap = sp.token_cap or None
        # plan_epoch draws its shuffles from one int seed: derive it from (seed, epoch)
        plan_seed = int(np.random.default_rng((self.seed, epoch, 2**31 - 1)).integers(2**31))
        try:
            ep = balance.plan_epoch(sp.costs(self.tokens), order, R, self.batch_size // R, policy="lookahead",
                                    window=sp.lookahead, cap=cap, sizes=self.tokens, seed=plan_seed)
        except ValueError as exc:
            raise DataError(f"dist.balance='lookahead' could not plan epoch {epoch}: {exc}; raise "
                            f"dist.rank_token_cap or set it to 0") from None
        steps, assign = [], []
        for b in range(ep.num_batches):
            per_rank = ep.batch(b)
            steps.append(np.concatenate(per_rank))
            assign.append(np.repeat(np.arange(R), [len(x) for x in per_rank]))
        self._plan_cache = (epoch, steps)
        self._assign_cache = (epoch, assign)
        return steps

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.plan(epoch))

    @property
    def steps_per_epoch(self) -> int:
        """Steps of the current epoch (the same for every epoch unless ``max_tokens`` is on)."""
        return self.steps_in_epoch(self._epoch)

    # ------------------------------------------------------------------ batches
    def batch(self, epoch: int, step: int) -> HSTUBatch:
        """Batch ``step`` of ``epoch`` (random access; does not move the position)."""
        plan = self.plan(epoch)
        if not 0 <= step < len(plan):
            raise IndexError(f"epoch {epoch} has {len(plan)} steps, asked for step {step}")
        users = plan[step]
        histories, times = self.data.sequences(users)
        return make_batch(histories, times, self.model_cfg, rng=np.random.default_rng((self.seed, epoch, step)),
                          num_items=self.num_items, train=True, b_cap=self.batch_size,
                          t_cap=round_up_capacity(int(self.tokens[users].sum())), negatives=self.negatives)

    def rank_assignment(self, epoch: int, step: int) -> np.ndarray:
        """``[B_s] int64``: the rank that trains each sequence of global batch ``step`` (in the
        batch's order). A pure function of the plan and the costs, so every rank computes the same."""
        sp = self.split
        if sp is None:
            raise ValueError("rank_assignment needs a loader built with split=RankSplit(...)")
        users = self.plan(epoch)[step]
        if sp.policy == "lookahead":
            with self._plan_lock:
                if self._assign_cache is None or self._assign_cache[0] != epoch:
                    self._plan_cache = None
                    self._plan(epoch)
                return self._assign_cache[1][step]
        return sp.assign(self.tokens[users], f"epoch {epoch} step {step}")

    def rank_batch(self, epoch: int, step: int, rank: int, *, capacity: str | tuple[int, int] = "exact",
                   global_batch: HSTUBatch | None = None, with_ids: bool = False) -> RankBatch:
        """Rank ``rank``'s share of global batch ``step`` of ``epoch`` (random access). The global
        batch is built as ``batch(epoch, step)`` (or passed in) and sliced (``slice_batch``);
        ``with_ids`` adds the global batch's distinct ids (``RankBatch.step_ids``)."""
        assign = self.rank_assignment(epoch, step)
        R = self.split.world_size
        if not 0 <= rank < R:
            raise ValueError(f"rank {rank} is outside the world of {R} ranks")
        whole = self.batch(epoch, step) if global_batch is None else global_batch
        tok = self.tokens[self.plan(epoch)[step]]
        mine = np.flatnonzero(assign == rank)
        part = slice_batch(whole, mine, capacity=capacity)
        step_ids = None
        if with_ids:
            step_ids = unique_ids(batch_ids(whole))
        return RankBatch(part, float(np.asarray(whole.weights).sum()), float(np.asarray(part.weights).sum()),
                         np.bincount(assign, weights=tok, minlength=R).astype(np.int64),
                         np.bincount(assign, weights=self.split.costs(tok), minlength=R), step_ids)

    def rank_batches(self, epoch: int, step: int, *, capacity: str | tuple[int, int] = "common",
                     with_ids: bool = False, ranks=None) -> list[RankBatch]:
        """The shares of global batch ``step`` of ``ranks`` (default every rank; a JAX mesh's step,
        backends/dist_jax.py, and tests). ``capacity="common"`` (default) pads them to one ladder
        capacity, the largest share's of ALL ranks, so every process's stack into ``[R, ...]``
        arrays of one shape; otherwise as ``slice_batch``. ``with_ids``: as ``rank_batch``'s, on
        the first of them."""
        whole = self.batch(epoch, step)
        if capacity == "common":
            capacity = common_capacity(whole, self.rank_assignment(epoch, step), self.split.world_size)
        ranks = list(range(self.split.world_size) if ranks is None else ranks)
        return [self.rank_batch(epoch, step, r, capacity=capacity, global_batch=whole,
                                with_ids=with_ids and r == ranks[0]) for r in ranks]

    def ranks_epoch(self, e: int, start_step: int = 0, *, ranks=None, with_ids: bool = False, prefetch: int = 0,
                    stats: PrefetchStats | None = None) -> Iterator[list[RankBatch]]:
        """Like ``epoch`` but yields the shares of ``ranks`` (default all) of each global batch
        (``rank_batches``: one capacity); moves the position the same way."""
        return self._advance(e, start_step, lambda s: self.rank_batches(e, s, with_ids=with_ids, ranks=ranks),
                             prefetch, stats)

    def rank_epoch(self, e: int, start_step: int = 0, *, rank: int,
                   capacity: str | tuple[int, int] = "exact", with_ids: bool = False, prefetch: int = 0,
                   stats: PrefetchStats | None = None, group: int = 0, finish=None,
                   limit: int | None = None, pairs: bool = False) -> Iterator:
        """Like ``epoch`` but yields this rank's ``RankBatch`` of each global batch; moves the
        position the same way (every rank holds the same position). With ``group = k``: yields
        ``finish(list of k consecutive RankBatches)`` (the last group of the epoch may be shorter),
        ``finish`` running where the batches are built (on the worker with ``prefetch``), and at
        most ``limit`` items. ``pairs``: yields ``(item, next item or None at the end)``, the
        position still naming what follows ``item``."""
        return self._advance(e, start_step, lambda s: self.rank_batch(e, s, rank, capacity=capacity, with_ids=with_ids),
                             prefetch, stats, group, finish, limit, pairs)

    def epoch(self, e: int, start_step: int = 0, *, prefetch: int = 0,
              stats: PrefetchStats | None = None) -> Iterator[HSTUBatch]:
        """Batches of epoch ``e`` from ``start_step`` on; moves the position as each is handed out.
        ``prefetch > 0`` builds up to that many batches ahead on a background thread (prefetch.py):
        the same batches, and the position still names the next batch the caller gets."""
        return self._advance(e, start_step, lambda s: self.batch(e, s), prefetch, stats)

    def _advance(self, e: int, start_step: int, make, prefetch: int, stats, group: int = 0, finish=None,
                 limit: int | None = None, pairs: bool = False) -> Iterator:
        def moved(position):
            self._epoch, self._step = position

        yield from advance(self.steps_in_epoch(e), e, start_step, make, moved, prefetch, stats, group, finish, limit,
                           pairs)

    def __iter__(self) -> Iterator[HSTUBatch]:
        """The rest of the current epoch, from the saved position."""
        return self.epoch(self._epoch, self._step)

    # ------------------------------------------------------------------ resume
    @property
    def position(self) -> tuple[int, int]:
        return self._epoch, self._step

    def state_dict(self) -> dict:
        """``{"epoch", "step"}`` of the next batch, plus what must match on resume."""
        state = {"epoch": self._epoch, "step": self._step, "seed": self.seed, "batch_size": self.batch_size,
                 "max_tokens": self.max_tokens, "num_users": self.num_users}
        schedule = self.split.schedule_key() if self.split is not None else None
        if schedule is not None:  # only lookahead changes the global batches; plain states stay as they were
            state["schedule"] = schedule
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "max_tokens", "num_users"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(f"loader state has {key}={state[key]} but this loader has {key}={getattr(self, key)}; "
                                f"resuming would replay different batches. Resume with the run's original config")
        mine = self.split.schedule_key() if self.split is not None else None
        if state.get("schedule") != mine:
            raise DataError(f"loader state was planned as {state.get('schedule') or 'plain global batches'} but this "
                            f"run plans {mine or 'plain global batches'} (dist.balance='lookahead' batches depend on "
                            f"the world size, dist.lookahead, dist.cost_a/b and dist.rank_token_cap); resume with "
                            f"the original dist settings and number of ranks")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or step < 0:
            raise DataError(f"loader state has a negative position epoch={epoch} step={step}")
        self._epoch, self._step = epoch, step


def eval_batches(histories, times, targets, target_times, model_cfg: ModelConfig, batch_size: int, *,
                 num_items: int | None = None) -> Iterator[tuple[HSTUBatch, np.ndarray, list[np.ndarray]]]:
    """Evaluation batches of ``batch_size`` users (the last may hold fewer).

    histories/times: U arrays (item ids int, unix seconds), each history >= 1 event;
    targets[U], target_times[U]: the held-out item and its time.
    Yields ``(batch, targets[B] int32, exclude)``: ``batch`` is ``make_batch(train=False)``
    scoring the last history position at ``query_times = target_times``; ``exclude`` holds the
    history ids the model saw (the most recent ``max_len``), the ids GR removes before ranking.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    n = len(histories)
    if not (len(times) == len(targets) == len(target_times) == n):
        raise DataError(f"eval_batches: {n} histories, {len(times)} time arrays, {len(targets)} targets, "
                        f"{len(target_times)} target times; they must match")
    targets = np.asarray(targets)
    target_times = np.asarray(target_times, dtype=np.int64)
    max_len = model_cfg.max_len
    for start in range(0, n, batch_size):
        end = min(start + batch_size, n)
        hs, ts = list(histories[start:end]), list(times[start:end])
        tokens = sum(min(len(h), max_len) for h in hs)
        batch = make_batch(hs, ts, model_cfg, query_times=target_times[start:end], num_items=num_items,
                           train=False, b_cap=batch_size, t_cap=round_up_capacity(tokens))
        yield batch, targets[start:end].astype(np.int32), [np.asarray(h[-max_len:]) for h in hs]


def iter_eval(split: EvalSet, model_cfg: ModelConfig, batch_size: int, *, num_items: int | None = None,
              max_users: int = 0) -> Iterator[tuple[HSTUBatch, np.ndarray, list[np.ndarray]]]:
    """``eval_batches`` over an ``EvalSet`` (``Split.valid`` or ``Split.test``); ``max_users > 0``
    keeps the first users only."""
    split = split.head(max_users)
    histories, times = split.history.sequences()
    return eval_batches(histories, times, split.targets, split.target_times, model_cfg, batch_size,
                        num_items=num_items)
