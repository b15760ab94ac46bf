"""The epoch planner of ``dist.balance = "lookahead"`` (host-side, numpy only).

:func:`plan_epoch` -> :class:`EpochPlan`: an epoch's schedule of global batches of ``R`` ranks x
``n`` sequences, every sample exactly once, each rank's sequences of about equal cost, planned
over windows of ``dist.lookahead`` global batches. :meth:`EpochPlan.displacement` measures how
far samples moved from the epoch order. (``dist.balance = "none" | "kk"`` keep the global batches
and split each one alone: ``data.batching.TrainLoader.rank_assignment``.)

Why a window. With few sequences per rank and long truncation, one global batch does not hold
enough different sizes to balance: at 8000 tokens 53 % of KuaiRand-27K users are truncated (all of
equal cost), and with 2 per rank a rank that draws two of them costs about 1.4x the mean.
Pooling ``W`` batches lets the planner put similar-cost pairs in the same batch.

Per window of ``W`` consecutive global batches of the epoch order (``G = R * n`` samples each;
the last window may be shorter, a last partial batch stands alone):

1. split the window's ``W * G`` samples into ``W * R`` bins of ``n`` by equal-count KK;
2. sort the bins by cost and cut the list into ``W`` batches of ``R`` consecutive bins;
3. exchange local search: take the worst batch, swap one sample of its most expensive bin with a
   sample anywhere in the window when that lowers the worse of the two batches' imbalances;
   stop when every batch is within ``tol`` or nothing improves (terminates: the sorted vector of
   batch imbalances decreases lexicographically);
4. keep this only if it wastes less rank time (sum over batches of max - mean rank cost) than
   per-batch KK + exchanges on the window's original batches, so pooling never costs throughput;
5. shuffle the window's batch order and each batch's rank order (seeded).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .cost import imbalance, part_sums
from .partition import _kk_raw, _repair, _window_search, karmarkar_karp, refine

POLICIES = ("lookahead",)


@dataclass(frozen=True)
class EpochPlan:
    """An epoch's schedule: global batch ``b`` is ``samples[batch_offsets[b]:batch_offsets[b+1]]``,
    and ``rank[i]`` is the rank that trains ``samples[i]``.

    samples[N] int64: sample (user row) ids, each exactly once, batch-major, rank-major in a batch
    (ascending id within a rank); rank[N] int32; batch_offsets[B+1] int64; num_ranks: R.
    """
    samples: np.ndarray
    rank: np.ndarray
    batch_offsets: np.ndarray
    num_ranks: int

    @classmethod
    def from_batches(cls, batches: Iterable[tuple[np.ndarray, np.ndarray]], num_ranks: int) -> "EpochPlan":
        """The plan of global batches given as ``(samples[G_b], rank[G_b])`` pairs, in order;
        each batch is stored rank-major, by sample id within a rank."""
        out_s, out_r, offs = [], [], [0]
        for items, ranks in batches:
            items, ranks = np.asarray(items), np.asarray(ranks)
            o = np.lexsort((items, ranks))  # rank-major, then by sample id
            out_s.append(items[o])
            out_r.append(ranks[o].astype(np.int32))
            offs.append(offs[-1] + len(items))
        return cls(samples=np.concatenate(out_s) if out_s else np.zeros(0, np.int64),
                   rank=np.concatenate(out_r) if out_r else np.zeros(0, np.int32),
                   batch_offsets=np.asarray(offs, dtype=np.int64), num_ranks=num_ranks)

    @property
    def num_batches(self) -> int:
        return len(self.batch_offsets) - 1

    def batch(self, b: int) -> list[np.ndarray]:
        """Per-rank sample ids of global batch ``b``: R arrays (lengths may differ; may be empty)."""
        lo, hi = self.batch_offsets[b], self.batch_offsets[b + 1]
        s, r = self.samples[lo:hi], self.rank[lo:hi]
        return [s[r == q] for q in range(self.num_ranks)]

    def rank_sums(self, values) -> np.ndarray:
        """``[B, R] float64``: sum of ``values[sample]`` per rank of each global batch."""
        values = np.asarray(values, dtype=np.float64)
        b = np.repeat(np.arange(self.num_batches), np.diff(self.batch_offsets))
        flat = b * self.num_ranks + self.rank
        return np.bincount(flat, weights=values[self.samples],
                           minlength=self.num_batches * self.num_ranks).reshape(self.num_batches, self.num_ranks)

    def imbalance(self, costs) -> np.ndarray:
        """``[B]``: ``max / mean - 1`` of per-rank cost of each global batch."""
        return imbalance(self.rank_sums(costs))

    def displacement(self, order, global_batch: int) -> dict:
        """How far samples moved from the epoch order (the "cost in data order").

        ``order[N]``: the epoch's sample order before balancing. For each sample,
        ``d = |planned position - position in order|`` (positions in the flattened schedule);
        returned in units of nominal global batches (``d / global_batch``): ``mean_batches``,
        ``p95_batches``, ``max_batches``; and ``moved_frac``, the fraction of samples not in the
        global batch ``position // global_batch`` the order put them in.
        """
        order = np.asarray(order)
        if len(order) != len(self.samples):
            raise ValueError(f"order has {len(order)} samples, the plan {len(self.samples)}")
        if len(order) == 0:
            return {"mean_batches": 0.0, "p95_batches": 0.0, "max_batches": 0.0, "moved_frac": 0.0}
        pos = np.zeros(int(order.max()) + 1, dtype=np.int64)
        pos[order] = np.arange(len(order))
        orig = pos[self.samples]
        d = np.abs(np.arange(len(self.samples)) - orig) / float(global_batch)
        got = np.repeat(np.arange(self.num_batches), np.diff(self.batch_offsets))
        return {"mean_batches": float(d.mean()), "p95_batches": float(np.percentile(d, 95)),
                "max_batches": float(d.max()), "moved_frac": float((got != orig // global_batch).mean())}


def _plan_windows(costs, order, R, n, window, cap, tok_all, seed, tol, max_iters):
    """``(samples, ranks)`` of each global batch, in schedule order (module docstring)."""
    G = R * n
    N = len(order)
    nfull = N // G
    rng = np.random.default_rng(seed)

    def one_batch(items):
        c = costs[items]
        tok = None if tok_all is None else tok_all[items]
        r = karmarkar_karp(c, R, equal_count=True, cap=cap, sizes=tok)
        r = refine(c, r, R, cap=cap, sizes=tok, tol=tol)
        return rng.permutation(R)[r]

    W = window
    for w0 in range(0, nfull, W):
        nb = min(W, nfull - w0)
        pool = order[w0 * G:(w0 + nb) * G]
        if nb == 1:
            yield pool, one_batch(pool)
            continue
        c = costs[pool]
        tok = None if tok_all is None else tok_all[pool]
        nbins = nb * R
        # 1. equal-count KK of the pool into nb * R bins of n samples
        bin_of = _kk_raw(c, nbins, equal_count=True)
        if cap is not None:
            bin_of = _repair(c, tok, bin_of, nbins, cap, swaps_only=True)
        # 2. bins sorted by cost, R consecutive bins a batch
        S = np.bincount(bin_of, weights=c, minlength=nbins)
        rank_of_bin = np.empty(nbins, dtype=np.int64)
        rank_of_bin[np.argsort(-S, kind="stable")] = np.arange(nbins)
        bin_of = rank_of_bin[bin_of]
        # 3. exchange local search over the window
        bin_of = _window_search(c, tok, bin_of, nbins, R, moves=False, cap=cap, tol=tol,
                                max_iters=max_iters or 8 * nbins)
        # 4. keep the window plan only if it wastes less rank time (sum over batches of max - mean
        #    rank cost) than per-batch KK + refine on the same samples: pooling never costs time
        SW = np.bincount(bin_of, weights=c, minlength=nbins).reshape(nb, R)
        win_waste = float((SW.max(axis=1) - SW.mean(axis=1)).sum())
        per = [refine(c[b * G:(b + 1) * G], karmarkar_karp(c[b * G:(b + 1) * G], R, equal_count=True, cap=cap,
                                                           sizes=None if tok is None else tok[b * G:(b + 1) * G]),
                      R, cap=cap, sizes=None if tok is None else tok[b * G:(b + 1) * G], tol=tol)
               for b in range(nb)]
        SP = np.stack([part_sums(c[b * G:(b + 1) * G], per[b], R) for b in range(nb)])
        if float((SP.max(axis=1) - SP.mean(axis=1)).sum()) < win_waste:
            bin_of = np.concatenate([b * R + per[b] for b in range(nb)])
        # 5. batch order and rank order shuffled (seeded)
        bb = bin_of // R
        for b in rng.permutation(nb):
            sel = np.flatnonzero(bb == b)
            yield pool[sel], rng.permutation(R)[bin_of[sel] % R]
    tail = order[nfull * G:]
    if tail.size:
        yield tail, one_batch(tail)


def plan_epoch(costs, order, num_ranks: int, per_rank: int, *, policy: str = "lookahead", window: int = 16,
               cap: float | None = None, sizes=None, seed: int = 0, tol: float = 1e-3,
               max_iters: int | None = None) -> EpochPlan:
    """Schedule one epoch into global batches of ``num_ranks`` ranks x ``per_rank`` sequences,
    balanced per rank over windows of ``window`` global batches (module docstring).

    costs[U]: cost per sample (:func:`~gr_functional.balance.cost.cost`); order[N]: the epoch's
    sample order (e.g. the loader's ``default_rng((seed, epoch)).permutation``), distinct sample
    ids. Every id of ``order`` appears exactly once in the result, every full batch gives each
    rank ``per_rank`` sequences (a last partial batch of ``N % G`` stands alone), samples move
    < ``window`` batches, and the result is a pure function of the arguments (``seed`` drives the
    only randomness). policy: "lookahead" (the only one: ``dist.balance``'s other values split
    each global batch alone). cap: per-rank limit on the sum of ``sizes[U]`` (tokens; ``costs``
    when None). tol: the local search stops once a batch is within this imbalance. max_iters:
    local-search steps per window (default 8 W R).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_ranks < 1 or per_rank < 1 or window < 1:
        raise ValueError(f"need num_ranks, per_rank, window >= 1; got {num_ranks}, {per_rank}, {window}")
    costs, order, tok_all = check_order(costs, order, cap, sizes)
    R = int(num_ranks)
    return EpochPlan.from_batches(_plan_windows(costs, order, R, int(per_rank), window, cap, tok_all, seed, tol,
                                                max_iters), R)


def check_order(costs, order, cap=None, sizes=None):
    """``(costs float64, order int64, sizes float64 or None)`` of a plan's inputs, checked: no
    sample twice in ``order``, none larger than ``cap`` (in ``sizes``, else ``costs``)."""
    costs = np.asarray(costs, dtype=np.float64)
    order = np.asarray(order, dtype=np.int64)
    if len(np.unique(order)) != len(order):
        raise ValueError("order repeats a sample id")
    tok_all = None
    if cap is not None:
        tok_all = costs if sizes is None else np.asarray(sizes, dtype=np.float64)
        if len(order) and tok_all[order].max() > cap:
            raise ValueError(f"infeasible: a sample of size {tok_all[order].max():g} exceeds the per-rank cap {cap:g}")
    return costs, order, tok_all
