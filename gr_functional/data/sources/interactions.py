"""Dataset "csv": your own interactions file, one event per line (CSV, TSV, any one separator).

    grf train --set data.dataset=csv --set data.path=events.csv --set data.csv_user=uid \\
              --set data.csv_item=sku --set data.csv_time=ts --set data.csv_time_unit=ms --out runs/mine

Keys (``[data]``, see ``DataConfig``): ``csv_sep`` ("" = from the extension: .csv ",", .tsv/.tab
"\\t", else the most frequent of tab , ; | on line 1), ``csv_header``, the columns ``csv_user``,
``csv_item``, ``csv_time`` (header names; 0-based indices written as strings, "0", when the file has
no header, or when no header column has that name), ``csv_time_unit`` (s | ms | us | ns),
``csv_rating`` + ``csv_min_rating`` (keep rows rated >= it). Other columns are ignored.

Ids. A user or item column whose every value is an integer keeps those ids (items must then be >= 1,
or set ``data.remap_items=true``). A column of string ids (hashes, SKUs such as "B000123456") is
read as strings and mapped to dense ints automatically: id k (1-based) is the k-th distinct string
in byte order (``np.unique(strings)[k - 1]`` recovers it), so the mapping depends only on the set
of ids; a note on stderr says so (``grf: note: ... mapped to dense ints 1..K``). Surrounding spaces
are ignored. Which it is: a column whose values are integers except for fewer than 1 % of its
rows (``_MALFORMED_SHARE``) is an integer column with damaged values, an error naming the first
one (``FILE:LINE:FIELD``, the value shown with repr), not a string column: one stray value must
not renumber every item. With at least 1 % non-integer rows (or none that is an integer, or
integers beyond int64) the column holds string ids. A NUL byte in any column read is an error.

Times become integer unix seconds (the model's time bias buckets log-seconds): numbers are divided
by the unit and floored; a column that is not numeric is read as ISO 8601 dates
("2022-04-08 12:30:00", "2022-04-08T12:30:00+02:00", "2022-04-08T12:30:00Z", "2022-04-08"; UTC
unless an offset or Z is given; fractions of a second are floored). Dates without an offset are
converted by numpy in one call; dates with one by ``datetime.fromisoformat``, once per distinct
string (numpy's own offset parsing is deprecated and crashed the process on large columns).

Speed: lines are cut into fields with one ``bytes.split`` per 64 MB block and each column is
converted by numpy (no per-line Python), about 1-2 s per million rows. Blocks holding a double quote
go through the csv module instead (quoted fields may hold the separator or a newline; a quote the
file never closes is an error naming the line it opens on). Errors name
``FILE:LINE`` (and ``:FIELD``, 1-based, for a bad value) and the key to set.

Parquet files (.parquet, .pq) are read with pyarrow when it is installed (``pip install pyarrow``);
the same column keys apply (``csv_sep``/``csv_header`` do not).
"""
from __future__ import annotations

import csv
import io
import itertools
import re
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ...errors import DataError
from ...log import note
from ..loaders import _BLOCK_BYTES, _BOM, Interactions, _blocks, _read_first_line
from ..registry import DatasetSpec, register_dataset

_BY_EXTENSION = {".csv": ",", ".tsv": "\t", ".tab": "\t"}
_SNIFFED = ("\t", ",", ";", "|")  # separators recognised on line 1 when the extension says nothing
_UNIT_DIVISOR = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_PARQUET = (".parquet", ".pq")


def _sep_name(sep: str) -> str:
    """How to write ``sep`` in a --set value ("\\t" for a tab)."""
    return repr(sep)


def _resolve_sep(path: Path, sep: str, first_line: str) -> tuple[str, str]:
    """``(separator, where it came from)``: ``data.csv_sep``, else the extension, else sniffed."""
    if sep == "\\t":  # a bare --set data.csv_sep=\t arrives as backslash + t
        sep = "\t"
    if sep:
        return sep, f"data.csv_sep={_sep_name(sep)}"
    ext = path.suffix.lower()
    if ext in _BY_EXTENSION:
        return _BY_EXTENSION[ext], f"from the {ext} extension"
    counts = {s: first_line.count(s) for s in _SNIFFED}
    best = max(_SNIFFED, key=lambda s: counts[s])
    if counts[best] == 0:
        raise DataError(f"{path}:1: cannot tell the field separator: line 1 holds none of "
                        f"{', '.join(map(_sep_name, _SNIFFED))}: {first_line[:120]!r}; set data.csv_sep "
                        f"(e.g. --set 'data.csv_sep=\" \"' for spaces)")
    return best, f"found on line 1 of this {ext or 'extension-less'} file"


def _split_line(line: str, sep: str) -> list[str]:
    """Fields of one text line (the csv module honours quotes; it takes 1-character separators only)."""
    if len(sep) == 1:
        return next(csv.reader([line], delimiter=sep), [])
    return line.split(sep)


def _column_index(path: Path, role: str, value: str, names: list[str] | None, ncols: int, first: str) -> int:
    """0-based index of the column named by ``data.csv_<role> = value``."""
    key = f"data.csv_{role}"
    if not value:
        raise DataError(f"{key} is empty; it must name the {role} column of {path}")
    if names is not None and value in names:
        return names.index(value)
    if value.isascii() and value.isdigit():
        index = int(value)
        if index < ncols:
            return index
        raise DataError(f"{key}={value!r}: {path}:1 has {ncols} columns (0-based indices 0..{ncols - 1}): "
                        f"{first[:120]!r}")
    if names is None:
        raise DataError(f"{key}={value!r}: with data.csv_header=false columns are 0-based indices written as "
                        f"strings: csv_{role} = \"0\" in the TOML file, --set {key}=0 on the command line "
                        f"(data.csv_user, csv_item and csv_time each need one); {path}:1 has {ncols} columns: "
                        f"{first[:120]!r}")
    raise DataError(f"{path}:1: no column {value!r} ({key}); the header's columns are: {', '.join(names)}. "
                    f"Set {key} to one of them (or a 0-based index)")


# ----------------------------------------------------------------------------- splitting lines
def _bad_line(path: Path, lineno: int, line: str, ncols: int, sep: str, got: int) -> DataError:
    if not line.strip():
        return DataError(f"{path}:{lineno}: expected {ncols} fields separated by {_sep_name(sep)}, got an empty "
                         f"line (remove it)")
    return DataError(f"{path}:{lineno}: expected {ncols} fields separated by {_sep_name(sep)} (as on line 1), got "
                     f"{got}: {line[:120]!r}")


def _fast_fields(path: Path, block: bytes, lineno: int, sep: str, ncols: int,
                 wanted: list[int]) -> tuple[list[list[bytes]], np.ndarray]:
    """Fields of columns ``wanted`` of a quote-free block (a list of bytes per column) and each
    row's line number ``[n] int64``."""
    sep_b = sep.encode()
    if b"\r" in block:
        block = block.replace(b"\r\n", b"\n")
    n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
    # Separators per line, vectorised: a line with one field too many next to one with one too
    # few would otherwise shift every later field silently.
    if len(sep_b) == 1:
        u8 = np.frombuffer(block, dtype=np.uint8)
        ends = np.flatnonzero(u8 == 10)
        if len(ends) < n_lines:
            ends = np.append(ends, len(u8))
        per_line = np.bincount(np.searchsorted(ends, np.flatnonzero(u8 == sep_b[0])), minlength=n_lines)
    else:
        per_line = np.array([line.count(sep_b) for line in block.split(b"\n")[:n_lines]])
    bad = np.flatnonzero(per_line != ncols - 1)
    if bad.size:
        r = int(bad[0])
        line = block.split(b"\n")[r].decode("utf-8", errors="replace")
        raise _bad_line(path, lineno + r, line, ncols, sep, int(per_line[r]) + 1)
    fields = block.replace(b"\n", sep_b).split(sep_b)
    return [fields[c:n_lines * ncols:ncols] for c in wanted], np.arange(lineno, lineno + n_lines, dtype=np.int64)


def _quoted_fields(path: Path, block: bytes, lineno: int, sep: str, ncols: int,
                   wanted: list[int], at_eof: bool = False) -> tuple[list[list[bytes]], np.ndarray]:
    """The same through the csv module, for blocks with quotes (a record may span lines).
    ``at_eof``: the block ends the file, so a quoted field still open at its end is an error (the
    csv module would take the rest of the file as that field, swallowing every later line)."""
    text = block.decode("utf-8", errors="surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep)
    columns: list[list[bytes]] = [[] for _ in wanted]
    lines = []
    start = last = 1  # line (within the block) where the next / the last record starts
    for row in _records(reader, path, lineno, lambda: start):
        if len(row) != ncols:
            physical = text.split("\n")[start - 1] if row else ""
            if at_eof and _exhausted(reader):  # the file's last record: an open quote?
                _check_closed(path, text, start, lineno, sep)
            raise _bad_line(path, lineno + start - 1, physical, ncols, sep, len(row))
        for out, c in zip(columns, wanted):
            out.append(row[c].encode("utf-8", errors="surrogateescape"))
        lines.append(lineno + start - 1)
        last, start = start, reader.line_num + 1
    if at_eof and lines:
        _check_closed(path, text, last, lineno, sep)
    return columns, np.asarray(lines, dtype=np.int64)


def _exhausted(reader) -> bool:
    try:
        return next(reader, None) is None
    except csv.Error:
        return False


def _records(reader, path: Path, lineno: int, start):
    """The rows of ``reader``; its errors (a field over the csv module's 131,072-character limit:
    an unclosed quote running on through the file) as ``DataError`` naming the line where the
    record starts (``start()``, within the block that starts on line ``lineno``)."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DataError(f"{path}:{lineno + start() - 1}: cannot read the record starting on this line ({exc}): "
                            f"a double quote (\") that is never closed? Close it or remove it") from None
        yield row


def _check_closed(path: Path, text: str, start: int, lineno: int, sep: str) -> None:
    """``DataError`` when the record starting on line ``start`` of ``text`` (the file's last) opens
    a quoted field that the file never closes. A strict csv reader over that record alone tells:
    it raises "unexpected end of data" there (a stray quote inside an unquoted field, 5" screen,
    is text to both readers)."""
    tail = "\n".join(text.split("\n")[start - 1:])
    try:
        for _ in csv.reader(io.StringIO(tail, newline=""), delimiter=sep, strict=True):
            pass
    except csv.Error as exc:
        if "unexpected end of data" not in str(exc):
            return  # a quirk the lenient reader accepts ("ab"c); not an open quote
        first = tail.split("\n", 1)[0].rstrip("\r")
        raise DataError(f"{path}:{lineno + start - 1}: a quoted field opened on this line is never closed: the "
                        f"file ends inside it ({first[:120]!r}); add the closing double quote (\") or remove the "
                        f"stray one") from None


_INT64_LIMITS = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)


def _one_token_per_field(joined: bytes, n: int) -> bool:
    """Whether ``joined`` (n fields joined by newlines) holds exactly one whitespace-free token in
    every field: an empty field next to one holding "1 2" would otherwise give the right count."""
    u8 = np.frombuffer(joined, dtype=np.uint8)
    space = (u8 == 32) | (u8 == 9) | (u8 == 13) | (u8 == 10)
    starts = np.flatnonzero(~space & np.concatenate(([True], space[:-1])))
    ends = np.flatnonzero(u8 == 10)
    if len(starts) != n or len(ends) != n - 1:
        return False
    return bool((np.searchsorted(ends, starts) == np.arange(n)).all())


def _convert(values: list[bytes], kind: str) -> np.ndarray | None:
    """``values`` as ``[n]`` int64 ("int"), float64 ("float") or bytes ("bytes"); None when some
    value is not of that kind. Numbers are parsed by one ``np.fromstring`` over the joined fields
    (ASCII digits only, not Python's "1_000"; surrounding spaces allowed), after a vectorised check
    that each field holds exactly one token (fromstring reads "" as 0 and "1 2" as two numbers)."""
    if kind == "bytes":
        return np.array(values, dtype=bytes)
    joined = b"\n".join(values)
    if not _one_token_per_field(joined, len(values)):
        return None
    dtype = np.int64 if kind == "int" else np.float64
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy warns (not raises) on text it stops at
            out = np.fromstring(joined, dtype=dtype, sep=" ")
    except (ValueError, DeprecationWarning):
        return None
    if len(out) != len(values):
        return None
    if kind == "int" and (out.min() == _INT64_LIMITS[0] or out.max() == _INT64_LIMITS[1]):
        return None  # fromstring clamps ids beyond int64: read them as strings instead
    return out


class _Retry(Exception):
    """A column's kind changed after earlier blocks were converted with the old one: read again."""


def _read_columns(path: Path, start: int, first_lineno: int, sep: str, ncols: int, kinds: dict[int, list[str]],
                  block_bytes: int, labels: dict[int, str] | None = None) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Columns ``kinds`` (index -> kinds to try in order, e.g. ``["int", "float", "bytes"]``) of
    every data line, each ``[N]`` of the first kind that parses every value, and ``lines[N] int64``.
    A value a column's kind cannot parse moves the column to its next kind; when earlier blocks
    were already converted the read starts over (string ids fail on the first block: no re-read).
    ``labels`` (index -> "column 'sku', data.csv_item") name columns in errors."""
    while True:
        try:
            return _read_pass(path, start, first_lineno, sep, ncols, kinds, block_bytes, labels or {})
        except _Retry:
            continue


def _with_last(blocks):
    """``(block, lineno, is_last)`` for each of ``blocks``."""
    previous = None
    for item in blocks:
        if previous is not None:
            yield (*previous, False)
        previous = item
    if previous is not None:
        yield (*previous, True)


def _no_nul(path: Path, values: list[bytes], lines: np.ndarray, c: int, label: str) -> None:
    """``DataError`` at the first value holding a NUL byte: never text, always damage (and numpy's
    bytes arrays would drop a trailing one, silently merging "12\\x00" into "12")."""
    if b"\x00" not in b"".join(values):
        return
    row = next(r for r, v in enumerate(values) if b"\x00" in v)
    value = values[row].decode("utf-8", errors="backslashreplace")
    raise DataError(f"{path}:{int(lines[row])}:{c + 1}: value {value[:40]!r}{f' ({label})' if label else ''} holds "
                    f"a NUL byte (\\x00): the file is damaged here; fix or remove the line")


def _read_pass(path: Path, start: int, first_lineno: int, sep: str, ncols: int, kinds: dict[int, list[str]],
               block_bytes: int, labels: dict[int, str]) -> tuple[dict[int, np.ndarray], np.ndarray]:
    wanted = sorted(kinds)
    parts: list[dict[int, np.ndarray]] = []
    line_parts = []

    def add(fields: list[list[bytes]], lines: np.ndarray) -> None:
        part = {}
        for c, values in zip(wanted, fields):
            part[c] = _convert(values, kinds[c][0])
            while part[c] is None:  # "bytes", the last kind, always parses
                kinds[c].pop(0)
                if parts:
                    raise _Retry(c)
                part[c] = _convert(values, kinds[c][0])
            if kinds[c][0] == "bytes":
                _no_nul(path, values, lines, c, labels.get(c, ""))
        parts.append(part)
        line_parts.append(lines)

    pending, pending_line = b"", 0
    for block, lineno, last in _with_last(_blocks(path, start, block_bytes)):
        if start == 0 and lineno == 1 and block.startswith(_BOM):  # a headerless file's byte-order mark
            block = block[len(_BOM):]
        if pending:
            block, lineno = pending + block, pending_line
        if block.count(b'"') % 2 and not last:  # a quoted field runs on into the next block
            pending, pending_line = block, lineno
            continue
        pending = b""
        if b'"' in block and len(sep) == 1:
            # through the csv module; in the file's last block a quoted field still open at its
            # end is an error (an odd number of quotes there: an unclosed one, or a stray one)
            fields = _quoted_fields(path, block, lineno + first_lineno - 1, sep, ncols, wanted, at_eof=last)
        else:
            fields = _fast_fields(path, block, lineno + first_lineno - 1, sep, ncols, wanted)
        add(*fields)
    if not parts:
        return {c: np.array([], dtype=bytes) for c in wanted}, np.array([], dtype=np.int64)
    return {c: np.concatenate([p[c] for p in parts]) for c in wanted}, np.concatenate(line_parts)


# ----------------------------------------------------------------------------- converting columns
_NUMBER = re.compile(rb"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _is_number(value: bytes) -> bool:
    return _NUMBER.fullmatch(value) is not None


def _is_date(value: bytes) -> bool:
    return _date_seconds(np.array([value.strip()])) is not None


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _with_offset(text: np.ndarray) -> np.ndarray:
    """``[N] bool``: which dates (bytes, "YYYY-MM-DD..." per ``_dated``) carry a UTC offset or a Z:
    a sign or a trailing Z after the 10-character date."""
    return ((np.char.find(text, b"+", 10) >= 0) | (np.char.find(text, b"-", 10) >= 0)
            | np.char.endswith(text, b"Z") | np.char.endswith(text, b"z"))


def _offset_seconds(value: bytes) -> int | None:
    """Unix seconds (floored) of one ISO 8601 date with an offset or Z; None when it is not one."""
    try:
        date = datetime.fromisoformat(value.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    if date.tzinfo is None:
        date = date.replace(tzinfo=timezone.utc)
    delta = date - _EPOCH  # days, seconds (0..86399) and microseconds (dropped): floored seconds
    return delta.days * 86_400 + delta.seconds


def _naive_seconds(text: np.ndarray) -> np.ndarray | None:
    """``[N] int64`` unix seconds of dates without an offset (numpy reads them as UTC, floors
    fractions of a second); None when some value is not a date."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dates = text.astype("datetime64[s]")
    except ValueError:
        return None
    if np.isnat(dates).any():
        return None
    return dates.astype(np.int64)


def _date_seconds(text: np.ndarray) -> np.ndarray | None:
    """``[N] int64`` unix seconds of ISO 8601 dates (bytes, stripped), None when some value is not
    one. Dates without an offset go through numpy in one call; those with an offset or Z through
    ``datetime.fromisoformat``, once per distinct string (numpy's deprecated offset parsing
    segfaulted on a few hundred rows)."""
    aware = _with_offset(text)
    if not aware.any():
        return _naive_seconds(text)
    out = np.empty(len(text), dtype=np.int64)
    if not aware.all():
        naive = _naive_seconds(text[~aware])
        if naive is None:
            return None
        out[~aware] = naive
    distinct, inverse = np.unique(text[aware], return_inverse=True)
    seconds = [_offset_seconds(v) for v in distinct.tolist()]
    if None in seconds:
        return None
    out[aware] = np.asarray(seconds, dtype=np.int64)[inverse.reshape(-1)]
    return out


def _dated(text: np.ndarray) -> bool:
    """Whether every value of ``text[N]`` (bytes) starts like an ISO 8601 date, "YYYY-": numpy would
    otherwise read a number such as 1651314030 as the year 1651314030."""
    if text.dtype.itemsize < 5:
        return False
    head = np.ascontiguousarray(text).view(np.uint8).reshape(len(text), -1)[:, :5]
    return bool(((head[:, :4] >= ord("0")) & (head[:, :4] <= ord("9"))).all() and (head[:, 4] == ord("-")).all())


class _Column:
    """One raw column: ``values[N]`` (from a text file: int64 / float64 when every value parsed as
    one, else bytes; from Parquet: its numbers, timestamps or strings), each row's line (None for
    Parquet: rows are named by position), and its names for errors."""

    def __init__(self, path: Path, values: np.ndarray, lines: np.ndarray | None, index: int, name: str, role: str):
        self.path, self.values, self.lines, self.index, self.name, self.role = path, values, lines, index, name, role

    def where(self, row: int) -> str:
        if self.lines is None:
            return f"{self.path} row {row}"
        return f"{self.path}:{int(self.lines[row])}:{self.index + 1}"

    def text(self, row: int) -> str:
        value = self.values[row]
        text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
        return text.strip()[:40]

    def describe(self) -> str:
        return f"column {self.name!r}, data.csv_{self.role}"

    def as_bytes(self) -> np.ndarray:
        """``[N]`` bytes (UTF-8, surrounding spaces removed) of any column."""
        values = self.values if self.values.dtype.kind == "S" else np.char.encode(self.values.astype(str), "utf-8")
        return np.char.strip(values)


# An id column whose non-integer values are fewer than this share of its rows holds integer ids
# with damaged values (an error), not string ids: one stray value must not renumber every item.
# String ids that are mostly digits stay strings (Amazon ASINs: ISBN-10s like "0439023483", some
# ending in X, next to "B000123456").
_MALFORMED_SHARE = 0.01


def _integer_like(text: np.ndarray) -> np.ndarray:
    """``[K] bool``: which values (bytes, stripped) are an optional sign and ASCII digits."""
    if len(text) == 0 or text.dtype.itemsize == 0:
        return np.zeros(len(text), dtype=bool)
    u8 = np.ascontiguousarray(text).view(np.uint8).reshape(len(text), -1)
    digits = ((u8 >= ord("0")) & (u8 <= ord("9"))).sum(axis=1)
    signed = (u8[:, 0] == ord("+")) | (u8[:, 0] == ord("-"))
    return (digits > 0) & (digits + signed == np.char.str_len(text))


def _ids(col: _Column) -> np.ndarray:
    """``[N] int64`` ids of the column (``_ids_and_names``)."""
    return _ids_and_names(col)[0]


def _ids_and_names(col: _Column) -> tuple[np.ndarray, np.ndarray | None]:
    """``([N] int64 ids, [K] str names or None)``: integer ids as they are (no names), string ids
    mapped to dense 1..K (k = rank of the string among the distinct strings, in byte order; a note
    on stderr says so) with ``names[k - 1]`` the string of id k. A column of integers but for
    fewer than ``_MALFORMED_SHARE`` of its rows is an error at the first other value (module
    docstring)."""
    values = col.values
    if values.dtype.kind in "iu":
        return values.astype(np.int64), None
    if values.dtype.kind == "f" and np.isfinite(values).all() and (values == np.floor(values)).all():
        return values.astype(np.int64), None  # Parquet float ids (a pandas int column that once held NaN)
    text = col.as_bytes()
    empty = np.flatnonzero(text == b"")
    if empty.size:
        row = int(empty[0])
        raise DataError(f"{col.where(row)}: the {col.role} id is empty ({col.describe()}); every row needs one "
                        f"(fill it in or remove the row)")
    distinct, dense = np.unique(text, return_inverse=True)
    dense = dense.reshape(-1)
    integer = _integer_like(distinct)
    n = len(text)
    n_int = int(np.bincount(dense, minlength=len(distinct))[integer].sum())
    n_other = n - n_int
    if n_int and n_other and n_other < _MALFORMED_SHARE * n:
        row = int(np.flatnonzero(~integer[dense])[0])
        raw = values[row]
        raw = raw.decode("utf-8", errors="backslashreplace") if isinstance(raw, bytes) else str(raw)
        raise DataError(f"{col.where(row)}: {col.role} id {raw[:40]!r} ({col.describe()}) is not an integer, but "
                        f"{n_int:,} of the {n:,} rows hold integers: a damaged value? Fix or remove the line "
                        f"({n_other:,} row{'s' if n_other != 1 else ''} hold{'s' if n_other == 1 else ''} "
                        f"non-integers; a column is read as string ids only when at least "
                        f"{_MALFORMED_SHARE:.0%} of its rows do)")
    why = ("" if not n_int else f" ({n_other:,} of {n:,} rows are not integers)" if n_other else
           " (integers stored as text or beyond int64)")
    note(f"{col.path}: the {col.role} ids ({col.describe()}) are read as strings{why}: the "
         f"{len(distinct):,} distinct ids were mapped to dense ints 1..{len(distinct):,} (in byte order)")
    names = np.array([b.decode("utf-8", errors="backslashreplace") for b in distinct.tolist()], dtype=object)
    return dense.astype(np.int64) + 1, names


def _ratings(col: _Column) -> np.ndarray:
    """``[N] float64``; ``DataError`` at the first value that is not a finite number."""
    values = col.values
    if values.dtype.kind in "iuf":
        values = values.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            row = int(bad[0])
            raise DataError(f"{col.where(row)}: rating {col.text(row)!r} ({col.describe()}) is not a finite number; "
                            f"fix it or remove the row")
        return values
    text = col.as_bytes()
    row = next((r for r, v in enumerate(text) if not _is_number(v)), 0)
    raise DataError(f"{col.where(row)}: rating {col.text(row)!r} ({col.describe()}) is not a number; fix it or "
                    f"remove the row (or set data.csv_rating=\"\" to read no rating)")


def _seconds(col: _Column, unit: str) -> np.ndarray:
    """``[N] int64`` unix seconds: numbers divided by the unit and floored, else ISO 8601 dates."""
    divisor = _UNIT_DIVISOR[unit]
    values = col.values
    kind = values.dtype.kind
    if kind == "M":  # Parquet timestamps: already a point in time, the unit does not apply
        return values.astype("datetime64[s]").astype(np.int64)
    if kind in "iu":
        return values.astype(np.int64) // divisor
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            row = int(bad[0])
            raise DataError(f"{col.where(row)}: time {col.text(row)!r} ({col.describe()}) is not a finite number; "
                            f"fix it or remove the row")
        seconds = np.floor(values / divisor)
        # beyond int64 a cast would wrap to a huge negative time: say what the value is instead
        big = np.flatnonzero(np.abs(seconds) >= 2.0 ** 62)
        if big.size:
            row = int(big[0])
            digits = int(np.floor(np.log10(abs(float(values[row]))))) + 1
            raise DataError(f"{col.where(row)}: time {col.text(row)} ({col.describe()}) has {digits} digits, far "
                            f"beyond any date in data.csv_time_unit={unit!r} units (unix seconds have 10 today); the "
                            f"line is damaged or the unit is wrong: fix the line or set data.csv_time_unit")
        return seconds.astype(np.int64)
    text = col.as_bytes()
    if _dated(text):
        seconds = _date_seconds(text)
        if seconds is not None:
            return seconds
    known: dict[bytes, bool] = {}  # value -> number or date (each distinct value parsed once)

    def readable(v: bytes) -> bool:
        if v not in known:
            known[v] = _is_number(v) or _is_date(v)
        return known[v]

    row = next((r for r, v in enumerate(text) if not readable(v)), None)
    number = next((r for r, v in enumerate(text) if _is_number(v)), None)
    date = next((r for r, v in enumerate(text) if not _is_number(v)), None)
    if row is None and number is not None and date is not None:  # numbers and dates, mixed
        raise DataError(f"{col.where(date)}: time {col.text(date)!r} ({col.describe()}) is a date, but "
                        f"{col.where(number)} holds the number {col.text(number)!r}; write every time the same way")
    row = 0 if row is None else row
    raise DataError(f"{col.where(row)}: time {col.text(row)!r} ({col.describe()}) is neither a number nor an ISO 8601 "
                    f"date; write unix time in data.csv_time_unit units (now {unit!r}) or dates like "
                    f"2022-04-08T12:30:00")


# ----------------------------------------------------------------------------- the loader
def load_csv(path: str | Path, *, sep: str = "", header: bool = True, user: str = "user_id",
             item: str = "item_id", time: str = "timestamp", time_unit: str = "s", rating: str = "",
             min_rating: float = 0.0, block_bytes: int = _BLOCK_BYTES) -> Interactions:
    """Read a delimited interactions file (or Parquet) into ``Interactions``, in file order.

    Returns user/item/time ``[N] int64`` (time in unix seconds), ``rating[N] float32`` when
    ``rating`` names a column (rows rated below ``min_rating`` dropped) else None, and
    ``lines[N]`` (each row's line in the file, for error messages). Arguments are the
    ``data.csv_*`` keys; string ids are mapped to dense ints as the module docstring says.
    """
    path = Path(path)
    if path.is_dir():
        held = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in (
            ".csv", ".tsv", ".txt", ".dat", *_PARQUET))
        among = f" (it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''})" if held else ""
        raise DataError(f"{path} is a folder{among}; data.path takes the interactions file itself (CSV/TSV or "
                        f"Parquet), e.g. --set data.path={path / (held[0] if held else 'events.csv')}")
    if not path.is_file():
        raise DataError(f"{path}: no such file (data.path names your interactions file)")
    if time_unit not in _UNIT_DIVISOR:
        raise DataError(f"time unit {time_unit!r} is not one of {', '.join(map(repr, _UNIT_DIVISOR))} "
                        f"(data.csv_time_unit)")
    if path.suffix.lower() in _PARQUET:
        return _load_parquet(path, user=user, item=item, time=time, time_unit=time_unit, rating=rating,
                             min_rating=min_rating)
    first_b, offset = _read_first_line(path)
    first = first_b.decode("utf-8", errors="replace")
    if not first.strip():
        with open(path, "rb") as f:
            empty = not f.read(1 << 16).strip()
        if empty:
            raise DataError(f"{path}: file is empty (expected {'a header line naming the columns, then ' if header else ''}"
                            f"one line per event with user, item and time fields)")
        raise DataError(f"{path}:1: the first line is empty; it must be "
                        f"{'the header naming the columns' if header else 'a data line'}")
    sep, sep_origin = _resolve_sep(path, sep, first)
    fields = [f.strip() for f in _split_line(first, sep)]
    if len(fields) < 2:
        others = [s for s in (*_SNIFFED, " ") if s != sep and s in first.strip()]
        hint = (f"it looks {_sep_name(others[0])}-separated: set data.csv_sep={_sep_name(others[0])}" if others
                else "set data.csv_sep to the file's separator")
        raise DataError(f"{path}:1: with separator {_sep_name(sep)} ({sep_origin}) the "
                        f"{'header' if header else 'first line'} is a single column: {first[:120]!r}; {hint}")
    names = fields if header else None
    ncols = len(fields)
    roles = {"user": user, "item": item, "time": time, **({"rating": rating} if rating else {})}
    index = {role: _column_index(path, role, value, names, ncols, first) for role, value in roles.items()}
    for a, b in itertools.combinations(index, 2):
        if index[a] == index[b]:
            raise DataError(f"data.csv_{a}={roles[a]!r} and data.csv_{b}={roles[b]!r} name the same column of {path}")

    start, first_lineno = (offset, 2) if header else (0, 1)
    tries = {"user": ["int", "bytes"], "item": ["int", "bytes"], "time": ["int", "float", "bytes"],
             "rating": ["float", "bytes"]}
    labels = {i: f"column {names[i] if names else str(i)!r}, data.csv_{role}" for role, i in index.items()}
    columns, lines = _read_columns(path, start, first_lineno, sep, ncols,
                                   {i: list(tries[role]) for role, i in index.items()}, block_bytes, labels)
    if len(lines) == 0:
        raise DataError(f"{path}: no data rows after the header" if header else f"{path}: no data rows")
    raw = {role: _Column(path, columns[i], lines, i, names[i] if names else str(i), role)
           for role, i in index.items()}
    return _interactions(path, raw, time_unit, rating, min_rating, lines)


def _interactions(path: Path, raw: dict, time_unit: str, rating: str, min_rating: float,
                  lines: np.ndarray) -> Interactions:
    """Convert the raw columns, apply the rating filter, build ``Interactions``."""
    user = _ids(raw["user"])
    item, item_names = _ids_and_names(raw["item"])
    time = _seconds(raw["time"], time_unit)
    ratings = None
    if rating:
        values = _ratings(raw["rating"])
        keep = values >= min_rating
        if not keep.any():
            raise DataError(f"{path}: no rows left: every rating ({values.min():g}..{values.max():g}, "
                            f"{raw['rating'].describe()}) is below data.csv_min_rating={min_rating:g}")
        if not keep.all():
            user, item, time, values, lines = user[keep], item[keep], time[keep], values[keep], lines[keep]
        ratings = values.astype(np.float32)
    return Interactions(user=user, item=item, time=time, rating=ratings, name=path.name, source=str(path),
                        first_line=int(lines[0]) if len(lines) else 1, lines=lines, item_names=item_names)


def _load_parquet(path: Path, *, user: str, item: str, time: str, time_unit: str, rating: str,
                  min_rating: float) -> Interactions:
    """A Parquet file through pyarrow (an optional dependency). Parquet has no lines: errors name
    rows by 0-based position (``FILE row R``; after the rating filter, among the kept rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed: run `pip install pyarrow`, "
                        f"or write the file as CSV/TSV") from None
    try:
        schema_names = list(pq.read_schema(path).names)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid / OSError types
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    roles = {"user": user, "item": item, "time": time, **({"rating": rating} if rating else {})}
    for role, value in roles.items():
        if value not in schema_names:
            raise DataError(f"{path}: no column {value!r} (data.csv_{role}); the file's columns are: "
                            f"{', '.join(schema_names)}. Set data.csv_{role} to one of them")
    table = pq.read_table(path, columns=list(dict.fromkeys(roles.values())))
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    raw = {}
    for role, value in roles.items():
        column = table.column(value)
        if column.null_count:
            first = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{path} row {first}: column {value!r} (data.csv_{role}) has no value here (nor in "
                            f"{column.null_count - 1:,} more of {table.num_rows:,} rows); every row needs one")
        raw[role] = _Column(path, np.asarray(column.to_numpy(zero_copy_only=False)), None,
                            schema_names.index(value), value, role)
    rows = np.arange(table.num_rows, dtype=np.int64)
    inter = _interactions(path, raw, time_unit, rating, min_rating, rows)
    # no source: later errors (from_interactions) then say "NAME row R"
    return Interactions(user=inter.user, item=inter.item, time=inter.time, rating=inter.rating, name=str(path),
                        item_names=inter.item_names)


# ----------------------------------------------------------------------------- registry entry
def _load(cfg, path: Path) -> Interactions:
    return load_csv(path, sep=cfg.csv_sep, header=cfg.csv_header, user=cfg.csv_user, item=cfg.csv_item,
                    time=cfg.csv_time, time_unit=cfg.csv_time_unit, rating=cfg.csv_rating,
                    min_rating=cfg.csv_min_rating)


register_dataset(DatasetSpec("csv", "CSV/TSV", _load, label_for=lambda path: path.name))
