"""Dataset "csv" on damaged or unusual files ([hardening3]): ISO 8601 dates with UTC offsets at
scale, integer id columns with a stray value, unterminated quotes. Each valid input keeps its
exact result; each damaged one is a DataError naming FILE:LINE(:FIELD)."""
import calendar
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from gr_functional.cli import main
from gr_functional.data import DataError, load_csv


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ---------------------------------------------------------------- ISO 8601 dates with offsets
# (suffix, offset in seconds east of UTC, fraction written after the seconds, separator)
_STYLES = [("", 0, "", "T"), ("+02:00", 7200, "", "T"), ("Z", 0, "", "T"), ("-05:30", -19800, "", "T"),
           ("", 0, ".5", " "), ("+05:45", 20700, ".999", "T"), ("Z", 0, ".25", " "), ("+0100", 3600, "", "T")]


def _dates(n):
    """``(lines, seconds)``: n ISO 8601 times mixing offsets, Z and naive (UTC) ones, and each one's
    unix seconds, computed from the parts (not by a date parser)."""
    lines, seconds = [], []
    for r in range(n):
        unix = 1_600_000_000 + r * 7_919
        suffix, offset, fraction, sep = _STYLES[r % len(_STYLES)]
        local = time.gmtime(unix + offset)  # the wall clock at that offset
        lines.append(time.strftime(f"%Y-%m-%d{sep}%H:%M:%S", local) + fraction + suffix)
        seconds.append(unix)  # fractions of a second are floored
    return lines, seconds


def test_the_expected_values_are_right():
    lines, seconds = _dates(8)
    assert lines[1] == "2020-09-13T16:38:39+02:00" and seconds[1] == 1_600_007_919
    assert calendar.timegm(time.strptime("2020-09-13T14:38:39", "%Y-%m-%dT%H:%M:%S")) == seconds[1]
    assert lines[2].endswith("Z") and lines[4].endswith(".5") and " " in lines[4]


def test_iso_dates_with_offsets_and_z_at_scale_do_not_crash(tmp_path):
    # numpy's datetime64 parsing of offsets segfaulted (exit 139) from a few hundred rows: load in
    # a child process, so that a crash fails this test instead of killing pytest
    n = 100_000
    lines, seconds = _dates(n)
    p = _write(tmp_path, "dates.csv", "user_id,item_id,timestamp\n"
               + "".join(f"{r % 97 + 1},{r % 501 + 1},{t}\n" for r, t in enumerate(lines)))
    out = tmp_path / "time.npy"
    code = ("import sys, numpy as np\nfrom gr_functional.data import load_csv\n"
            "np.save(sys.argv[2], load_csv(sys.argv[1]).time)\n")
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(p), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert time.perf_counter() - started < 120  # once per distinct string, not per character
    got = np.load(out)
    assert got.dtype == np.int64 and got.tolist() == seconds


def test_naive_dates_keep_their_values_next_to_offset_ones(tmp_path):
    naive = "user_id,item_id,timestamp\n1,2,2022-04-08 12:30:00\n1,3,2022-04-09\n1,4,2022-04-08T12:30:00.75\n"
    assert load_csv(_write(tmp_path, "n.csv", naive)).time.tolist() == [1649421000, 1649462400, 1649421000]
    mixed = naive + "1,5,2022-04-08T12:30:00Z\n1,6,2022-04-08T14:30:00+02:00\n1,7,1969-12-31T23:59:59.5Z\n"
    assert load_csv(_write(tmp_path, "m.csv", mixed)).time.tolist() == [1649421000, 1649462400, 1649421000,
                                                                        1649421000, 1649421000, -1]


@pytest.mark.parametrize("bad", ["2022-04-31T12:30:00+02:00", "2022-04-08T12:30:00+25:00", "2022-04-08T12:30:00z",
                                 "2022-04-08T25:00:00", "2022-04-08Tnoon+02:00"])
def test_a_malformed_date_names_file_line_and_field(tmp_path, bad):
    rows = ["user_id,item_id,timestamp"] + [f"1,{i},2022-04-08T12:3{i}:00+02:00" for i in range(1, 6)]
    rows[4] = f"1,4,{bad}"
    with pytest.raises(DataError, match=rf"d.csv:5:3: time '{re.escape(bad)}' \(column 'timestamp', data.csv_time\) is "
                                        r"neither a number nor an ISO 8601 date"):
        load_csv(_write(tmp_path, "d.csv", "\n".join(rows) + "\n"))


# ---------------------------------------------------------------- integer ids with a stray value
def _ids_file(tmp_path, n=2000, bad=None, at=777, column=1, name="ids.csv"):
    rows = []
    for r in range(n):
        fields = [str(r % 40 + 1), str(r % 500 + 1), str(1_600_000_000 + r)]
        if r == at and bad is not None:
            fields[column] = bad
        rows.append(",".join(fields))
    return _write(tmp_path, name, ("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n").encode("utf-8",
                                                                                           "surrogateescape"))


@pytest.mark.parametrize("bad,column,message", [
    ("12\x0034", 1, r"ids.csv:779:2: value '12\\x0034' \(column 'item_id', data.csv_item\) holds a NUL byte"),
    ("12\x00", 1, r"ids.csv:779:2: value '12\\x00' \(column 'item_id', data.csv_item\) holds a NUL byte"),
    ("\x00", 0, r"ids.csv:779:1: value '\\x00' \(column 'user_id', data.csv_user\) holds a NUL byte"),
    ("12x", 1, r"ids.csv:779:2: item id '12x' \(column 'item_id', data.csv_item\) is not an integer, but 1,999 of "
               r"the 2,000 rows hold integers: a damaged value\? Fix or remove the line"),
    ("7.0", 0, r"ids.csv:779:1: user id '7.0' \(column 'user_id', data.csv_user\) is not an integer"),
    ("1_000", 1, r"ids.csv:779:2: item id '1_000'"),
])
def test_one_malformed_value_in_an_integer_id_column_is_an_error(tmp_path, bad, column, message):
    # was: the whole column read as strings and every item renumbered, exit 0
    with pytest.raises(DataError, match=message):
        load_csv(_ids_file(tmp_path, bad=bad, column=column))


def test_a_block_boundary_does_not_hide_the_stray_value(tmp_path):
    p = _ids_file(tmp_path, bad="oops", at=1900)
    with pytest.raises(DataError, match=r"ids.csv:1902:2: item id 'oops'"):
        load_csv(p, block_bytes=256)  # integer blocks first, then the column is read again as text


def test_string_ids_are_mapped_and_the_mapping_is_announced(tmp_path, capsys):
    p = _write(tmp_path, "s.csv", "user,sku,ts\nbob,B-2,1\nann,A-1,2\nbob,A-1,3\n")
    inter = load_csv(p, user="user", item="sku", time="ts")
    assert inter.user.tolist() == [2, 1, 2] and inter.item.tolist() == [2, 1, 1]
    err = capsys.readouterr().err
    assert (f"grf: note: {p}: the item ids (column 'sku', data.csv_item) are read as strings: the 2 distinct ids "
            f"were mapped to dense ints 1..2 (in byte order)") in err
    assert "the user ids (column 'user', data.csv_user) are read as strings" in err
    load_csv(_ids_file(tmp_path))  # integer ids: kept, nothing to announce
    assert capsys.readouterr().err == ""


def test_mostly_numeric_string_ids_stay_strings(tmp_path, capsys):
    # Amazon-style ASINs: ISBN-10s ("0439023483"), some ending in X, next to "B0..." ids; 1 % or
    # more of the rows are not integers, so the column is string ids (not a damaged integer column)
    rng = np.random.default_rng(0)
    asins = [f"{int(x):010d}" for x in rng.integers(0, 10**9, 90)] + [f"B00{i:07d}" for i in range(5)] + \
            [f"{int(x):09d}X" for x in rng.integers(0, 10**8, 5)]
    items = [asins[int(i)] for i in rng.integers(0, 90, 1000)]  # ISBN-style, all digits
    items[:20] = asins[90:] * 2  # 20 of 1000 rows (2 %) are not integers
    p = _write(tmp_path, "amazon.csv", "user_id,item_id,timestamp\n"
               + "".join(f"{r % 50 + 1},{item},{1_600_000_000 + r}\n" for r, item in enumerate(items)))
    inter = load_csv(p)
    distinct = sorted(set(items), key=str.encode)
    assert inter.item.tolist() == [distinct.index(i) + 1 for i in items]
    assert "(20 of 1,000 rows are not integers)" in capsys.readouterr().err


def test_integers_beyond_int64_are_string_ids_with_a_note(tmp_path, capsys):
    p = _write(tmp_path, "big.csv", "user_id,item_id,timestamp\n1,99999999999999999999,1\n1,5,2\n")
    assert load_csv(p).item.tolist() == [2, 1]  # b"5" < b"9..." in byte order
    assert "(integers stored as text or beyond int64)" in capsys.readouterr().err


# ---------------------------------------------------------------- quotes
@pytest.mark.parametrize("block_bytes", [16, 1 << 20])
@pytest.mark.parametrize("text,line", [
    ('user_id,item_id,timestamp\n1,2,3\n1,3,"4\n', 3),  # the last line
    ('user_id,item_id,timestamp\n1,2,3\n1,3,"4', 3),  # no final newline
    ('user_id,item_id,timestamp,note\n1,2,3,x\n1,3,4,"abc\n2,3,5,y\n2,4,6,z\n', 3),  # swallowed the lines after it
    ('user_id,item_id,timestamp,note\n1,2,3,"a\nb"\n1,3,4,"a, ""b\n', 4),  # after a closed multi-line one
])
def test_an_unterminated_quote_is_an_error(tmp_path, text, line, block_bytes):
    with pytest.raises(DataError, match=rf"q.csv:{line}: a quoted field opened on this line is never closed: the file "
                                        r"ends inside it"):
        load_csv(_write(tmp_path, "q.csv", text), block_bytes=block_bytes)


@pytest.mark.parametrize("block_bytes", [16, 1 << 20])
def test_closed_and_stray_quotes_still_read(tmp_path, block_bytes):
    text = ('user_id,item_id,timestamp,note\n1,2,3,"a, b"\n1,3,4,"two\nlines"\n2,"3",5,5" screen\n'
            '2,4,6,"ends ""quoted"""\n')
    inter = load_csv(_write(tmp_path, "q.csv", text), block_bytes=block_bytes)
    assert inter.item.tolist() == [2, 3, 3, 4] and inter.lines.tolist() == [2, 3, 5, 6]


def test_an_unclosed_quote_early_in_a_long_file_is_an_error_not_a_traceback(tmp_path):
    rows = ["user_id,item_id,timestamp,note"] + [f"{r % 9 + 1},{r % 50 + 1},{1_600_000_000 + r},note {r}"
                                                 for r in range(20_000)]
    rows[100] = '5,6,1600000100,"oops'  # the csv module's field limit (131,072 characters) is hit
    with pytest.raises(DataError, match=r"big.csv:101: cannot read the record starting on this line \(field larger "
                                        r"than field limit \(131072\)\): a double quote \(\"\) that is never closed"):
        load_csv(_write(tmp_path, "big.csv", "\n".join(rows) + "\n"))


@pytest.mark.parametrize("text,fragment", [
    (b"user_id,item_id,timestamp\n1,2,1\n1,12\x0034,2\n2,3,3\n", "bad.csv:3:2: value '12\\x0034'"),
    (b"user_id,item_id,timestamp\n1,2,1\n1,3,2\n2,3,\"3\n", "bad.csv:4: a quoted field opened on this line"),
    (b"user_id,item_id,timestamp\n1,2,2022-04-08T12:30:00+02:00\n1,3,2022-04-08T12:30:00+2:00\n", "bad.csv:3:3: time"),
])
def test_grf_train_exits_2_naming_the_line(tmp_path, capsys, text, fragment):
    p = _write(tmp_path, "bad.csv", text)
    code = main(["train", "--quiet", "--out", str(tmp_path / "run"), "--set", "data.dataset=csv",
                 "--set", f"data.path={p}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("grf: error: ") and fragment in err and "Traceback" not in err, err
