"""One entry point from ``[data]`` config to ``SequenceData``: ``load_dataset(cfg.data)``."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import DataConfig, Dataset, choices
from .loaders import DataError, load_kuairand_log, load_movielens_1m, load_movielens_20m
from .paths import dataset_path
from .sequences import SequenceData, from_interactions, remap_sequence_items
from .synthetic import make_synthetic

DATASETS = choices(Dataset)  # declared once, in gr_functional/config.py


def _resolve(cfg_path: str, name: str, default_file: str) -> Path:
    if not cfg_path:
        return dataset_path(name)
    path = Path(cfg_path).expanduser()
    if path.is_dir():
        path = path / default_file
    if not path.is_file():
        raise DataError(f"data.path={cfg_path!r}: {path} does not exist (leave data.path empty to use "
                        f"the {name} file under GRF_DATA_DIR)")
    return path


def _movielens_candidates(ratings: Path, movies_name: str, sep: str, header: bool) -> np.ndarray | None:
    """Movie ids listed in movies.dat / movies.csv: GR ranks exactly these at evaluation."""
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


def load_dataset(cfg: DataConfig) -> SequenceData:
    """Build the dataset named by ``cfg.dataset`` (``synthetic | ml-1m | ml-20m | kuairand``).

    MovieLens keeps raw movie ids and, when movies.dat / movies.csv sits beside the ratings (or in
    ``../official/`` for the reconstructed ML-1M), records those ids as evaluation candidates.
    ``data.remap_items=true`` maps every dataset's item ids to dense 1..K in increasing raw-id
    order (``SequenceData.raw_item_ids`` keeps the raw id of each; candidates are mapped the same
    way). KuaiRand ids are always remapped (its video ids start at 0, the padding id); with
    ``data.path`` empty it reads the 211-row sample. ``SequenceData.describe()`` is the one-line
    report of what was loaded (users, events, item-id range, duplicates).
    """
    name = cfg.dataset
    remap = cfg.remap_items
    if name == "synthetic":
        data = make_synthetic(cfg.synthetic_users, cfg.synthetic_items, cfg.synthetic_max_events, cfg.zipf_a,
                              cfg.seed)
        return remap_sequence_items(data) if remap else data
    if name == "ml-1m":
        path = _resolve(cfg.path, "ml-1m", "ratings.dat")
        return from_interactions(load_movielens_1m(path), remap_items=remap,
                                 candidates=_movielens_candidates(path, "movies.dat", "::", header=False))
    if name == "ml-20m":
        path = _resolve(cfg.path, "ml-20m", "ratings.csv")
        return from_interactions(load_movielens_20m(path), remap_items=remap,
                                 candidates=_movielens_candidates(path, "movies.csv", ",", header=True))
    if name == "kuairand":
        path = _resolve(cfg.path, "kuairand-sample", "log_random_4_22_to_5_08_1k.csv")
        return from_interactions(load_kuairand_log(path), remap_items=True)
    raise DataError(f"data.dataset={name!r} is not a known dataset; valid: {', '.join(DATASETS)}")
