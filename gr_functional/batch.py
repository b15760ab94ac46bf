"""The HSTU training/eval batch and its host-side (numpy) construction.

All randomness of a step (negatives, dropout masks) is drawn here from a numpy Generator and
passed to the model as data, so every backend computes the same function of the same inputs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import numpy as np

from .config import ModelConfig
from .jagged import Jagged, JaggedError

_INT32_MAX = np.iinfo(np.int32).max

NegativeKind = Literal["sampled", "in_batch", "pool", "mixed", "catalogue", "none"]
NegativeSampler = Literal["uniform", "popularity"]


@dataclasses.dataclass(frozen=True)
class Negatives:
    """Which negatives a training batch carries (each loss declares its kind, losses.py):

      "sampled"   negatives[T, count] int32, uniform ids in 1..N for every real token (GR)
      "in_batch"  shared_negatives[count] int32, the targets of ``count`` supervised positions
                  of the batch drawn uniformly with replacement, shared by every position
      "pool"      shared_negatives[count] int32, ``count`` ids drawn with replacement from the
                  sampler's distribution q over 1..N, shared by every position, and
                  shared_logq[count] float32 = log(count * q(id)) (the sampled-softmax correction)
      "mixed"     shared_negatives[batch_count + count] int32: ``batch_count`` in-batch draws (as
                  "in_batch") then ``count`` pool draws (as "pool"), and shared_logq = log of each
                  id's expected count in that pool, log(batch_count p_batch(id) + count q(id))
      "catalogue" shared_negatives[N] int32 = 1..N, every item (the full softmax; ``count`` unused)
      "none"      neither

    ``sampler`` ("pool" and "mixed"): "uniform" (q = 1/N) or "popularity" (q proportional to
    ``popularity ** alpha``, where ``popularity[N+1]`` counts each id's training events; ids never
    seen are never drawn).
    """

    kind: NegativeKind = "sampled"
    count: int = 128
    sampler: NegativeSampler = "uniform"
    alpha: float = 1.0
    popularity: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    batch_count: int = 0

    def __post_init__(self):
        if self.kind in ("pool", "mixed") and self.sampler == "popularity":
            if self.popularity is None:
                raise ValueError("Negatives(sampler='popularity') needs popularity[N+1] (events per id)")
            weights = np.asarray(self.popularity, dtype=np.float64) ** self.alpha
            weights[0] = 0.0
            weights[np.asarray(self.popularity) <= 0] = 0.0  # 0 ** 0 is 1: an unseen id stays undrawn
            if not weights.sum() > 0:
                raise ValueError("Negatives(sampler='popularity'): no id has a training event")
            object.__setattr__(self, "_cdf", np.cumsum(weights))

    def draw_pool(self, rng: np.random.Generator, num_items: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids[count] int32, logq[count] float32)``: one pool, ``logq = log(count * q(id))``."""
        ids = self._draw(rng, num_items)
        if self.sampler == "uniform":
            return ids, np.full(self.count, np.log(self.count / num_items), dtype=np.float32)
        return ids, np.log(self.count * self.q(ids, num_items)).astype(np.float32)

    def _draw(self, rng: np.random.Generator, num_items: int) -> np.ndarray:
        if self.sampler == "uniform":
            return rng.integers(1, num_items + 1, size=self.count, dtype=np.int32)
        self._check_covers(num_items)
        cdf = self._cdf
        return np.minimum(np.searchsorted(cdf, rng.random(self.count) * cdf[-1], side="right"),
                          num_items).astype(np.int32)

    def _check_covers(self, num_items: int) -> None:
        if len(self._cdf) != num_items + 1:
            raise ValueError(f"popularity covers ids 0..{len(self._cdf) - 1} but the data has {num_items} items")

    def q(self, ids: np.ndarray, num_items: int) -> np.ndarray:
        """float64 ``[len(ids)]``: the sampler's probability of each id (1..N)."""
        if self.sampler == "uniform":
            return np.full(len(ids), 1.0 / num_items)
        self._check_covers(num_items)
        cdf = self._cdf
        return (cdf[ids] - cdf[ids - 1]) / cdf[-1]

    def draw_mixed(self, rng: np.random.Generator, num_items: int, supervised: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids[batch_count + count] int32, logq float32)``: ``batch_count`` draws from the
        batch's targets ``supervised[S]`` (padding ids 0, masked by the loss, when S = 0) then
        ``count`` from the sampler; ``logq = log(batch_count p_batch(id) + count q(id))``, the
        id's expected count in the pool (for an id either part can draw, both terms)."""
        in_batch = np.zeros(self.batch_count, dtype=np.int32)
        if supervised.size:
            in_batch[:] = supervised[rng.integers(0, supervised.size, size=self.batch_count)]
        ids = np.concatenate([in_batch, self._draw(rng, num_items)])
        seen = np.bincount(supervised, minlength=num_items + 1).astype(np.float64)
        p_batch = seen[ids] / max(supervised.size, 1)
        expected = self.batch_count * p_batch + self.count * self.q(np.maximum(ids, 1), num_items)
        return ids, np.log(np.where(ids > 0, expected, 1.0)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class HSTUBatch:
    """One jagged batch of user histories (all per-token arrays share ``tokens``' layout).

      tokens      Jagged, values[T] int32: input item ids (0 on padding rows)
      ts          [T] int32  event time of each token, seconds since the batch's earliest event
      query_ts    [T] int32  time of the event this position predicts (the request time)
      targets     [T] int32  item id to predict at each position (0 = no supervision)
      weights     [T] float  supervision weight (1 where targets > 0)
      negatives   [T, R] int32 sampled negative ids, or None (evaluation; losses without them)
      input_keep  [T, D] float dropout keep-mask already scaled by 1/(1-p), or None (no dropout)
      block_keep  [N_blocks, T, H*dv] float, likewise for each block's output dropout, or None
      shared_negatives  [R] int32 negatives shared by every position ("in_batch", "pool",
                  "mixed" and "catalogue" losses), or None; not per-token: a rank's slice of a global batch keeps all of them
      shared_logq [R] float32 log of each pooled negative's expected count in the pool, R q(id)
                  ("pool" and "mixed" losses), or None
      lookup      embedding.lookup.Lookup or None: with a row-sparse embedding optimizer, the
                  table rows this step reads; every id above is then a local index into them
    """

    tokens: Jagged
    ts: Any
    query_ts: Any
    targets: Any
    weights: Any
    negatives: Any = None
    input_keep: Any = None
    block_keep: Any = None
    shared_negatives: Any = None
    lookup: Any = None
    shared_logq: Any = None

    @property
    def layout(self) -> Jagged:
        return self.tokens


def _dropout_keep(rng: np.random.Generator, shape, p: float, real_rows: int) -> np.ndarray | None:
    if p <= 0.0:
        return None
    keep = np.zeros(shape, dtype=np.float32)
    body = (rng.random((real_rows,) + tuple(shape[1:])) >= p).astype(np.float32) / (1.0 - p)
    keep[:real_rows] = body
    return keep


def _relative_times(times: list[np.ndarray]) -> int:
    lo = min((int(t.min()) for t in times if len(t)), default=0)
    hi = max((int(t.max()) for t in times if len(t)), default=0)
    if hi - lo > _INT32_MAX:
        raise JaggedError(f"timestamps in one batch span {hi - lo} units, more than int32 holds; "
                          f"use seconds, not milliseconds")
    return lo


def make_batch(histories: Sequence[np.ndarray], times: Sequence[np.ndarray], cfg: ModelConfig, *,
               query_times: Sequence[int] | None = None, rng: np.random.Generator | None = None,
               num_items: int | None = None, train: bool = True, t_cap: int | None = None,
               b_cap: int | None = None, p_cap: int | None = None, nc_cap: int | None = None,
               negatives: Negatives = Negatives()) -> HSTUBatch:
    """Build a batch from per-user id sequences and their timestamps (seconds, sorted by time).

    train=True: each sequence s (length m >= 2) becomes inputs ``s[:-1]`` predicting ``s[1:]``,
    keeping the most recent ``cfg.max_len`` positions; ``negatives`` (the loss's kind and count)
    and dropout masks are drawn from ``rng``, in that order. train=False: each sequence is a full history (most recent ``max_len`` kept) whose
    last position is scored; ``query_times[b]`` is the time of the held-out item (request time).
    ``cfg.tile > 0`` (``model.attention_tile``) adds the jagged attention's tile plan (capacities ``p_cap`` /
    ``nc_cap``, default from the ladder) to the layout.
    """
    n_items = num_items or cfg.num_items
    inputs, in_ts, q_ts, targets = [], [], [], []
    for b, (ids, ts) in enumerate(zip(histories, times)):
        ids = np.asarray(ids)
        ts = np.asarray(ts, dtype=np.int64)
        if len(ids) != len(ts):
            raise JaggedError(f"sequence {b}: {len(ids)} ids but {len(ts)} timestamps")
        if train:
            if len(ids) < 2:
                raise JaggedError(f"sequence {b} has {len(ids)} event(s); training needs >= 2")
            inputs.append(ids[:-1][-cfg.max_len:])
            targets.append(ids[1:][-cfg.max_len:])
            in_ts.append(ts[:-1][-cfg.max_len:])
            q_ts.append(ts[1:][-cfg.max_len:])
        else:
            if len(ids) < 1:
                raise JaggedError(f"sequence {b} is empty; evaluation needs >= 1 history event")
            hist, hts = ids[-cfg.max_len:], ts[-cfg.max_len:]
            q = hts[1:]
            last = int(query_times[b]) if query_times is not None else int(hts[-1])
            inputs.append(hist)
            targets.append(np.zeros_like(hist))
            in_ts.append(hts)
            q_ts.append(np.concatenate([q, [last]]))
    origin = _relative_times(in_ts + q_ts)
    tokens = Jagged.from_sequences(inputs, max_len=cfg.max_len, t_cap=t_cap, b_cap=b_cap)
    if cfg.tile > 0:
        tokens = tokens.with_tiles(cfg.tile, p_cap=p_cap, nc_cap=nc_cap)
    if n_items and tokens.values.max(initial=0) > n_items:
        raise JaggedError(f"item id {tokens.values.max()} > num_items={n_items}")
    layout = tokens

    ts_arr = _pack(layout, [t - origin for t in in_ts], np.int32)
    q_arr = _pack(layout, [t - origin for t in q_ts], np.int32)
    tgt = _pack(layout, targets, np.int32)
    weights = (tgt > 0).astype(np.float32)
    sampled = shared = shared_logq = input_keep = block_keep = None
    if train:
        if rng is None:
            raise ValueError("make_batch(train=True) needs rng for negatives and dropout masks")
        T, real = layout.t_cap, layout.num_tokens()
        if negatives.kind == "sampled":
            sampled = np.zeros((T, negatives.count), dtype=np.int32)
            sampled[:real] = rng.integers(1, n_items + 1, size=(real, negatives.count), dtype=np.int32)
        elif negatives.kind == "in_batch":
            supervised = tgt[tgt > 0]
            shared = np.zeros(negatives.count, dtype=np.int32)  # padding ids (masked) if nothing is supervised
            if supervised.size:
                shared[:] = supervised[rng.integers(0, supervised.size, size=negatives.count)]
        elif negatives.kind == "pool":
            shared, shared_logq = negatives.draw_pool(rng, n_items)
        elif negatives.kind == "mixed":
            shared, shared_logq = negatives.draw_mixed(rng, n_items, tgt[tgt > 0])
        elif negatives.kind == "catalogue":  # nothing drawn: the rng stream stays that of the other kinds
            shared = np.arange(1, n_items + 1, dtype=np.int32)
        input_keep = _dropout_keep(rng, (T, cfg.embed_dim), cfg.input_dropout, real)
        if cfg.linear_dropout > 0:
            block_keep = np.stack([_dropout_keep(rng, (T, cfg.num_heads * cfg.dv), cfg.linear_dropout, real)
                                   for _ in range(cfg.num_blocks)])
    return HSTUBatch(tokens, ts_arr, q_arr, tgt, weights, sampled, input_keep, block_keep, shared,
                     shared_logq=shared_logq)


def _pack(layout: Jagged, seqs: Sequence[np.ndarray], dtype) -> np.ndarray:
    out = np.zeros(layout.t_cap, dtype=dtype)
    total = layout.num_tokens()
    if total:
        out[:total] = np.concatenate([np.asarray(s) for s in seqs]).astype(dtype)
    return out
