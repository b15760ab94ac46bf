"""Validation of raw logs before anything is allocated (README "Bad inputs"): sparse item ids are
refused unless remapped (``data.remap_items``), negative timestamps are errors naming FILE:LINE,
exact duplicate rows are kept and counted, and ``SequenceData.describe`` reports what was loaded."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gr_functional.config import DataConfig
from gr_functional.data import DataError, load_dataset, load_movielens_1m
from gr_functional.data.sequences import SPARSE_ID_FLOOR, SPARSE_ID_RATIO, count_duplicates, from_interactions

STRAY = 999_999_999


def ml1m_rows(users=20, items=50, seed=0):
    """``[user, item, rating, time]`` rows, sorted by user then time; every item 1..items occurs."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, users + 1):
        n = int(rng.integers(3, 9))
        ts = 978_300_000 + np.cumsum(rng.integers(1, 10_000, n))
        rows += [[u, int(rng.integers(1, items + 1)), 4, int(t)] for t in ts]
    rows += [[users + 1, i, 3, 978_300_000 + i] for i in range(1, items + 1)]
    return rows


def write_ml1m(path, rows):
    path.write_text("".join("::".join(str(x) for x in r) + "\n" for r in rows))
    return path


def write_ml20m(path, rows):
    path.write_text("userId,movieId,rating,timestamp\n"
                    + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in rows))
    return path


# ------------------------------------------------------------------------------ sparse ids
def test_one_stray_item_id_is_refused_quickly_naming_file_line_and_fix(tmp_path):
    rows = ml1m_rows()
    rows[7][1] = STRAY
    path = write_ml1m(tmp_path / "ratings.dat", rows)
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="ml-1m", path=str(path)))
    assert time.perf_counter() - start < 5.0  # no 1e9-row anything
    msg = str(err.value)
    distinct = len({r[1] for r in rows})
    assert f"{path}:8: item id {STRAY:,}" in msg
    assert f"{STRAY + 1:,} rows" in msg and f"only {distinct:,} distinct item ids" in msg
    assert "data.remap_items=true" in msg and f"1..{distinct:,}" in msg


def test_stray_id_loads_remapped_with_consistent_mapping(tmp_path):
    rows = ml1m_rows()
    rows[7][1] = STRAY
    path = write_ml1m(tmp_path / "ratings.dat", rows)
    data = load_dataset(DataConfig(dataset="ml-1m", path=str(path), remap_items=True))
    raw = sorted({r[1] for r in rows})
    assert data.num_items == len(raw) and data.raw_item_ids.tolist() == [-1] + raw
    assert data.items.min() == 1 and data.items.max() == len(raw)
    # every event keeps its raw id through the mapping, in the loader's (user, time) order
    inter = load_movielens_1m(path)
    order = np.lexsort((inter.time, inter.user))
    assert data.raw_item_ids[data.items].tolist() == inter.item[order].tolist()
    assert f"item ids 1..{len(raw)} ({len(raw)} distinct), remapped from raw ids 1..{STRAY:,}" in data.describe()


def test_remap_is_deterministic_whatever_the_row_order(tmp_path):
    rows = ml1m_rows()
    rows[3][1] = STRAY
    shuffled = [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]
    a = load_dataset(DataConfig(dataset="ml-1m", path=str(write_ml1m(tmp_path / "a.dat", rows)), remap_items=True))
    b = load_dataset(DataConfig(dataset="ml-1m", path=str(write_ml1m(tmp_path / "b.dat", shuffled)),
                                remap_items=True))
    assert a.raw_item_ids.tolist() == b.raw_item_ids.tolist()
    assert a.items.tolist() == b.items.tolist() and a.offsets.tolist() == b.offsets.tolist()


def test_remap_maps_movielens_candidates(tmp_path):
    rows = ml1m_rows(items=30)
    rows[0][1] = 2_000_000_000
    path = write_ml1m(tmp_path / "ratings.dat", rows)
    # movies.dat beside the ratings: ids 1..40 plus the stray one; 31..40 never occur
    (tmp_path / "movies.dat").write_text("".join(f"{i}::Movie {i}::Drama\n" for i in [*range(1, 41), 2_000_000_000]))
    data = load_dataset(DataConfig(dataset="ml-1m", path=str(path), remap_items=True))
    occurring = sorted({r[1] for r in rows})
    assert data.raw_item_ids[data.candidates].tolist() == occurring  # unseen candidates dropped, rest mapped


def test_ml20m_like_sparsity_still_loads(tmp_path):
    """ML-20M: max id 131,262 over 26,744 distinct ids (4.9x) loads with raw ids."""
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(np.arange(1, 131_262), size=26_743, replace=False)).tolist() + [131_262]
    rows = [[1 + k // 50, i, 4, 1_000_000_000 + k] for k, i in enumerate(ids)]
    data = load_dataset(DataConfig(dataset="ml-20m", path=str(write_ml20m(tmp_path / "ratings.csv", rows))))
    assert data.num_items == 131_262 and data.raw_item_ids is None
    assert "item ids 1..131,262 (26,744 distinct)" in data.describe()


@pytest.mark.parametrize("distinct, ok", [(20_000, True), (25_000, True), (SPARSE_ID_FLOOR // SPARSE_ID_RATIO, False)])
def test_sparse_threshold_above_the_floor(distinct, ok):
    """Above SPARSE_ID_FLOOR the rule is max id <= SPARSE_ID_RATIO x distinct ids."""
    top = 2_000_000
    items = np.concatenate([np.arange(1, distinct), [top]]).astype(np.int64)
    from gr_functional.data import Interactions

    inter = Interactions(np.repeat(np.arange(distinct // 10 + 1), 10)[:distinct].astype(np.int64), items,
                         np.arange(distinct, dtype=np.int64), name="made")
    assert (top <= SPARSE_ID_RATIO * distinct) == ok
    if ok:
        assert from_interactions(inter, remap_items=False).num_items == top
    else:
        with pytest.raises(DataError, match=rf"made row {distinct - 1}: item id 2,000,000 .* \(200x; raw ids are "
                                            rf"refused above 100x"):
            from_interactions(inter, remap_items=False)


def test_every_dataset_honours_remap_items(real_data_env):
    syn = load_dataset(DataConfig(synthetic_users=50, synthetic_items=400, synthetic_max_events=20))
    syn_r = load_dataset(DataConfig(synthetic_users=50, synthetic_items=400, synthetic_max_events=20,
                                    remap_items=True))
    assert syn_r.num_items == syn.distinct_items() < syn.num_items  # 50 short users leave ids unused
    assert syn_r.raw_item_ids[syn_r.items].tolist() == syn.items.tolist()
    ml = load_dataset(DataConfig(dataset="ml-1m", remap_items=True))
    assert ml.num_items == 3615 and ml.raw_item_ids[-1] == 3952
    assert ml.candidates.max() <= ml.num_items and len(ml.candidates) == 3615  # movies.dat ids mapped
    kr = load_dataset(DataConfig(dataset="kuairand"))  # always remapped: its ids start at 0
    assert kr.raw_item_ids is not None


# ------------------------------------------------------------------------------ timestamps
def test_negative_timestamp_names_file_and_line(tmp_path):
    rows = ml1m_rows()
    rows[5][3] = -86_400
    path = write_ml1m(tmp_path / "ratings.dat", rows)
    with pytest.raises(DataError, match=rf"{path}:6: timestamp -86400 is negative; timestamps are unix seconds"):
        load_dataset(DataConfig(dataset="ml-1m", path=str(path)))
    # below a header the line is row + 2
    path = write_ml20m(tmp_path / "ratings.csv", rows)
    with pytest.raises(DataError, match=rf"{path}:7: timestamp -86400 is negative"):
        load_dataset(DataConfig(dataset="ml-20m", path=str(path)))


# ------------------------------------------------------------------------------ duplicates
def test_duplicate_rows_are_kept_and_counted(tmp_path):
    rows = ml1m_rows()
    dup = [list(rows[2]), list(rows[2]), list(rows[9])]  # rows[2] three times in all, rows[9] twice
    dup[1][2] = 1  # a different rating is still the same (user, item, time) event
    path = write_ml1m(tmp_path / "ratings.dat", rows + dup)
    data = load_dataset(DataConfig(dataset="ml-1m", path=str(path)))
    assert data.num_events == len(rows) + 3  # kept
    assert data.duplicate_events == 3
    assert "3 duplicate (user, item, time) rows kept" in data.describe()
    clean = load_dataset(DataConfig(dataset="ml-1m", path=str(write_ml1m(tmp_path / "clean.dat", rows))))
    assert clean.duplicate_events == 0 and "0 duplicate (user, item, time) rows" in clean.describe()


def test_count_duplicates_matches_a_brute_force_count():
    rng = np.random.default_rng(3)
    u = np.sort(rng.integers(0, 30, 3000))
    t = rng.integers(0, 40, 3000)
    order = np.lexsort((t, u))
    u, t = u[order], t[order]
    i = rng.integers(0, 5, 3000)
    expected = 3000 - len({(a, b, c) for a, b, c in zip(u.tolist(), i.tolist(), t.tolist())})
    assert expected > 0 and count_duplicates(u, t, i) == expected


def test_real_ml1m_summary(ml1m):
    assert ml1m.duplicate_events == 0
    assert ml1m.describe().endswith("6,040 users, 999,917 events, item ids 1..3,952 (3,615 distinct), "
                                    "0 duplicate (user, item, time) rows")
