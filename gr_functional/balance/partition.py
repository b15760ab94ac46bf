"""Partitioning one set of sequences into ``k`` parts of near-equal cost (host-side, numpy only).

- :func:`greedy_lpt`: longest-processing-time-first greedy (the classic baseline; the loader's
  fallback when KK's cap repair fails).
- :func:`karmarkar_karp`: multi-way largest differencing, optionally with equal item counts per
  part (as NVIDIA recsys-examples' batch shuffler) and a per-part token cap.
- :func:`refine`: exchange/move local search that never makes the largest part larger; the same
  search over a window of batches (``_window_search``) is step 3 of the lookahead planner.

Inputs are ``costs[N] >= 0`` (:func:`~gr_functional.balance.cost.cost`); outputs are
``assignment[N] int64`` in ``[0, k)``. ``cap`` limits each part's sum of ``sizes[N]`` (tokens;
``costs`` when ``sizes`` is None): ``dist.rank_token_cap``.
"""
from __future__ import annotations

import heapq

import numpy as np

from .cost import part_sums


def _check_inputs(costs, num_parts, sizes, cap):
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
    return c, tok


def greedy_lpt(costs, num_parts: int, *, equal_count: bool = False, cap: float | None = None,
               sizes=None) -> np.ndarray:
    """Longest-processing-time-first: items by decreasing cost, each to the cheapest part that can take it.

    costs[N] >= 0; returns ``assignment[N] int64`` in ``[0, num_parts)``. ``equal_count``: part counts
    differ by at most one; ``cap``: per-part sum of ``sizes[N]`` (tokens; ``costs`` when ``sizes``
    is None) stays <= cap. ``ValueError`` when no part can take an item. O(N log k) with a heap.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap)
    N, k = len(c), int(num_parts)
    limit = [np.iinfo(np.int64).max] * k
    if equal_count:
        q, r = divmod(N, k)
        limit = [q + 1 if p < r else q for p in range(k)]
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
            raise ValueError(f"greedy_lpt: no part can take item {i} (cap={cap})")
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


def karmarkar_karp(costs, num_parts: int, *, equal_count: bool = False, cap: float | None = None,
                   sizes=None, refine_result: bool = False) -> np.ndarray:
    """Multi-way Karmarkar-Karp (largest differencing) partition of ``costs[N]`` into ``num_parts``.

    Returns ``assignment[N] int64`` in ``[0, num_parts)``. States are k-tuples of subsets kept
    sorted by sum; the two states of largest spread (max - min) are merged by pairing the largest
    subset of one with the smallest of the other, until one state is left.

    - ``equal_count=True``: part counts differ by at most one (the state-per-stratum start of
      NVIDIA's / verl's implementation; zero-cost dummies pad ``N`` to a multiple of ``num_parts``).
    - ``cap``: per-part sum of ``sizes[N]`` (tokens; ``costs`` when None) <= cap. KK ignores it,
      then a repair pass moves (or, with ``equal_count``, swaps) items out of violating parts,
      least cost damage first. ``ValueError`` when that fails (the instance may still be
      feasible; greedy_lpt with the same cap is the fallback to try).
    - ``refine_result``: finish with :func:`refine` (exchange local search), which never makes the
      largest part larger.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap)
    k = int(num_parts)
    out = _kk_raw(c, k, equal_count)
    if cap is not None:
        out = _repair(c, tok, out, k, cap, swaps_only=equal_count)
    if refine_result:
        out = refine(c, out, k, moves=not equal_count, cap=cap, sizes=None if tok is None else tok)
    return out


def _repair(c, tok, assign, k, cap, *, swaps_only: bool) -> np.ndarray:
    """Make ``assign`` respect the token ``cap`` (on ``tok``) by moves or swaps out of violating parts."""
    assign = assign.copy()
    lim_tok = float(cap)
    for _ in range(4 * len(c) + 4):
        S = part_sums(c, assign, k)
        T = part_sums(tok, assign, k)
        bad = np.flatnonzero(T > lim_tok + 1e-9)
        if bad.size == 0:
            return assign
        p = int(bad[np.argmax(T[bad] - lim_tok)])
        items = np.flatnonzero(assign == p)
        best = None
        if not swaps_only:  # move one item of p to another part with room
            room = np.ones(k, dtype=bool)
            room[p] = False
            new_t = T[None, :] + tok[items][:, None]
            ok = room[None, :] & (new_t <= lim_tok + 1e-9)
            if ok.any():
                score = np.where(ok, S[None, :] + c[items][:, None], np.inf)
                i, q = np.unravel_index(np.argmin(score), score.shape)
                best = ("move", items[i], q)
        if best is None:  # swap an item of p for a smaller one elsewhere
            others = np.flatnonzero(assign != p)
            dt = tok[items][:, None] - tok[others][None, :]
            q = assign[others][None, :]
            ok = (dt > 0) & (T[q] + dt <= lim_tok + 1e-9)
            if ok.any():
                dc = c[items][:, None] - c[others][None, :]
                score = np.where(ok, np.maximum(S[p] - dc, S[q] + dc), np.inf)
                i, j = np.unravel_index(np.argmin(score), score.shape)
                best = ("swap", items[i], others[j])
        if best is None:
            raise ValueError(f"cannot satisfy the per-part limits (cap={cap}) by repairing the partition")
        if best[0] == "move":
            assign[best[1]] = best[2]
        else:
            i, j = best[1], best[2]
            assign[i], assign[j] = assign[j], assign[i]
    raise ValueError("repair did not converge")


# ------------------------------------------------------------------------------- local search
def _window_search(c, tok, bin_of, num_bins: int, R: int, *, moves: bool, cap, tol: float,
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
            okm = np.ones((len(ux), num_bins), dtype=bool)
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


def refine(costs, assignment, num_parts: int, *, moves: bool = False, cap: float | None = None, sizes=None,
           tol: float = 0.0, max_iters: int | None = None) -> np.ndarray:
    """Exchange (and, with ``moves``, move) local search on one partition; returns a new assignment[N].

    Each step swaps one item of the most expensive part with a cheaper item of another part (or
    moves it there) when that lowers the largest part; the ``cap`` (on ``sizes``, else ``costs``)
    is kept. Stops at ``imbalance <= tol``, when no step helps, or after ``max_iters`` (default
    ``4 * N``) steps.
    """
    c, tok = _check_inputs(costs, num_parts, sizes, cap)
    bin_of = np.asarray(assignment, dtype=np.int64).copy()
    if len(c) == 0 or num_parts == 1:
        return bin_of
    return _window_search(c, tok, bin_of, num_parts, num_parts, moves=moves, cap=cap, tol=tol,
                          max_iters=max_iters or 4 * len(c) + 8)
