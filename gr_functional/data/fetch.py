"""Download a registered dataset or data file from its publisher, verify its checksum, unpack it.

What to download is a ``registry.Download`` (URL, MD5 or SHA-256, kind: zip, tar.gz or a single
file, target folder), either a dataset's ``DatasetSpec.download`` (``SOURCES``: MovieLens-1M and
-20M, ``sources/movielens.py``, where the checksums' provenance is documented) or, for downloads
that belong to no single dataset, one registered with ``register_download`` (``FILE_DOWNLOADS``:
the KuaiRand-Pure and -1K releases, which hold several registered files, and the third-party
KuaiRand-27K length table; ``sources/kuairand.py``). None of these is shipped: MovieLens may not be
redistributed, KuaiRand is CC BY-SA 4.0 data best taken from its publisher, and the 27K table
carries no licence, so each user fetches them.
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import MutableMapping
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ..errors import DataError
from . import registry
from .paths import ENV_VAR, data_dir
from .registry import Download

Source = Download  # the name this module used before the registry


class _Sources(MutableMapping):
    """``SOURCES``: name -> ``Download`` of every downloadable registered dataset, read live from
    the registry; assigning replaces a dataset's download (a mirror, or a test's fake archive)."""

    def __getitem__(self, name: str) -> Download:
        spec = registry.get_dataset(name) if name in registry.names() else None
        if spec is None or spec.download is None:
            raise KeyError(name)
        return spec.download

    def __setitem__(self, name: str, download: Download) -> None:
        registry.set_download(name, download)

    def __delitem__(self, name: str) -> None:
        self[name]  # KeyError when there is nothing to remove
        registry.set_download(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(registry.downloadable())

    def __len__(self) -> int:
        return len(registry.downloadable())


SOURCES: MutableMapping[str, Download] = _Sources()

_FILE_DOWNLOADS: dict[str, Download] = {}


class _FileDownloads(MutableMapping):
    """``FILE_DOWNLOADS``: fetch name -> ``Download`` of the downloads that belong to no single
    dataset (a release holding several registered files, a side file), in registration order;
    assigning replaces one (a mirror, or a test's fake archive)."""

    def __getitem__(self, name: str) -> Download:
        registry.names()  # the shipped modules register theirs on the registry's first use
        return _FILE_DOWNLOADS[name]

    def __setitem__(self, name: str, download: Download) -> None:
        registry.names()
        _FILE_DOWNLOADS[name] = download

    def __delitem__(self, name: str) -> None:
        registry.names()
        del _FILE_DOWNLOADS[name]

    def __iter__(self) -> Iterator[str]:
        registry.names()
        return iter(list(_FILE_DOWNLOADS))

    def __len__(self) -> int:
        registry.names()
        return len(_FILE_DOWNLOADS)


FILE_DOWNLOADS: MutableMapping[str, Download] = _FileDownloads()


def register_download(name: str, download: Download, *, replace: bool = False) -> Download:
    """Make ``grf data fetch NAME`` download ``download`` where no dataset owns it (a dataset's own
    download is its ``DatasetSpec.download``). A name taken by another download or by a dataset
    with one raises ``ValueError`` unless ``replace=True``. Returns ``download``."""
    old = _FILE_DOWNLOADS.get(name)
    if not replace and old is not None and old != download:
        raise ValueError(f"a download named {name!r} is already registered ({old.url}); "
                         f"pick another name or pass replace=True")
    if not replace and name in registry.downloadable():
        raise ValueError(f"{name!r} is a dataset with its own download; pick another name or pass replace=True")
    _FILE_DOWNLOADS[name] = download
    return download


def fetchable() -> tuple[str, ...]:
    """Every name ``grf data fetch`` accepts: the downloadable datasets, then ``FILE_DOWNLOADS``."""
    return (*SOURCES, *(n for n in FILE_DOWNLOADS if n not in SOURCES))


def _download_of(name: str) -> Download | None:
    if name in SOURCES:
        return SOURCES[name]
    return FILE_DOWNLOADS.get(name)


def _size(mb: int) -> str:
    return f"{mb / 1000:.1f} GB" if mb >= 1000 else f"{mb} MB"


def listing() -> list[str]:
    """One line per fetchable name: what it is, the download's size and host, its licence."""
    lines = []
    for name in fetchable():
        src = _download_of(name)
        label = src.label or (registry.get_dataset(name).label if name in SOURCES else name)
        licence = f"; {src.license}" if src.license else ""
        lines.append(f"{name}: {label}, about {_size(src.approx_mb)} from {_host(src)}{licence}")
    return lines


def __getattr__(name: str):
    if name == "LICENSE_NOTE":  # moved with the MovieLens entries
        from .sources.movielens import LICENSE_NOTE
        return LICENSE_NOTE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _host(src: Download) -> str:
    return urllib.parse.urlparse(src.url).netloc or src.url


_CHUNK = 1 << 20


def _download(src: Download, dest: Path, timeout: float, progress: Callable[[int, int], None] | None) -> str:
    """Stream ``src.url`` to ``dest``; returns the hex digest of the bytes written, in the
    algorithm of ``src.checksum``."""
    digest = hashlib.new(src.checksum[0], usedforsecurity=False)
    with urllib.request.urlopen(src.url, timeout=timeout) as resp, open(dest, "wb") as out:
        headers = getattr(resp, "headers", None)
        total = int(headers.get("Content-Length") or 0) if headers is not None else 0
        done = 0
        while True:
            chunk = resp.read(_CHUNK)
            if not chunk:
                break
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def _regular_files(archive: Path, src: Download) -> Iterator[tuple[str, BinaryIO]]:
    """``(name inside the archive, open member)`` of each regular file of the zip or tar.gz
    ``archive``, in archive order (each read before the next is asked for: a tarball is streamed)."""
    if src.kind == "zip":
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if not info.is_dir():
                    with z.open(info) as f:
                        yield info.filename, f
        return
    with tarfile.open(archive, "r|gz") as tar:
        for member in tar:
            # Regular files only: a symlink, hard link or device could point outside the target.
            if member.isfile():
                yield member.name, tar.extractfile(member)


def _extract(archive: Path, src: Download, target: Path) -> list[Path]:
    """Unpack the regular files directly under ``src.zip_prefix`` into ``target`` (flat; nothing
    else is written); returns the files written. ``src.main`` is put in place last, so its
    presence means the whole archive was unpacked."""
    written, part, main_part = [], None, None
    try:
        for name, fin in _regular_files(archive, src):
            while name.startswith("./"):  # tar's "./KuaiRand-Pure/..." spelling of the same member
                name = name[2:]
            if not name.startswith(src.zip_prefix):
                continue
            rel = name[len(src.zip_prefix):]
            # Flat names only: refuses "../x" and absolute paths a hostile archive could hold.
            if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
                continue
            out = target / rel
            part = out.with_name(out.name + ".part")
            with open(part, "wb") as fout:
                shutil.copyfileobj(fin, fout, _CHUNK)
            if rel == src.main:
                main_part, part = part, None
                continue
            os.replace(part, out)
            part = None
            written.append(out)
    except BaseException as exc:
        for leftover in (part, main_part):  # no half-written file that looks like data
            if leftover is not None:
                leftover.unlink(missing_ok=True)
        if isinstance(exc, (zipfile.BadZipFile, tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error)):
            raise DataError(f"{src.url}: the download is not a valid {src.kind} archive ({exc})") from None
        if isinstance(exc, OSError):  # local: disk full, permissions
            raise DataError(f"could not unpack {archive} into {target}: {exc}; free some space or set {ENV_VAR} "
                            f"to another folder") from None
        raise
    if main_part is not None:
        os.replace(main_part, target / src.main)
        written.append(target / src.main)
    return written


def _not_fetchable(name: str) -> str:
    """How to get a dataset or data file that has no download (its how-to-get text, or that it needs no file)."""
    if name not in registry.names():
        if name in registry.file_names():
            file = registry.get_file(name)
            return f" ({name}: {file.how_to_get}: {data_dir() / file.layout[0]})" if file.how_to_get else ""
        return f" (registered datasets: {', '.join(registry.names())})"
    spec = registry.get_dataset(name)
    if not spec.needs_file:
        return f" ({name} is generated: it needs no file)"
    if spec.file is not None and spec.how_to_get:
        return f" ({name}: {spec.how_to_get}: {data_dir() / spec.layout[0]})"
    return f" ({name} reads the file named by data.path)"


def fetch(name: str, dest_dir: str | Path | None = None, *, force: bool = False, timeout: float = 60.0,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Download ``name`` (``fetchable()``: a dataset with a download, "ml-1m" | "ml-20m", or a
    ``FILE_DOWNLOADS`` name, "kuairand-pure" | "kuairand-1k" | "kuairand-27k-lengths"), check its
    checksum, unpack it; returns the main file.

    Files land in ``<dest_dir or data_dir()>/<download.folder>/``: ``movielens-1m/`` (``ratings.dat``,
    ``movies.dat``, ``users.dat``, ``README``), ``movielens-20m/`` (``ratings.csv``, ...),
    ``kuairand/KuaiRand-Pure/data/`` and ``kuairand/KuaiRand-1K/data/`` (the release's csv files),
    ``kuairand/stats_kuairand27k_third_party/`` (the length table). An existing main file is kept
    unless ``force``. ``progress(bytes_done, bytes_total)`` is called while downloading (total 0
    when unknown). Raises ``DataError`` when offline, on an HTTP error, or when the checksum does not
    match (the bad download is deleted).
    """
    src = _download_of(name)
    if src is None:
        others = [n for n in fetchable() if n not in SOURCES]
        also = f"; other downloads: {', '.join(others)} (grf data info lists them)" if others else ""
        raise DataError(f"cannot fetch {name!r}: fetchable datasets are {', '.join(SOURCES)}{_not_fetchable(name)}"
                        f"{also}")
    root = Path(dest_dir).expanduser() if dest_dir is not None else data_dir()
    target = root / src.folder
    main = target / src.main
    if main.is_file() and not force:
        return main
    created = None  # the outermost folder this fetch creates, if any
    if not target.exists():
        created = target
        while not created.parent.exists() and created.parent != created:
            created = created.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {target}: {exc}; pass another folder or set {ENV_VAR}") from None
    try:
        return _fetch_into(src, target, main, timeout, progress)
    except DataError:
        # A failed first fetch leaves no empty folders that look like data.
        folder = target
        while created is not None and not any(folder.iterdir()):
            folder.rmdir()
            if folder == created:
                break
            folder = folder.parent
        raise


def _by_hand(src: Download, main: Path) -> str:
    """The manual route, for errors: download, check the checksum, unpack (or save) to ``main``."""
    algo, digest = src.checksum
    put = {"zip": f"unzip it so that {main} exists", "tar.gz": f"unpack it (tar -xzf) so that {main} exists",
           "file": f"save it as {main}"}[src.kind]
    return (f"download {src.url} by hand (about {_size(src.approx_mb)}), check `{algo}sum` prints {digest}, and "
            f"{put}, or set {ENV_VAR} to a folder that holds {src.folder}/{src.main}")


def _fetch_into(src: Download, target: Path, main: Path, timeout: float,
                progress: Callable[[int, int], None] | None) -> Path:
    archive = target / (Path(urllib.parse.urlparse(src.url).path).name + ".part")
    by_hand = _by_hand(src, main)
    try:
        got = _download(src, archive, timeout, progress)
    except urllib.error.HTTPError as exc:
        archive.unlink(missing_ok=True)
        raise DataError(f"{_host(src)} answered HTTP {exc.code} for {src.url}; {by_hand}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
        archive.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise DataError(f"could not reach {_host(src)}: {reason}; {by_hand}") from None
    except OSError as exc:  # local: disk full, permissions
        archive.unlink(missing_ok=True)
        raise DataError(f"could not write {archive}: {exc}; free some space or set {ENV_VAR} to another folder") from None
    algo, expected = src.checksum
    if got != expected:
        archive.unlink(missing_ok=True)
        where = f" ({src.md5_url})" if src.md5_url else ""
        # Without a publisher the value was pinned here (the 27K table's repository publishes none).
        who = f"{src.publisher} publishes" if src.publisher else "the pinned value is"
        raise DataError(f"checksum mismatch for {src.url}: {algo} {got}, but {who} {expected}{where}. "
                        f"The download is corrupt or was altered and has been deleted; run the fetch again, "
                        f"or {by_hand}")
    if src.kind == "file":
        os.replace(archive, main)
        return main
    try:
        _extract(archive, src, target)
    finally:
        archive.unlink(missing_ok=True)
    if not main.is_file():
        raise DataError(f"{src.url} held no {src.zip_prefix}{src.main}; {by_hand}")
    return main
