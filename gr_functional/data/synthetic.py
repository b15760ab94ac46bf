"""A synthetic sequential-recommendation dataset with real length skew and learnable structure.

It is the default dataset of the quickstart, so it must (a) need no download, (b) be identical on
every machine for a given seed, (c) be jagged the way production logs are, and (d) reward a
sequential model over a popularity ranking.

Lengths. Per-user sequence lengths follow KuaiRand-27K's standard log (322,278,385 exposures over
27,285 users; ``log_standard_user_stats_distribution.csv``, column ``exposures``; its other columns,
``clicks`` and ``ctr``, are not used). Real lengths run from 100 to 228,000 (median 8,594), so
truncating them at a few hundred events would give almost every user exactly ``max_events``
(99.6 % of users have >= 400 exposures) and no jaggedness at all. Instead the distribution is
scaled: ``length = clip(round(x * scale), 3, max_events)`` with ``x`` drawn from the real
distribution and ``scale = max_events / p99(x)`` by default, which keeps the shape (quantile
ratios) and truncates only the top 1 %. ``length_scale=1.0`` gives the literal truncation.
Sampling uses the 101 percentiles of the real column (``np.percentile(..., method="inverted_cdf")``),
embedded below so the generator needs no data file and gives the same users everywhere; draws
interpolate log-linearly between adjacent percentiles. ``lengths_csv`` recomputes the table from
a file with an ``exposures`` column; a test checks the embedded table against the real file.

Items. Popularity is Zipf(``zipf_a``) over a random permutation of ids 1..N. Items are split
evenly into topics at random. Each user has 3 favourite topics. Step by step:
- a new session starts with probability ``1/session_events`` (always at t = 0): the topic becomes
  one of the user's favourites and the item is drawn from it by popularity;
- otherwise, with ``p_transition`` the next item is one of the previous item's 4 fixed successors
  (slot probabilities 0.55/0.25/0.12/0.08), with ``p_topic`` it is drawn from the current topic by
  popularity, and otherwise from global popularity (the topic follows the drawn item).
So the previous item and the recent topic predict the next item far better than popularity does.

Times (unix seconds, strictly increasing per user): the first event falls in the 14 days from
2022-04-08 (KuaiRand's start); gaps inside a session are ``1 + Exponential(30 s)`` (KuaiRand:
median gap 0 s, p90 62 s); gaps between sessions are log-normal around 4 hours.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..errors import DataError
from .sequences import SequenceData

# np.percentile(exposures, 0..100, method="inverted_cdf") of the 27,285 KuaiRand-27K users
# (standard logs), from log_standard_user_stats_distribution.csv (sha256 f9532007...5b066).
KUAIRAND27K_EXPOSURE_PERCENTILES = (
    100, 571, 809, 1027, 1216, 1393, 1560, 1710, 1864, 2028, 2188, 2343, 2506, 2666, 2825, 2971, 3132,
    3297, 3448, 3585, 3744, 3883, 4023, 4173, 4330, 4476, 4639, 4782, 4954, 5102, 5252, 5407, 5548, 5695,
    5846, 6005, 6171, 6329, 6487, 6646, 6815, 6973, 7157, 7334, 7512, 7668, 7847, 8033, 8221, 8409, 8594,
    8789, 8978, 9186, 9394, 9589, 9782, 10016, 10239, 10482, 10712, 10956, 11193, 11433, 11703, 11967,
    12231, 12535, 12861, 13165, 13471, 13807, 14135, 14481, 14849, 15227, 15601, 16023, 16470, 16938,
    17399, 17866, 18436, 19055, 19688, 20342, 21051, 21823, 22624, 23532, 24591, 25800, 27132, 28624,
    30255, 32594, 35210, 38845, 44827, 56232, 228000,
)

_EPOCH_START = 1649347200  # 2022-04-08 00:00:00 UTC, the first day of the KuaiRand logs
_SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.12, 0.08])
_FAVOURITE_TOPICS = 3
_MIN_LENGTH = 3  # leave-one-out needs 1 train target, 1 valid and 1 test item


def exposure_percentiles(lengths_csv: str | Path | None = None) -> np.ndarray:
    """``[101] float64`` percentiles 0..100 of per-user exposures (embedded table when no file is given)."""
    if lengths_csv is None:
        return np.asarray(KUAIRAND27K_EXPOSURE_PERCENTILES, dtype=np.float64)
    path = Path(lengths_csv)
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected the KuaiRand-27K per-user table with an "
                        f"'exposures' column; omit lengths_csv to use the embedded percentiles)")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or "exposures" not in [h.strip() for h in header]:
            raise DataError(f"{path}:1: expected a header with an 'exposures' column, got {header!r}")
        col = [h.strip() for h in header].index("exposures")
        values = []
        for lineno, row in enumerate(reader, start=2):
            try:
                values.append(float(row[col]))
            except (ValueError, IndexError):
                raise DataError(f"{path}:{lineno}: 'exposures' is not a number: {row!r}") from None
    if not values:
        raise DataError(f"{path}: no rows under the header")
    x = np.asarray(values)
    if (x <= 0).any():
        raise DataError(f"{path}: exposures must be positive (lengths are sampled in log space)")
    return np.percentile(x, np.arange(101), method="inverted_cdf").astype(np.float64)


def sample_lengths(rng: np.random.Generator, n: int, percentiles: np.ndarray) -> np.ndarray:
    """``[n] float64`` draws from the distribution given by its 101 percentiles (log-linear inverse CDF)."""
    u = rng.random(n) * 100.0
    lo = np.minimum(u.astype(np.int64), 99)
    frac = u - lo
    logq = np.log(percentiles)
    return np.exp(logq[lo] + frac * (logq[lo + 1] - logq[lo]))


def make_synthetic(num_users: int = 2000, num_items: int = 3000, max_events: int = 400, zipf_a: float = 1.05,
                   seed: int = 0, lengths_csv: str | Path | None = None, *, num_topics: int | None = None,
                   p_transition: float = 0.4, p_topic: float = 0.4, session_events: float = 20.0,
                   length_scale: float | None = None) -> SequenceData:
    """Generate ``num_users`` time-ordered sequences over ids ``1..num_items`` (deterministic in ``seed``).

    Returns ``SequenceData`` (items[T] int32, times[T] int64 seconds, offsets[U+1] int64). See the
    module docstring for the generative process. ``num_topics`` defaults to ``num_items // 50``
    (at least 4); ``length_scale`` defaults to ``max_events / p99`` of the real lengths.
    """
    if num_users < 1 or num_items < 2:
        raise DataError(f"synthetic data needs >= 1 user and >= 2 items, got {num_users} users, {num_items} items")
    if max_events < _MIN_LENGTH:
        raise DataError(f"synthetic_max_events must be >= {_MIN_LENGTH}, got {max_events}")
    if not (0 <= p_transition and 0 <= p_topic and p_transition + p_topic <= 1):
        raise DataError(f"need p_transition, p_topic >= 0 with sum <= 1, got {p_transition}, {p_topic}")
    if zipf_a < 0:
        raise DataError(f"zipf_a must be >= 0, got {zipf_a}")
    if session_events < 1:
        raise DataError(f"session_events must be >= 1, got {session_events}")
    rng = np.random.default_rng(seed)
    N, U = int(num_items), int(num_users)

    # ---- lengths
    pct = exposure_percentiles(lengths_csv)
    scale = max_events / pct[99] if length_scale is None else float(length_scale)
    lengths = np.clip(np.rint(sample_lengths(rng, U, pct) * scale), _MIN_LENGTH, max_events).astype(np.int64)

    # ---- items: popularity, topics, successors (0-based item index here; ids are index + 1)
    weight = np.empty(N)
    weight[rng.permutation(N)] = (np.arange(N) + 1.0) ** -zipf_a
    weight /= weight.sum()
    K = int(num_topics) if num_topics else max(4, N // 50)
    K = min(K, N)
    topic_of = rng.permutation(N) % K
    by_topic = np.argsort(topic_of, kind="stable")
    cum_topic = np.cumsum(weight[by_topic])
    topic_end = np.cumsum(np.bincount(topic_of, minlength=K))
    topic_start = topic_end - np.bincount(topic_of, minlength=K)
    mass_lo = np.where(topic_start > 0, cum_topic[np.maximum(topic_start - 1, 0)], 0.0)
    mass_hi = cum_topic[topic_end - 1]
    cum_global = np.cumsum(weight)

    flat = np.sqrt(weight)  # successors: popular-ish but not all the head items
    flat /= flat.sum()
    successors = rng.choice(N, size=(N, len(_SUCCESSOR_PROBS)), p=flat)
    self_loop = successors == np.arange(N)[:, None]
    successors[self_loop] = (successors[self_loop] + 1) % N
    slot_cum = np.cumsum(_SUCCESSOR_PROBS)

    topic_mass = mass_hi - mass_lo
    favourites = rng.choice(K, size=(U, _FAVOURITE_TOPICS), p=topic_mass / topic_mass.sum())

    def in_topic(topics: np.ndarray, r: np.ndarray) -> np.ndarray:
        target = mass_lo[topics] + r * (mass_hi[topics] - mass_lo[topics])
        pos = np.searchsorted(cum_topic, target, side="right")
        pos = np.clip(pos, topic_start[topics], topic_end[topics] - 1)
        return by_topic[pos]

    def global_pop(r: np.ndarray) -> np.ndarray:
        return np.minimum(np.searchsorted(cum_global, r * cum_global[-1], side="right"), N - 1)

    # ---- walk all users in lockstep; users sorted by length so the active ones are a prefix
    order = np.argsort(-lengths, kind="stable")
    offsets = np.zeros(U + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    base = offsets[:-1][order]
    sorted_len = lengths[order]
    T = int(offsets[-1])
    items = np.zeros(T, dtype=np.int32)
    times = np.zeros(T, dtype=np.int64)
    prev_item = np.zeros(U, dtype=np.int64)
    topic = np.zeros(U, dtype=np.int64)
    clock = _EPOCH_START + rng.integers(0, 14 * 86400, size=U)
    fav_sorted = favourites[order]
    p_new = 1.0 / session_events
    for t in range(int(sorted_len[0])):
        n = int(np.searchsorted(-sorted_len, -t, side="left"))  # users with length > t
        draws = rng.random((6, n))
        new = (draws[0] < p_new) if t > 0 else np.ones(n, dtype=bool)
        r = draws[1]
        trans = ~new & (r < p_transition)
        stay = ~new & ~trans & (r < p_transition + p_topic)
        jump = ~new & ~trans & ~stay

        cur_topic = topic[:n]
        fav = fav_sorted[np.arange(n), (draws[2] * _FAVOURITE_TOPICS).astype(np.int64)]
        cur_topic = np.where(new, fav, cur_topic)
        nxt = in_topic(cur_topic, draws[3])                     # session start / stay in topic
        slot = np.minimum(np.searchsorted(slot_cum, draws[4], side="right"), len(slot_cum) - 1)
        nxt = np.where(trans, successors[prev_item[:n], slot], nxt)
        nxt = np.where(jump, global_pop(draws[3]), nxt)
        topic[:n] = np.where(trans | jump, topic_of[nxt], cur_topic)
        prev_item[:n] = nxt

        if t > 0:
            in_gap = 1 + np.floor(rng.exponential(30.0, size=n)).astype(np.int64)
            sess_gap = 600 + np.exp(rng.normal(np.log(4 * 3600.0), 1.0, size=n)).astype(np.int64)
            clock[:n] += np.where(new, sess_gap, in_gap)
        idx = base[:n] + t
        items[idx] = nxt + 1
        times[idx] = clock[:n]

    return SequenceData(items=items, times=times, offsets=offsets, user_ids=np.arange(U, dtype=np.int64),
                        num_items=N, name=f"synthetic (seed {seed}, KuaiRand-27K lengths)")
