"""A KuaiRand-27K-shaped interaction stream, generated on the fly and never materialised.

KuaiRand-27K has 27,285 users, 322,278,385 interactions and 32,038,725 videos; this project has the
27,285 real per-user lengths (``dataset_path("kuairand-27k-lengths")``, column ``exposures``) but
not the logs. ``KuaiRandStream`` makes a stream of that shape: user u's history has exactly its
real length L_u, cut into windows of ``window + 1`` consecutive events (a training sequence of
``window`` inputs predicting the next event each); an epoch visits every (user, window) pair once
in a seeded random order. Each window is generated from ``default_rng((seed, u, w))`` alone, so any
window is random access and nothing is stored but the lengths:

  items   raw 60-bit ids (splitmix64 of a popularity rank, shifted), ranks drawn from a bounded
          Zipf (P(rank r) ~ 1/r over ``num_items``: rank = floor(num_items ** U)), so the stream
          names millions of distinct ids with a heavy head, as a video catalogue does
  times   increasing seconds (gaps uniform in 1..600 s), the window's start after the previous ones

The sum of the lengths is 322,278,385 events; with ``window = 255``, 1.27M training sequences per
epoch. Memory: the lengths and the window index (two int64 arrays of the windows: ~20 MB).
"""
from __future__ import annotations

import numpy as np

from ..embedding.hashtable import mix64
from ..errors import DataError

KUAIRAND_27K_ITEMS = 32_038_725


def real_lengths(path=None) -> np.ndarray:
    """The 27,285 per-user lengths of KuaiRand-27K (int64), from the data folder's table."""
    import csv

    from .paths import dataset_path

    path = path or dataset_path("kuairand-27k-lengths")
    with open(path, newline="", encoding="utf-8-sig") as f:  # the file starts with a BOM
        rows = list(csv.DictReader(f))
    if not rows or "exposures" not in rows[0]:
        raise DataError(f"{path}: no 'exposures' column (the per-user length of KuaiRand-27K's standard log)")
    return np.asarray([int(float(r["exposures"])) for r in rows], np.int64)


class KuaiRandStream:
    """Windows of a KuaiRand-27K-shaped stream (module docstring). ``lengths``: per-user history
    lengths (default the real ones); ``window``: inputs per training sequence."""

    def __init__(self, lengths=None, *, window: int = 255, num_items: int = KUAIRAND_27K_ITEMS, seed: int = 0):
        self.lengths = real_lengths() if lengths is None else np.asarray(lengths, np.int64)
        self.window, self.num_items, self.seed = window, num_items, seed
        per_user = -(-np.maximum(self.lengths - 1, 1) // window)      # windows of window + 1 events, overlapping by 1
        self.user = np.repeat(np.arange(len(self.lengths)), per_user)
        self.index = np.concatenate([np.arange(n) for n in per_user]) if len(per_user) else np.zeros(0, np.int64)

    @property
    def num_events(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        """Training sequences (windows) per epoch."""
        return len(self.user)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's visiting order of window numbers (a seeded permutation)."""
        return np.random.default_rng((self.seed, 1 << 20, epoch)).permutation(len(self))

    def window_events(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64[n], times int64[n])`` of window ``k``: n = min(window + 1, what is left
        of the user's history from the window's start)."""
        u, w = int(self.user[k]), int(self.index[k])
        start = w * self.window
        n = int(min(self.window + 1, self.lengths[u] - start))
        n = max(n, 2)
        rng = np.random.default_rng((self.seed, u, w))
        ranks = np.floor(self.num_items ** rng.random(n)).astype(np.uint64)   # P(r) ~ 1/r on [1, num_items)
        ids = (mix64(ranks + np.uint64(self.seed) * np.uint64(KUAIRAND_27K_ITEMS)) >> np.uint64(4)).astype(np.int64)
        ids = np.where(ids == 0, 1, ids)
        times = 1_600_000_000 + start * 300 + np.cumsum(rng.integers(1, 601, size=n))
        return ids, times

    def batches(self, epoch: int, batch_size: int, start: int = 0):
        """``(histories, times)`` lists of ``batch_size`` windows at a time, from batch ``start``."""
        order = self.order(epoch)
        for b in range(start, -(-len(order) // batch_size)):
            got = [self.window_events(int(k)) for k in order[b * batch_size:(b + 1) * batch_size]]
            yield [g[0] for g in got], [g[1] for g in got]
