"""Leave-one-out split by time, as generative-recommenders does (``ignore_last_n``).

GR trains on each user's sequence minus its last item (``ignore_last_n=1``) and evaluates the
last item given everything before it (``ignore_last_n=0``). It has no validation set; ``valid``
here holds out the second-to-last item so epochs can be selected without looking at ``test``.
Note that with GR's train set (``valid_in_train=True``) the validation target is also the final
training target of that user, so validation scores run optimistic; pass ``valid_in_train=False``
to train on all but the last TWO items when a clean validation matters more than the protocol.
Histories are NOT truncated here; ``make_batch`` keeps the most recent ``max_len`` events.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .sequences import SequenceData


@dataclasses.dataclass
class EvalSet:
    """One held-out item per user.

      history        SequenceData: the events before the target (>= 1 per user)
      targets[U] int32        held-out item id
      target_times[U] int64   its time in seconds (the request time the model is queried at)
      target_ratings[U] float32 or None (GR also reports metrics on targets rated >= 4)
    """

    history: SequenceData
    targets: np.ndarray
    target_times: np.ndarray
    target_ratings: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.targets)

    def head(self, n: int) -> "EvalSet":
        """The first ``n`` users (``eval.max_users``); ``n <= 0`` keeps all."""
        if n <= 0 or n >= len(self):
            return self
        users = np.arange(n)
        return EvalSet(self.history.take(self.history.lengths()[:n], users), self.targets[:n],
                       self.target_times[:n], None if self.target_ratings is None else self.target_ratings[:n])


@dataclasses.dataclass
class Split:
    """``train`` (SequenceData), ``valid`` and ``test`` (EvalSet) of one dataset."""

    train: SequenceData
    valid: EvalSet
    test: EvalSet


def _holdout(data: SequenceData, n_last: int) -> EvalSet:
    """Target = the ``n_last``-th event from the end; history = the events before it."""
    lengths = data.lengths()
    users = np.flatnonzero(lengths >= n_last + 1)
    target_index = data.offsets[users + 1] - n_last
    history = data.take(lengths[users] - n_last, users)
    return EvalSet(history, data.items[target_index].astype(np.int32), data.times[target_index].astype(np.int64),
                   None if data.ratings is None else data.ratings[target_index])


def leave_one_out(data: SequenceData, *, valid_in_train: bool = True) -> Split:
    """Split every user's time-sorted sequence s (length L).

    train: s[:-1] (or s[:-2] when ``valid_in_train=False``), users left with < 2 events dropped
           (a training sequence needs one input and one target);
    test:  history s[:-1], target s[-1]   (users with L >= 2);
    valid: history s[:-2], target s[-2]   (users with L >= 3).
    """
    lengths = data.lengths()
    cut = 1 if valid_in_train else 2
    train_users = np.flatnonzero(lengths - cut >= 2)
    train = data.take(lengths[train_users] - cut, train_users)
    return Split(train=train, valid=_holdout(data, 2), test=_holdout(data, 1))
