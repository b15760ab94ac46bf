"""Loaders on the real files and on tiny hand-written malformed files."""
import numpy as np
import pytest

from gr_functional.data import DataError, load_kuairand_log, load_movielens_1m, load_movielens_20m


# ---------------------------------------------------------------- real files
def test_ml1m_real_file(ml1m_inter, ml1m_path):
    inter = ml1m_inter
    reconstructed = ml1m_path.name == "ratings_known.dat"
    assert len(inter) == (999_917 if reconstructed else 1_000_209)
    assert inter.name == ("ML-1M (reconstructed)" if reconstructed else "ML-1M")
    assert inter.user.dtype == inter.item.dtype == inter.time.dtype == np.int64
    assert inter.rating.dtype == np.float32
    assert np.unique(inter.user).size == 6040 and inter.user.min() == 1 and inter.user.max() == 6040
    assert inter.item.max() == 3952
    # First and last lines of ratings.dat, in file order.
    assert (inter.user[0], inter.item[0], inter.rating[0], inter.time[0]) == (1, 1193, 5.0, 978300760)
    assert (inter.user[-1], inter.item[-1], inter.time[-1]) == (6040, 1097, 956715569)
    assert set(np.unique(inter.rating).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}


def test_ml1m_block_boundaries_do_not_change_result(ml1m_inter, ml1m_path):
    small = load_movielens_1m(ml1m_path, block_bytes=3 << 20)
    for col in ("user", "item", "time", "rating"):
        np.testing.assert_array_equal(getattr(small, col), getattr(ml1m_inter, col))


def test_kuairand_sample(kuairand_sample_path):
    inter = load_kuairand_log(kuairand_sample_path)
    assert len(inter) == 211
    assert np.bincount(inter.user).tolist() == [63, 22, 48, 78]
    assert inter.item[:3].tolist() == [5543, 1836, 721]
    assert inter.extra["time_ms"][0] == 1651314030792
    assert inter.time[0] == 1651314030  # seconds = time_ms // 1000
    np.testing.assert_array_equal(inter.time, inter.extra["time_ms"] // 1000)
    assert inter.extra["is_click"].dtype == np.int64
    assert set(np.unique(inter.extra["is_click"]).tolist()) <= {0, 1}
    assert (inter.extra["tab"] == 1).all()
    assert inter.rating is None


def test_kuairand_columns_by_name(tmp_path):
    # Column order differs from the official file: columns are found by header name.
    p = tmp_path / "log.csv"
    p.write_text("video_id,time_ms,user_id,is_click\n7,1651314030792,3,1\n9,1651314031999,3,0\n")
    inter = load_kuairand_log(p, columns=("is_click",))
    assert inter.user.tolist() == [3, 3] and inter.item.tolist() == [7, 9]
    assert inter.time.tolist() == [1651314030, 1651314031]
    assert inter.extra["is_click"].tolist() == [1, 0]


# ---------------------------------------------------------------- ML-20M format (tiny hand-made rows)
def test_ml20m_csv(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n1,29,4.0,1112484676\n2,131262,0.5,974820889\n")
    inter = load_movielens_20m(p)
    assert inter.user.tolist() == [1, 1, 2]
    assert inter.item.tolist() == [2, 29, 131262]
    assert inter.rating.tolist() == [3.5, 4.0, 0.5]
    assert inter.time.tolist() == [1112486027, 1112484676, 974820889]


def test_ml20m_bad_header(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("user,movie,rating,ts\n1,2,3.5,1112486027\n")
    with pytest.raises(DataError, match=r"ratings.csv:1: expected the header 'userId,movieId,rating,timestamp'"):
        load_movielens_20m(p)


def test_ml20m_non_integer_id(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n1,2.5,4.0,1112484676\n")
    with pytest.raises(DataError, match=r"ratings.csv:3: field 2 \(movieId\) is not an integer: '2.5'"):
        load_movielens_20m(p)


def test_ml20m_header_only_is_empty(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n")
    with pytest.raises(DataError, match="no data rows"):
        load_movielens_20m(p)


# ---------------------------------------------------------------- malformed ML-1M files
def _write(tmp_path, text, name="ratings.dat"):
    p = tmp_path / name
    p.write_bytes(text.encode())
    return p


def test_wrong_field_count_names_file_and_line(tmp_path):
    p = _write(tmp_path, "1::1193::5::978300760\n1::661::3::978302109\n1::914::3\n")
    with pytest.raises(DataError) as exc:
        load_movielens_1m(p)
    assert str(exc.value).startswith(f"{p}:3: expected 4 fields separated by '::', got 3")


def test_compensating_field_counts_are_caught(tmp_path):
    # 5 + 3 fields = 2 * 4 in total: a plain token count would accept this and shift the columns.
    p = _write(tmp_path, "1::1::5::9::9\n1::2::5\n")
    with pytest.raises(DataError, match=r"ratings.dat:1: expected 4 fields separated by '::', got 5"):
        load_movielens_1m(p)


def test_non_integer_field(tmp_path):
    p = _write(tmp_path, "1::1193::5::978300760\n1::abc::3::978302109\n")
    with pytest.raises(DataError, match=r"ratings.dat:2: field 2 \(MovieID\) is not an integer: 'abc'"):
        load_movielens_1m(p)
    p = _write(tmp_path, "1::1193::4.5::978300760\n")
    with pytest.raises(DataError, match=r"ratings.dat:1: field 3 \(Rating\) is not an integer: '4.5'"):
        load_movielens_1m(p)


def test_wrong_separator(tmp_path):
    p = _write(tmp_path, "1,1193,5,978300760\n")
    with pytest.raises(DataError, match=r"ratings.dat:1: expected 4 fields separated by '::', got 1"):
        load_movielens_1m(p)


def test_empty_and_blank_files(tmp_path):
    with pytest.raises(DataError, match="no data rows"):
        load_movielens_1m(_write(tmp_path, ""))
    with pytest.raises(DataError, match="no data rows"):
        load_movielens_1m(_write(tmp_path, "\n\n  \n"))


def test_blank_line_inside_is_an_error(tmp_path):
    p = _write(tmp_path, "1::1::5::1\n\n1::2::5::2\n")
    with pytest.raises(DataError, match=r"ratings.dat:2: .*got an empty line"):
        load_movielens_1m(p)


def test_tolerated_variants(tmp_path):
    # CRLF line endings, no final newline, trailing blank lines.
    for text in ("1::1::5::10\r\n2::3::4::20\r\n", "1::1::5::10\n2::3::4::20", "1::1::5::10\n2::3::4::20\n\n\n"):
        inter = load_movielens_1m(_write(tmp_path, text))
        assert inter.user.tolist() == [1, 2] and inter.item.tolist() == [1, 3] and inter.time.tolist() == [10, 20]


def test_error_line_numbers_across_blocks(tmp_path):
    lines = [f"{u}::{u + 1}::5::{1000 + u}" for u in range(1, 200)]
    lines[150] = "151::oops::5::1151"
    p = _write(tmp_path, "\n".join(lines) + "\n")
    ok = load_movielens_1m(_write(tmp_path, "\n".join(lines[:150]) + "\n", "ok.dat"), block_bytes=64)
    assert ok.user.tolist() == list(range(1, 151))
    with pytest.raises(DataError, match=r"ratings.dat:151: field 2 \(MovieID\) is not an integer: 'oops'"):
        load_movielens_1m(p, block_bytes=64)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_movielens_1m(tmp_path / "nope.dat")


def test_kuairand_missing_column(tmp_path):
    p = tmp_path / "log.csv"
    p.write_text("user_id,video_id,date\n0,1,20220422\n")
    with pytest.raises(DataError, match=r"log.csv:1: KuaiRand log header lacks column\(s\) time_ms"):
        load_kuairand_log(p)


def test_kuairand_bad_value(tmp_path):
    p = tmp_path / "log.csv"
    p.write_text("user_id,video_id,time_ms,is_click\n0,1,1651314030792,0\n0,x,1651314031792,1\n")
    with pytest.raises(DataError, match=r"log.csv:3: field 2 \(video_id\) is not an integer: 'x'"):
        load_kuairand_log(p, columns=("is_click",))
