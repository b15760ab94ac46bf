"""One entry point from ``[data]`` config to ``SequenceData``: ``load_dataset(cfg.data)``."""
from __future__ import annotations

from pathlib import Path

from ..config import DataConfig
from . import registry
from .loaders import DataError, Interactions
from .paths import dataset_path
from .sequences import SequenceData, from_interactions, remap_sequence_items, shuffle_ties


def __getattr__(name: str):
    if name == "DATASETS":  # the registered names, read live (a plugin may register more)
        return registry.names("retrieval")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_path(spec: registry.DatasetSpec, cfg_path: str) -> Path | None:
    """The file dataset ``spec`` reads: ``data.path`` (a folder: its ``spec.default_file``), else
    the dataset's default file under GRF_DATA_DIR; None when the dataset needs no file.
    ``DataError`` naming ``data.path`` and the fix when there is no such file."""
    if not spec.needs_file:
        return None
    file = spec.file
    if not cfg_path:
        if file is None:
            raise DataError(f"data.dataset={spec.name!r} reads the file named by data.path, which is empty; set it, "
                            f"e.g. --set data.path=events.csv")
        return dataset_path(file.name)
    path = Path(cfg_path).expanduser()
    if path.is_dir():
        if not spec.default_file:
            raise DataError(f"data.path={cfg_path!r} is a folder; name the {spec.label} file in it "
                            f"(data.dataset={spec.name!r}): data.path takes a file")
        if not (path / spec.default_file).is_file():
            raise DataError(f"data.path={cfg_path!r} is a folder without {spec.default_file} (the file "
                            f"data.dataset={spec.name!r} looks for in a folder); data.path takes the {spec.label} "
                            f"file itself, or a folder holding {spec.default_file}"
                            f"{f' (or leave it empty to use the {file.name} file under GRF_DATA_DIR)' if file else ''}")
        path = path / spec.default_file
    if not path.is_file():
        fix = (f"leave data.path empty to use the {file.name} file under GRF_DATA_DIR" if file is not None
               else "set data.path to an existing file")
        raise DataError(f"data.path={cfg_path!r}: {path} does not exist ({fix})")
    return path


def load_dataset(cfg: DataConfig) -> SequenceData:
    """Build the dataset named by ``cfg.dataset``: any registered name (``registry.names()``;
    shipped: ``synthetic | ml-1m | ml-20m | kuairand | csv``).

    The registered ``load(cfg, path)`` reads the resolved file (``resolve_path``). When it returns
    ``Interactions`` they are grouped into time-sorted per-user sequences by ``from_interactions``
    with ``data.remap_items``; a returned ``SequenceData`` whose ids were not remapped yet is
    remapped here when ``data.remap_items=true`` (dense 1..K in increasing raw-id order,
    ``SequenceData.raw_item_ids`` keeps the raw id of each; candidates are mapped the same way).
    Per dataset (see each ``sources/`` module): MovieLens keeps raw movie ids and ranks the ids of
    movies.dat / movies.csv at evaluation; KuaiRand ids are always remapped (its video ids start
    at 0, the padding id) and with ``data.path`` empty it reads the 211-row sample; "csv" reads
    ``data.path`` with the ``data.csv_*`` keys. ``SequenceData.describe()`` is the one-line report
    of what was loaded (users, events, item-id range, duplicates). ``data.ties = "shuffle"``
    then permutes each user's same-second events (``sequences.shuffle_ties``).
    """
    name = cfg.dataset
    retrieval = registry.names("retrieval")
    if name not in retrieval:
        raise DataError(f"data.dataset={name!r}: {registry.unknown_message(name, 'retrieval')}")
    spec = registry.get_dataset(name)
    data = spec.load(cfg, resolve_path(spec, cfg.path))
    if isinstance(data, Interactions):
        data = from_interactions(data, remap_items=cfg.remap_items)
    elif not isinstance(data, SequenceData):
        raise TypeError(f"dataset {name!r}: {spec.load.__module__}.{spec.load.__qualname__} returned "
                        f"{type(data).__name__}; a dataset's load returns Interactions or SequenceData")
    elif cfg.remap_items and data.raw_item_ids is None:
        data = remap_sequence_items(data)
    if cfg.ties == "shuffle":
        data = shuffle_ties(data, cfg.ties_seed)
    return data
