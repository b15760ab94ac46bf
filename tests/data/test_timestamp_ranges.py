"""Timestamps no int64 / float64 holds exactly, or that are no unix seconds ([hardening3]): the
error names FILE:LINE of the offending value (it used to say "look like milliseconds" of the
whole dataset, after a 23-digit value had silently become the int64 limit)."""
import pytest

from gr_functional.cli import main
from gr_functional.config import DataConfig
from gr_functional.data import DataError, from_interactions, load_dataset, load_movielens_1m, load_movielens_20m


def _ratings(tmp_path, bad_time=None, at=3, n=6, name="ratings.dat"):
    rows = [[1 + r // 3, 10 + r, 4, 978_300_760 + r] for r in range(n)]
    if bad_time is not None:
        rows[at - 1][3] = bad_time
    p = tmp_path / name
    p.write_text("".join("::".join(map(str, row)) + "\n" for row in rows))
    return p


@pytest.mark.parametrize("digits", [23, 20])
def test_ml1m_timestamp_beyond_int64_names_its_line(tmp_path, digits):
    value = "1234567890" * 2 + "123"
    p = _ratings(tmp_path, value[:digits])
    with pytest.raises(DataError, match=rf"ratings.dat:3: field 4 \(Timestamp\) is too large: '{value[:digits]}' has "
                                        rf"{digits} digits, beyond 9,223,372,036,854,775,806, the largest integer read "
                                        r"exactly; timestamps are unix seconds, 10 digits today"):
        load_movielens_1m(p)
    with pytest.raises(DataError, match=r"ratings.dat:3: field 4"):  # the grf train path
        load_dataset(DataConfig(dataset="ml-1m", path=str(p)))


def test_the_line_is_right_across_blocks(tmp_path):
    p = _ratings(tmp_path, "9" * 23, at=150, n=200)
    with pytest.raises(DataError, match=r"ratings.dat:150: field 4 \(Timestamp\) is too large"):
        load_movielens_1m(p, block_bytes=64)


def test_ml1m_milliseconds_name_the_line(tmp_path):
    p = _ratings(tmp_path, 978_300_762_000)
    with pytest.raises(DataError, match=r"ratings.dat:3: timestamp 978,300,762,000 is after the year 5000 in unix "
                                        r"seconds; the timestamps look like milliseconds .*Convert them to seconds"):
        from_interactions(load_movielens_1m(p), remap_items=False)
    # 11 digits: before the year 5000, but 360 years after the others (more than int32 seconds)
    p = _ratings(tmp_path, 12_345_678_901, at=5)
    with pytest.raises(DataError, match=r"ratings.dat:5: timestamp 12,345,678,901 is 11,367,378,141 seconds after the "
                                        r"one at .*ratings.dat:1 \(978,300,760\), more than int32 seconds hold"):
        load_dataset(DataConfig(dataset="ml-1m", path=str(p)))


def test_ml20m_float_reader_refuses_integers_it_cannot_hold(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n1,2,4.0,978300760\n1,3,4.5,12345678901234567890123\n")
    with pytest.raises(DataError, match=r"ratings.csv:3: field 4 \(timestamp\) is too large: '12345678901234567890123' "
                                        r"has 23 digits, beyond 9,007,199,254,740,992"):
        load_movielens_20m(p)


def test_valid_files_are_unchanged(tmp_path):
    inter = load_movielens_1m(_ratings(tmp_path))
    assert inter.time.tolist() == [978_300_760 + r for r in range(6)] and inter.item.tolist() == list(range(10, 16))
    assert from_interactions(inter, remap_items=False).times.tolist() == inter.time.tolist()


def test_grf_train_exits_2_naming_the_line(tmp_path, capsys):
    p = _ratings(tmp_path, "1" * 23, at=4)
    code = main(["train", "--quiet", "--out", str(tmp_path / "run"), "--set", "data.dataset=ml-1m",
                 "--set", f"data.path={p}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"grf: error: {p}:4: field 4 (Timestamp) is too large: '{'1' * 23}'"), err


def test_csv_timestamp_beyond_int64_names_its_line_and_digits(tmp_path):
    """The CSV reader reads such a time as a float; cast to int64 it wrapped to -9.2e18 and was
    reported as "negative" (found re-running the [hardening3] campaign)."""
    from gr_functional.data.sources.interactions import load_csv

    p = tmp_path / "log.csv"
    rows = [f"{1 + r % 3},{10 + r},{1_600_000_000 + r}" for r in range(6)] + ["2,30,12345678901234567890123"]
    p.write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"log.csv:8:3: time 1.2345678901234568e\+22 .* has 23 digits, far beyond any "
                                        r"date"):
        load_csv(p)
