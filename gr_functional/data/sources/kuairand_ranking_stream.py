"""A KuaiRand-27K-shaped *ranking* stream: the 27,285 real per-user lengths (322,278,385 events),
ids over 32M videos, 8 engagement labels and the users' real features, generated per user on demand
and never materialised (``data.dataset = "kuairand-rank-stream"``).

It quacks like ``kuairand_ranking.RankingSequences`` where the ranking loader and batch builder
look (``users``, ``offsets``, ``context``, ``sequence(u)``), so the ranking model trains on it
unchanged; only the lengths (27,285 ints), the users' feature codes and a few constants are held.

What is real: every user's length and click rate (the third-party per-user table of KuaiRand-27K's
standard logs in the data folder: exposures, clicks), and user u's 5 contextual features (row u of
the official KuaiRand-Pure user file: the same 27,285 users; which length belongs to which user id
is not known, the table has no ids, so user u gets row u of both). What is generated, as in
``kuairand_ranking_synthetic`` (its docstring states the assumed rates): videos by a bounded Zipf
over 32,038,725 ranks (ids ``rank + 1``: they fit the batch's int32), a latent-factor affinity
``z`` from a per-user vector (with drift along the sequence) and a per-video vector hashed from
the video id (``hashed_init``: no table of 32M vectors), the click drawn so each user's expected
click rate is its real one, the other actions from ``ACTION_RATES`` and the click, play time
consistent with long_view, time gaps as the 27K logs' summary. User u's events come from
``default_rng((seed, u))`` alone; the last few users generated are cached.
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np

from ...embedding.hashtable import hashed_init
from ...errors import DataError
from ..registry import DatasetSpec, register_dataset
from ..stream import KUAIRAND_27K_ITEMS
from .kuairand_features import load_kuairand_features
from .kuairand_ranking import ACTION_BITS, CONTEXT_FEATURES, appearance_codes
from .kuairand_ranking_synthetic import (_CLICK_LIFT, _LATENT, _SLOPE, _SPAN_MS, _START_MS, ACTION_RATES, _solve_offset,
                                         action_score, play_and_gaps)

_SAMPLE = 200_000    # (user, video) draws the action offsets are solved on
_CTR_DRAWS = 256     # affinity draws per user for its click offset


def user_stats(path=None) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths[27285] int64, ctr[27285] float64)`` of KuaiRand-27K's standard logs."""
    import csv

    from ..paths import dataset_path

    path = path or dataset_path("kuairand-27k-lengths")
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"exposures", "ctr"} <= set(rows[0]):
        raise DataError(f"{path}: needs 'exposures' and 'ctr' columns (the KuaiRand-27K per-user table)")
    lengths = np.asarray([int(float(r["exposures"])) for r in rows], np.int64)
    ctr = np.asarray([float(r["ctr"]) for r in rows], np.float64)
    return lengths, np.clip(ctr, 1e-4, 1 - 1e-4)


class KuaiRandRankingStream:
    """The stream of the module docstring. ``max_events`` > 0 keeps each user's first
    ``max_events`` events (a smaller run); ``num_users`` > 0 the first users."""

    def __init__(self, *, seed: int = 0, num_items: int = KUAIRAND_27K_ITEMS, max_events: int = 0,
                 num_users: int = 0, rates: dict | None = None, user_features=None, stats_path=None,
                 zipf: bool = True):
        lengths, ctr = user_stats(stats_path)
        feats = user_features if user_features is not None else load_kuairand_features(kind="user")
        if len(feats.ids) < len(lengths):
            raise DataError(f"{feats.source}: {len(feats.ids)} users, fewer than the {len(lengths)} of the lengths table")
        keep = slice(0, num_users or len(lengths))
        self.lengths = np.minimum(lengths, max_events)[keep] if max_events else lengths[keep]
        self.ctr = ctr[keep]
        self.seed, self.num_items, self.zipf = seed, num_items, zipf
        self.rates = {**ACTION_RATES, **(rates or {})}
        self.users = np.arange(len(self.lengths), dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        order = np.argsort(feats.ids, kind="stable")[: len(self.lengths)]      # user u = the file's id u
        self.context = {c: appearance_codes(feats.categorical[c][0])[order] for c in CONTEXT_FEATURES}
        activity_codes = self.context[CONTEXT_FEATURES[0]]
        rng = np.random.default_rng((seed, 1 << 40))
        self._activity = rng.normal(0.0, 0.5, int(activity_codes.max()) + 1)
        self._bias = self._activity[activity_codes] + rng.normal(0.0, 0.3, len(self.users))
        self._click_offset, self._offsets = self._solve(rng)

    # ------------------------------------------------------------------ constants
    def _solve(self, rng) -> tuple[np.ndarray, dict]:
        """Each user's click offset (its expected click rate = its real one) and the other actions'
        global offsets (their marginal rates = ``rates``), on draws of the affinity."""
        U = len(self.users)
        z = rng.standard_normal((U, _CTR_DRAWS)) + self._bias[:, None]             # <p, q> / sqrt(d) ~ N(0, 1)
        lo, hi = np.full(U, -30.0), np.full(U, 30.0)
        for _ in range(50):                                                         # bisection, all users at once
            mid = (lo + hi) / 2
            rate = (1.0 / (1.0 + np.exp(-(mid[:, None] + _SLOPE["is_click"] * z)))).mean(axis=1)
            low = rate < self.ctr
            lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
        click_offset = (lo + hi) / 2
        users = rng.integers(0, U, _SAMPLE)
        zs = rng.standard_normal(_SAMPLE) + self._bias[users]
        click = rng.random(_SAMPLE) < 1.0 / (1.0 + np.exp(-(click_offset[users] + _SLOPE["is_click"] * zs)))
        offsets = {}
        for name, _ in ACTION_BITS:
            if name == "is_click":
                continue
            offsets[name] = _solve_offset(action_score(name, zs, click), self.rates[name])
        return click_offset, offsets

    def fingerprint(self) -> str:
        """What fixes the stream (resume on another stream is refused)."""
        h = hashlib.sha256(repr((self.seed, self.num_items, self.zipf, sorted(self.rates.items()))).encode())
        for arr in (self.lengths, *(self.context[c] for c in CONTEXT_FEATURES)):
            h.update(np.ascontiguousarray(arr, np.int64).view(np.uint8).reshape(-1).data)
        return h.hexdigest()

    @property
    def num_events(self) -> int:
        return int(self.offsets[-1])

    # ------------------------------------------------------------------ one user
    @functools.lru_cache(maxsize=64)  # noqa: B019 - bounded; a batch asks for a user once per sample
    def sequence(self, u: int) -> dict:
        """User ``u``'s columns (``SEQUENCE_COLUMNS``), int64 arrays of its length."""
        n = int(self.lengths[u])
        rng = np.random.default_rng((self.seed, int(u)))
        r = rng.random(n)
        rank = np.floor(self.num_items ** r).astype(np.int64) if self.zipf else (r * self.num_items).astype(np.int64)
        video = np.minimum(rank, self.num_items - 1) + 1                            # ids 1..num_items
        q = hashed_init(self.seed + 1, video, _LATENT, std=1.0, bound=4.0).astype(np.float64)
        p, drift = rng.standard_normal(_LATENT), rng.standard_normal(_LATENT)
        frac = (np.arange(n) / max(n - 1, 1))[:, None]
        pref = p * np.sqrt(1 - 0.3 * frac) + drift * np.sqrt(0.3 * frac)
        z = np.einsum("nd,nd->n", pref, q) / np.sqrt(_LATENT) + self._bias[u]
        click = rng.random(n) < 1.0 / (1.0 + np.exp(-(self._click_offset[u] + _SLOPE["is_click"] * z)))
        bits = np.where(click, 1, 0).astype(np.int64)
        long_view = click
        for name, bit in ACTION_BITS:
            if name == "is_click":
                continue
            lift = 0.0 if name == "is_hate" else _CLICK_LIFT * click
            got = rng.random(n) < 1.0 / (1.0 + np.exp(-(self._offsets[name] + _SLOPE.get(name, 1.0) * z + lift)))
            bits |= np.where(got, bit, 0)
            if name == "long_view":
                long_view = got
        duration, play, gaps = play_and_gaps(rng, long_view, n)
        gaps[0] = rng.random() * _SPAN_MS / 2
        out = {"video_id": video, "time_ms": _START_MS + np.cumsum(gaps).astype(np.int64), "action_weights": bits,
               "play_time_ms": play.astype(np.int64), "duration_ms": duration}
        for col in out.values():
            col.setflags(write=False)                                               # cached: shared by callers
        return out


def _load_stream(cfg, path):
    d = cfg.data
    return KuaiRandRankingStream(seed=d.seed, max_events=d.synthetic_max_events, num_users=d.synthetic_users)


register_dataset(DatasetSpec("kuairand-rank-stream", "KuaiRand-27K-shaped ranking stream", _load_stream,
                             needs_file=False, task="ranking"))
