"""The ``Interactions`` type and the fast reader of delimited numeric logs the dataset modules use
(``sources/movielens.py``, ``sources/kuairand.py``).

The fast path reads the file in large newline-aligned blocks and parses each block with one
``np.fromstring`` call (about 0.5 s for the 1M-row ML-1M file). A vectorised per-line field count
guards it: a line with 5 fields next to one with 3 would otherwise shift every column silently.
Only when a block fails a check does a slow line-by-line scan run, to report the first bad line as
``path:lineno: ...``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from ..errors import DataError  # noqa: F401 (re-exported)

_BLOCK_BYTES = 64 << 20
_WHITESPACE = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass
class Interactions:
    """One row per event, in file order.

      user[N] int64      raw user id
      item[N] int64      raw item id
      time[N] int64      event time, unix seconds
      rating[N] float32  explicit rating, or None (implicit feedback)
      extra              name -> [N] array of further columns (e.g. KuaiRand ``is_click`` int64)
      name               dataset label for reports, e.g. "ML-1M (reconstructed)"
      source             file the rows came from
      first_line         line number of row 0 in ``source`` (2 below a header), so row r is
                         ``source:first_line + r`` in error messages
      lines[N] int64     line of each row in ``source`` when rows are not consecutive lines (rows
                         filtered out, or records spanning lines), or None (then ``first_line + r``)
      item_names[K] str  when the file's item ids were strings: the string of item id k + 1 (ids
                         are the strings' ranks in byte order); None when they were integers
    """

    user: np.ndarray
    item: np.ndarray
    time: np.ndarray
    rating: np.ndarray | None = None
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    name: str = ""
    source: str = ""
    first_line: int = 1
    lines: np.ndarray | None = None
    item_names: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.user)
        columns = {"item": self.item, "time": self.time, **self.extra}
        if self.rating is not None:
            columns["rating"] = self.rating
        if self.lines is not None:
            columns["lines"] = self.lines
        for key, col in columns.items():
            if len(col) != n:
                raise DataError(f"Interactions column {key!r} has {len(col)} rows, user has {n}")

    def __len__(self) -> int:
        return len(self.user)

    def where(self, row: int) -> str:
        """``"FILE:LINE"`` of row ``row`` (file order), or ``"NAME row R"`` when built in memory."""
        if self.source:
            line = self.first_line + int(row) if self.lines is None else int(self.lines[row])
            return f"{self.source}:{line}"
        return f"{self.name or 'interactions'} row {int(row)}"


# ---------------------------------------------------------------------------------- parsing
def _content_end(f, size: int) -> int:
    """Byte offset after the last non-whitespace byte, so trailing blank lines are not rows."""
    end = size
    while end > 0:
        start = max(0, end - 4096)
        f.seek(start)
        tail = f.read(end - start).rstrip(_WHITESPACE)
        if tail:
            return start + len(tail)
        end = start
    return 0


def _blocks(path: Path, start: int, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block, lineno of its first line)``; blocks end on line boundaries, none is empty."""
    with open(path, "rb") as f:
        end = _content_end(f, os.fstat(f.fileno()).st_size)
        f.seek(start)
        pos, carry, lineno = start, b"", 1
        while pos < end:
            chunk = f.read(min(block_bytes, end - pos))
            pos += len(chunk)
            data = carry + chunk
            if pos >= end:
                cut = len(data)
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # a single line longer than a block: keep reading
                    carry = data
                    continue
            carry = data[cut:]
            block = data[:cut]
            yield block, lineno
            lineno += block.count(b"\n")


def _read_first_line(path: Path) -> tuple[bytes, int]:
    """First line (BOM and line ending removed) and the byte offset where line 2 starts."""
    with open(path, "rb") as f:
        line = f.readline()
    offset = len(line)
    if line.startswith(_BOM):
        line = line[len(_BOM):]
    return line.rstrip(b"\r\n"), offset


def _describe(fields: Sequence[str], sep: str) -> str:
    return sep.join(fields)


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_BOM = b"\xef\xbb\xbf"


def _scan_block(path: Path, block: bytes, lineno: int, sep: str, names: Sequence[str],
                int_cols: set[int]) -> None:
    """Slow path: raise ``DataError`` at the first malformed line of ``block`` (only run after a fast check failed)."""
    lines = block.split(b"\n")
    for i, raw in enumerate(lines):
        where = f"{path}:{lineno + i}"
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        if i == 0 and line.startswith("\ufeff"):
            line = line[1:]
        if not line.strip():
            if i == len(lines) - 1:
                continue  # the newline that ends the block, not a line
            raise DataError(f"{where}: expected {len(names)} fields separated by {sep!r}, got an empty line "
                            f"(format: {_describe(names, sep)})")
        fields = line.split(sep)
        if len(fields) != len(names):
            raise DataError(f"{where}: expected {len(names)} fields separated by {sep!r}, got {len(fields)}: "
                            f"{line[:120]!r} (format: {_describe(names, sep)})")
        for c, text in enumerate(fields):
            text = text.strip()
            if not text:
                raise DataError(f"{where}: field {c + 1} ({names[c]}) is empty: {line[:120]!r}")
            # ASCII digits only, as the fast parser reads them (Python's int() would also take
            # "1_2" or full-width digits, and the error would blame the whole block)
            if not (_INT if c in int_cols else _FLOAT).fullmatch(text):
                kind = "an integer" if c in int_cols else "a number"
                raise DataError(f"{where}: field {c + 1} ({names[c]}) is not {kind}: {text[:40]!r} "
                                f"in line {line[:120]!r} (ASCII digits only)") from None


def _parse_block(path: Path, block: bytes, lineno: int, sep: str, names: Sequence[str],
                 int_cols: set[int], dtype) -> np.ndarray:
    ncols = len(names)
    sep_b = sep.encode()
    if block.startswith(_BOM) and lineno <= 2:  # a UTF-8 byte-order mark before the first line
        block = block[len(_BOM):]
    n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)

    u8 = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(u8 == 10)
    if len(ends) < n_lines:
        ends = np.append(ends, len(u8))
    seps = np.flatnonzero(u8 == sep_b[0])
    per_line = np.bincount(np.searchsorted(ends, seps), minlength=n_lines)
    ok = bool((per_line == len(sep_b) * (ncols - 1)).all())

    values = None
    if ok:
        text = block.replace(sep_b, b" ") if sep != " " else block
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                values = np.fromstring(text, dtype=dtype, sep=" ")
            except ValueError:
                values = None
        # On unparsable text fromstring only warns and returns what it read so far.
        if any("could not be read to its end" in str(w.message) for w in caught):
            values = None
        if values is not None and values.size != n_lines * ncols:
            values = None
    if values is None:
        _scan_block(path, block, lineno, sep, names, int_cols)
        raise DataError(f"{path}:{lineno}-{lineno + n_lines - 1}: could not parse these lines as "
                        f"{_describe(names, sep)}")
    values = values.reshape(n_lines, ncols)
    if values.dtype.kind == "f" and int_cols:
        cols = sorted(int_cols)
        sub = values[:, cols]
        bad_rows = np.flatnonzero((~np.isfinite(sub) | (sub != np.floor(sub))).any(axis=1))
        if bad_rows.size:
            r = int(bad_rows[0])
            line = block.split(b"\n")[r].decode("utf-8", errors="replace").rstrip("\r")
            c = next(c for c in cols if not (np.isfinite(values[r, c]) and values[r, c] == np.floor(values[r, c])))
            raise DataError(f"{path}:{lineno + r}: field {c + 1} ({names[c]}) is not an integer: "
                            f"{line.split(sep)[c].strip()[:40]!r} in line {line[:120]!r}")
    if int_cols:
        _check_int_range(path, block, lineno, sep, names, sorted(int_cols), values)
    return values


# Integers a column of ``_parse_table`` holds exactly: int64 (np.fromstring clamps larger ones to
# the limits, silently) and float64 (integers beyond 2^53 are rounded).
_INT64_LIMITS = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
_FLOAT_EXACT = 2**53


def _check_int_range(path: Path, block: bytes, lineno: int, sep: str, names: Sequence[str], cols: list[int],
                     values: np.ndarray) -> None:
    """``DataError`` at the first integer field too large to be read exactly (a 23-digit timestamp
    would otherwise become the int64 limit and only fail later, far from its line)."""
    sub = values[:, cols]
    if values.dtype.kind == "f":
        limit = _FLOAT_EXACT
        big = np.abs(sub) > limit
    else:
        limit = _INT64_LIMITS[1] - 1
        big = (sub == _INT64_LIMITS[0]) | (sub == _INT64_LIMITS[1])
    rows = np.flatnonzero(big.any(axis=1))
    if not rows.size:
        return
    r = int(rows[0])
    c = cols[int(np.argmax(big[r]))]
    line = block.split(b"\n")[r].decode("utf-8", errors="replace").rstrip("\r")
    if r == 0 and line.startswith("\ufeff"):
        line = line[1:]
    text = line.split(sep)[c].strip()
    hint = "; timestamps are unix seconds, 10 digits today" if names[c].lower() == "timestamp" else ""
    raise DataError(f"{path}:{lineno + r}: field {c + 1} ({names[c]}) is too large: {text[:40]!r} has "
                    f"{len(text.lstrip('+-'))} digits, beyond {limit:,}, the largest integer read exactly{hint}. "
                    f"Is the line damaged? Fix or remove it")


def _parse_table(path: Path, *, sep: str, names: Sequence[str], int_cols: set[int], dtype,
                 start: int = 0, first_lineno: int = 1, block_bytes: int = _BLOCK_BYTES) -> np.ndarray:
    """All rows of a delimited numeric file as ``[N, len(names)]`` of ``dtype``."""
    parts = []
    for block, lineno in _blocks(path, start, block_bytes):
        parts.append(_parse_block(path, block, lineno + first_lineno - 1, sep, names, int_cols, dtype))
    if not parts:
        raise DataError(f"{path}: no data rows (expected lines like {_describe(names, sep)!r}); "
                        f"the file is empty or holds only a header")
    return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _check_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder; data.path takes the data file itself (e.g. {path}/FILE.csv)")
    if not path.is_file():
        raise DataError(f"{path}: no such file (see gr_functional.data.paths.dataset_path for the expected layout, "
                        f"or set GRF_DATA_DIR)")
    return path


def _int_column(values: np.ndarray, c: int) -> np.ndarray:
    col = values[:, c]
    return col if col.dtype == np.int64 else col.astype(np.int64)


# The dataset readers live with their registry entries (gr_functional/data/sources/); the old
# import paths (``from gr_functional.data.loaders import load_movielens_1m``) still work.
_MOVED = {
    "load_movielens_1m": "movielens", "load_movielens_20m": "movielens", "ML1M_FIELDS": "movielens",
    "ML20M_HEADER": "movielens", "load_kuairand_log": "kuairand", "KUAIRAND_LOG_COLUMNS": "kuairand",
    "KUAIRAND_DEFAULT_EXTRA": "kuairand",
}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(f".sources.{_MOVED[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
