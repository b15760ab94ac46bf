"""Dataset "csv" (gr_functional/data/sources/interactions.py): users' own CSV/TSV files, on tiny
hand-written files and on a generated one checked against a plain csv-module reading."""
import csv
import json
import sys

import numpy as np
import pytest

from gr_functional.cli import main
from gr_functional.config import DataConfig
from gr_functional.configure import load_config
from gr_functional.data import DataError, from_interactions, load_csv, load_dataset


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ---------------------------------------------------------------- reading
def test_header_csv_keeps_integer_ids_in_file_order(tmp_path):
    p = _write(tmp_path, "events.csv", "user_id,item_id,timestamp,extra\n7,10,100,a\n7,11,101,b\n3,10,50,c\n")
    inter = load_csv(p)
    assert inter.user.dtype == inter.item.dtype == inter.time.dtype == np.int64
    assert inter.user.tolist() == [7, 7, 3] and inter.item.tolist() == [10, 11, 10]
    assert inter.time.tolist() == [100, 101, 50] and inter.rating is None
    assert inter.lines.tolist() == [2, 3, 4] and inter.where(2) == f"{p}:4" and inter.name == "events.csv"


def test_no_header_columns_by_index(tmp_path):
    p = _write(tmp_path, "log.csv", "10,1,5,999\n11,1,4,998\n")
    inter = load_csv(p, header=False, user="1", item="0", time="3")
    assert inter.user.tolist() == [1, 1] and inter.item.tolist() == [10, 11] and inter.time.tolist() == [999, 998]
    assert inter.lines.tolist() == [1, 2]


def test_a_digit_string_is_an_index_when_no_header_column_has_that_name(tmp_path):
    p = _write(tmp_path, "e.csv", "a,b,c\n1,2,3\n")
    inter = load_csv(p, user="0", item="b", time="2")
    assert (inter.user[0], inter.item[0], inter.time[0]) == (1, 2, 3)


def test_tsv_string_ids_and_millisecond_times(tmp_path):
    p = _write(tmp_path, "clicks.tsv", "uid\tsku\tts\nbob\tB-2\t1651314030792\nann\tA-1\t1651314031999\n"
                                        "bob\tA-1\t1651314032000\n")
    inter = load_csv(p, user="uid", item="sku", time="ts", time_unit="ms")
    # id k is the k-th distinct string in byte order: ann=1, bob=2; A-1=1, B-2=2
    assert inter.user.tolist() == [2, 1, 2] and inter.item.tolist() == [2, 1, 1]
    assert inter.time.tolist() == [1651314030, 1651314031, 1651314032]  # floored to seconds


@pytest.mark.parametrize("unit,raw,seconds", [
    ("s", "1651314030", 1651314030), ("ms", "1651314030999", 1651314030), ("us", "1651314030000001", 1651314030),
    ("ns", "1651314030999999999", 1651314030), ("s", "1651314030.75", 1651314030), ("ms", "-1500", -2),
])
def test_time_units_floor_to_integer_seconds(tmp_path, unit, raw, seconds):
    p = _write(tmp_path, "t.csv", f"user_id,item_id,timestamp\n1,2,{raw}\n")
    assert load_csv(p, time_unit=unit).time.tolist() == [seconds]


def test_iso_dates(tmp_path):
    p = _write(tmp_path, "d.csv", "user_id,item_id,timestamp\n1,2,2022-04-08 12:30:00\n1,3,2022-04-08T12:31:00+02:00\n"
                                  "1,4,2022-04-09\n")
    assert load_csv(p).time.tolist() == [1649421000, 1649421000 - 7200 + 60, 1649462400]


def test_rating_filter_keeps_line_numbers(tmp_path):
    p = _write(tmp_path, "r.csv", "user_id,item_id,timestamp,stars\n1,2,3,5\n1,3,4,1.5\n2,3,5,4\n")
    inter = load_csv(p, rating="stars", min_rating=3)
    assert inter.user.tolist() == [1, 2] and inter.rating.tolist() == [5.0, 4.0]
    assert inter.rating.dtype == np.float32 and inter.lines.tolist() == [2, 4]
    # a later error (from_interactions) names the right line despite the dropped row
    p = _write(tmp_path, "neg.csv", "user_id,item_id,timestamp,stars\n1,2,3,1\n1,3,-4,5\n")
    with pytest.raises(DataError, match=r"neg.csv:3: timestamp -4 is negative"):
        from_interactions(load_csv(p, rating="stars", min_rating=3), remap_items=False)


def test_separators_extension_sniffed_and_explicit(tmp_path):
    assert load_csv(_write(tmp_path, "a.txt", "user_id;item_id;timestamp\n1;2;3\n")).item.tolist() == [2]
    assert load_csv(_write(tmp_path, "b.tab", "user_id\titem_id\ttimestamp\n1\t2\t3\n")).item.tolist() == [2]
    p = _write(tmp_path, "c.dat", "1::2::3\n")
    assert load_csv(p, sep="::", header=False, user="0", item="1", time="2").item.tolist() == [2]
    p = _write(tmp_path, "d.csv", "user_id\titem_id\ttimestamp\n1\t2\t3\n")
    assert load_csv(p, sep="\\t").item.tolist() == [2]  # a bare --set data.csv_sep=\t


def test_quotes_crlf_bom_and_trailing_blank_lines(tmp_path):
    text = ('\ufeffuser_id,item_id,timestamp,title\r\n1,2,3,"a, b"\r\n1,3,4,"two\r\nlines"\r\n'
            '2,"3",5,x\r\n\r\n\r\n')
    inter = load_csv(_write(tmp_path, "q.csv", text))
    assert inter.user.tolist() == [1, 1, 2] and inter.item.tolist() == [2, 3, 3] and inter.time.tolist() == [3, 4, 5]
    assert inter.lines.tolist() == [2, 3, 5]
    p = _write(tmp_path, "bom.csv", "\ufeff1,2,3\n")
    assert load_csv(p, header=False, user="0", item="1", time="2").user.tolist() == [1]


def _reference(path, user, item, time):
    """A plain csv-module reading: the result load_csv must match."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    names = rows[0]
    cols = [[r[names.index(c)] for r in rows[1:]] for c in (user, item, time)]
    return cols


@pytest.mark.parametrize("block_bytes", [64, 1000, 1 << 20])
def test_blocks_quotes_and_late_string_ids_match_a_csv_module_reading(tmp_path, block_bytes):
    rng = np.random.default_rng(0)
    lines = ["user_id,item_id,timestamp,note"]
    for r in range(400):
        note = '"x, ""y""\nz"' if r % 37 == 0 else "plain"
        # string ids from row 350 on, late in the file (12 % of the rows: a string column, not damage)
        item = f"sku{r % 7}" if r >= 350 else str(int(rng.integers(1, 30)))
        lines.append(f"{int(rng.integers(1, 20))},{item},{1_600_000_000 + r},{note}")
    p = _write(tmp_path, "big.csv", "\n".join(lines) + "\n")
    inter = load_csv(p, block_bytes=block_bytes)
    users, items, times = _reference(p, "user_id", "item_id", "timestamp")
    assert inter.user.tolist() == [int(u) for u in users]
    assert inter.time.tolist() == [int(t) for t in times]
    uniq = sorted(set(items), key=str.encode)  # strings: k-th distinct string in byte order
    assert inter.item.tolist() == [uniq.index(i) + 1 for i in items]
    assert len(inter) == 400 and inter.lines[-1] == 400 + 1 + 400 // 37 + 1  # quoted notes span 2 lines


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("name,text,kwargs,message", [
    ("e.csv", "", {}, r"e.csv: file is empty"),
    ("h.csv", "user_id,item_id,timestamp\n", {}, r"h.csv: no data rows after the header"),
    ("m.csv", "user,item,ts\n1,2,3\n", {},
     r"m.csv:1: no column 'user_id' \(data.csv_user\); the header's columns are: user, item, ts. Set data.csv_user"),
    ("s.csv", "user_id\titem_id\ttimestamp\n1\t2\t3\n", {},
     r"s.csv:1: with separator ',' \(from the .csv extension\) the header is a single column: .*"
     r"it looks '\\t'-separated: set data.csv_sep='\\t'"),
    ("n.csv", "user_id,item_id,timestamp\n1,2,3\n1,2,12x\n", {},
     r"n.csv:3:3: time '12x' \(column 'timestamp', data.csv_time\) is neither a number nor an ISO 8601 date"),
    ("u.csv", "user_id,item_id,timestamp\n1,2,1_000\n", {}, r"u.csv:2:3: time '1_000'"),
    ("f.csv", "user_id,item_id,timestamp\n1,2,inf\n", {}, r"f.csv:2:3: time 'inf' .* is not a finite number"),
    ("d.csv", "user_id,item_id,timestamp\n1,2,2022-04-08\n1,3,1651314030\n", {},
     r"d.csv:2:3: time '2022-04-08' .* is a date, but .*d.csv:3:3 holds the number '1651314030'"),
    ("r.csv", "user_id,item_id,timestamp,stars\n1,2,3,5\n1,3,4,five\n", {"rating": "stars"},
     r"r.csv:3:4: rating 'five' \(column 'stars', data.csv_rating\) is not a number"),
    ("a.csv", "user_id,item_id,timestamp,stars\n1,2,3,1\n", {"rating": "stars", "min_rating": 4},
     r"a.csv: no rows left: every rating \(1..1, column 'stars', data.csv_rating\) is below data.csv_min_rating=4"),
    ("c.csv", "user_id,item_id,timestamp\n1,2,3\n1,2\n", {},
     r"c.csv:3: expected 3 fields separated by ',' \(as on line 1\), got 2: '1,2'"),
    ("b.csv", "user_id,item_id,timestamp\n1,2,3\n\n1,2,4\n", {}, r"b.csv:3: expected 3 fields .*got an empty line"),
    ("i.csv", "user_id,item_id,timestamp\n1, ,3\n", {}, r"i.csv:2:2: the item id is empty"),
    ("x.csv", "1,2,3\n", {"header": False},
     r"data.csv_user='user_id': with data.csv_header=false columns are 0-based indices written as strings"),
    ("y.csv", "1,2,3\n", {"header": False, "user": "0", "item": "1", "time": "3"},
     r"data.csv_time='3': .*y.csv:1 has 3 columns \(0-based indices 0..2\)"),
    ("z.csv", "user_id,item_id,timestamp\n1,2,3\n", {"item": "user_id"},
     r"data.csv_user='user_id' and data.csv_item='user_id' name the same column"),
    ("w.txt", "user_id item_id timestamp\n1 2 3\n", {}, r"w.txt:1: cannot tell the field separator"),
])
def test_errors_name_file_line_and_fix(tmp_path, name, text, kwargs, message):
    with pytest.raises(DataError, match=message):
        load_csv(_write(tmp_path, name, text), **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_csv(tmp_path / "nope.csv")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"reading Parquet needs pyarrow.*pip install pyarrow"):
        load_csv(_write(tmp_path, "e.parquet", b"PAR1"))


def test_parquet_with_pyarrow(tmp_path):
    import pyarrow as pa  # in the test extra: Parquet input is tested, not skipped
    import pyarrow.parquet as pq
    p = tmp_path / "e.parquet"
    pq.write_table(pa.table({"user_id": ["b", "a", "b"], "item_id": [5, 6, 5], "timestamp": [3000, 1000, 2000],
                             "stars": [5.0, 1.0, 4.0]}), p)
    inter = load_csv(p, time_unit="ms", rating="stars", min_rating=2)
    assert inter.user.tolist() == [2, 2] and inter.item.tolist() == [5, 5] and inter.time.tolist() == [3, 2]
    with pytest.raises(DataError, match=r"no column 'uid' \(data.csv_user\); the file's columns are: user_id"):
        load_csv(p, user="uid")


# ---------------------------------------------------------------- config and training
def test_load_dataset_csv_and_its_config_keys(tmp_path):
    p = _write(tmp_path, "mine.tsv", "u\ti\tt\nx\t900\t5\nx\t7\t6\ny\t900\t7\n")
    cfg = load_config(None, ["data.dataset=csv", f"data.path={p}", "data.csv_user=u", "data.csv_item=i",
                             "data.csv_time=t", "data.remap_items=true"]).data
    data = load_dataset(cfg)
    assert len(data) == 2 and data.num_items == 2 and data.raw_item_ids.tolist() == [-1, 7, 900]
    assert data.name == "mine.tsv" and data.source == str(p)
    with pytest.raises(DataError, match=r"data.dataset='csv' reads the file named by data.path, which is empty"):
        load_dataset(DataConfig(dataset="csv"))
    with pytest.raises(DataError, match=r"data.path=.* is a folder; name the CSV/TSV file in it \(data.dataset=.csv.\)"):
        load_dataset(DataConfig(dataset="csv", path=str(tmp_path)))
    with pytest.raises(DataError, match=r"does not exist \(set data.path to an existing file\)"):
        load_dataset(DataConfig(dataset="csv", path=str(tmp_path / "nope.csv")))
    with pytest.raises(Exception, match=r"--set data.csv_time_unit=h: 'h' is not one of 's', 'ms', 'us', 'ns'"):
        load_config(None, ["data.csv_time_unit=h"])


def test_grf_train_on_a_csv_file(tmp_path, capsys):
    rng = np.random.default_rng(1)
    rows = ["user,sku,ts_ms"]
    for u in range(40):
        t = 1_650_000_000_000
        for _ in range(int(rng.integers(4, 12))):
            t += int(rng.integers(1_000, 3_600_000))
            rows.append(f"u{u},sku-{int(rng.integers(1, 60))},{t}")
    p = _write(tmp_path, "mine.csv", "\n".join(rows) + "\n")
    out = tmp_path / "run"
    sets = ["data.dataset=csv", f"data.path={p}", "data.csv_user=user", "data.csv_item=sku", "data.csv_time=ts_ms",
            "data.csv_time_unit=ms", "model.max_len=16", "model.embed_dim=16", "model.dqk=8", "model.dv=8",
            "loss.num_negatives=8", "train.epochs=1", "train.max_steps=2", "train.batch_size=16", "eval.batch_size=64"]
    assert main(["train", "--quiet", "--out", str(out)] + [a for s in sets for a in ("--set", s)]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert 0.0 <= result["hr@10"] <= 1.0
    config = (out / "config.toml").read_text()
    assert 'dataset = "csv"' in config and 'csv_time_unit = "ms"' in config
