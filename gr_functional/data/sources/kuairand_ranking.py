"""KuaiRand engagement sequences in the layout of generative-recommenders' dlrm_v3 ranking data:
per user, the videos watched with their time, an action bitmask, play time and duration, plus the
user's contextual features. Two ways in:

- ``sequences_from_log``: from an official log (``load_kuairand_log``) and the user feature file
  (``load_kuairand_features``), as GR's KuaiRand preprocessor derives them;
- ``load_gr_processed``: GR's own ``processed_seqs.csv`` (list columns written as "[a, b, ...]"),
  so a GR user's preprocessed data trains here unchanged; ``write_gr_processed`` writes one.

GR's preprocessing (``generative_recommenders/dlrm_v3/preprocess_public_data.py``,
``DLRMKuaiRandProcessor``, at commit 2e81fab), rules kept here, each deliberate:
- ``action_weights`` is a bitmask: is_click 1, is_like 2, is_follow 4, is_comment 8, is_forward 16,
  is_hate 32, long_view 64, is_profile_enter 128 (a bit set where the log's column is non-zero);
- a user's events stay in file order (GR groups rows by user with pandas, which keeps row order;
  nothing sorts by time: the official logs are already in time order per user and part);
- users without a row in the feature file are dropped (GR joins the two with an inner merge);
- contextual categorical features (``CONTEXT_FEATURES``) are numbered 1.. in order of first
  appearance in the feature file (GR's ``_one_hot_encode``: pandas ``unique()`` order), an empty
  field being a category of its own.
Where this departs: GR inner-joins the log parts too (a user absent from one part is dropped
from all); ``sequences_from_log`` takes one log (``data.path`` may be a glob of the parts:
``log_files``, ``concat_logs``), keeping every user.
"""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..paths import dataset_path
from ..registry import DataFile, DatasetSpec, register_dataset, register_file
from .kuairand import load_kuairand_log
from .kuairand_features import load_kuairand_features

ACTION_BITS = (("is_click", 1), ("is_like", 2), ("is_follow", 4), ("is_comment", 8), ("is_forward", 16),
               ("is_hate", 32), ("long_view", 64), ("is_profile_enter", 128))
CONTEXT_FEATURES = ("user_active_degree", "follow_user_num_range", "fans_user_num_range", "friend_user_num_range",
                    "register_days_range")
SEQUENCE_COLUMNS = ("video_id", "time_ms", "action_weights", "play_time_ms", "duration_ms")
LOG_COLUMNS = tuple(name for name, _ in ACTION_BITS) + ("play_time_ms", "duration_ms")


@dataclasses.dataclass
class RankingSequences:
    """``users[U]`` int64 and jagged per-user sequences ``offsets[U+1]`` int64 over
    ``columns[name][T]`` int64 for each of ``SEQUENCE_COLUMNS``; ``context[name][U]`` int64 codes
    (>= 1) of ``CONTEXT_FEATURES``; ``history_only[U]`` int64 or None: how many of each user's first
    events are history only (a pre-period prefix, ``prefix_history``: never candidates)."""

    users: np.ndarray
    offsets: np.ndarray
    columns: dict
    context: dict
    history_only: np.ndarray | None = None

    def sequence(self, u: int) -> dict:
        """User number ``u``'s columns (numpy slices)."""
        s, e = self.offsets[u], self.offsets[u + 1]
        return {name: col[s:e] for name, col in self.columns.items()}


def action_weights(extra: dict) -> np.ndarray:
    """``[N]`` int64 bitmask of ``ACTION_BITS`` from a log's columns (each ``[N]``)."""
    missing = [name for name, _ in ACTION_BITS if name not in extra]
    if missing:
        raise DataError(f"the log lacks the action column(s) {', '.join(missing)} "
                        f"(load it with load_kuairand_log(columns=kuairand_ranking.LOG_COLUMNS))")
    out = np.zeros(len(extra[ACTION_BITS[0][0]]), np.int64)
    for name, bit in ACTION_BITS:
        out |= np.where(np.asarray(extra[name]) != 0, bit, 0)
    return out


def appearance_codes(codes: np.ndarray) -> np.ndarray:
    """Re-number category codes 1.. in order of first appearance (GR's numbering)."""
    uniq, first = np.unique(codes, return_index=True)
    rank = np.empty(len(uniq), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(1, len(uniq) + 1)
    return rank[np.searchsorted(uniq, codes)]


def sequences_from_log(log, user_features) -> RankingSequences:
    """Per-user sequences of an ``Interactions`` log (``load_kuairand_log(path,
    columns=LOG_COLUMNS)``) joined with a user ``FeatureTable``: users in increasing id order,
    events in file order."""
    for name in ("play_time_ms", "duration_ms", "time_ms"):
        if name not in log.extra:
            raise DataError(f"{log.source}: the log lacks column {name!r} "
                            f"(load it with load_kuairand_log(columns=kuairand_ranking.LOG_COLUMNS))")
    missing = [c for c in CONTEXT_FEATURES if c not in user_features.categorical]
    if missing:
        raise DataError(f"{user_features.source}: no categorical column(s) {', '.join(missing)}; "
                        f"a KuaiRand user feature file has them")
    rows = user_features.rows_of(log.user)
    keep = rows >= 0
    order = np.argsort(log.user[keep], kind="stable")                    # by user, file order within
    user = log.user[keep][order]
    users, counts = np.unique(user, return_counts=True)
    offsets = np.zeros(len(users) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    picked = lambda a: np.asarray(a, np.int64)[keep][order]  # noqa: E731
    columns = {"video_id": picked(log.item), "time_ms": picked(log.extra["time_ms"]),
               "action_weights": picked(action_weights(log.extra)), "play_time_ms": picked(log.extra["play_time_ms"]),
               "duration_ms": picked(log.extra["duration_ms"])}
    user_rows = user_features.rows_of(users)
    context = {c: appearance_codes(user_features.categorical[c][0])[user_rows] for c in CONTEXT_FEATURES}
    return RankingSequences(users, offsets, columns, context)


def write_gr_processed(seqs: RankingSequences, path: str | Path) -> None:
    """``seqs`` as GR's ``processed_seqs.csv``: ``user_id``, each sequence column as a list
    "[a, b, ...]", each context feature's code."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", *SEQUENCE_COLUMNS, *CONTEXT_FEATURES])
        for u, uid in enumerate(seqs.users):
            seq = seqs.sequence(u)
            w.writerow([int(uid), *("[" + ", ".join(str(int(x)) for x in seq[c]) + "]" for c in SEQUENCE_COLUMNS),
                        *(int(seqs.context[c][u]) for c in CONTEXT_FEATURES)])


def load_gr_processed(path: str | Path) -> RankingSequences:
    """Read GR's ``processed_seqs.csv`` (KuaiRand): ``user_id``, the ``SEQUENCE_COLUMNS`` as list
    strings of one length per row, and the ``CONTEXT_FEATURES`` codes; other columns (the rest of
    the user features GR's merge writes) are ignored. Rows in file order. ``DataError`` naming
    the line for a missing column, a malformed list or lists of different lengths."""
    path = Path(path)
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with f:
        reader = csv.reader(f)
        header = next(reader, None) or []
        need = ("user_id", *SEQUENCE_COLUMNS, *CONTEXT_FEATURES)
        missing = [c for c in need if c not in header]
        if missing:
            raise DataError(f"{path}:1: GR's processed_seqs.csv has column(s) {', '.join(missing)}; got {header!r}")
        at = {c: header.index(c) for c in need}
        users, lengths, context = [], [], {c: [] for c in CONTEXT_FEATURES}
        chunks = {c: [] for c in SEQUENCE_COLUMNS}
        for lineno, row in enumerate(reader, start=2):
            try:
                lists = {c: json.loads(row[at[c]]) for c in SEQUENCE_COLUMNS}
                users.append(int(row[at["user_id"]]))
                for c in CONTEXT_FEATURES:
                    context[c].append(int(float(row[at[c]])))
            except (ValueError, IndexError) as exc:
                raise DataError(f"{path}:{lineno}: cannot read the row ({exc})") from None
            n = {len(v) if isinstance(v, list) else -1 for v in lists.values()}
            if len(n) != 1 or -1 in n:
                raise DataError(f"{path}:{lineno}: the sequence columns {', '.join(SEQUENCE_COLUMNS)} must be lists "
                                f"of one length; got lengths {[len(v) if isinstance(v, list) else None for v in lists.values()]}")
            lengths.append(n.pop())
            for c in SEQUENCE_COLUMNS:
                chunks[c].append(np.asarray(lists[c], np.int64))
    offsets = np.zeros(len(users) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    columns = {c: np.concatenate(chunks[c]) if chunks[c] else np.zeros(0, np.int64) for c in SEQUENCE_COLUMNS}
    return RankingSequences(np.asarray(users, np.int64), offsets, columns,
                            {c: np.asarray(v, np.int64) for c, v in context.items()})


def _needs_path(cfg) -> str:
    if not cfg.data.path:
        raise DataError(f"data.dataset={cfg.data.dataset!r} reads a file: set data.path to GR's processed_seqs.csv")
    return cfg.data.path


def _load_gr(cfg, path):
    return load_gr_processed(_needs_path(cfg))


def log_files(path: str) -> list[Path]:
    """The log files ``data.path`` names: one file, or a glob pattern (``*``, ``?``, ``[``) matching
    several in name order, e.g. the official KuaiRand-Pure logs ``.../log_standard_4_*_pure.csv``
    (4_08_to_4_21, then 4_22_to_5_08: the earlier period first). DataError when none matches."""
    if not any(ch in path for ch in "*?["):
        return [Path(path)]
    p = Path(path)
    files = sorted(f for f in p.parent.glob(p.name) if f.is_file())
    if not files:
        raise DataError(f"data.path={path!r}: no file matches the pattern (in {p.parent})")
    return files


def concat_logs(logs: list):
    """One log of several (``load_kuairand_log`` each), rows in the given order: a later period's
    file after an earlier one's. Errors still name each file (they are raised while reading it)."""
    if len(logs) == 1:
        return logs[0]
    cat = lambda key: np.concatenate([getattr(log, key) for log in logs])  # noqa: E731
    return dataclasses.replace(logs[0], user=cat("user"), item=cat("item"), time=cat("time"),
                               extra={k: np.concatenate([log.extra[k] for log in logs]) for k in logs[0].extra},
                               source=" + ".join(log.source for log in logs), lines=None)


PREFIX_COLUMNS = ("user_id", "last_time_ms", "watch_seq", "like_seq", "long_watch_seq")


def read_prefix(path: str | Path) -> dict:
    """``{user_id: (last_time_ms, watch ids, like ids, long-view ids)}`` of a pre-period Parquet file
    (``PREFIX_COLUMNS``; pyarrow reads it); DataError naming the file and what is wrong."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: data.history_prefix reads Parquet, which needs pyarrow: pip install pyarrow") from None
    try:
        names = list(pq.read_schema(path).names)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid / OSError types
        raise DataError(f"{path}: not a readable Parquet file ({exc}) (data.history_prefix)") from None
    missing = [c for c in PREFIX_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path}: no column(s) {', '.join(missing)} (data.history_prefix needs {', '.join(PREFIX_COLUMNS)}; "
                        f"the file has {', '.join(names)})")
    rows = pq.read_table(path, columns=list(PREFIX_COLUMNS)).to_pydict()
    return {int(u): (int(t), list(w or ()), set(lk or ()), set(lw or ()))
            for u, t, w, lk, lw in zip(*(rows[c] for c in PREFIX_COLUMNS))}


def prefix_history(seqs: RankingSequences, prefix: dict, source: str = "data.history_prefix") -> RankingSequences:
    """``seqs`` with each user's pre-period video ids (``read_prefix``: ``watch_seq``, taken as
    oldest first) before its first event, counted in ``history_only``. What the file gives is all
    they carry: one time for all (``last_time_ms``, the user's last pre-period event), the like and
    long-view bits where the id is in ``like_seq`` / ``long_watch_seq`` (the last 50 of each), no
    click or other action (0), play and duration 0. Users absent from the file get no prefix; a
    prefix later than the user's first event is a DataError."""
    bit = dict(ACTION_BITS)
    parts = {c: [] for c in SEQUENCE_COLUMNS}
    lengths, extra = np.diff(seqs.offsets), np.zeros(len(seqs.users), np.int64)
    for u, user in enumerate(seqs.users):
        own = seqs.sequence(u)
        pre = prefix.get(int(user))
        if pre is not None and pre[1]:
            when, ids, liked, long_viewed = pre
            if lengths[u] and when > int(own["time_ms"][0]):
                raise DataError(f"{source}: user {int(user)}'s pre-period events (last_time_ms {when}) are later than "
                                f"its first log event ({int(own['time_ms'][0])}): the prefix must precede the log")
            extra[u] = len(ids)
            parts["video_id"].append(np.asarray(ids, np.int64))
            parts["time_ms"].append(np.full(len(ids), when, np.int64))
            parts["action_weights"].append(np.asarray([bit["is_like"] * (i in liked) + bit["long_view"] * (i in long_viewed)
                                                       for i in ids], np.int64))
            parts["play_time_ms"].append(np.zeros(len(ids), np.int64))
            parts["duration_ms"].append(np.zeros(len(ids), np.int64))
        for c in SEQUENCE_COLUMNS:
            parts[c].append(np.asarray(own[c], np.int64))
    offsets = np.zeros(len(seqs.users) + 1, np.int64)
    np.cumsum(lengths + extra, out=offsets[1:])
    columns = {c: np.concatenate(parts[c]) if parts[c] else np.zeros(0, np.int64) for c in SEQUENCE_COLUMNS}
    return dataclasses.replace(seqs, offsets=offsets, columns=columns, history_only=extra)


def _load_log(cfg, path):
    files = log_files(cfg.data.path) if cfg.data.path else [dataset_path("kuairand-pure-log")]  # default: real Pure rows
    log = concat_logs([load_kuairand_log(f, columns=LOG_COLUMNS) for f in files])
    seqs = sequences_from_log(log, load_kuairand_features(kind="user"))
    if cfg.data.history_prefix:
        name = cfg.data.history_prefix
        where = dataset_path(name) if name == "kuairand-pure-before" else Path(name)
        seqs = prefix_history(seqs, read_prefix(where), source=str(where))
    return seqs


register_dataset(DatasetSpec("kuairand-rank-gr", "KuaiRand (GR's processed_seqs.csv)", _load_gr, needs_file=False,
                             task="ranking"))
register_dataset(DatasetSpec("kuairand-rank-log", "KuaiRand log", _load_log, needs_file=False, task="ranking"))
register_file(DataFile(
    "kuairand-pure-log", "KuaiRand-Pure standard log",
    # The team's partial copy first, so existing setups keep reading it; then the official
    # 04-22..05-08 log (``grf data fetch kuairand-pure``) whose period holds it.
    ("kuairand/KuaiRand-Pure/data/log_standard_pure_20220425_to_20220504.partial.csv",
     "kuairand/KuaiRand-Pure/data/log_standard_4_22_to_5_08_pure.csv"),
    how_to_get="run `grf data fetch kuairand-pure` (KuaiRand-Pure from zenodo record 10439422, about 47 MB; "
               "https://kuairand.com), or set data.path to any official KuaiRand log csv"))
register_file(DataFile(
    "kuairand-pure-before", "KuaiRand-Pure per-user sequences before 2022-04-25",
    ("kuairand/KuaiRand-Pure/data/user_sequences_pure_before_20220425.parquet",),
    how_to_get="it is derived data (README of $GRF_DATA_DIR/kuairand); or set data.history_prefix to such a file"))
