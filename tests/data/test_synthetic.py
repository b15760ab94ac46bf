import numpy as np
import pytest

from gr_functional.data import DataError, leave_one_out, make_synthetic, metrics_from_ranks, ranks_from_scores
from gr_functional.data.synthetic import KUAIRAND27K_EXPOSURE_PERCENTILES, exposure_percentiles


@pytest.fixture(scope="module")
def default_data():
    return make_synthetic()  # the quickstart default: 2000 users, 3000 items, max 400 events


def test_deterministic_from_seed(default_data):
    again = make_synthetic()
    for col in ("items", "times", "offsets", "user_ids"):
        np.testing.assert_array_equal(getattr(again, col), getattr(default_data, col))
    other = make_synthetic(seed=1)
    assert not np.array_equal(other.lengths(), default_data.lengths())


def test_valid_sequences(default_data):
    d = default_data
    assert len(d) == 2000 and d.num_items == 3000
    assert d.items.dtype == np.int32 and d.times.dtype == np.int64 and d.offsets.dtype == np.int64
    assert d.items.min() >= 1 and d.items.max() <= 3000
    lengths = d.lengths()
    assert lengths.min() >= 3 and lengths.max() <= 400
    step = np.diff(d.times)
    first = np.zeros(d.num_events, bool)
    first[d.offsets[:-1]] = True
    gaps = step[~first[1:]]
    assert (gaps >= 1).all()  # strictly increasing inside a user
    # Seconds, KuaiRand-like: most gaps inside a session are about a minute, session breaks are hours.
    assert 5 <= np.median(gaps) <= 120
    assert np.percentile(gaps, 99) > 3600
    assert d.times.min() >= 1649347200  # 2022-04-08, the KuaiRand log start


def test_embedded_percentiles_match_real_file(lengths_csv):
    np.testing.assert_array_equal(exposure_percentiles(lengths_csv), np.array(KUAIRAND27K_EXPOSURE_PERCENTILES))


def test_lengths_follow_real_distribution(lengths_csv):
    real = np.loadtxt(lengths_csv, delimiter=",", skiprows=1, usecols=0, encoding="utf-8-sig")
    d = make_synthetic(num_users=4000, num_items=500, max_events=400, lengths_csv=lengths_csv)
    scale = 400 / np.percentile(real, 99, method="inverted_cdf")
    qs = [10, 25, 50, 75, 90]
    synthetic_q = np.percentile(d.lengths(), qs)
    real_q = np.percentile(real, qs) * scale
    np.testing.assert_allclose(synthetic_q, real_q, rtol=0.12)
    # Only the top ~1 % is truncated at max_events.
    assert 0.003 < np.mean(d.lengths() == 400) < 0.03
    # Literal truncation (length_scale=1): real lengths are >= 100 and 99.6 % exceed 400.
    literal = make_synthetic(num_users=500, num_items=100, max_events=400, length_scale=1.0)
    assert np.mean(literal.lengths() == 400) > 0.98


def test_sequential_signal_beats_popularity(default_data):
    """A first-order (previous item) count model must clearly beat popularity on the test split."""
    split = leave_one_out(default_data)
    train, test, N = split.train, split.test, default_data.num_items
    pop = np.bincount(train.items, minlength=N + 1).astype(np.float64)
    same_user = np.repeat(np.arange(len(train)), train.lengths())
    pairs = same_user[:-1] == same_user[1:]
    bigram = np.zeros((N + 1, N + 1))
    np.add.at(bigram, (train.items[:-1][pairs], train.items[1:][pairs]), 1.0)
    histories, _ = test.history.sequences()
    last = np.array([h[-1] for h in histories])
    exclude = [h[-200:] for h in histories]
    pop_m = metrics_from_ranks(ranks_from_scores(np.tile(pop, (len(test), 1)), test.targets, exclude))
    seq_m = metrics_from_ranks(ranks_from_scores(bigram[last] + 1e-6 * pop, test.targets, exclude))
    assert seq_m["hr@10"] > pop_m["hr@10"] + 0.2, (seq_m, pop_m)
    assert seq_m["ndcg@10"] > 1.5 * pop_m["ndcg@10"], (seq_m, pop_m)


def test_bad_arguments():
    with pytest.raises(DataError, match="max_events"):
        make_synthetic(num_users=5, num_items=10, max_events=2)
    with pytest.raises(DataError, match="p_transition"):
        make_synthetic(num_users=5, num_items=10, p_transition=0.8, p_topic=0.5)
