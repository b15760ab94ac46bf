"""Dataset "kuairand": a log in the official KuaiRand schema (https://kuairand.com); with
``data.path`` empty it reads the team's 211-row sample of the KuaiRand-1K random log (else the
official random log that ``grf data fetch kuairand-1k`` downloads). Also registers the KuaiRand-27K
per-user length table (``dataset_path("kuairand-27k-lengths")``) and the downloads
``grf data fetch kuairand-pure | kuairand-1k | kuairand-27k-lengths``.

Download provenance (read in copies of both repositories; the build machine has no network): the
KuaiRand README (github.com/chongminggao/KuaiRand, "Download the data", at commit
f8dbf66) gives ``wget https://zenodo.org/records/10439422/files/KuaiRand-Pure.tar.gz``
``(md5:0820331067a3784d9691136f772b35a7)`` and ``.../KuaiRand-1K.tar.gz``
``(md5:6b0b9c8222d67fcd4c676218edca3f1f)``, and under "Data Descriptions" the archives' layout,
``KuaiRand-Pure/data/*.csv`` (194 MB) and ``KuaiRand-1K/data/*.csv`` (4.3 GB) beside a
``load_data_*.py``; its earlier revision 103d9b7 gives the compressed sizes (45.2 MB, 1 GB; other
projects' scripts pin Pure at 47,432,272 bytes and 1K at "1.1 GB"). The 27K length table is
limings02/kuairand's ``EDA/kuairand_report/tables/log_standard_user_stats_distribution.csv`` at
commit e49bef7 (860,535 bytes, UTF-8 BOM; sha256 computed from that commit's blob; the repository
has no licence file, so the table is fetched, never shipped)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ...errors import DataError
from ..fetch import register_download
from ..loaders import _BLOCK_BYTES, Interactions, _check_file, _int_column, _parse_table, _read_first_line
from ..registry import DataFile, DatasetSpec, Download, register_dataset, register_file
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
    # The team's sample first (tests and presets expect its 211 rows); then the official log.
    layout=("kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.head_users0-3.csv",
            "kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.csv"),
    how_to_get="copy the KuaiRand-1K random log to one of those paths, or run `grf data fetch kuairand-1k` "
               "(the whole KuaiRand-1K release from zenodo record 10439422, about 1.1 GB; https://kuairand.com)",
    default_file="log_random_4_22_to_5_08_1k.csv", file_name="kuairand-sample", label_for=_label,
    # the 211 rows ship with the package (CC BY-SA 4.0, attributed in gr_functional/data/samples/)
    bundled="kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.head_users0-3.csv"))

register_file(DataFile(
    "kuairand-27k-lengths", "KuaiRand-27K per-user lengths",
    ("kuairand/stats_kuairand27k_third_party/log_standard_user_stats_distribution.csv",),
    how_to_get=("run `grf data fetch kuairand-27k-lengths` (the third-party KuaiRand-27K per-user statistics "
                "table of github.com/limings02/kuairand, EDA/kuairand_report/tables/)")))

_ZENODO = "https://zenodo.org/records/10439422/files/"
_KUAIRAND_README = "https://github.com/chongminggao/KuaiRand#download-the-data"
KUAIRAND_LICENSE = "CC BY-SA 4.0; cite Gao et al., KuaiRand, CIKM'22 (https://kuairand.com)"

# Each release's main file is one a registered layout looks for; the archive's other csv files
# (features, the other logs) land beside it, where kuairand_features / kuairand_ranking look.
register_download("kuairand-pure", Download(
    _ZENODO + "KuaiRand-Pure.tar.gz", "0820331067a3784d9691136f772b35a7", "kuairand/KuaiRand-Pure/data",
    "KuaiRand-Pure/data/", "log_standard_4_22_to_5_08_pure.csv", 47, publisher="the KuaiRand authors",
    md5_url=_KUAIRAND_README, kind="tar.gz", label="KuaiRand-Pure release (logs and features, 194 MB unpacked)",
    license=KUAIRAND_LICENSE))
register_download("kuairand-1k", Download(
    _ZENODO + "KuaiRand-1K.tar.gz", "6b0b9c8222d67fcd4c676218edca3f1f", "kuairand/KuaiRand-1K/data",
    "KuaiRand-1K/data/", "log_random_4_22_to_5_08_1k.csv", 1100, publisher="the KuaiRand authors",
    md5_url=_KUAIRAND_README, kind="tar.gz", label="KuaiRand-1K release (logs and features, 4.3 GB unpacked)",
    license=KUAIRAND_LICENSE))
register_download("kuairand-27k-lengths", Download(
    "https://raw.githubusercontent.com/limings02/kuairand/e49bef71584f09252b45fb54b4716e8c7c1f8459/"
    "EDA/kuairand_report/tables/log_standard_user_stats_distribution.csv", "",
    "kuairand/stats_kuairand27k_third_party", "", "log_standard_user_stats_distribution.csv", 1, kind="file",
    sha256="f9532007fb904d8f23c1e9228b6be9ecd469f331af40b84200502697d7e5b066",
    label="KuaiRand-27K per-user lengths (a third-party statistics table)",
    license="third-party statistics of github.com/limings02/kuairand, no licence: fetched from that "
            "repository, never shipped"))
