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


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _int_list(text: str) -> list[int] | None:
    parts = text.split(",")
    return [int(p) for p in parts] if all(p.strip().lstrip("-").isdigit() for p in parts) else None


def load_kuairand_features(path: str | Path | None = None, kind: str = "user") -> FeatureTable:
    """Read a KuaiRand user (``kind="user"``, key ``user_id``) or video (``"video"``, key
    ``video_id``) feature CSV; ``path=None`` reads the registered KuaiRand-Pure file. Raises
    ``DataError`` naming the file and line for a missing key column, a row of the wrong width,
    a non-integer or repeated id."""
    from ..paths import dataset_path

    if kind not in _KEYS:
        raise ValueError(f"kind must be 'user' or 'video', not {kind!r}")
    path = Path(dataset_path(f"kuairand-{kind}-features") if path is None else path)
    key = _KEYS[kind]
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not rows or key not in [h.strip() for h in rows[0]]:
        got = ",".join(rows[0]) if rows else "an empty file"
        raise DataError(f"{path}:1: a KuaiRand {kind} feature file starts with a header naming {key!r}; got {got!r}")
    header = [h.strip() for h in rows[0]]
    body = rows[1:]
    for lineno, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise DataError(f"{path}:{lineno}: {len(row)} fields, the header has {len(header)}")
    columns = list(zip(*body)) if body else [()] * len(header)
    k = header.index(key)
    for lineno, v in enumerate(columns[k], start=2):
        if not v.strip().lstrip("-").isdigit():
            raise DataError(f"{path}:{lineno}: {key} {v!r} is not an integer")
    ids = np.array([int(v) for v in columns[k]], np.int64)
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][0]
        lines = np.flatnonzero(ids == dup)[:2] + 2
        raise DataError(f"{path}:{lines[1]}: {key} {dup} repeats line {lines[0]}; a feature file has one row per id")
    numeric, categorical, multi = {}, {}, {}
    for name, values in zip(header, columns):
        if name == key:
            continue
        filled = [v for v in values if v != ""]
        numbers = [_number(v) for v in filled]
        if all(x is not None for x in numbers):
            numeric[name] = np.array([np.nan if v == "" else float(v) for v in values], np.float64)
            continue
        lists = [_int_list(v) for v in filled]
        if all(x is not None for x in lists):
            per_row = [[] if v == "" else _int_list(v) for v in values]
            offsets = np.zeros(len(values) + 1, np.int64)
            np.cumsum([len(x) for x in per_row], out=offsets[1:])
            multi[name] = (offsets, np.array([x for r in per_row for x in r], np.int64))
            continue
        vocab = tuple(sorted(set(filled)))
        index = {v: i + 1 for i, v in enumerate(vocab)}
        categorical[name] = (np.array([index.get(v, 0) for v in values], np.int64), vocab)
    return FeatureTable(key, ids, numeric, categorical, multi, str(path))


register_file(DataFile(
    "kuairand-user-features", "KuaiRand user features",
    ("kuairand/KuaiRand-Pure/data/user_features_pure.csv", "kuairand/KuaiRand-1K/data/user_features_1k.csv",
     "kuairand/KuaiRand-27K/data/user_features_27k.csv"),
    how_to_get="copy user_features_pure.csv of KuaiRand-Pure (https://kuairand.com, zenodo record 10439422) there"))
register_file(DataFile(
    "kuairand-video-features", "KuaiRand basic video features",
    ("kuairand/KuaiRand-Pure/data/video_features_basic_pure.csv",
     "kuairand/KuaiRand-1K/data/video_features_basic_1k.csv",
     "kuairand/KuaiRand-27K/data/video_features_basic_27k.csv"),
    how_to_get="copy video_features_basic_pure.csv of KuaiRand-Pure (https://kuairand.com, zenodo record 10439422) there"))
