"""Dataset "kuairand": a log in the official KuaiRand schema (https://kuairand.com); with
``data.path`` empty it reads the team's 211-row sample of the KuaiRand-1K random log. Also
registers the KuaiRand-27K per-user length table (``dataset_path("kuairand-27k-lengths")``)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ...errors import DataError
from ..loaders import _BLOCK_BYTES, Interactions, _check_file, _int_column, _parse_table, _read_first_line
from ..registry import DataFile, DatasetSpec, register_dataset, register_file
from ..sequences import SequenceData, from_interactions

KUAIRAND_LOG_COLUMNS = (
    "user_id", "video_id", "date", "hourmin", "time_ms", "is_click", "is_like", "is_follow", "is_comment",
    "is_forward", "is_hate", "long_view", "play_time_ms", "duration_ms", "profile_stay_time",
    "comment_stay_time", "is_profile_enter", "is_rand", "tab",
)
KUAIRAND_DEFAULT_EXTRA = (
    "is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view",
    "play_time_ms", "duration_ms", "tab",
)
_KUAIRAND_REQUIRED = ("user_id", "video_id", "time_ms")


def load_kuairand_log(path: str | Path | None = None, *, columns: Sequence[str] = KUAIRAND_DEFAULT_EXTRA,
                      block_bytes: int = _BLOCK_BYTES) -> Interactions:
    """Read an official KuaiRand log CSV (``log_standard_*.csv`` / ``log_random_*.csv``, 19 columns).

    Columns are found by header name. ``user_id`` -> user, ``video_id`` -> item, ``time_ms // 1000``
    -> time (seconds; ``date``/``hourmin`` disagree with ``time_ms`` by up to 1 h, so they are not used).
    ``columns`` picks the feedback columns kept in ``extra`` (each ``[N] int64``, or float64 if the
    file holds fractions); ``time_ms`` is always kept too. ``path=None`` reads the 211-row sample.
    """
    from ..paths import dataset_label, dataset_path
    path = _check_file(dataset_path("kuairand-sample") if path is None else path)
    header, offset = _read_first_line(path)
    names = tuple(h.strip() for h in header.decode("utf-8", errors="replace").split(","))
    if not header.strip():
        raise DataError(f"{path}: file is empty (expected the KuaiRand log header "
                        f"{','.join(KUAIRAND_LOG_COLUMNS)!r} and rows)")
    missing = [c for c in (*_KUAIRAND_REQUIRED, *columns) if c not in names]
    if missing:
        raise DataError(f"{path}:1: KuaiRand log header lacks column(s) {', '.join(missing)}; got {names!r}; "
                        f"the official log schema is {','.join(KUAIRAND_LOG_COLUMNS)}")
    index = {c: names.index(c) for c in names}
    int_cols = {index[c] for c in _KUAIRAND_REQUIRED}
    values = _parse_table(path, sep=",", names=names, int_cols=int_cols, dtype=np.float64,
                          start=offset, first_lineno=2, block_bytes=block_bytes)
    time_ms = _int_column(values, index["time_ms"])
    extra = {"time_ms": time_ms}
    for c in columns:
        col = values[:, index[c]]
        integral = bool(np.all(np.isfinite(col) & (col == np.floor(col))))
        extra[c] = col.astype(np.int64) if integral else col
    return Interactions(user=_int_column(values, index["user_id"]), item=_int_column(values, index["video_id"]),
                        time=time_ms // 1000, extra=extra, name=dataset_label("kuairand", path), source=str(path),
                        first_line=2)


def _load(cfg, path: Path) -> SequenceData:
    # Always remapped: KuaiRand video ids start at 0, the padding id.
    return from_interactions(load_kuairand_log(path), remap_items=True)


def _label(path: Path) -> str:
    return "KuaiRand-1K random log (211-row sample)" if "head_users0-3" in path.name else f"KuaiRand ({path.name})"


register_dataset(DatasetSpec(
    "kuairand", "KuaiRand-1K random log (211-row sample)", _load,
    layout=("kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.head_users0-3.csv",),
    how_to_get="copy the KuaiRand-1K random log (https://kuairand.com, zenodo record 10439422) to that path",
    default_file="log_random_4_22_to_5_08_1k.csv", file_name="kuairand-sample", label_for=_label))

register_file(DataFile(
    "kuairand-27k-lengths", "KuaiRand-27K per-user lengths",
    ("kuairand/stats_kuairand27k_third_party/log_standard_user_stats_distribution.csv",),
    how_to_get=("copy the third-party KuaiRand-27K per-user statistics table "
                "(limings02/kuairand, EDA/kuairand_report/tables/) to that path")))
