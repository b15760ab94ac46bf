import numpy as np
import pytest

from gr_functional.data import DataError, Interactions, from_interactions, load_kuairand_log


def _inter(user, item, time, **kw):
    return Interactions(np.array(user, np.int64), np.array(item, np.int64), np.array(time, np.int64), **kw)


def test_groups_by_user_and_sorts_by_time_stably():
    # User 2 has a tie at t=5 (items 30 then 10 in file order) that must keep file order.
    inter = _inter(user=[2, 1, 2, 2, 1, 2], item=[30, 7, 10, 20, 8, 40], time=[5, 9, 5, 1, 3, 7],
                   rating=np.array([1, 2, 3, 4, 5, 1], np.float32))
    data = from_interactions(inter, remap_items=False)
    assert data.user_ids.tolist() == [1, 2]
    assert data.offsets.tolist() == [0, 2, 6]
    assert data.offsets.dtype == np.int64 and data.items.dtype == np.int32 and data.times.dtype == np.int64
    items, times = data.sequence(0)
    assert items.tolist() == [8, 7] and times.tolist() == [3, 9]
    items, times = data.sequence(1)
    assert items.tolist() == [20, 30, 10, 40] and times.tolist() == [1, 5, 5, 7]
    assert data.ratings.tolist() == [5, 2, 4, 1, 3, 1]
    assert data.num_items == 40 and len(data) == 2 and data.lengths().tolist() == [2, 4]


def test_ml1m_sequences(ml1m, ml1m_inter):
    assert len(ml1m) == 6040
    assert ml1m.num_items == 3952  # GR keeps raw movie ids: num_items = max id
    assert ml1m.raw_item_ids is None
    assert ml1m.num_events == len(ml1m_inter)
    assert ml1m.user_ids.tolist() == list(range(1, 6041))
    lengths = ml1m.lengths()
    assert lengths.min() >= 19 and lengths.max() == 2277
    # Non-decreasing time inside every user (between users the time may go down).
    step = np.diff(ml1m.times)
    new_user = np.zeros(ml1m.num_events, bool)
    new_user[ml1m.offsets[:-1]] = True
    assert (step[~new_user[1:]] >= 0).all()
    # Same multiset of (user, item) pairs as the file.
    users = np.repeat(ml1m.user_ids, lengths)
    key_seq = np.sort(users * 10_000 + ml1m.items)
    key_file = np.sort(ml1m_inter.user * 10_000 + ml1m_inter.item)
    np.testing.assert_array_equal(key_seq, key_file)


def test_kuairand_remap(kuairand_sample_path):
    inter = load_kuairand_log(kuairand_sample_path)
    data = from_interactions(inter, remap_items=True)
    distinct = np.unique(inter.item)
    assert data.num_items == distinct.size
    assert data.items.min() == 1 and data.items.max() == data.num_items
    assert data.raw_item_ids[0] == -1
    np.testing.assert_array_equal(data.raw_item_ids[1:], distinct)
    # Mapping back gives the file's video ids per user in time order.
    for u in range(len(data)):
        items, times = data.sequence(u)
        mask = inter.user == data.user_ids[u]
        order = np.argsort(inter.time[mask], kind="stable")
        np.testing.assert_array_equal(data.raw_item_ids[items], inter.item[mask][order])


def test_item_zero_needs_remap():
    with pytest.raises(DataError, match="remap_items=True"):
        from_interactions(_inter([1, 1], [0, 5], [1, 2]), remap_items=False)
    data = from_interactions(_inter([1, 1], [0, 5], [1, 2]), remap_items=True)
    assert data.items.tolist() == [1, 2]


def test_ids_must_fit_int32():
    with pytest.raises(DataError, match="does not fit int32"):
        from_interactions(_inter([1, 1], [1, 2**40], [1, 2]), remap_items=False)
    data = from_interactions(_inter([1, 1], [1, 2**40], [1, 2]), remap_items=True)
    assert data.num_items == 2


def test_empty_interactions():
    with pytest.raises(DataError, match="no interactions"):
        from_interactions(_inter([], [], []), remap_items=True)


def test_classmethod_form():
    from gr_functional.data import SequenceData
    inter = _inter([1, 1], [3, 4], [2, 1])
    data = SequenceData.from_interactions(inter, remap_items=False)
    assert data.items.tolist() == [4, 3]
