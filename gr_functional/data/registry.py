"""Datasets by name: each dataset is one ``DatasetSpec`` registered once, in the module that reads it.

``[data] dataset = NAME`` (a plain string, checked against this registry when the config is
built) picks the spec; ``load_dataset(cfg.data)`` calls its ``load``; ``dataset_path``,
``dataset_label``, ``grf data fetch`` and ``grf data info`` read its file layout, label and
download from the same entry. The shipped datasets live in ``gr_functional/data/sources/``
(``synthetic``, ``movielens``: ml-1m and ml-20m, ``kuairand``, ``interactions``: csv, your own
file); the first use of the registry imports them, so they are always registered.

A dataset of your own is one module with one entry (a file passed to ``grf train --plugin``,
saved in ``train.plugins``, or any module imported before ``load_dataset``)::

    from gr_functional.data import Interactions
    from gr_functional.data.registry import DatasetSpec, register_dataset

    def load_clicks(cfg, path):                     # cfg: DataConfig, path: the resolved file
        user, item, time = ...                      # [N] int64 each, time in unix seconds
        return Interactions(user=user, item=item, time=time, name="Clicks", source=str(path))

    register_dataset(DatasetSpec("clicks", "Clicks", load_clicks, layout=("clicks/log.csv",),
                                 how_to_get="export the click log to that path"))

and ``--set data.dataset=clicks`` trains on it. ``load`` returns ``Interactions`` (the registry
groups them into per-user sequences with ``from_interactions``, honouring ``data.remap_items``)
or a finished ``SequenceData``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, DataError
from ..registry import Registry


@dataclasses.dataclass(frozen=True)
class Download:
    """Where ``grf data fetch NAME`` downloads from: a zip or tar.gz archive, or a single file, with
    a checksum (the publisher's MD5, or a SHA-256 pinned here where nobody publishes one).

    ``folder``/``main`` is the file the download must produce under the data dir (a dataset's
    ``layout[0]``, or a candidate of the registered files it provides); an archive's regular files
    directly under ``zip_prefix`` (a folder inside the zip or tarball) are unpacked flat into
    ``folder``, and a single file is saved as ``main``. ``publisher`` and ``md5_url`` name who
    publishes the checksum and where, for the error on a mismatch ("" = nobody / not said).
    ``label`` and ``license`` are what ``grf data info`` lists beside the name ("" = the
    dataset's label / nothing said).
    """

    url: str
    md5: str          # hex digest, as published beside the archive ("" when ``sha256`` is the checksum)
    folder: str       # under the data dir
    zip_prefix: str   # folder inside the archive ("" for kind="file")
    main: str         # the file dataset_path() looks for
    approx_mb: int
    publisher: str = ""
    md5_url: str = ""  # where the checksum (md5 or sha256) is published
    kind: str = "zip"  # "zip" | "tar.gz" | "file" (a single file, not unpacked)
    sha256: str = ""   # hex digest, checked instead of the MD5 when given
    label: str = ""
    license: str = ""

    KINDS = ("zip", "tar.gz", "file")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"Download {self.url}: kind must be one of {', '.join(self.KINDS)}, not {self.kind!r}")
        if bool(self.md5) == bool(self.sha256):
            raise ValueError(f"Download {self.url}: give exactly one checksum, md5 or sha256")

    @property
    def checksum(self) -> tuple[str, str]:
        """``(algorithm, hex digest)``: ``("sha256", ...)`` when a SHA-256 is given, else ``("md5", ...)``."""
        return ("sha256", self.sha256) if self.sha256 else ("md5", self.md5)


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A named file under the data dir: ``layout`` holds candidate paths relative to it, in order
    of preference; ``how_to_get`` completes "To get it, ..." when none exists. Files that no
    dataset loads by default (KuaiRand-27K's per-user lengths) are registered with
    ``register_file``; a dataset's default file is registered with it."""

    name: str
    label: str
    layout: tuple[str, ...]
    how_to_get: str = ""
    # a small excerpt shipped with the package (gr_functional/data/samples/, its licence beside it),
    # read when the data dir has none of ``layout``: relative to that folder ("" = none shipped)
    bundled: str = ""


SAMPLES = Path(__file__).resolve().parent / "samples"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A dataset ``[data] dataset = name`` can select.

      name         the config value, e.g. "ml-1m"
      label        what results tables call the data read from the default file, e.g. "ML-1M"
      load         ``load(cfg: DataConfig, path: Path | None) -> Interactions | SequenceData``;
                   ``path`` is the resolved file (``data.path``, else the default file), None when
                   ``needs_file`` is false
      layout       default file: candidate paths under the data dir, in order of preference
                   (empty: the file must be named by ``data.path``)
      how_to_get   how to obtain the default file (completes "To get it, ...")
      default_file file name looked for when ``data.path`` is a folder ("" = a folder is an error)
      download     what ``grf data fetch NAME`` downloads (None: not downloadable)
      needs_file   false for generated data (synthetic): no path is resolved
      file_name    the name ``dataset_path`` knows the default file by ("" = ``name``)
      label_for    label of the data read from a given file (e.g. the reconstructed ML-1M copy);
                   None = ``label`` whatever the file
      bundled      a shipped excerpt of the default file, read when the data dir has none
                   (``DataFile.bundled``)
      task         the ``model.task`` that trains on it: "retrieval" (``load`` returns Interactions
                   or SequenceData) or "ranking" (``load(cfg: Config, path: Path | None)``, the
                   whole config, returns RankingSequences; gr_functional/ranking/data.py)
    """

    name: str
    label: str
    load: Callable  # (cfg: DataConfig, path: Path | None) -> Interactions | SequenceData
    layout: tuple[str, ...] = ()
    how_to_get: str = ""
    default_file: str = ""
    download: Download | None = None
    needs_file: bool = True
    file_name: str = ""
    label_for: Callable[[Path], str] | None = None
    task: str = "retrieval"
    bundled: str = ""

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"DatasetSpec name must be a non-empty string, got {self.name!r}")
        if not callable(self.load):
            raise ValueError(f"DatasetSpec {self.name!r}: load must be callable, got {self.load!r}")
        if isinstance(self.layout, str):  # ("a.csv") is a string, not a 1-tuple: a common slip
            raise ValueError(f"DatasetSpec {self.name!r}: layout must be a tuple of paths, e.g. ({self.layout!r},)")
        if self.download is not None and not self.layout:
            raise ValueError(f"DatasetSpec {self.name!r}: a download needs a layout (where the file lands)")

    @property
    def file(self) -> DataFile | None:
        """The default file as a ``DataFile`` (None when the dataset has no layout)."""
        if not self.layout:
            return None
        return DataFile(self.file_name or self.name, self.label, tuple(self.layout), self.how_to_get, self.bundled)


_FILES: dict[str, DataFile] = {}
# The shipped datasets register themselves when their modules are imported, which happens on the
# first use of this registry, in this order (the order of names()): imported here at module level,
# they would import this module back while it is half-built.
_SHIPPED = ("synthetic", "movielens", "kuairand", "kuairand_features", "interactions",
            "kuairand_ranking_synthetic", "kuairand_ranking", "kuairand_ranking_stream")


def _load_shipped() -> None:
    import importlib

    for module in _SHIPPED:
        importlib.import_module(f"{__package__}.sources.{module}")


def _listing_order(name: str, spec: DatasetSpec) -> tuple:
    """Retrieval datasets first, then ranking; the shipped in _SHIPPED's order (one module may
    import another while registering), then the others as registered."""
    module = getattr(spec.load, "__module__", "").rpartition(".")[2]
    return spec.task != "retrieval", _SHIPPED.index(module) if module in _SHIPPED else len(_SHIPPED)


DATASETS: Registry[DatasetSpec] = Registry(
    "dataset", config_key="data.dataset", load=_load_shipped, order=_listing_order,
    how="Your own interactions file: data.dataset=\"csv\" with data.path=FILE (README \"Your own data\"); your own "
        "loader: gr_functional.data.registry.register_dataset(DatasetSpec(NAME, ...)) in a module passed to "
        "grf train --plugin")


def register_dataset(spec: DatasetSpec, *, replace: bool = False) -> DatasetSpec:
    """Register ``spec`` under ``spec.name`` (and its default file under ``file_name or name``).

    Registering a taken name raises ``ValueError`` unless ``replace=True`` or the same loader is
    registered again (a module imported twice). Returns ``spec``.
    """
    DATASETS.add(spec.name, spec, origin_of=spec.load, replace=replace)
    if spec.file is not None:
        _FILES[spec.file.name] = spec.file
    return spec


def dataset(name: str, label: str, **fields) -> Callable:
    """Decorator form of ``register_dataset``: ``@dataset("clicks", "Clicks", layout=(...))`` over
    the ``load(cfg, path)`` function registers it (other ``DatasetSpec`` fields as keywords;
    ``replace=True`` passes through)."""
    replace = fields.pop("replace", False)

    def add(load: Callable) -> Callable:
        register_dataset(DatasetSpec(name, label, load, **fields), replace=replace)
        return load

    return add


def register_file(file: DataFile, *, replace: bool = False) -> DataFile:
    """Register a file under the data dir that no dataset loads by default (``dataset_path`` finds it)."""
    DATASETS.names()  # the shipped files come first
    old = _FILES.get(file.name)
    if old is not None and old != file and not replace:
        raise ValueError(f"a data file named {file.name!r} is already registered ({old.layout[0]}); "
                         f"pick another name or pass replace=True")
    _FILES[file.name] = file
    return file


def names(task: str | None = None) -> tuple[str, ...]:
    """Registered dataset names (of ``task`` when given), in registration order (the shipped ones first)."""
    return tuple(n for n, spec in DATASETS.items() if task is None or spec.task == task)


def file_names() -> tuple[str, ...]:
    """Names of the registered data files (``dataset_path`` accepts these), in registration order."""
    DATASETS.names()
    return tuple(_FILES)


def unknown_message(name: str, task: str | None = None) -> str:
    """Why ``name`` is not a dataset, the registered names (of ``task``) and how to add one."""
    return DATASETS.unknown_message(name, among=names(task))


def get_dataset(name: str) -> DatasetSpec:
    """The registered dataset ``name``, or ``ConfigError`` with a did-you-mean and the registered names."""
    if not isinstance(name, str) or name not in DATASETS:
        raise ConfigError(f"data.dataset={name!r}: {unknown_message(name)}")
    return DATASETS.get(name)


def check_config(cfg) -> list[tuple[str, str, str]]:
    """``data.dataset`` must be registered, for the config's ``model.task``."""
    name, task = cfg.data.dataset, cfg.model.task
    if name not in DATASETS:
        return [("data", "dataset", unknown_message(name, task))]
    spec = DATASETS.get(name)
    if spec.task != task:
        return [("data", "dataset", f"is a {spec.task} dataset, but model.task={task!r} trains on a {task} "
                                    f"dataset: one of {', '.join(names(task))} (or set model.task={spec.task!r})")]
    return []


def get_file(name: str) -> DataFile:
    """The data file ``name``: a registered file, else the default file of dataset ``name``;
    ``DataError`` listing the known files otherwise."""
    DATASETS.names()
    if name in _FILES:
        return _FILES[name]
    spec = DATASETS.get(name) if name in DATASETS else None
    if spec is not None and spec.file is not None:
        return _FILES.get(spec.file.name, spec.file)
    raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(_FILES)}")


def downloadable() -> tuple[str, ...]:
    """Names of the datasets ``grf data fetch`` can download."""
    return tuple(n for n, s in DATASETS.items() if s.download is not None)


def set_download(name: str, download: Download | None) -> None:
    """Replace (or remove, with None) the download of the registered dataset ``name`` (a mirror,
    or a test's fake archive)."""
    spec = get_dataset(name)
    DATASETS.add(name, dataclasses.replace(spec, download=download), origin_of=spec.load, replace=True)

