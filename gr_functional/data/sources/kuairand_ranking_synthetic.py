"""A KuaiRand-shaped ranking stream with learnable engagement labels (``RankingSequences``).

The full KuaiRand logs are not in the data folder (README of ``$GRF_DATA_DIR/kuairand``), so the
ranking preset trains on this generator. What is real and what is assumed:

- per-user lengths: draws from the real KuaiRand-27K per-user exposure distribution (its
  percentiles, ``synthetic.exposure_percentiles``), truncated to ``max_events``;
- contextual features: each user takes the 5 categorical features of a real row of the official
  ``user_features_pure.csv`` (27,285 users), numbered as GR numbers them;
- time gaps: half the gaps are under a second, the rest log-normal with a 60 s median and a session
  break of hours now and then (the 27K logs: gap median 0 s, p90 62 s, mean 218 s);
- action rates (``ACTION_RATES``): is_click .379 is KuaiRand-27K's standard-log click rate
  (122,052,542 clicks / 322,278,385 exposures, third-party statistics in the data folder);
  long_view .253 scales the official 1K sample's long_view/click ratio (20/30) to that click
  rate; the other six are **assumptions** (typical short-video engagement rates), because the
  211-row official sample has no positive for them. Pass ``rates`` to change any.

Labels follow a latent-factor model, so there is something to learn and AUC above 0.5 means the
model learnt it: user u and video v have 8-d latent vectors, affinity ``z = <p_u, q_v> / sqrt(8) +
b_u`` (``b_u`` depends on the user's activity feature); click ~ Bernoulli(sigmoid(c_click + 2 z));
the positive engagements are likelier after a click and for high affinity, is_hate for low affinity.
Each action's offset ``c_k`` is solved (bisection) so its marginal rate matches ``ACTION_RATES``.
Videos are shown by a Zipf popularity (exposure is the recommender's, not the user's, choice); a
user's preference drifts slowly along its sequence, so recent history predicts better than old.
Deterministic in ``seed``.
"""
from __future__ import annotations

import numpy as np

from ...errors import DataError
from ..registry import DatasetSpec, register_dataset
from ..synthetic import exposure_percentiles, sample_lengths
from .kuairand_features import load_kuairand_features
from .kuairand_ranking import ACTION_BITS, CONTEXT_FEATURES, RankingSequences, appearance_codes

ACTION_RATES = {"is_click": 0.379, "is_like": 0.015, "is_follow": 0.002, "is_comment": 0.003,
                "is_forward": 0.002, "is_hate": 0.0005, "long_view": 0.253, "is_profile_enter": 0.02}
MEASURED_RATES = ("is_click", "long_view")  # from data; the others are assumptions (module docstring)
_LATENT = 8
_START_MS = 1649347200000  # 2022-04-08 00:00 UTC, the first day of the KuaiRand logs
_SPAN_MS = 30 * 86400 * 1000
# how each action depends on the affinity z and on a click (positive engagements need interest)
_SLOPE = {"is_click": 2.0, "is_hate": -2.0}
_CLICK_LIFT = 1.5


def action_score(name: str, z: np.ndarray, click) -> np.ndarray:
    """``name``'s logit less its offset: slope x affinity ``z``, plus a lift after a click for the
    positive engagements (``click`` is unused for is_click and is_hate)."""
    lift = 0.0 if name in ("is_click", "is_hate") else _CLICK_LIFT * click
    return _SLOPE.get(name, 1.0) * z + lift


def play_and_gaps(rng: np.random.Generator, long_view: np.ndarray, n: int):
    """``(duration int64[n], play float[n], gaps float[n])`` in ms: a log-normal duration, a play
    time that meets KuaiRand's long_view rule (play >= min(duration, 18 s)) exactly where
    ``long_view``, and the gaps before each event (half under a second, the rest log-normal around
    60 s, a session break of hours now and then); the caller sets each user's first gap."""
    duration = np.clip(rng.lognormal(np.log(20000), 0.8, n), 3000, 600000).astype(np.int64)
    need = np.minimum(duration, 18000)
    play = np.where(long_view, need + rng.random(n) * (duration * 1.5 - need + 1), rng.random(n) * (need - 1))
    gaps = np.where(rng.random(n) < 0.5, rng.random(n) * 1000, rng.lognormal(np.log(60000), 1.2, n))
    gaps = np.where(rng.random(n) < 0.01, gaps + rng.exponential(3 * 3600 * 1000, n), gaps)
    return duration, play, gaps


def _solve_offset(score: np.ndarray, rate: float) -> float:
    """``c`` with ``mean(sigmoid(c + score)) == rate`` (monotone in c: bisection)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(mid + score)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def synthetic_ranking(num_users: int = 1000, num_items: int = 20000, max_events: int = 256, zipf_a: float = 1.05,
                      seed: int = 0, rates: dict | None = None, user_features=None,
                      min_events: int = 31, truth: bool = False) -> RankingSequences:
    """``num_users`` users (ids 0..num_users-1) with ``min_events``..``max_events`` events each
    over videos 0..num_items-1. ``user_features``: a ``FeatureTable`` of KuaiRand users (default:
    the official Pure file under GRF_DATA_DIR). ``rates``: overrides of ``ACTION_RATES``.
    ``truth``: also put each event's true probability of each action in ``columns["p_<action>"]``
    (float64; the ceiling a model can reach: ``benchmarks`` and the README quote its AUC)."""
    rates = {**ACTION_RATES, **(rates or {})}
    unknown = sorted(set(rates) - set(ACTION_RATES))
    if unknown:
        raise DataError(f"unknown action(s) {unknown}; the actions are {', '.join(ACTION_RATES)}")
    if not all(0.0 < r < 1.0 for r in rates.values()):
        raise DataError(f"action rates must be in (0, 1), got {rates}")
    if max_events < min_events:
        raise DataError(f"max_events={max_events} is below the {min_events} events a user needs here "
                        f"(history, training, validation and test candidates)")
    rng = np.random.default_rng(seed)
    feats = user_features if user_features is not None else load_kuairand_features(kind="user")
    missing = [c for c in CONTEXT_FEATURES if c not in feats.categorical]
    if missing:
        raise DataError(f"{feats.source}: no categorical column(s) {', '.join(missing)}")
    codes = {c: appearance_codes(feats.categorical[c][0]) for c in CONTEXT_FEATURES}
    donor = rng.integers(0, len(feats.ids), num_users)
    context = {c: codes[c][donor] for c in CONTEXT_FEATURES}

    lengths = np.clip(sample_lengths(rng, num_users, exposure_percentiles()).astype(np.int64), min_events, max_events)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    owner = np.repeat(np.arange(num_users), lengths)
    pos = np.arange(n) - offsets[owner]                                       # event index within its user

    # exposure: Zipf popularity over a random permutation of the ids
    weights = 1.0 / np.arange(1, num_items + 1) ** zipf_a
    video = rng.permutation(num_items)[rng.choice(num_items, n, p=weights / weights.sum())]
    p_user = rng.standard_normal((num_users, _LATENT))
    drift = rng.standard_normal((num_users, _LATENT))
    q_item = rng.standard_normal((num_items, _LATENT))
    activity = rng.normal(0.0, 0.5, int(codes[CONTEXT_FEATURES[0]].max()) + 1)
    bias = activity[context[CONTEXT_FEATURES[0]]] + rng.normal(0.0, 0.3, num_users)
    frac = (pos / np.maximum(lengths[owner] - 1, 1))[:, None]               # 0 at the first event, 1 at the last
    pref = (p_user[owner] * np.sqrt(1 - 0.3 * frac) + drift[owner] * np.sqrt(0.3 * frac))
    z = np.einsum("nd,nd->n", pref, q_item[video]) / np.sqrt(_LATENT) + bias[owner]

    probs = {}

    def draw(name: str, click) -> np.ndarray:
        score = action_score(name, z, click)
        c = _solve_offset(score, rates[name])
        probs[name] = 1.0 / (1.0 + np.exp(-(c + score)))
        return rng.random(n) < probs[name]

    click = draw("is_click", None)
    actions = {name: (click if name == "is_click" else draw(name, click)) for name, _ in ACTION_BITS}
    bitmask = np.zeros(n, np.int64)
    for name, bit in ACTION_BITS:
        bitmask |= np.where(actions[name], bit, 0)

    duration, play, gaps = play_and_gaps(rng, actions["long_view"], n)
    gaps[offsets[:-1]] = rng.random(num_users) * _SPAN_MS / 2                  # each user's first event
    time = np.zeros(n, np.int64)
    for u in range(num_users):  # a cumulative sum per user (users are short: a plain loop is fine)
        s, e = offsets[u], offsets[u + 1]
        time[s:e] = _START_MS + np.cumsum(gaps[s:e]).astype(np.int64)
    columns = {"video_id": video.astype(np.int64), "time_ms": time, "action_weights": bitmask,
               "play_time_ms": play.astype(np.int64), "duration_ms": duration}
    if truth:
        # the engagements' probabilities given the click that was drawn; a click's own is unconditional
        columns.update({f"p_{name}": p for name, p in probs.items()})
    return RankingSequences(np.arange(num_users, dtype=np.int64), offsets, columns, context)


def _load_preset(cfg, path):
    """``data.dataset = "kuairand-rank-synthetic"``: the generator at ``data.synthetic_*``, every user
    long enough for three windows of ``ranking.num_candidates`` (train, valid, test)."""
    d = cfg.data
    return synthetic_ranking(d.synthetic_users, d.synthetic_items, d.synthetic_max_events, d.zipf_a, seed=d.seed,
                             min_events=3 * cfg.ranking.num_candidates + 1)


register_dataset(DatasetSpec("kuairand-rank-synthetic", "KuaiRand-1K-scale synthetic ranking stream", _load_preset,
                             needs_file=False, task="ranking"))
