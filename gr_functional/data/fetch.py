"""Download a registered dataset from its publisher, verify the published checksum, unzip.

What to download is each dataset's ``DatasetSpec.download`` (``registry.Download``: URL, MD5,
target folder); today MovieLens-1M and -20M (``sources/movielens.py``, where the checksums'
provenance is documented). MovieLens may not be redistributed, so the project never ships it:
each user fetches it from files.grouplens.org.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Callable, Iterator

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


def __getattr__(name: str):
    if name == "LICENSE_NOTE":  # moved with the MovieLens entries
        from .sources.movielens import LICENSE_NOTE
        return LICENSE_NOTE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _host(src: Download) -> str:
    return urllib.parse.urlparse(src.url).netloc or src.url


_CHUNK = 1 << 20


def _download(src: Download, dest: Path, timeout: float, progress: Callable[[int, int], None] | None) -> str:
    """Stream ``src.url`` to ``dest``; returns the MD5 hex digest of the bytes written."""
    md5 = hashlib.md5(usedforsecurity=False)
    with urllib.request.urlopen(src.url, timeout=timeout) as resp, open(dest, "wb") as out:
        headers = getattr(resp, "headers", None)
        total = int(headers.get("Content-Length") or 0) if headers is not None else 0
        done = 0
        while True:
            chunk = resp.read(_CHUNK)
            if not chunk:
                break
            out.write(chunk)
            md5.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return md5.hexdigest()


def _extract(archive: Path, src: Download, target: Path) -> list[Path]:
    """Unpack the files directly under ``src.zip_prefix`` into ``target`` (flat; nothing else is written)."""
    written = []
    try:
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                name = info.filename
                if info.is_dir() or not name.startswith(src.zip_prefix):
                    continue
                rel = name[len(src.zip_prefix):]
                # Flat names only: refuses "../x" and absolute paths a hostile archive could hold.
                if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
                    continue
                out = target / rel
                part = out.with_name(out.name + ".part")
                with z.open(info) as fin, open(part, "wb") as fout:
                    shutil.copyfileobj(fin, fout, _CHUNK)
                os.replace(part, out)
                written.append(out)
    except zipfile.BadZipFile as exc:
        raise DataError(f"{src.url}: the download is not a valid zip archive ({exc})") from None
    return written


def _not_fetchable(name: str) -> str:
    """How to get a dataset that has no download (its how-to-get text, or that it needs no file)."""
    if name not in registry.names():
        return f" (registered datasets: {', '.join(registry.names())})"
    spec = registry.get_dataset(name)
    if not spec.needs_file:
        return f" ({name} is generated: it needs no file)"
    if spec.file is not None and spec.how_to_get:
        return f" ({name}: {spec.how_to_get}: {data_dir() / spec.layout[0]})"
    return f" ({name} reads the file named by data.path)"


def fetch(name: str, dest_dir: str | Path | None = None, *, force: bool = False, timeout: float = 60.0,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Download dataset ``name`` (a registered dataset with a download: "ml-1m" | "ml-20m"), check
    its MD5, unzip; returns the main file.

    Files land in ``<dest_dir or data_dir()>/movielens-1m/`` (``ratings.dat``, ``movies.dat``,
    ``users.dat``, ``README``) or ``movielens-20m/`` (``ratings.csv``, ``movies.csv``, ...). An existing
    ratings file is kept unless ``force``. ``progress(bytes_done, bytes_total)`` is called while
    downloading (total 0 when unknown). Raises ``DataError`` when offline, on an HTTP error, or when
    the checksum does not match (the bad download is deleted).
    """
    if name not in SOURCES:
        raise DataError(f"cannot fetch {name!r}: fetchable datasets are {', '.join(SOURCES)}{_not_fetchable(name)}")
    src = SOURCES[name]
    root = Path(dest_dir).expanduser() if dest_dir is not None else data_dir()
    target = root / src.folder
    main = target / src.main
    if main.is_file() and not force:
        return main
    created = not target.exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {target}: {exc}; pass another folder or set {ENV_VAR}") from None
    try:
        return _fetch_into(src, target, main, timeout, progress)
    except DataError:
        if created and not any(target.iterdir()):
            target.rmdir()  # a failed first fetch leaves no empty folder that looks like data
        raise


def _fetch_into(src: Download, target: Path, main: Path, timeout: float,
                progress: Callable[[int, int], None] | None) -> Path:
    archive = target / (Path(src.url).name + ".part")
    by_hand = (f"download {src.url} by hand (about {src.approx_mb} MB), check `md5sum` prints {src.md5}, and unzip "
               f"it so that {main} exists, or set {ENV_VAR} to a folder that holds {src.folder}/{src.main}")
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
    if got != src.md5:
        archive.unlink(missing_ok=True)
        where = f" ({src.md5_url})" if src.md5_url else ""
        raise DataError(f"checksum mismatch for {src.url}: md5 {got}, but {src.publisher or _host(src)} publishes "
                        f"{src.md5}{where}. The download is corrupt or was altered and has been deleted; "
                        f"run the fetch again, or {by_hand}")
    try:
        _extract(archive, src, target)
    finally:
        archive.unlink(missing_ok=True)
    if not main.is_file():
        raise DataError(f"{src.url} held no {src.zip_prefix}{src.main}; {by_hand}")
    return main
