"""Per-user, time-ordered item sequences packed CSR-style (values + offsets), the pipeline's core type."""
from __future__ import annotations

import dataclasses

import numpy as np

from .loaders import DataError, Interactions

_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass
class SequenceData:
    """All users' histories, packed.

      items[T] int32        item ids 1..num_items (0 is reserved for padding), user by user
      times[T] int64        event time in unix seconds, non-decreasing within each user
      offsets[U+1] int64    user u owns ``items[offsets[u]:offsets[u+1]]``; ``offsets[0] == 0``
      user_ids[U] int64     raw user id of each row u (sorted ascending)
      num_items int         largest valid item id (embedding table has num_items + 1 rows)
      name str              dataset label for reports, e.g. "ML-1M (reconstructed)"
      ratings[T] float32    explicit rating per event, or None
      raw_item_ids[num_items+1] int64   raw id of each dense id when ids were remapped
                            (``raw_item_ids[0] == -1``), or None when ids are the raw ids
      candidates[C] int32   the item ids ranked at evaluation (GR ranks every movie in
                            movies.dat: 3,883 ids for ML-1M), or None = all ids 1..num_items
    """

    items: np.ndarray
    times: np.ndarray
    offsets: np.ndarray
    user_ids: np.ndarray
    num_items: int
    name: str = ""
    ratings: np.ndarray | None = None
    raw_item_ids: np.ndarray | None = None
    candidates: np.ndarray | None = None

    def __post_init__(self):
        offsets = self.offsets
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
            raise DataError(f"{self.name or 'SequenceData'}: offsets must be 1-D and start at 0")
        if offsets[-1] != len(self.items) or len(self.times) != len(self.items):
            raise DataError(f"{self.name or 'SequenceData'}: offsets[-1]={offsets[-1]}, {len(self.items)} items, "
                            f"{len(self.times)} times; they must agree")
        if len(self.user_ids) != len(offsets) - 1:
            raise DataError(f"{self.name or 'SequenceData'}: {len(self.user_ids)} user ids for "
                            f"{len(offsets) - 1} sequences")

    @classmethod
    def from_interactions(cls, inter: Interactions, remap_items: bool, **kwargs) -> "SequenceData":
        """Same as the module function ``from_interactions``."""
        return from_interactions(inter, remap_items, **kwargs)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_events(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        """``[U] int64`` number of events per user."""
        return np.diff(self.offsets)

    def sequence(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        """``(items[L] int32, times[L] int64)`` of user row ``u`` (views, not copies)."""
        a, b = int(self.offsets[u]), int(self.offsets[u + 1])
        return self.items[a:b], self.times[a:b]

    def sequences(self, users=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Lists of per-user item and time arrays for the user rows ``users`` (default: all)."""
        rows = range(len(self)) if users is None else users
        pairs = [self.sequence(int(u)) for u in rows]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def take(self, keep: np.ndarray, users: np.ndarray) -> "SequenceData":
        """Subset: user rows ``users[K]`` each cut to its first ``keep[K]`` events (``keep <= length``)."""
        users = np.asarray(users, dtype=np.int64)
        keep = np.asarray(keep, dtype=np.int64)
        starts = self.offsets[users]
        offsets = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(keep, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], keep) + np.arange(offsets[-1], dtype=np.int64)
        return dataclasses.replace(
            self, items=self.items[index], times=self.times[index], offsets=offsets,
            user_ids=self.user_ids[users], ratings=None if self.ratings is None else self.ratings[index])

    def positions(self) -> np.ndarray:
        """``[T] int64`` position of each event inside its user's sequence (0-based)."""
        lengths = self.lengths()
        return np.arange(self.num_events, dtype=np.int64) - np.repeat(self.offsets[:-1], lengths)

    def summary(self) -> dict:
        """Counts and per-user length statistics, for logs and ``grf data`` output."""
        lengths = self.lengths()
        out = {"name": self.name, "users": len(self), "events": self.num_events, "num_items": int(self.num_items),
               "distinct_items": int(np.unique(self.items).size)}
        if len(lengths):
            out.update(len_min=int(lengths.min()), len_median=float(np.median(lengths)),
                       len_mean=float(lengths.mean()), len_p90=float(np.percentile(lengths, 90)),
                       len_max=int(lengths.max()))
        return out


def from_interactions(inter: Interactions, remap_items: bool, *, name: str | None = None,
                      candidates: np.ndarray | None = None) -> SequenceData:
    """Group events by user and sort each user's events by time.

    The sort is STABLE, so events with equal timestamps keep their file order (GR's pandas
    ``sort_values`` is not stable, which makes its tie order arbitrary). ``remap_items=False``
    keeps raw ids (GR does this for MovieLens: ML-1M num_items = max id = 3952); ``True`` maps the
    distinct raw ids, sorted, to dense 1..N (KuaiRand ids start at 0 and are sparse).
    ``candidates`` (raw ids) restricts evaluation ranking to those ids.
    """
    label = name if name is not None else inter.name
    if len(inter) == 0:
        raise DataError(f"{inter.source or label}: no interactions to build sequences from")
    by_time = np.argsort(inter.time, kind="stable")
    order = by_time[np.argsort(inter.user[by_time], kind="stable")]
    user = inter.user[order]
    starts = np.flatnonzero(np.concatenate([[True], user[1:] != user[:-1]]))
    offsets = np.append(starts, len(user)).astype(np.int64)
    raw_items = inter.item[order]

    raw_item_ids = None
    cand = None
    if remap_items:
        uniq, dense = np.unique(raw_items, return_inverse=True)
        items64 = dense.reshape(-1).astype(np.int64) + 1
        num_items = len(uniq)
        raw_item_ids = np.concatenate([[-1], uniq]).astype(np.int64)
        if candidates is not None:
            cand = np.searchsorted(uniq, np.asarray(candidates)) + 1
            known = np.isin(np.asarray(candidates), uniq)
            cand = cand[known]
    else:
        lo, hi = int(raw_items.min()), int(raw_items.max())
        if lo < 1:
            row = int(order[np.argmin(raw_items)])
            raise DataError(f"{inter.source or label}: item id {lo} (row {row}) is < 1; id 0 is the padding id. "
                            f"Load with remap_items=True to map ids to 1..N")
        if hi > _INT32_MAX:
            raise DataError(f"{inter.source or label}: item id {hi} does not fit int32; load with remap_items=True")
        items64 = raw_items
        num_items = hi
        if candidates is not None:
            cand = np.asarray(candidates, dtype=np.int64)
            cand = cand[(cand >= 1) & (cand <= hi)]
    if num_items > _INT32_MAX:
        raise DataError(f"{inter.source or label}: {num_items} items do not fit int32 ids")
    if cand is not None:
        cand = np.unique(cand).astype(np.int32)
    return SequenceData(
        items=items64.astype(np.int32), times=inter.time[order].astype(np.int64), offsets=offsets,
        user_ids=user[starts].astype(np.int64), num_items=int(num_items), name=label,
        ratings=None if inter.rating is None else inter.rating[order].astype(np.float32),
        raw_item_ids=raw_item_ids, candidates=cand)
