"""Where datasets live on disk.

``data_dir()`` resolves the data folder once per call (so tests may change ``GRF_DATA_DIR``):

1. ``$GRF_DATA_DIR`` when set;
2. ``<repo root>/../shared/data`` when that folder exists (the team's shared checkout layout;
   repo root = the folder holding the ``gr_functional`` package);
3. ``~/.cache/gr-functional/data`` (where ``grf data fetch`` puts downloads for users).

``dataset_path(name)`` maps a dataset name to its main file under that folder and raises
``DataMissing`` (a ``DataError``) saying where it looked and how to get the data when nothing is there. Layouts,
labels and how-to-get texts come from the dataset registry (``registry.py``): each dataset
declares them in its own module.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataMissing
from . import registry

ENV_VAR = "GRF_DATA_DIR"


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
    """Names ``dataset_path`` knows (the registered data files), in display order."""
    return registry.file_names()


def dataset_path(name: str) -> Path:
    """Main file of dataset ``name`` under ``data_dir()``; ``DataMissing`` (where it looked, how to get it) if absent.

    ``name`` is a registered data file (``dataset_names()``) or a dataset with a default file
    (``gr_functional/data/registry.py``). Shipped: ``ml-1m`` (``movielens-1m/ratings.dat``, else
    the reconstructed ``movielens-1m/reconstructed/ratings_known.dat``), ``ml-20m``
    (``movielens-20m/ratings.csv``), ``kuairand-sample`` (the 211-row KuaiRand-1K log sample; also
    ``kuairand``), ``kuairand-27k-lengths`` (per-user exposure counts of KuaiRand-27K),
    ``kuairand-user-features`` / ``kuairand-video-features`` (KuaiRand-Pure's side features).
    """
    file = registry.get_file(name)
    root = data_dir()
    candidates = [root / rel for rel in file.layout]
    for path in candidates:
        if path.is_file():
            return path
    if file.bundled and (registry.SAMPLES / file.bundled).is_file():
        return registry.SAMPLES / file.bundled  # the excerpt shipped with the package
    looked = " and ".join(str(p) for p in candidates)
    how = f"{file.how_to_get}, or " if file.how_to_get else ""
    raise DataMissing(
        f"{file.label} data not found: looked for {looked} (data dir {root}, {_data_dir_origin()}). "
        f"To get it, {how}set {ENV_VAR} to a folder that holds {file.layout[0]}.",
        name=name, label=file.label, how_to_get=file.how_to_get)


def dataset_label(name: str, path: str | Path | None = None) -> str:
    """Human label for results tables, from the registry: the dataset's ``label_for(path)`` when a
    path is given (the reconstructed ML-1M copy is labelled as such), else its label; a data
    file's label; ``name`` itself when nothing is registered under it."""
    if name in registry.names():
        spec = registry.get_dataset(name)
        if path is not None and spec.label_for is not None:
            return spec.label_for(Path(path))
        return spec.label
    if name in registry.file_names():
        return registry.get_file(name).label
    return name
