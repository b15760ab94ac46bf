"""KuaiRand's side-feature files (``user_features*.csv``, ``video_features_basic*.csv``): one row
per user or video, read into a ``FeatureTable`` keyed by id. Registered data files
``kuairand-user-features`` and ``kuairand-video-features`` (the official KuaiRand-Pure files in the
data folder; the 1K and 27K releases use the same schemas).

Each column's kind is decided from its values (the files mix them, and say nothing):
numeric (every non-empty value parses as a number; empty -> NaN), multi-valued (comma-separated
integers, e.g. a video's ``tag`` "20,43"; jagged) or categorical (any other strings, e.g.
``user_active_degree``; integer codes 1.. into the column's sorted vocabulary, 0 for empty).
Whether a numeric column is an id to embed (``author_id``, ``onehot_feat3``) or a value to
normalise (``register_days``) is the model config's choice, not the loader's.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..registry import DataFile, register_file

_KEYS = {"user": "user_id", "video": "video_id"}


@dataclasses.dataclass
class FeatureTable:
    """Side features of ``ids[n]`` int64 (file order):

    numeric[name]      float64[n], NaN where the file is empty
    categorical[name]  (codes int64[n], vocab tuple[str]): code c >= 1 is vocab[c - 1], 0 is empty
    multi[name]        (offsets int64[n+1], values int64[m]): row i's values are
                       values[offsets[i]:offsets[i+1]] (empty where the file is)
    """

    key: str
    ids: np.ndarray
    numeric: dict
    categorical: dict
    multi: dict
    source: str

    def rows_of(self, ids) -> np.ndarray:
        """Row of each id (int64), -1 for ids the file does not have."""
        ids = np.asarray(ids, np.int64)
        order = np.argsort(self.ids, kind="stable")
        pos = np.clip(np.searchsorted(self.ids, ids, sorter=order), 0, max(len(self.ids) - 1, 0))
        found = order[pos] if len(self.ids) else np.zeros(ids.shape, np.int64)
        return np.where((len(self.ids) > 0) & (self.ids[found] == ids), found, -1)

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.numeric, *self.categorical, *self.multi)


BLOCK_ROWS = 50_000  # rows converted at a time: memory holds the output arrays and one block of text


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int_list(text: str) -> bool:
    return all(p.strip().lstrip("-").isdigit() for p in text.split(","))


def _rows(path: Path, key: str, kind: str):
    """``(header, iterator of (lineno, row))``, each row checked for width and an integer key."""
    f = open(path, newline="", encoding="utf-8-sig")
    reader = csv.reader(f)
    first = next(reader, None)
    if not first or key not in [h.strip() for h in first]:
        f.close()
        got = ",".join(first) if first else "an empty file"
        raise DataError(f"{path}:1: a KuaiRand {kind} feature file starts with a header naming {key!r}; got {got!r}")
    header = [h.strip() for h in first]
    k = header.index(key)

    def rows():
        with f:
            for lineno, row in enumerate(reader, start=2):
                if len(row) != len(header):
                    raise DataError(f"{path}:{lineno}: {len(row)} fields, the header has {len(header)}")
                if not row[k].strip().lstrip("-").isdigit():
                    raise DataError(f"{path}:{lineno}: {key} {row[k]!r} is not an integer")
                yield row
    return header, rows()


def _blocks(rows):
    block = []
    for row in rows:
        block.append(row)
        if len(block) == BLOCK_ROWS:
            yield block
            block = []
    if block:
        yield block


def load_kuairand_features(path: str | Path | None = None, kind: str = "user") -> FeatureTable:
    """Read a KuaiRand user (``kind="user"``, key ``user_id``) or video (``"video"``, key
    ``video_id``) feature CSV; ``path=None`` reads the registered KuaiRand-Pure file. Two passes
    over the file, ``BLOCK_ROWS`` rows at a time (the first decides each column's kind and
    collects categorical vocabularies, the second converts), so a release with millions of
    videos needs memory for its arrays only. Raises ``DataError`` naming the file and line for a
    missing key column, a row of the wrong width, a non-integer or repeated id."""
    from ..paths import dataset_path

    if kind not in _KEYS:
        raise ValueError(f"kind must be 'user' or 'video', not {kind!r}")
    path = Path(dataset_path(f"kuairand-{kind}-features") if path is None else path)
    key = _KEYS[kind]
    try:
        header, rows = _rows(path, key, kind)
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    k = header.index(key)
    others = [j for j in range(len(header)) if j != k]
    numeric, multi = {j: True for j in others}, {j: True for j in others}
    strings = {j: set() for j in others}
    late = set()                  # columns that looked numeric for a block or more, then did not
    for b, block in enumerate(_blocks(rows)):                              # pass 1: kinds
        for j in others:
            values = {row[j] for row in block} - {""}
            if numeric[j]:
                numeric[j] = all(_is_number(v) for v in values)
                if not numeric[j] and b:
                    late.add(j)
            if not numeric[j]:
                multi[j] = multi[j] and all(_is_int_list(v) for v in values)
                strings[j] |= values
    if late:                      # their earlier blocks were not looked at as strings: once more
        for block in _blocks(_rows(path, key, kind)[1]):
            for j in late:
                values = {row[j] for row in block} - {""}
                multi[j] = multi[j] and all(_is_int_list(v) for v in values)
                strings[j] |= values
    vocab = {j: tuple(sorted(strings[j])) for j in others if not numeric[j] and not multi[j]}
    index = {j: {v: i + 1 for i, v in enumerate(vocab[j])} for j in vocab}
    ids, cols = [], {j: [] for j in others}
    for block in _blocks(_rows(path, key, kind)[1]):                       # pass 2: values
        ids.append(np.array([int(row[k]) for row in block], np.int64))
        for j in others:
            values = [row[j] for row in block]
            if numeric[j]:
                cols[j].append(np.array([v if v != "" else "nan" for v in values], np.float64))
            elif j in vocab:
                cols[j].append(np.array([index[j].get(v, 0) for v in values], np.int64))
            else:
                per_row = [[int(x) for x in v.split(",")] if v else [] for v in values]
                cols[j].append((np.array([len(r) for r in per_row], np.int64),
                                np.array([x for r in per_row for x in r], np.int64)))
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][0]
        lines = np.flatnonzero(ids == dup)[:2] + 2
        raise DataError(f"{path}:{lines[1]}: {key} {dup} repeats line {lines[0]}; a feature file has one row per id")
    table = FeatureTable(key, ids, {}, {}, {}, str(path))
    for j in others:
        name = header[j]
        if numeric[j]:
            table.numeric[name] = np.concatenate(cols[j]) if cols[j] else np.zeros(0)
        elif j in vocab:
            table.categorical[name] = (np.concatenate(cols[j]) if cols[j] else np.zeros(0, np.int64), vocab[j])
        else:
            counts_ = np.concatenate([c for c, _ in cols[j]]) if cols[j] else np.zeros(0, np.int64)
            offsets = np.zeros(len(counts_) + 1, np.int64)
            np.cumsum(counts_, out=offsets[1:])
            table.multi[name] = (offsets, np.concatenate([v for _, v in cols[j]]) if cols[j] else np.zeros(0, np.int64))
    return table


register_file(DataFile(
    "kuairand-user-features", "KuaiRand user features",
    ("kuairand/KuaiRand-Pure/data/user_features_pure.csv", "kuairand/KuaiRand-1K/data/user_features_1k.csv",
     "kuairand/KuaiRand-27K/data/user_features_27k.csv"),
    how_to_get="run `grf data fetch kuairand-pure` (KuaiRand-Pure from zenodo record 10439422, about 47 MB; "
               "https://kuairand.com), or copy its user_features_pure.csv to the first path"))
register_file(DataFile(
    "kuairand-video-features", "KuaiRand basic video features",
    ("kuairand/KuaiRand-Pure/data/video_features_basic_pure.csv",
     "kuairand/KuaiRand-1K/data/video_features_basic_1k.csv",
     "kuairand/KuaiRand-27K/data/video_features_basic_27k.csv"),
    how_to_get="run `grf data fetch kuairand-pure` (KuaiRand-Pure from zenodo record 10439422, about 47 MB; "
               "https://kuairand.com), or copy its video_features_basic_pure.csv to the first path"))
