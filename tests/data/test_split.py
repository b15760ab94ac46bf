import numpy as np

from gr_functional.data import SequenceData, leave_one_out


def _data(seqs):
    lengths = [len(s) for s in seqs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    items = np.concatenate([np.array(s, np.int32) for s in seqs])
    times = np.arange(len(items), dtype=np.int64) * 10
    return SequenceData(items, times, offsets, np.array([100, 200, 300, 400])[: len(seqs)], num_items=9)


def _seqs(data):
    return [data.sequence(u)[0].tolist() for u in range(len(data))]


def test_leave_one_out_by_hand():
    data = _data([[1, 2, 3, 4], [5, 6], [7], [8, 9, 1]])
    split = leave_one_out(data)
    # train: all but the last item; users left with < 2 events dropped (user 200 keeps only [5]).
    assert _seqs(split.train) == [[1, 2, 3], [8, 9]]
    assert split.train.user_ids.tolist() == [100, 400]
    # test: history = all but last, target = last (users with >= 2 events).
    assert _seqs(split.test.history) == [[1, 2, 3], [5], [8, 9]]
    assert split.test.targets.tolist() == [4, 6, 1]
    assert split.test.history.user_ids.tolist() == [100, 200, 400]
    assert split.test.target_times.tolist() == [30, 50, 90]
    assert split.test.targets.dtype == np.int32 and split.test.target_times.dtype == np.int64
    # valid: history = all but the last two, target = second to last (users with >= 3 events).
    assert _seqs(split.valid.history) == [[1, 2], [8]]
    assert split.valid.targets.tolist() == [3, 9]
    assert split.valid.target_times.tolist() == [20, 80]
    # Strict validation: train stops before the validation target.
    strict = leave_one_out(data, valid_in_train=False)
    assert _seqs(strict.train) == [[1, 2]]


def test_times_follow_items():
    data = _data([[1, 2, 3, 4], [5, 6, 7]])
    split = leave_one_out(data)
    for u in range(len(split.train)):
        items, times = split.train.sequence(u)
        full_items, full_times = data.sequence(u)
        np.testing.assert_array_equal(times, full_times[: len(items)])


def test_ml1m_split(ml1m):
    split = leave_one_out(ml1m)
    assert len(split.test) == len(split.valid) == len(split.train) == 6040  # every ML-1M user has >= 19 events
    assert split.train.num_events == ml1m.num_events - 6040
    assert split.test.history.num_events == ml1m.num_events - 6040
    last = ml1m.offsets[1:] - 1
    np.testing.assert_array_equal(split.test.targets, ml1m.items[last])
    np.testing.assert_array_equal(split.valid.targets, ml1m.items[last - 1])
    assert split.train.num_items == ml1m.num_items == 3952
    head = split.test.head(100)
    assert len(head) == 100 and head.history.num_events == split.test.history.offsets[100]
