"""Where datasets live on disk.

``data_dir()`` resolves the data folder once per call (so tests may change ``GRF_DATA_DIR``):

1. ``$GRF_DATA_DIR`` when set;
2. ``<repo root>/../shared/data`` when that folder exists (the team's shared checkout layout;
   repo root = the folder holding the ``gr_functional`` package);
3. ``~/.cache/gr-functional/data`` (where ``grf data fetch`` puts downloads for users).

``dataset_path(name)`` maps a dataset name to its main file under that folder and raises
``DataError`` saying where it looked and how to get the data when nothing is there.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataError

ENV_VAR = "GRF_DATA_DIR"

# name -> candidate paths relative to the data dir, in order of preference.
_LAYOUT: dict[str, tuple[str, ...]] = {
    # The publisher's file (``grf data fetch ml-1m``) wins over the team's reconstructed copy.
    "ml-1m": ("movielens-1m/ratings.dat", "movielens-1m/reconstructed/ratings_known.dat"),
    "ml-20m": ("movielens-20m/ratings.csv",),
    "kuairand-sample": ("kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.head_users0-3.csv",),
    "kuairand-27k-lengths": ("kuairand/stats_kuairand27k_third_party/log_standard_user_stats_distribution.csv",),
}

_HOW_TO_GET = {
    "ml-1m": "run `grf data fetch ml-1m` (downloads ml-1m.zip from files.grouplens.org and checks its md5)",
    "ml-20m": "run `grf data fetch ml-20m` (downloads ml-20m.zip from files.grouplens.org and checks its md5)",
    "kuairand-sample": ("copy the KuaiRand-1K random log (https://kuairand.com, zenodo record 10439422) "
                        "to that path"),
    "kuairand-27k-lengths": ("copy the third-party KuaiRand-27K per-user statistics table "
                             "(limings02/kuairand, EDA/kuairand_report/tables/) to that path"),
}

LABELS = {
    "ml-1m": "ML-1M",
    "ml-20m": "ML-20M",
    "kuairand-sample": "KuaiRand-1K random log (211-row sample)",
    "kuairand-27k-lengths": "KuaiRand-27K per-user lengths",
}


def repo_root() -> Path:
    """The folder holding the ``gr_functional`` package (the checkout root in development)."""
    return Path(__file__).resolve().parent.parent.parent


def data_dir() -> Path:
    """The data folder: ``$GRF_DATA_DIR``, else ``<repo>/../shared/data`` if present, else the user cache."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    shared = repo_root().parent / "shared" / "data"
    if shared.is_dir():
        return shared
    return Path.home() / ".cache" / "gr-functional" / "data"


def _data_dir_origin() -> str:
    if os.environ.get(ENV_VAR):
        return f"from ${ENV_VAR}"
    shared = repo_root().parent / "shared" / "data"
    return "the shared checkout folder" if shared.is_dir() else "the default cache folder"


def dataset_names() -> tuple[str, ...]:
    """Names ``dataset_path`` knows, in display order."""
    return tuple(_LAYOUT)


def dataset_path(name: str) -> Path:
    """Main file of dataset ``name`` under ``data_dir()``; ``DataError`` (where it looked, how to get it) if absent.

    Names: ``ml-1m`` (``movielens-1m/ratings.dat``, else the reconstructed
    ``movielens-1m/reconstructed/ratings_known.dat``), ``ml-20m`` (``movielens-20m/ratings.csv``),
    ``kuairand-sample`` (the 211-row KuaiRand-1K log sample), ``kuairand-27k-lengths`` (per-user
    exposure counts of KuaiRand-27K).
    """
    if name not in _LAYOUT:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(_LAYOUT)}")
    root = data_dir()
    candidates = [root / rel for rel in _LAYOUT[name]]
    for path in candidates:
        if path.is_file():
            return path
    looked = " and ".join(str(p) for p in candidates)
    raise DataError(
        f"{LABELS[name]} data not found: looked for {looked} (data dir {root}, {_data_dir_origin()}). "
        f"To get it, {_HOW_TO_GET[name]}, or set {ENV_VAR} to a folder that holds {_LAYOUT[name][0]}.")


def dataset_label(name: str, path: str | Path | None = None) -> str:
    """Human label for results tables; the reconstructed ML-1M copy is labelled as such."""
    if name == "ml-1m" and path is not None and Path(path).name == "ratings_known.dat":
        return "ML-1M (reconstructed)"
    if name == "kuairand" and path is not None:
        return LABELS["kuairand-sample"] if "head_users0-3" in Path(path).name else f"KuaiRand ({Path(path).name})"
    return LABELS.get(name, name)
