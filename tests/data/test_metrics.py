import math

import numpy as np
import pytest

from gr_functional.data import metrics_from_ranks, ranks_from_scores


def test_ranks_by_hand():
    #                  pad  1    2    3    4    5
    scores = np.array([[9., 0.5, 0.9, 0.1, 0.7, 0.5],
                       [9., 0.5, 0.9, 0.1, 0.7, 0.5],
                       [9., 0.5, 0.9, 0.1, 0.7, 0.5],
                       [0., 0.2, 0.3, 0.4, 0.5, 0.6]], dtype=np.float32)
    targets = np.array([1, 1, 1, 3])
    ranks = ranks_from_scores(scores, targets, [[], [2], [1, 4], [5, 5]])
    # row 0: items 2 (0.9) and 4 (0.7) beat 0.5; item 5 ties and does not count; pad ignored -> 3
    # row 1: item 2 excluded -> 2
    # row 2: the target (1) is in the history but is never excluded; item 4 excluded -> 2
    # row 3: item 4 (0.5) beats 0.4; 5 excluded (twice, harmless) -> 2
    assert ranks.tolist() == [3, 2, 2, 2]
    assert ranks.dtype == np.int64
    assert ranks_from_scores(scores, targets, None).tolist() == [3, 3, 3, 3]


def test_candidates_restrict_ranking():
    scores = np.array([[0., 0.5, 0.9, 0.1, 0.7]])
    assert ranks_from_scores(scores, [1], [[]], candidates=np.array([1, 3, 4])).tolist() == [2]
    # A target outside the candidate list is still ranked (never silently dropped).
    assert ranks_from_scores(scores, [3], [[]], candidates=np.array([1, 4])).tolist() == [3]


def test_ranks_match_a_plain_loop():
    rng = np.random.default_rng(0)
    B, N = 20, 50
    scores = rng.normal(size=(B, N + 1)).round(1)  # rounding makes ties
    targets = rng.integers(1, N + 1, size=B)
    exclude = [rng.integers(1, N + 1, size=rng.integers(0, 10)) for _ in range(B)]
    ranks = ranks_from_scores(scores, targets, exclude)
    for b in range(B):
        banned = set(exclude[b].tolist()) - {targets[b]}
        better = sum(1 for i in range(1, N + 1) if i not in banned and scores[b, i] > scores[b, targets[b]])
        assert ranks[b] == 1 + better


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        ranks_from_scores(np.array([[0., np.nan, 1.0]]), [1], [[]])
    with pytest.raises(ValueError, match="targets must lie in 1..2"):
        ranks_from_scores(np.zeros((1, 3)), [0], [[]])
    with pytest.raises(ValueError, match=r"\[B, N\+1\]"):
        ranks_from_scores(np.zeros((2, 3)), [1], [[]])
    with pytest.raises(ValueError, match="empty"):
        metrics_from_ranks(np.array([], np.int64))


def test_metrics_by_hand():
    m = metrics_from_ranks(np.array([1, 3, 20, 300]))
    assert list(m) == ["hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr"]
    assert m["hr@10"] == pytest.approx(2 / 4)
    assert m["ndcg@10"] == pytest.approx((1.0 + 0.5) / 4)  # 1/log2(2) = 1, 1/log2(4) = 0.5
    assert m["hr@50"] == pytest.approx(3 / 4)
    assert m["ndcg@50"] == pytest.approx((1.0 + 0.5 + 1 / math.log2(21)) / 4)
    assert m["hr@200"] == pytest.approx(3 / 4)
    assert m["ndcg@200"] == pytest.approx(m["ndcg@50"])
    assert m["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 20 + 1 / 300) / 4)
    assert all(isinstance(v, float) for v in m.values())
    assert list(metrics_from_ranks([1], ks=(5,))) == ["hr@5", "ndcg@5", "mrr"]
