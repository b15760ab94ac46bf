"""Dynamic load balancing of jagged sequences across data-parallel ranks (host-side, numpy only).

Every rank of a synchronous data-parallel step waits for the slowest one, so a global batch's
sequences should be split so that every rank does the same work. Work per sequence follows the
cost model ``a * L**2 + b * L`` (attention is quadratic in the length ``L``, the projections
linear); ``a`` and ``b`` are fitted to measured HSTU-layer timings with :func:`calibrate` /
:func:`fit_cost` (:func:`flop_cost_coefficients` is the FLOP-count stand-in until then).

Pieces (pure functions; randomness only through explicit seeds):

- :func:`cost`, :func:`part_sums`, :func:`imbalance` (``max / mean - 1`` of per-rank cost).
- :func:`greedy_lpt`: longest-processing-time-first greedy (the classic baseline).
- :func:`karmarkar_karp`: multi-way largest differencing, optionally with equal item counts per
  part (as NVIDIA recsys-examples' batch shuffler), a per-part item limit and a token cap.
- :func:`refine`: exchange/move local search that never makes the largest part larger.
- :func:`plan_epoch` -> :class:`EpochPlan`: an epoch's schedule of global batches. Per batch
  (``policy="random" | "greedy" | "kk"``) or over a lookahead window (``policy="lookahead"``), with
  a fixed number of sequences per rank (``counts="fixed"``) or ranks filled to a common cost budget
  with different counts (``counts="budget"``). Every sample exactly once per epoch;
  :meth:`EpochPlan.displacement` measures how far samples moved from the epoch order.
- :func:`fit_cost`, :func:`calibrate`: least-squares fit of ``(a, b)`` to timings.
- :func:`rank_loss_weight`: loss normalisation by the global token count, so that gradients are
  those of the global per-token mean whatever the per-rank token counts.

Why a window. With few sequences per rank and long truncation, one global batch does not hold
enough different sizes to balance: at 8000 tokens 53 % of KuaiRand-27K users are truncated (all of
equal cost), and with 2 per rank a rank that draws two of them costs about 1.4x the mean. Pooling
``W`` batches lets the planner put similar-cost pairs in the same batch.

Fixed-count lookahead, per window of ``W`` consecutive global batches of the epoch order
(``G = R * n`` samples each; the last window may be shorter, a last partial batch stands alone):

1. split the window's ``W * G`` samples into ``W * R`` bins of ``n`` by equal-count KK;
2. sort the bins by cost and cut the list into ``W`` batches of ``R`` consecutive bins;
3. exchange local search: take the worst batch, swap one sample of its most expensive bin with a
   sample anywhere in the window when that lowers the worse of the two batches' imbalances;
   stop when every batch is within ``tol`` or nothing improves (terminates: the sorted vector of
   batch imbalances decreases lexicographically);
4. keep this only if it wastes less rank time (sum over batches of max - mean rank cost) than
   per-batch KK + exchanges on the window's original batches, so pooling never costs throughput;
5. shuffle the window's batch order and each batch's rank order (seeded).

Budget lookahead (``counts="budget"``, see :func:`plan_epoch`): the pool is split by LPT into bins
of about one cost budget each, with as many sequences as it takes; with many small sequences to
finish on, LPT's bins come out within a fraction of a percent of each other, and bins of similar
cost go out together. A few bins per window wait for the next one (at most ``patience`` windows).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

POLICIES = ("random", "greedy", "kk", "lookahead")
COUNT_MODES = ("fixed", "budget")


# ------------------------------------------------------------------------------------------ cost
def cost(lengths, a: float = 1.0, b: float = 0.0) -> np.ndarray:
    """``[N] float64`` cost ``a * L**2 + b * L`` of sequences of ``lengths[N]`` tokens."""
    L = np.asarray(lengths, dtype=np.float64)
    return a * L * L + b * L


def flop_cost_coefficients(embed_dim: int, num_heads: int, dqk: int, dv: int, *, causal: bool = True
                           ) -> tuple[float, float]:
    """``(a, b)`` of one research HSTU layer's forward FLOPs (a stand-in until :func:`calibrate` runs).

    Per sequence of ``L`` tokens: uvqk projection ``2 L D (2 H dv + 2 H dqk)`` and output projection
    ``2 L (H dv) D`` (linear in L), attention ``Q K^T`` and ``A V`` ``2 L^2 H (dqk + dv)``, halved
    when ``causal`` (only the lower triangle is computed by jagged kernels).
    """
    D, H = embed_dim, num_heads
    a = 2.0 * H * (dqk + dv) * (0.5 if causal else 1.0)
    b = 2.0 * D * (2 * H * dv + 2 * H * dqk) + 2.0 * H * dv * D
    return a, b


def part_sums(values, assignment, num_parts: int) -> np.ndarray:
    """``[num_parts] float64``: sum of ``values[N]`` per part of ``assignment[N]`` (ints in [0, num_parts))."""
    return np.bincount(np.asarray(assignment), weights=np.asarray(values, dtype=np.float64),
                       minlength=num_parts).astype(np.float64)


def imbalance(part_costs) -> np.ndarray | float:
    """``max / mean - 1`` over the last axis of ``part_costs[..., k]`` (0 where the mean is 0)."""
    x = np.asarray(part_costs, dtype=np.float64)
    mean = x.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(mean > 0, x.max(axis=-1) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)
    return float(out) if out.ndim == 0 else out


# ------------------------------------------------------------------------------- partitioners
def _check_inputs(costs, num_parts, sizes, cap, max_items):
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {c.shape}")
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if (c < 0).any() or not np.isfinite(c).all():
        raise ValueError("costs must be finite and >= 0")
    tok = None
    if cap is not None:
        tok = c if sizes is None else np.asarray(sizes, dtype=np.float64)
        if tok.shape != c.shape:
            raise ValueError(f"sizes has shape {tok.shape}, costs {c.shape}")
        if len(tok) and tok.max() > cap:
            raise ValueError(f"infeasible: an item of size {tok.max():g} exceeds the per-part cap {cap:g}")
    if max_items is not None and max_items * num_parts < len(c):
        raise ValueError(f"infeasible: {len(c)} items do not fit {num_parts} parts of at most {max_items}")
    return c, tok


def greedy_lpt(costs, num_parts: int, *, equal_count: bool = False, max_items: int | None = None,
               cap: float | None = None, sizes=None) -> np.ndarray:
    """Longest-processing-time-first: items by decreasing cost, each to the cheapest part that can take it.

    costs[N] >= 0; returns ``assignment[N] int64`` in ``[0, num_parts)``. ``equal_count``: part counts
    differ by at most one; ``max_items``: at most that many items per part; ``cap``: per-part sum of
    ``sizes[N]`` (tokens; ``costs`` when ``sizes`` is None) stays <= cap. ``ValueError`` when no part
    can take an item. O(N log k) with a heap.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap, max_items)
    N, k = len(c), int(num_parts)
    big = np.iinfo(np.int64).max
    limit = [big if max_items is None else int(max_items)] * k
    if equal_count:
        q, r = divmod(N, k)
        limit = [min(limit[p], q + 1 if p < r else q) for p in range(k)]
        if sum(limit) < N:
            raise ValueError(f"infeasible: equal counts with max_items={max_items}")
    tcap = np.inf if cap is None else float(cap) + 1e-9
    tokl = [0.0] * N if tok is None else tok.tolist()
    used = [0.0] * k
    count = [0] * k
    heap = [(0.0, p) for p in range(k) if limit[p] > 0]
    heapq.heapify(heap)
    out = np.empty(N, dtype=np.int64)
    cl = c.tolist()
    for i in np.argsort(-c, kind="stable").tolist():
        aside = []
        while heap:
            s_, p = heapq.heappop(heap)
            if used[p] + tokl[i] <= tcap:
                break
            aside.append((s_, p))
        else:
            raise ValueError(f"greedy_lpt: no part can take item {i} (cap={cap}, max_items={max_items})")
        out[i] = p
        used[p] += tokl[i]
        count[p] += 1
        if count[p] < limit[p]:
            heapq.heappush(heap, (s_ + cl[i], p))
        for e in aside:
            heapq.heappush(heap, e)
    return out


def _kk_raw(c: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    """Multi-way largest differencing; ``assignment[N]``. Equal counts need no cap logic here."""
    N = len(c)
    out = np.zeros(N, dtype=np.int64)
    if N == 0 or k == 1:
        return out
    tie = 0
    heap: list = []
    if equal_count:
        # Strata of k items (sorted descending): every state starts with one item per part, and a
        # merge pairs the parts of two states largest-with-smallest, so counts stay equal.
        pad = (-N) % k
        order = np.argsort(-c, kind="stable")
        order = np.concatenate([order, -np.ones(pad, dtype=np.int64)])
        vals = np.concatenate([c[order[:N]], np.zeros(pad)])
        for s in range(0, N + pad, k):
            sums = vals[s:s + k].tolist()
            members = [[int(i)] if i >= 0 else [] for i in order[s:s + k]]
            heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
            tie += 1
    else:
        for i in np.argsort(-c, kind="stable"):
            sums = [float(c[i])] + [0.0] * (k - 1)
            heapq.heappush(heap, (-sums[0], tie, sums, [[int(i)]] + [[] for _ in range(k - 1)]))
            tie += 1
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        sums = [s1[i] + s2[k - 1 - i] for i in range(k)]
        members = []
        for i in range(k):
            a, b = m1[i], m2[k - 1 - i]
            if len(a) < len(b):
                a, b = b, a
            a.extend(b)
            members.append(a)
        idx = sorted(range(k), key=sums.__getitem__, reverse=True)
        sums = [sums[i] for i in idx]
        members = [members[i] for i in idx]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
        tie += 1
    _, _, _, members = heap[0]
    for p, m in enumerate(members):
        out[m] = p
    return out


def karmarkar_karp(costs, num_parts: int, *, equal_count: bool = False, max_items: int | None = None,
                   cap: float | None = None, sizes=None, refine_result: bool = False) -> np.ndarray:
    """Multi-way Karmarkar-Karp (largest differencing) partition of ``costs[N]`` into ``num_parts``.

    Returns ``assignment[N] int64`` in ``[0, num_parts)``. States are k-tuples of subsets kept
    sorted by sum; the two states of largest spread (max - min) are merged by pairing the largest
    subset of one with the smallest of the other, until one state is left.

    - ``equal_count=True``: part counts differ by at most one (the state-per-stratum start of
      NVIDIA's / verl's implementation; zero-cost dummies pad ``N`` to a multiple of ``num_parts``).
    - ``max_items``: at most that many items per part; ``cap``: per-part sum of ``sizes[N]``
      (tokens; ``costs`` when None) <= cap. KK ignores both, then a repair pass moves (or, with
      ``equal_count``, swaps) items out of violating parts, least cost damage first. ``ValueError``
      when that fails (the instance may still be feasible; greedy_lpt with the same limits is the
      fallback to try).
    - ``refine_result``: finish with :func:`refine` (exchange local search), which never makes the
      largest part larger.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap, max_items)
    k = int(num_parts)
    out = _kk_raw(c, k, equal_count)
    if cap is not None or max_items is not None:
        out = _repair(c, tok, out, k, max_items, cap, swaps_only=equal_count)
    if refine_result:
        out = refine(c, out, k, moves=not equal_count, max_items=max_items, cap=cap,
                     sizes=None if tok is None else tok)
    return out


def _repair(c, tok, assign, k, max_items, cap, *, swaps_only: bool) -> np.ndarray:
    """Make ``assign`` respect ``max_items`` / ``cap`` by moves or swaps out of violating parts."""
    assign = assign.copy()
    tokv = np.zeros_like(c) if tok is None else tok
    lim_items = np.iinfo(np.int64).max if max_items is None else int(max_items)
    lim_tok = np.inf if cap is None else float(cap)
    for _ in range(4 * len(c) + 4):
        S = part_sums(c, assign, k)
        T = part_sums(tokv, assign, k)
        C = np.bincount(assign, minlength=k)
        bad = np.flatnonzero((C > lim_items) | (T > lim_tok + 1e-9))
        if bad.size == 0:
            return assign
        p = int(bad[np.argmax(T[bad] - lim_tok if cap is not None else C[bad])])
        items = np.flatnonzero(assign == p)
        best = None
        if not swaps_only:  # move one item of p to a part with room
            room = (C + 1 <= lim_items)
            room[p] = False
            new_t = T[None, :] + tokv[items][:, None]
            ok = room[None, :] & (new_t <= lim_tok + 1e-9)
            if ok.any():
                score = np.where(ok, S[None, :] + c[items][:, None], np.inf)
                i, q = np.unravel_index(np.argmin(score), score.shape)
                best = ("move", items[i], q)
        if best is None:  # swap an item of p for a smaller one elsewhere
            others = np.flatnonzero(assign != p)
            dt = tokv[items][:, None] - tokv[others][None, :]
            q = assign[others][None, :]
            ok = (dt > 0) & (T[q] + dt <= lim_tok + 1e-9)
            if max_items is not None and C[p] > lim_items:
                ok &= False  # swaps cannot fix a count violation
            if ok.any():
                dc = c[items][:, None] - c[others][None, :]
                score = np.where(ok, np.maximum(S[p] - dc, S[q] + dc), np.inf)
                i, j = np.unravel_index(np.argmin(score), score.shape)
                best = ("swap", items[i], others[j])
        if best is None:
            raise ValueError(f"cannot satisfy the per-part limits (cap={cap}, max_items={max_items}) "
                             f"by repairing the partition")
        if best[0] == "move":
            assign[best[1]] = best[2]
        else:
            i, j = best[1], best[2]
            assign[i], assign[j] = assign[j], assign[i]
    raise ValueError("repair did not converge")


# ------------------------------------------------------------------------------- local search
def _window_search(c, tok, bin_of, num_bins: int, R: int, *, moves: bool, max_items, cap, tol: float,
                   max_iters: int) -> np.ndarray:
    """Local search over a window of ``num_bins // R`` batches (batch = R consecutive bin ids).

    ``bin_of[P]`` is modified in place and returned. Each step takes the worst non-stuck batch j,
    its most expensive bin x, and the best exchange of one item u of x with one item v of any other
    bin y (or, with ``moves``, the move of u into y) that lowers ``max(imb_j', imb_k')`` below
    ``imb_j`` (k = batch of y). The sorted vector of batch imbalances then decreases
    lexicographically, so the search terminates.
    """
    W = num_bins // R
    S = np.bincount(bin_of, weights=c, minlength=num_bins)
    C = np.bincount(bin_of, minlength=num_bins)
    T = np.bincount(bin_of, weights=tok, minlength=num_bins) if tok is not None else None
    lim_items = np.iinfo(np.int64).max if max_items is None else int(max_items)
    lim_tok = np.inf if cap is None else float(cap) + 1e-9
    stuck = np.zeros(W, dtype=bool)
    ar = np.arange(W)
    by_cost = np.argsort(c, kind="stable")
    sc = c[by_cost]
    for _ in range(max_iters):
        SB = S.reshape(W, R)
        mean = SB.mean(axis=1)
        srt = np.argsort(-SB, axis=1, kind="stable")
        top = np.take_along_axis(SB, srt, axis=1)
        M1 = top[:, 0]
        M2 = top[:, 1] if R > 1 else np.zeros(W)
        M3 = top[:, 2] if R > 2 else np.zeros(W)
        A1 = ar * R + srt[:, 0]
        A2 = ar * R + (srt[:, 1] if R > 1 else srt[:, 0])
        safe = np.where(mean > 0, mean, 1.0)
        imb = np.where(mean > 0, M1 / safe - 1.0, 0.0)
        cand = np.where(stuck, -np.inf, imb)
        j = int(np.argmax(cand))
        if cand[j] <= tol:
            break
        x = int(A1[j])
        ux = np.flatnonzero(bin_of == x)
        cu = c[ux][:, None]
        best_score, best = imb[j] * (1 - 1e-9) - 1e-12, None

        def evaluate(d, yb, extra_ok):
            kb = yb // R
            same = kb == j
            # different batch k: j loses d, k gains d
            mj, mk = mean[j], mean[kb]
            new_j = np.maximum(M2[j], S[x] - d) / (mj - d / R) - 1.0
            rest_k = np.where(yb == A1[kb], M2[kb], M1[kb])
            new_k = np.maximum(rest_k, S[yb] + d) / (mk + d / R) - 1.0
            diff = np.maximum(new_j, new_k)
            # same batch: mean unchanged
            rest_j = np.where(yb == A2[j], M3[j], M2[j])
            new_s = np.maximum(np.maximum(rest_j, S[x] - d), S[yb] + d) / mean[j] - 1.0
            score = np.where(same, new_s, diff)
            ok = extra_ok & (d > 0) & (yb != x)
            return np.where(ok, score, np.inf)

        # exchanges u <-> v, only with 0 < c_u - c_v <= S_x - (cheapest bin of j): larger steps
        # cannot lower batch j's maximum (found by binary search on the sorted costs)
        dmax = S[x] - SB[j].min()
        lo = np.searchsorted(sc, c[ux] - dmax, side="left")
        hi = np.searchsorted(sc, c[ux], side="left")
        lens = np.maximum(hi - lo, 0)
        tot = int(lens.sum())
        if tot:
            rep = np.repeat(np.arange(len(ux)), lens)
            v = by_cost[np.repeat(lo, lens) + (np.arange(tot) - np.repeat(np.cumsum(lens) - lens, lens))]
            u = ux[rep]
            yv = bin_of[v]
            d = c[u] - c[v]
            ok = np.ones(tot, dtype=bool)
            if T is not None:
                dt = tok[u] - tok[v]
                ok &= (T[x] - dt <= lim_tok) & (T[yv] + dt <= lim_tok)
            score = evaluate(d, yv, ok)
            q = int(np.argmin(score))
            if score[q] < best_score:
                best_score, best = score[q], ("swap", int(u[q]), int(v[q]))
        if moves and C[x] > 1:
            yb = np.arange(num_bins)[None, :]
            okm = np.broadcast_to((C + 1 <= lim_items)[None, :], (len(ux), num_bins)).copy()
            if T is not None:
                okm &= T[None, :] + tok[ux][:, None] <= lim_tok
            dm = np.broadcast_to(cu, (len(ux), num_bins))
            score = evaluate(dm, yb, okm)
            i, q = np.unravel_index(np.argmin(score), score.shape)
            if score[i, q] < best_score:
                best_score, best = score[i, q], ("move", ux[i], int(q))
        if best is None:
            stuck[j] = True
            continue
        if best[0] == "swap":
            u, v = best[1], best[2]
            y = int(bin_of[v])
            du = c[u] - c[v]
            S[x] -= du
            S[y] += du
            if T is not None:
                dtk = tok[u] - tok[v]
                T[x] -= dtk
                T[y] += dtk
            bin_of[u], bin_of[v] = y, x
        else:
            u, y = best[1], best[2]
            S[x] -= c[u]
            S[y] += c[u]
            C[x] -= 1
            C[y] += 1
            if T is not None:
                T[x] -= tok[u]
                T[y] += tok[u]
            bin_of[u] = y
        stuck[y // R] = False
    return bin_of


def refine(costs, assignment, num_parts: int, *, moves: bool = False, max_items: int | None = None,
           cap: float | None = None, sizes=None, tol: float = 0.0, max_iters: int | None = None) -> np.ndarray:
    """Exchange (and, with ``moves``, move) local search on one partition; returns a new assignment[N].

    Each step swaps one item of the most expensive part with a cheaper item of another part (or
    moves it there) when that lowers the largest part; limits ``max_items`` / ``cap`` (on
    ``sizes``, else ``costs``) are kept. Stops at ``imbalance <= tol``, when no step helps, or after
    ``max_iters`` (default ``4 * N``) steps.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap, max_items)
    bin_of = np.asarray(assignment, dtype=np.int64).copy()
    if len(c) == 0 or num_parts == 1:
        return bin_of
    return _window_search(c, tok, bin_of, num_parts, num_parts, moves=moves, max_items=max_items, cap=cap,
                          tol=tol, max_iters=max_iters or 4 * len(c) + 8)


# ------------------------------------------------------------------------------------- planner
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

    def rank_counts(self) -> np.ndarray:
        """``[B, R] int64``: sequences per rank of each global batch."""
        b = np.repeat(np.arange(self.num_batches), np.diff(self.batch_offsets))
        return np.bincount(b * self.num_ranks + self.rank,
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
        global batch ``position // global_batch`` the order put them in (fixed counts only; with
        budget batching batch boundaries move, so this is reported against the same formula).
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


def _concat_plan(out_s, out_r, offs, R) -> EpochPlan:
    return EpochPlan(samples=np.concatenate(out_s) if out_s else np.zeros(0, np.int64),
                     rank=np.concatenate(out_r) if out_r else np.zeros(0, np.int32),
                     batch_offsets=np.asarray(offs, dtype=np.int64), num_ranks=R)


def _plan_fixed(costs, order, R, n, policy, window, cap, tok_all, seed, tol, max_iters) -> EpochPlan:
    """counts="fixed": see :func:`plan_epoch`."""
    G = R * n
    N = len(order)
    nfull = N // G
    rng = np.random.default_rng(seed)
    out_s, out_r, offs = [], [], [0]

    def emit(items, ranks):
        o = np.lexsort((items, ranks))  # rank-major, then by sample id
        out_s.append(items[o])
        out_r.append(ranks[o].astype(np.int32))
        offs.append(offs[-1] + len(items))

    def one_batch(items):
        c = costs[items]
        tok = None if tok_all is None else tok_all[items]
        if policy == "random":
            return np.arange(len(items)) % R if len(items) < G else np.arange(len(items)) // n
        if policy == "greedy":
            return greedy_lpt(c, R, equal_count=True, cap=cap, sizes=tok)
        r = karmarkar_karp(c, R, equal_count=True, cap=cap, sizes=tok)
        if policy == "lookahead":
            r = refine(c, r, R, cap=cap, sizes=tok, tol=tol)
            r = rng.permutation(R)[r]
        return r

    W = window if policy == "lookahead" else 1
    for w0 in range(0, nfull, W):
        nb = min(W, nfull - w0)
        pool = order[w0 * G:(w0 + nb) * G]
        if nb == 1:
            emit(pool, one_batch(pool))
            continue
        c = costs[pool]
        tok = None if tok_all is None else tok_all[pool]
        nbins = nb * R
        # 1. equal-count KK of the pool into nb * R bins of n samples
        bin_of = _kk_raw(c, nbins, equal_count=True)
        if cap is not None:
            bin_of = _repair(c, tok, bin_of, nbins, None, cap, swaps_only=True)
        # 2. bins sorted by cost, R consecutive bins a batch
        S = np.bincount(bin_of, weights=c, minlength=nbins)
        rank_of_bin = np.empty(nbins, dtype=np.int64)
        rank_of_bin[np.argsort(-S, kind="stable")] = np.arange(nbins)
        bin_of = rank_of_bin[bin_of]
        # 3. exchange local search over the window
        bin_of = _window_search(c, tok, bin_of, nbins, R, moves=False, max_items=None, cap=cap, tol=tol,
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
            emit(pool[sel], rng.permutation(R)[bin_of[sel] % R])
    tail = order[nfull * G:]
    if tail.size:
        emit(tail, one_batch(tail))
    return _concat_plan(out_s, out_r, offs, R)


def aligned_budget(costs, per_rank: int) -> float:
    """Default per-rank cost budget of ``counts="budget"``: ``m * max(costs)`` with
    ``m = max(1, round(per_rank * mean(costs) / max(costs)))``.

    Sequences truncated at the maximum length all cost ``max(costs)``; a budget that is a whole
    multiple of it packs them exactly, which a budget of ``per_rank * mean`` cannot do when many
    sequences are truncated (KuaiRand-27K at 8000 tokens: 53 %). The price: ranks average
    ``budget / mean`` sequences instead of ``per_rank`` (reported by the benchmark).
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.size == 0 or c.max() <= 0:
        return 1.0
    return max(1, round(per_rank * float(c.mean()) / float(c.max()))) * float(c.max())


def _lpt_bins(pc, pt, K, step, max_items, cap):
    """LPT into K bins, adding ``step`` bins at a time until the per-bin limits can be met;
    returns ``(bin_of[P], K)``."""
    while True:
        try:
            return greedy_lpt(pc, K, max_items=max_items, cap=cap, sizes=pt), K
        except ValueError:
            if K >= len(pc) + step:
                raise
            K += step


def _plan_budget(costs, order, R, n, window, patience, max_items, cap, tok_all, seed, budget) -> EpochPlan:
    """counts="budget": see :func:`plan_epoch`."""
    G = R * n
    N = len(order)
    c_all = costs[order]
    t_all = None if tok_all is None else tok_all[order]
    if budget is None:
        budget = aligned_budget(c_all, n)
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    rng = np.random.default_rng(seed)
    out_s, out_r, offs = [], [], [0]
    pool = np.zeros(0, dtype=np.int64)      # positions in ``order`` of pooled samples
    arrived = np.zeros(0, dtype=np.int64)   # window each pooled sample arrived in
    nxt, w = 0, 0
    while pool.size or nxt < N:
        take = min(window * G, N - nxt)
        pool = np.concatenate([pool, np.arange(nxt, nxt + take)])
        arrived = np.concatenate([arrived, np.full(take, w)])
        nxt += take
        last = nxt >= N
        pc = c_all[pool]
        pt = None if t_all is None else t_all[pool]
        K = max(1, int(round(float(pc.sum()) / budget)))
        K = -(-K // R) * R if last else min(K, len(pool))
        forced = arrived <= w - patience  # has waited ``patience`` windows: goes now
        while True:
            bin_of, K = _lpt_bins(pc, pt, K, R if last else 1, max_items, cap)
            E = K if last else (K // R) * R
            forced_bins = np.zeros(K, dtype=bool)
            forced_bins[bin_of[forced]] = True
            if forced_bins.sum() <= E:
                break
            K = -(-K // R) * R  # more forced bins than a whole number of batches: emit them all
            last = True
        S = np.bincount(bin_of, weights=pc, minlength=K)
        keep_bins = np.ones(K, dtype=bool)
        if E < K:  # hold back the K - E non-forced bins farthest from the median cost
            cand = np.flatnonzero(~forced_bins)
            far = cand[np.argsort(-np.abs(S[cand] - np.median(S)), kind="stable")]
            keep_bins[far[:K - E]] = False
        sel = np.flatnonzero(keep_bins)
        sel = sel[np.argsort(-S[sel], kind="stable")]
        groups = [sel[i:i + R] for i in range(0, len(sel), R)]
        batch_of_bin = np.full(K, -1, dtype=np.int64)
        rank_of_bin = np.zeros(K, dtype=np.int64)
        for t, g in enumerate(groups):
            batch_of_bin[g] = t
            rank_of_bin[g] = rng.permutation(R)[:len(g)]
        bt = batch_of_bin[bin_of]
        taken = bt >= 0
        items, bt, rk = order[pool[taken]], bt[taken], rank_of_bin[bin_of[taken]]
        for t in rng.permutation(len(groups)):
            m = bt == t
            it, r = items[m], rk[m]
            o = np.lexsort((it, r))
            out_s.append(it[o])
            out_r.append(r[o].astype(np.int32))
            offs.append(offs[-1] + len(it))
        pool, arrived = pool[~taken], arrived[~taken]
        w += 1
    return _concat_plan(out_s, out_r, offs, R)


def plan_epoch(costs, order, num_ranks: int, per_rank: int, *, policy: str = "lookahead", counts: str = "fixed",
               window: int = 16, patience: int = 2, cap: float | None = None, sizes=None,
               max_items: int | None = None, budget: float | None = None, seed: int = 0,
               tol: float = 1e-3, max_iters: int | None = None) -> EpochPlan:
    """Schedule one epoch into global batches of ``num_ranks`` ranks, balanced per rank.

    costs[U]: cost per sample (:func:`cost`); order[N]: the epoch's sample order (e.g. the
    loader's ``default_rng((seed, epoch)).permutation``), distinct sample ids. Every id of
    ``order`` appears exactly once in the result, and the result is a pure function of the
    arguments (``seed`` drives the only randomness).

    policy (with ``counts="fixed"``: every rank ``per_rank`` sequences, ``G = num_ranks *
    per_rank`` per batch, a last partial batch of ``N % G``):
      ``"random"``: batches and ranks as the order falls (rank r of batch b takes order positions
      ``b*G + r*per_rank ...``): what an unbalanced loader does.
      ``"greedy"``: LPT per batch. ``"kk"``: equal-count Karmarkar-Karp per batch.
      ``"lookahead"``: windows of ``window`` global batches pooled, KK bins sorted into batches,
      exchange local search (module docstring); samples move < ``window`` batches.
    counts="budget" (policy ``"lookahead"`` only): ranks hold different numbers of sequences of
      equal total cost. Each window pools ``window * G`` new samples with those held back before;
      LPT splits the pool into ``K = round(pool cost / budget)`` bins (``budget`` defaults to
      :func:`aligned_budget`), bins sorted by cost go out R at a time, and the ``K mod R`` bins
      farthest from the median cost are held back for the next window, except bins holding a
      sample that has already waited ``patience`` windows. At the end of the order everything
      left goes out (``ceil(K / R)`` batches). Batches per epoch: about total cost / (R budget).
    cap: per-rank limit on the sum of ``sizes[U]`` (tokens; ``costs`` when None), both modes.
    max_items: per-rank sequence limit (budget mode). tol: the fixed-count local search stops once
    a batch is within this imbalance. max_iters: local-search steps per window (default 8 W R).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if counts not in COUNT_MODES:
        raise ValueError(f"counts must be one of {COUNT_MODES}, got {counts!r}")
    if num_ranks < 1 or per_rank < 1 or window < 1 or patience < 1:
        raise ValueError(f"need num_ranks, per_rank, window, patience >= 1; got {num_ranks}, {per_rank}, "
                         f"{window}, {patience}")
    costs = np.asarray(costs, dtype=np.float64)
    order = np.asarray(order, dtype=np.int64)
    if len(np.unique(order)) != len(order):
        raise ValueError("order repeats a sample id")
    tok_all = None
    if cap is not None:
        tok_all = costs if sizes is None else np.asarray(sizes, dtype=np.float64)
        if len(order) and tok_all[order].max() > cap:
            raise ValueError(f"infeasible: a sample of size {tok_all[order].max():g} exceeds the per-rank cap {cap:g}")
    if counts == "budget":
        if policy != "lookahead":
            raise ValueError("counts='budget' needs policy='lookahead'")
        return _plan_budget(costs, order, int(num_ranks), int(per_rank), window, patience, max_items, cap,
                            tok_all, seed, budget)
    return _plan_fixed(costs, order, int(num_ranks), int(per_rank), policy, window, cap, tok_all, seed, tol,
                       max_iters)


# --------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class CostFit:
    """Least-squares fit ``time ~ a L^2 + b L + c``: coefficients and the relative RMS residual."""
    a: float
    b: float
    c: float
    rel_rmse: float


def fit_cost(lengths, times, *, intercept: bool = True, relative: bool = True) -> CostFit:
    """Fit ``times[M] ~ a * L**2 + b * L (+ c)`` over ``lengths[M]`` by (non-negative) least squares.

    ``relative``: minimise relative residuals (weights 1/time), so short and long sequences count
    alike. ``intercept``: fit a constant per-call overhead ``c`` (kernel launches, Python) that the
    balancer then ignores; it is not a per-sequence cost inside a packed jagged batch. Negative
    coefficients are not physical: the fit then drops the offending term (a, b, c >= 0).
    """
    L = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if L.shape != t.shape or L.ndim != 1:
        raise ValueError(f"lengths and times must be 1-D of equal length, got {L.shape} and {t.shape}")
    if (t <= 0).any():
        raise ValueError("times must be > 0")
    cols = [L * L, L] + ([np.ones_like(L)] if intercept else [])
    if len(np.unique(L)) < len(cols):
        raise ValueError(f"need at least {len(cols)} distinct lengths to fit {len(cols)} coefficients")
    w = 1.0 / t if relative else np.ones_like(t)
    X = np.stack(cols, axis=1)
    best = None
    m = X.shape[1]
    for mask in range(1, 2 ** m):  # all supports: exact NNLS for <= 3 unknowns
        idx = [i for i in range(m) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(X[:, idx] * w[:, None], t * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(m)
        full[idx] = coef
        res = float(np.sqrt(np.mean(((X @ full - t) / t) ** 2)))
        if best is None or res < best[1] - 1e-15:
            best = (full, res)
    full, res = best
    return CostFit(a=float(full[0]), b=float(full[1]), c=float(full[2]) if intercept else 0.0, rel_rmse=res)


def calibrate(measure_fn: Callable[[int], float], lengths: Sequence[int], *, repeats: int = 3,
              intercept: bool = True) -> tuple[float, float]:
    """``(a, b)`` of the cost model from timings: ``measure_fn(L)`` returns seconds for one sequence
    of ``L`` tokens (e.g. a forward+backward HSTU layer); each length is timed ``repeats`` times and
    the median is fitted with :func:`fit_cost`. Use lengths spanning the training range (e.g. 8
    points log-spaced from 64 to the truncation length).
    """
    Ls = [int(x) for x in lengths]
    times = [float(np.median([measure_fn(L) for _ in range(max(1, repeats))])) for L in Ls]
    fit = fit_cost(Ls, times, intercept=intercept)
    return fit.a, fit.b


# ---------------------------------------------------------------------------- loss normalisation
def rank_loss_weight(global_tokens: int, world_size: int, *, grad_reduce: str = "mean") -> float:
    """Factor for a rank's *summed* per-token loss so that reduced gradients equal those of the
    global per-token mean, whatever the per-rank token counts.

    With ``grad_reduce="mean"`` (DDP averages gradients over ``world_size`` ranks) the factor is
    ``world_size / global_tokens``; with ``"sum"`` it is ``1 / global_tokens``. ``global_tokens``
    is the all-reduced sum of the ranks' loss-bearing token counts. Normalising by the local count
    instead (a per-rank mean) over-weights tokens on ranks that hold few of them, which balancing by
    cost makes common.
    """
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be > 0, got {global_tokens}")
    if grad_reduce == "mean":
        return world_size / global_tokens
    if grad_reduce == "sum":
        return 1.0 / global_tokens
    raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
