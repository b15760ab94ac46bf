"""Datasets "ml-1m" and "ml-20m": MovieLens ratings, downloaded from the publisher by ``grf data fetch``.

MovieLens keeps raw movie ids and, when movies.dat / movies.csv sits beside the ratings (or in
``../official/`` for the reconstructed ML-1M), records those ids as evaluation candidates (GR
ranks exactly these). ``data.remap_items=true`` maps the ids to dense 1..K (candidates mapped too).

Download checksums: GroupLens publishes an MD5 beside each archive
(``https://files.grouplens.org/datasets/movielens/ml-1m.zip.md5`` and ``ml-20m.zip.md5``, lines like
``MD5 (ml-20m.zip) = cd245b17...``). The values pinned below were not fetched here (no network);
they are the values that many independent public projects quote from those sidecar files
(e.g. eli-osherovich/papers_with_code ``datasets/movielens/dl_config.py``, a script commenting
"From: curl -O http://files.grouplens.org/datasets/movielens/ml-1m.zip.md5", and several dataset
registries), all agreeing. GroupLens publishes no SHA-256, so MD5 is what can be checked.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import DataError
from ..loaders import _BLOCK_BYTES, Interactions, _check_file, _int_column, _parse_table, _read_first_line
from ..registry import DatasetSpec, Download, register_dataset
from ..sequences import SequenceData, from_interactions

LICENSE_NOTE = ("MovieLens is published by GroupLens Research (University of Minnesota) for research use; "
                "it may not be redistributed. Cite: F. M. Harper and J. A. Konstan, The MovieLens Datasets: "
                "History and Context, ACM TiiS 5(4), 2015. Terms: the README inside the archive.")

ML1M_FIELDS = ("UserID", "MovieID", "Rating", "Timestamp")
ML20M_HEADER = ("userId", "movieId", "rating", "timestamp")


def load_movielens_1m(path: str | Path | None = None, *, block_bytes: int = _BLOCK_BYTES) -> Interactions:
    """Read ML-1M ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``, no header).

    Returns ``Interactions`` with user/item/time ``[N] int64`` (time in unix seconds) and
    ``rating[N] float32`` in file order. ``path=None`` takes ``dataset_path("ml-1m")``.
    """
    from ..paths import dataset_label, dataset_path
    path = _check_file(dataset_path("ml-1m") if path is None else path)
    values = _parse_table(path, sep="::", names=ML1M_FIELDS, int_cols={0, 1, 2, 3}, dtype=np.int64,
                          block_bytes=block_bytes)
    return Interactions(user=_int_column(values, 0), item=_int_column(values, 1), time=_int_column(values, 3),
                        rating=values[:, 2].astype(np.float32), name=dataset_label("ml-1m", path),
                        source=str(path))


def load_movielens_20m(path: str | Path | None = None, *, block_bytes: int = _BLOCK_BYTES) -> Interactions:
    """Read ML-20M ``ratings.csv`` (header ``userId,movieId,rating,timestamp``; ratings 0.5..5).

    Returns ``Interactions`` with user/item/time ``[N] int64`` (unix seconds) and ``rating[N] float32``.
    """
    from ..paths import dataset_label, dataset_path
    path = _check_file(dataset_path("ml-20m") if path is None else path)
    header, offset = _read_first_line(path)
    got = tuple(h.strip() for h in header.decode("utf-8", errors="replace").split(","))
    if got != ML20M_HEADER:
        if not header.strip():
            raise DataError(f"{path}: file is empty (expected a header {','.join(ML20M_HEADER)!r} and rows)")
        raise DataError(f"{path}:1: expected the header {','.join(ML20M_HEADER)!r}, got {header[:120]!r}; "
                        f"is this MovieLens-20M ratings.csv?")
    # float64 holds every id and timestamp exactly (< 2^53); int columns are checked to be integral.
    values = _parse_table(path, sep=",", names=ML20M_HEADER, int_cols={0, 1, 3}, dtype=np.float64,
                          start=offset, first_lineno=2, block_bytes=block_bytes)
    return Interactions(user=_int_column(values, 0), item=_int_column(values, 1), time=_int_column(values, 3),
                        rating=values[:, 2].astype(np.float32), name=dataset_label("ml-20m", path),
                        source=str(path), first_line=2)


def movielens_candidates(ratings: Path, movies_name: str, sep: str, header: bool) -> np.ndarray | None:
    """``[C] int64`` movie ids listed in movies.dat / movies.csv beside ``ratings`` (or in
    ``../official/``), or None when there is no such file: GR ranks exactly these at evaluation."""
    for movies in (ratings.parent / movies_name, ratings.parent.parent / "official" / movies_name):
        if movies.is_file():
            ids = []
            # latin-1: ML-1M titles are not UTF-8; only the leading id field is read.
            with open(movies, encoding="latin-1") as f:
                for lineno, line in enumerate(f, start=1):
                    if (header and lineno == 1) or not line.strip():
                        continue
                    head = line.split(sep, 1)[0].strip()
                    try:
                        ids.append(int(head))
                    except ValueError:
                        raise DataError(f"{movies}:{lineno}: movie id {head!r} is not an integer") from None
            return np.asarray(ids, dtype=np.int64)
    return None


def _load_ml1m(cfg, path: Path) -> SequenceData:
    return from_interactions(load_movielens_1m(path), remap_items=cfg.remap_items,
                             candidates=movielens_candidates(path, "movies.dat", "::", header=False))


def _load_ml20m(cfg, path: Path) -> SequenceData:
    return from_interactions(load_movielens_20m(path), remap_items=cfg.remap_items,
                             candidates=movielens_candidates(path, "movies.csv", ",", header=True))


def _ml1m_label(path: Path) -> str:
    """The team's reconstructed copy (999,917 of 1,000,209 ratings) is labelled as such in results."""
    return "ML-1M (reconstructed)" if path.name == "ratings_known.dat" else "ML-1M"


_GROUPLENS = "https://files.grouplens.org/datasets/movielens/"
_LISTED_LICENSE = ("research use, no redistribution; cite Harper and Konstan, ACM TiiS 2015 "
                   "(terms: the archive's README)")

register_dataset(DatasetSpec(
    "ml-1m", "ML-1M", _load_ml1m,
    # The publisher's file (``grf data fetch ml-1m``) wins over the team's reconstructed copy.
    layout=("movielens-1m/ratings.dat", "movielens-1m/reconstructed/ratings_known.dat"),
    how_to_get="run `grf data fetch ml-1m` (downloads ml-1m.zip from files.grouplens.org and checks its md5)",
    default_file="ratings.dat", label_for=_ml1m_label,
    download=Download(_GROUPLENS + "ml-1m.zip", "c4d9eecfca2ab87c1945afe126590906", "movielens-1m", "ml-1m/",
                      "ratings.dat", 6, publisher="GroupLens", md5_url=_GROUPLENS + "ml-1m.zip.md5",
                      license=_LISTED_LICENSE)))

register_dataset(DatasetSpec(
    "ml-20m", "ML-20M", _load_ml20m,
    layout=("movielens-20m/ratings.csv",),
    how_to_get="run `grf data fetch ml-20m` (downloads ml-20m.zip from files.grouplens.org and checks its md5)",
    default_file="ratings.csv",
    download=Download(_GROUPLENS + "ml-20m.zip", "cd245b17a1ae2cc31bb14903e1204af3", "movielens-20m", "ml-20m/",
                      "ratings.csv", 190, publisher="GroupLens", md5_url=_GROUPLENS + "ml-20m.zip.md5",
                      license=_LISTED_LICENSE)))
