"""Full-ranking retrieval metrics (HR@K, NDCG@K, MRR) as generative-recommenders reports them.

GR ranks the target among all candidate items after removing the user's history ids, and reports
HR@K = 1[rank <= K], NDCG@K = 1/log2(rank + 1) if rank <= K else 0, and MRR = 1/rank, averaged
over users. Differences, both deliberate: GR caps ranks at 2501 (it retrieves a top-2500 list),
which only moves MRR, by less than 1/2500 per user; and GR would also drop the target if it were in
the history, which never happens on MovieLens (each movie is rated once) but would on logs with
repeats, so here the target always stays rankable.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def ranks_from_scores(scores: np.ndarray, targets: np.ndarray, exclude: Sequence[np.ndarray] | None = None,
                      candidates: np.ndarray | None = None) -> np.ndarray:
    """1-based rank of each target: 1 + number of eligible items scoring strictly higher.

    scores[B, N+1] float    score of every item id 0..N (column 0 is padding, never ranked)
    targets[B] int          target id in 1..N
    exclude                 B arrays of item ids to remove (the user's history); the target itself
                            is never removed
    candidates[C] int       optional: only these ids are ranked (GR ranks movies.dat ids on ML)
    returns ranks[B] int64

    Ties count in the target's favour (strictly greater only). NaN scores raise ``ValueError``.
    """
    scores = np.asarray(scores)
    if not np.issubdtype(scores.dtype, np.floating):
        scores = scores.astype(np.float64)
    targets = np.asarray(targets).astype(np.int64).reshape(-1)
    if scores.ndim != 2 or scores.shape[0] != targets.shape[0]:
        raise ValueError(f"scores must be [B, N+1] with B = len(targets) = {targets.shape[0]}, got {scores.shape}")
    n_cols = scores.shape[1]
    if targets.size and (targets.min() < 1 or targets.max() >= n_cols):
        raise ValueError(f"targets must lie in 1..{n_cols - 1} (0 is padding), got "
                         f"{targets.min()}..{targets.max()}")
    if np.isnan(scores).any():
        rows = np.flatnonzero(np.isnan(scores).any(axis=1))
        raise ValueError(f"scores hold NaN in rows {rows[:10].tolist()}; a diverged model cannot be ranked")
    rows = np.arange(len(targets))
    target_score = scores[rows, targets]

    # Same dtype as the scores: a float64 copy of [256, 131k] ML-20M scores would be 270 MB.
    masked = scores.copy()
    masked[:, 0] = -np.inf
    if candidates is not None:
        keep = np.zeros(n_cols, dtype=bool)
        keep[np.asarray(candidates, dtype=np.int64)] = True
        masked[:, ~keep] = -np.inf
    if exclude is not None:
        if len(exclude) != len(targets):
            raise ValueError(f"exclude has {len(exclude)} lists for {len(targets)} targets")
        lengths = np.array([len(e) for e in exclude], dtype=np.int64)
        if lengths.sum():
            cols = np.concatenate([np.asarray(e, dtype=np.int64).reshape(-1) for e in exclude])
            masked[np.repeat(rows, lengths), cols] = -np.inf
    # Writing back the target's own score keeps it rankable when it is in the history or
    # outside ``candidates``; it never counts against itself because the comparison is strict.
    masked[rows, targets] = target_score
    return 1 + (masked > target_score[:, None]).sum(axis=1).astype(np.int64)


def metrics_from_ranks(ranks: np.ndarray, ks: Sequence[int] = (10, 50, 200)) -> dict[str, float]:
    """``{"hr@K", "ndcg@K" for K in ks, "mrr"}`` averaged over users, as Python floats.

    ranks[B] int, 1-based. NDCG@K = 1/log2(rank+1) when rank <= K else 0 (one relevant item).
    """
    ranks = np.asarray(ranks, dtype=np.float64).reshape(-1)
    if ranks.size == 0:
        raise ValueError("no ranks to average (empty evaluation set)")
    if (ranks < 1).any():
        raise ValueError(f"ranks are 1-based; got {ranks.min()}")
    out: dict[str, float] = {}
    gain = 1.0 / np.log2(ranks + 1.0)
    for k in ks:
        hit = ranks <= k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, gain, 0.0).mean())
    out["mrr"] = float((1.0 / ranks).mean())
    return out
