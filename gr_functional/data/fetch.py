"""Download MovieLens from its publisher (GroupLens), verify the published checksum, unzip.

MovieLens may not be redistributed, so the project never ships it: each user fetches it from
files.grouplens.org. Checksum provenance: GroupLens publishes an MD5 beside each archive
(``https://files.grouplens.org/datasets/movielens/ml-1m.zip.md5`` and ``ml-20m.zip.md5``, lines like
``MD5 (ml-20m.zip) = cd245b17...``). The values pinned below were not fetched here (no network);
they are the values that many independent public projects quote from those sidecar files
(e.g. eli-osherovich/papers_with_code ``datasets/movielens/dl_config.py``, a script commenting
"From: curl -O http://files.grouplens.org/datasets/movielens/ml-1m.zip.md5", and several dataset
registries), all agreeing. GroupLens publishes no SHA-256, so MD5 is what can be checked.
"""
from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import shutil
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable

from ..errors import DataError
from .paths import ENV_VAR, data_dir

LICENSE_NOTE = ("MovieLens is published by GroupLens Research (University of Minnesota) for research use; "
                "it may not be redistributed. Cite: F. M. Harper and J. A. Konstan, The MovieLens Datasets: "
                "History and Context, ACM TiiS 5(4), 2015. Terms: the README inside the archive.")


@dataclasses.dataclass(frozen=True)
class Source:
    url: str
    md5: str          # as published by GroupLens in <url>.md5
    folder: str       # under the data dir
    zip_prefix: str   # folder inside the archive
    main: str         # the file dataset_path() looks for
    approx_mb: int


SOURCES: dict[str, Source] = {
    "ml-1m": Source("https://files.grouplens.org/datasets/movielens/ml-1m.zip",
                    "c4d9eecfca2ab87c1945afe126590906", "movielens-1m", "ml-1m/", "ratings.dat", 6),
    "ml-20m": Source("https://files.grouplens.org/datasets/movielens/ml-20m.zip",
                     "cd245b17a1ae2cc31bb14903e1204af3", "movielens-20m", "ml-20m/", "ratings.csv", 190),
}

_CHUNK = 1 << 20


def _download(src: Source, dest: Path, timeout: float, progress: Callable[[int, int], None] | None) -> str:
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


def _extract(archive: Path, src: Source, target: Path) -> list[Path]:
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


def fetch(name: str, dest_dir: str | Path | None = None, *, force: bool = False, timeout: float = 60.0,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Download dataset ``name`` ("ml-1m" | "ml-20m"), check its MD5, unzip; returns the ratings file.

    Files land in ``<dest_dir or data_dir()>/movielens-1m/`` (``ratings.dat``, ``movies.dat``,
    ``users.dat``, ``README``) or ``movielens-20m/`` (``ratings.csv``, ``movies.csv``, ...). An existing
    ratings file is kept unless ``force``. ``progress(bytes_done, bytes_total)`` is called while
    downloading (total 0 when unknown). Raises ``DataError`` when offline, on an HTTP error, or when
    the checksum does not match (the bad download is deleted).
    """
    if name not in SOURCES:
        raise DataError(f"cannot fetch {name!r}: fetchable datasets are {', '.join(SOURCES)} "
                        f"(KuaiRand: download it from https://kuairand.com, zenodo record 10439422)")
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


def _fetch_into(src: Source, target: Path, main: Path, timeout: float,
                progress: Callable[[int, int], None] | None) -> Path:
    archive = target / (Path(src.url).name + ".part")
    by_hand = (f"download {src.url} by hand (about {src.approx_mb} MB), check `md5sum` prints {src.md5}, and unzip "
               f"it so that {main} exists, or set {ENV_VAR} to a folder that holds {src.folder}/{src.main}")
    try:
        got = _download(src, archive, timeout, progress)
    except urllib.error.HTTPError as exc:
        archive.unlink(missing_ok=True)
        raise DataError(f"files.grouplens.org answered HTTP {exc.code} for {src.url}; {by_hand}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
        archive.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise DataError(f"could not reach files.grouplens.org: {reason}; {by_hand}") from None
    except OSError as exc:  # local: disk full, permissions
        archive.unlink(missing_ok=True)
        raise DataError(f"could not write {archive}: {exc}; free some space or set {ENV_VAR} to another folder") from None
    if got != src.md5:
        archive.unlink(missing_ok=True)
        raise DataError(f"checksum mismatch for {src.url}: md5 {got}, but GroupLens publishes {src.md5} "
                        f"({src.url}.md5). The download is corrupt or was altered and has been deleted; "
                        f"run the fetch again, or {by_hand}")
    try:
        _extract(archive, src, target)
    finally:
        archive.unlink(missing_ok=True)
    if not main.is_file():
        raise DataError(f"{src.url} held no {src.zip_prefix}{src.main}; {by_hand}")
    return main
