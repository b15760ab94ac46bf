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
      source str            file the events came from ("" when generated)
      duplicate_events int  rows that repeat an earlier row's (user, item, time) exactly; they
                            are kept (see ``from_interactions``) and reported by ``describe``
      item_names[K] str     the file's string item ids (``Interactions.item_names``: raw id k is
                            ``item_names[k - 1]``), or None when the file's ids were integers
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
    source: str = ""
    duplicate_events: int = 0
    item_names: np.ndarray | None = None

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

    def item_id_table(self) -> list[str] | None:
        """Lines ``"ID\tRAW"`` of every item id 1..num_items whose raw id the file wrote as a
        string (``item_names``; through ``raw_item_ids`` when the ids were remapped again), or None
        when the file's ids were integers: what a run saves so its ids can be read back."""
        if self.item_names is None:
            return None
        raw = np.arange(self.num_items + 1) if self.raw_item_ids is None else self.raw_item_ids
        return [f"{i}\t{self.item_names[int(raw[i]) - 1]}" for i in range(1, self.num_items + 1)
                if 1 <= int(raw[i]) <= len(self.item_names)]

    def distinct_items(self) -> int:
        """Number of distinct item ids in ``items`` (a bincount: O(T + num_items), no sort)."""
        if self.num_events == 0:
            return 0
        return int(np.count_nonzero(np.bincount(self.items, minlength=self.num_items + 1)[1:]))

    def describe(self) -> str:
        """One line for logs: where the data came from, its size, its item-id range and the exact
        duplicate rows kept, e.g. ``ratings.dat: 6,040 users, 999,917 events, item ids 1..3,952
        (3,615 distinct), 0 duplicate (user, item, time) rows``."""
        ids = f"item ids 1..{self.num_items:,} ({self.distinct_items():,} distinct)"
        if self.raw_item_ids is not None and len(self.raw_item_ids) > 1:
            raw = self.raw_item_ids[1:]
            ids += f", remapped from raw ids {int(raw.min()):,}..{int(raw.max()):,}"
        n = self.duplicate_events
        dups = f"{n:,} duplicate (user, item, time) row{'s' if n != 1 else ''}" + (" kept" if n else "")
        return (f"{self.source or self.name or 'dataset'}: {len(self):,} users, {self.num_events:,} events, "
                f"{ids}, {dups}")

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


# Sparse raw ids (validated in ``from_interactions``). Without remapping, the item table has
# max_id + 1 rows however few ids occur, so one stray id 999,999,999 in a 3,700-item file asks
# for a 1e9-row table (200 GB at D=50 before gradients and AdamW state). A raw range is refused
# when the largest id is above SPARSE_ID_FLOOR (below it the table is at most 1e6 rows, 200 MB at
# D=50: affordable however empty) AND more than SPARSE_ID_RATIO times the distinct ids (over
# 99 % of the rows never trained). Real datasets are far inside: ML-1M 3,952 / 3,615 distinct
# (1.1x), ML-20M 131,262 / 26,744 (4.9x), both below the floor anyway. data.remap_items=true
# lifts the rule; a dense but huge catalogue is left to the memory check (gr_functional.memory).
SPARSE_ID_FLOOR = 1_000_000
SPARSE_ID_RATIO = 100


def count_duplicates(user: np.ndarray, time: np.ndarray, item: np.ndarray) -> int:
    """Rows that repeat an earlier row's (user, item, time) exactly. ``[N]`` columns already sorted
    by (user, time), as ``from_interactions`` orders them.

    Only rows sharing (user, time) with a neighbour can be duplicates, so the exact sort runs on
    that subset only (ML-1M: ratings given by one user in the same second), O(N) otherwise.
    """
    if len(user) < 2:
        return 0
    same = (user[1:] == user[:-1]) & (time[1:] == time[:-1])
    if not same.any():
        return 0
    tied = np.zeros(len(user), dtype=bool)
    tied[1:] |= same
    tied[:-1] |= same
    u, t, i = user[tied], time[tied], item[tied]
    sub = np.lexsort((i, t, u))
    u, t, i = u[sub], t[sub], i[sub]
    return int(np.count_nonzero((u[1:] == u[:-1]) & (t[1:] == t[:-1]) & (i[1:] == i[:-1])))


def _dense_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dense[N] int64 in 1..K, uniq[K] int64)``: the distinct ids sorted ascending and each id's
    1-based rank among them, so the mapping is a pure function of the set of ids (deterministic)."""
    uniq, dense = np.unique(ids, return_inverse=True)
    return dense.reshape(-1).astype(np.int64) + 1, uniq.astype(np.int64)


def _remap_candidates(candidates, uniq: np.ndarray) -> np.ndarray:
    """Raw candidate ids -> dense ids; candidates that never occur in the data are dropped (their
    embedding rows would never be trained)."""
    candidates = np.asarray(candidates, dtype=np.int64)
    known = np.isin(candidates, uniq)
    return np.searchsorted(uniq, candidates[known]) + 1


# Unix seconds reach 1e11 in the year 5138; milliseconds of any date since 1973 exceed it (the
# same bounds as retrieval.task.check_data, which checks data from any source without naming lines).
_LATEST_SECONDS = 10**11


def _check_time_range(inter: Interactions) -> None:
    """``DataError`` naming ``FILE:LINE`` of a timestamp the model cannot take as unix seconds:
    after the year 5000 (milliseconds?), or more than int32 seconds (68 years) from the earliest."""
    hi_row, lo_row = int(np.argmax(inter.time)), int(np.argmin(inter.time))
    hi, lo = int(inter.time[hi_row]), int(inter.time[lo_row])
    if hi > _LATEST_SECONDS:
        raise DataError(f"{inter.where(hi_row)}: timestamp {hi:,} is after the year 5000 in unix seconds; the "
                        f"timestamps look like milliseconds (or microseconds), or the line is damaged. Convert them "
                        f"to seconds (the time bias buckets log-seconds) or fix the line")
    if hi - lo > _INT32_MAX:
        raise DataError(f"{inter.where(hi_row)}: timestamp {hi:,} is {hi - lo:,} seconds after the one at "
                        f"{inter.where(lo_row)} ({lo:,}), more than int32 seconds hold (68 years): a damaged line, "
                        f"or timestamps that look like milliseconds. Fix the line or convert them to seconds")


def from_interactions(inter: Interactions, remap_items: bool, *, name: str | None = None,
                      candidates: np.ndarray | None = None) -> SequenceData:
    """Group events by user and sort each user's events by time, after validating the rows.

    The sort is STABLE, so events with equal timestamps keep their file order (GR's pandas
    ``sort_values`` is not stable, which makes its tie order arbitrary). ``remap_items=False``
    keeps raw ids (GR does this for MovieLens: ML-1M num_items = max id = 3952); ``True`` maps the
    distinct raw ids, sorted, to dense 1..K and keeps ``raw_item_ids`` (KuaiRand ids start at 0
    and are sparse). ``candidates`` (raw ids) restricts evaluation ranking to those ids.

    Rules (``DataError`` names ``FILE:LINE``; docs/guides/reliability.md "Bad inputs"):
      negative timestamp                  error: times are unix seconds (>= 0)
      timestamp > 1e11 (year 5000 on)    error naming its line: milliseconds? (``_check_time_range``)
      times spanning > int32 seconds      error naming both lines (68 years: a damaged line?)
      item id < 1 or beyond int32         error unless remapped (0 is the padding id)
      sparse raw ids (``SPARSE_ID_*``)    error unless remapped: the table would be mostly empty
      exact duplicate (user, item, time)  KEPT and counted in ``duplicate_events``. Why not
                                          dropped: at one-second resolution a repeat is often a real
                                          repeated event (KuaiRand's millisecond times are cut to
                                          seconds; a replay in the same second is two events), and
                                          GR's preprocessing keeps them, so dropping would change
                                          targets silently. The count makes them visible.
    """
    label = name if name is not None else inter.name
    if len(inter) == 0:
        raise DataError(f"{inter.source or label}: no interactions to build sequences from")
    if int(inter.time.min()) < 0:
        row = int(np.argmax(inter.time < 0))
        raise DataError(f"{inter.where(row)}: timestamp {int(inter.time[row])} is negative; timestamps are unix "
                        f"seconds (>= 0, i.e. from 1970 on). Fix or remove the row")
    _check_time_range(inter)
    by_time = np.argsort(inter.time, kind="stable")
    order = by_time[np.argsort(inter.user[by_time], kind="stable")]
    user = inter.user[order]
    starts = np.flatnonzero(np.concatenate([[True], user[1:] != user[:-1]]))
    offsets = np.append(starts, len(user)).astype(np.int64)
    raw_items = inter.item[order]
    times = inter.time[order].astype(np.int64)

    raw_item_ids = None
    cand = None
    if remap_items:
        items64, uniq = _dense_ids(raw_items)
        num_items = len(uniq)
        raw_item_ids = np.concatenate([[-1], uniq]).astype(np.int64)
        if candidates is not None:
            cand = _remap_candidates(candidates, uniq)
    else:
        lo, hi = int(raw_items.min()), int(raw_items.max())
        if lo < 1:
            row = int(np.argmin(inter.item))
            raise DataError(f"{inter.where(row)}: item id {lo} is < 1; id 0 is the padding id. Set "
                            f"data.remap_items=true (from_interactions(remap_items=True)) to map the ids to 1..K")
        if hi > _INT32_MAX:
            row = int(np.argmax(inter.item))
            raise DataError(f"{inter.where(row)}: item id {hi} does not fit int32; set data.remap_items=true "
                            f"(from_interactions(remap_items=True)) to map the ids to 1..K")
        if hi > SPARSE_ID_FLOOR:
            distinct = int(np.unique(raw_items).size)  # a sort, but only for ranges this large
            if hi > SPARSE_ID_RATIO * distinct:
                row = int(np.argmax(inter.item))
                raise DataError(
                    f"{inter.where(row)}: item id {hi:,} would make the item embedding table {hi + 1:,} rows, "
                    f"but only {distinct:,} distinct item ids occur ({hi / distinct:,.0f}x; raw ids are refused "
                    f"above {SPARSE_ID_RATIO}x once the largest id exceeds {SPARSE_ID_FLOOR:,}). Set "
                    f"data.remap_items=true to map the ids to 1..{distinct:,} (in raw-id order), or remove the "
                    f"stray id")
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
        items=items64.astype(np.int32), times=times, offsets=offsets,
        user_ids=user[starts].astype(np.int64), num_items=int(num_items), name=label,
        ratings=None if inter.rating is None else inter.rating[order].astype(np.float32),
        raw_item_ids=raw_item_ids, candidates=cand, source=inter.source,
        duplicate_events=count_duplicates(user, times, raw_items), item_names=inter.item_names)


def shuffle_ties(data: SequenceData, seed: int) -> SequenceData:
    """``data`` with each user's runs of equal-timestamp events in a random order drawn from
    ``default_rng(seed)``: events keep their user and time, only the order inside a run of ties
    changes (``data.ties = "shuffle"``). The reproducible stand-in for an unstable sort (GR's
    pandas quicksort), whose tie order is arbitrary."""
    n = data.num_events
    if n == 0:
        return data
    user = np.repeat(np.arange(len(data.offsets) - 1), np.diff(data.offsets))
    new_run = np.concatenate([[True], (user[1:] != user[:-1]) | (data.times[1:] != data.times[:-1])])
    run = np.cumsum(new_run)
    order = np.lexsort((np.random.default_rng(seed).random(n), run))  # run-major: only ties move
    return dataclasses.replace(data, items=data.items[order], times=data.times[order],
                               ratings=None if data.ratings is None else data.ratings[order])


def remap_sequence_items(data: SequenceData) -> SequenceData:
    """``data`` with its item ids mapped to dense 1..K (K distinct ids, in increasing id order),
    ``raw_item_ids`` composed with any earlier mapping and ``candidates`` mapped the same way
    (those that never occur dropped). For data built without ``from_interactions`` (synthetic)."""
    if data.num_events == 0:
        return data
    dense, uniq = _dense_ids(data.items.astype(np.int64))
    raw = uniq if data.raw_item_ids is None else data.raw_item_ids[uniq]
    cand = None if data.candidates is None else _remap_candidates(data.candidates, uniq).astype(np.int32)
    return dataclasses.replace(data, items=dense.astype(np.int32), num_items=len(uniq),
                               raw_item_ids=np.concatenate([[-1], raw]).astype(np.int64), candidates=cand)
