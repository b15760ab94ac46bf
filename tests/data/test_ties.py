"""data.ties: "shuffle" permutes each user's same-second events and nothing else, reproducibly."""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional.configure import load_config
from gr_functional.data import load_dataset


@pytest.fixture(scope="module")
def ml1m():
    return {rule: load_dataset(load_config(None, ["data.dataset=ml-1m", f"data.ties={rule}"]).data)
            for rule in ("file", "shuffle")}


def _tied(data) -> np.ndarray:
    """[T] bool: the event shares its user and second with another event."""
    user = np.repeat(np.arange(len(data.offsets) - 1), np.diff(data.offsets))
    same_next = (user[1:] == user[:-1]) & (data.times[1:] == data.times[:-1])
    tied = np.zeros(data.num_events, dtype=bool)
    tied[1:] |= same_next
    tied[:-1] |= same_next
    return tied


@pytest.mark.slow
def test_shuffle_differs_from_file_order_exactly_on_tied_events(ml1m):
    file, shuffled = ml1m["file"], ml1m["shuffle"]
    np.testing.assert_array_equal(file.times, shuffled.times)
    np.testing.assert_array_equal(file.offsets, shuffled.offsets)
    tied = _tied(file)
    moved = file.items != shuffled.items
    assert not moved[~tied].any()               # untied events stay where they were
    assert moved[tied].mean() > 0.3             # ML-1M: most tied events move (77% of ratings are tied)
    # the same events per (user, second): only the order inside a run changed
    user = np.repeat(np.arange(len(file.offsets) - 1), np.diff(file.offsets))
    key = lambda d: np.lexsort((d.items, d.times, user))  # noqa: E731
    np.testing.assert_array_equal(file.items[key(file)], shuffled.items[key(shuffled)])
    np.testing.assert_array_equal(file.ratings[key(file)], shuffled.ratings[key(shuffled)])


@pytest.mark.slow
def test_shuffle_is_reproducible_from_its_seed_and_moves_with_it(ml1m):
    again = load_dataset(load_config(None, ["data.dataset=ml-1m", "data.ties=shuffle"]).data)
    np.testing.assert_array_equal(again.items, ml1m["shuffle"].items)
    other = load_dataset(load_config(None, ["data.dataset=ml-1m", "data.ties=shuffle", "data.ties_seed=1"]).data)
    assert (other.items != ml1m["shuffle"].items).any()


def test_file_order_is_the_default_and_unknown_rules_are_refused():
    assert load_config(None).data.ties == "file"
    with pytest.raises(ValueError, match="'sorted' is not one of 'file', 'shuffle'"):
        load_config(None, ["data.ties=sorted"])
