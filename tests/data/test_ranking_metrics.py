"""Ranking metrics (gr_functional/data/ranking_metrics.py) against hand-computed cases and a
brute-force pairwise oracle (every positive-negative pair, ties one half, weights multiplied)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gr_functional.data import ranking_metrics as rm


def _pairwise_auc(scores, labels, weights):
    num = den = 0.0
    for si, yi, wi in zip(scores, labels, weights):
        for sj, yj, wj in zip(scores, labels, weights):
            if yi == 1 and yj == 0:
                den += wi * wj
                num += wi * wj * (1.0 if si > sj else 0.5 if si == sj else 0.0)
    return num / den if den else float("nan")


def test_auc_hand_cases():
    assert rm.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75       # sklearn's documented example
    assert rm.auc([0.5, 0.5], [0, 1]) == 0.5                          # a tie is half a win
    assert rm.auc([3.0, 1.0, 2.0], [1, 0, 0]) == 1.0
    assert rm.auc([3.0, 1.0, 2.0], [0, 1, 1]) == 0.0
    # weights: the positive (weight 3) beats one negative of weight 1 and loses to one of weight 2
    assert rm.auc([1.0, 0.0, 2.0], [1, 0, 0], [3.0, 1.0, 2.0]) == pytest.approx(1 / 3)
    assert math.isnan(rm.auc([1.0, 2.0], [1, 1]))


def test_auc_and_gauc_match_the_pairwise_oracle_with_ties_and_weights():
    rng = np.random.default_rng(0)
    n = 300
    scores = np.round(rng.standard_normal(n), 1)                      # many ties
    labels = (rng.random(n) < 0.3).astype(int)
    weights = rng.uniform(0.5, 2.0, n)
    users = rng.integers(0, 12, n) * 7 + 1000                         # arbitrary ids
    users[:5] = 5                                                     # one user with one class only
    labels[:5] = 1
    assert rm.auc(scores, labels, weights) == pytest.approx(_pairwise_auc(scores, labels, weights), abs=1e-12)
    got, count = rm.gauc(scores, labels, users, weights)
    num = den = 0.0
    valid = 0
    for u in np.unique(users):
        m = users == u
        if labels[m].min() == labels[m].max():
            continue
        valid += 1
        num += weights[m].sum() * _pairwise_auc(scores[m], labels[m], weights[m])
        den += weights[m].sum()
    assert count == valid == 12 and got == pytest.approx(num / den, abs=1e-12)


def test_gauc_hand_case():
    # user 1: perfect (2 impressions); user 2: reversed (4 impressions); user 3: positives only
    scores = [0.9, 0.1, 0.1, 0.2, 0.8, 0.7, 0.5, 0.6]
    labels = [1, 0, 1, 1, 0, 0, 1, 1]
    users = [1, 1, 2, 2, 2, 2, 3, 3]
    assert rm.gauc(scores, labels, users) == (pytest.approx((2 * 1.0 + 4 * 0.0) / 6), 2)
    assert rm.gauc([0.1, 0.2], [1, 1], [1, 2]) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_normalized_entropy():
    labels = np.array([1, 0, 0, 0])
    base = np.log(0.25 / 0.75)                                        # the base rate's logit
    assert rm.normalized_entropy(np.full(4, base), labels) == pytest.approx(1.0)
    assert rm.normalized_entropy(np.array([20.0, -20, -20, -20]), labels) < 1e-6
    # a confident wrong answer costs its full log loss: softplus(30) = 30 nats on one of 4 samples
    wrong = rm.normalized_entropy(np.array([-30.0, -30, -30, -30]), labels)
    entropy = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert wrong == pytest.approx((30 + 3 * np.log1p(np.exp(-30))) / 4 / entropy, rel=1e-9)
    assert math.isnan(rm.normalized_entropy([0.0, 1.0], [1, 1]))
    # infinite logits: confident right answers cost nothing, a confident wrong one is infinite
    assert rm.normalized_entropy([np.inf, -np.inf, -np.inf, -np.inf], labels) == 0.0
    assert rm.normalized_entropy([-np.inf, -np.inf, -np.inf, -np.inf], labels) == np.inf


def test_regression_errors_and_task_metrics():
    assert rm.mse([1.0, 3.0], [2.0, 1.0]) == 2.5 and rm.mae([1.0, 3.0], [2.0, 1.0]) == 1.5
    assert rm.mse([1.0, 3.0], [2.0, 1.0], [3.0, 1.0]) == pytest.approx((3 * 1 + 4) / 4)
    out = rm.task_metrics(np.array([[2.0, 10.0], [-1.0, 4.0], [0.5, 7.0]]), np.array([[1, 9.0], [0, 5.0], [1, 7.0]]),
                          users=[1, 1, 2], tasks=[("click", "binary"), ("watch_time", "regression")])
    assert out["click"]["auc"] == 1.0 and out["click"]["gauc"] == 1.0 and out["click"]["gauc_users"] == 1
    assert out["watch_time"] == {"mse": pytest.approx(2 / 3), "mae": pytest.approx(2 / 3)}


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="must be 0 or 1; got \\[2.0\\].*regression task"):
        rm.auc([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="differ in length"):
        rm.auc([0.1, 0.2], [0, 1, 1])
    with pytest.raises(ValueError, match="NaN"):
        rm.auc([float("nan"), 0.2], [0, 1])
    with pytest.raises(ValueError, match="kind 'ordinal'"):
        rm.task_metrics(np.zeros((2, 1)), np.zeros((2, 1)), [1, 2], [("x", "ordinal")])
