"""KuaiRand side-feature files: the real KuaiRand-Pure user and video files (every column's kind,
values checked against the file's own text), and the errors a malformed file gets."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from gr_functional.data.paths import dataset_path
from gr_functional.data.sources.kuairand_features import load_kuairand_features
from gr_functional.errors import DataError


def _raw(kind):
    with open(dataset_path(f"kuairand-{kind}-features"), newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


@pytest.mark.slow
def test_user_features_of_kuairand_pure():
    t = load_kuairand_features(kind="user")
    header, rows = _raw("user")
    assert t.key == "user_id" and len(t.ids) == 27_285 and t.ids.tolist() == list(range(27_285))
    assert set(t.names) == set(header) - {"user_id"}
    assert set(t.categorical) == {"user_active_degree", "follow_user_num_range", "fans_user_num_range",
                                  "friend_user_num_range", "register_days_range"}
    codes, vocab = t.categorical["user_active_degree"]
    j = header.index("user_active_degree")
    assert [vocab[c - 1] for c in codes[:50]] == [r[j] for r in rows[:50]] and codes.min() >= 1
    assert "[100,1k)" in t.categorical["fans_user_num_range"][1]      # a quoted field with a comma
    j = header.index("onehot_feat4")
    col = t.numeric["onehot_feat4"]
    assert np.isnan(col).sum() == sum(r[j] == "" for r in rows) == 874
    assert t.numeric["is_live_streamer"][1] == -124.0 and t.numeric["register_days"][0] == 799.0


def test_video_features_of_kuairand_pure_with_multi_valued_tags():
    t = load_kuairand_features(kind="video")
    header, rows = _raw("video")
    assert t.key == "video_id" and len(t.ids) == 7_583
    assert set(t.multi) == {"tag"} and set(t.categorical) == {"video_type", "upload_dt", "upload_type"}
    offsets, values = t.multi["tag"]
    j = header.index("tag")
    for i in (0, 1) + tuple(i for i, r in enumerate(rows) if "," in r[j])[:20] + tuple(
            i for i, r in enumerate(rows) if r[j] == "")[:5]:
        want = [int(x) for x in rows[i][j].split(",")] if rows[i][j] else []
        assert values[offsets[i]:offsets[i + 1]].tolist() == want, i
    assert t.numeric["music_id"][0] == 9155697141.0 and np.isnan(t.numeric["video_duration"]).sum() == 239
    assert t.rows_of([0, 7582, 7583, -1]).tolist() == [0, 7582, -1, -1]


@pytest.mark.parametrize("text, message", [
    ("a,b\n1,2\n", "starts with a header naming 'user_id'"),
    ("user_id,x\n1,2\n2\n", ":3: 1 fields, the header has 2"),
    ("user_id,x\n1,2\nu7,3\n", ":3: user_id 'u7' is not an integer"),
    ("user_id,x\n1,2\n5,3\n1,4\n", ":4: user_id 1 repeats line 2"),
])
def test_malformed_files_are_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "features.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message.replace("(", "\\(").replace("[", "\\[")):
        load_kuairand_features(path, kind="user")


def test_column_kinds_are_decided_over_the_whole_file_in_blocks(tmp_path, monkeypatch):
    """Read 2 rows at a time: a column numeric in the first blocks and text later is categorical
    with every value in its vocabulary; numbers then id lists make a multi-valued column."""
    from gr_functional.data.sources import kuairand_features as kf

    monkeypatch.setattr(kf, "BLOCK_ROWS", 2)
    path = tmp_path / "video.csv"
    path.write_text('video_id,mixed,tags,num\n0,7,3,1.5\n1,8,4,\n2,x,"5,6",2\n3,7,,3\n4,y,9,4\n')
    t = kf.load_kuairand_features(path, kind="video")
    codes, vocab = t.categorical["mixed"]
    assert vocab == ("7", "8", "x", "y") and [vocab[c - 1] for c in codes] == ["7", "8", "x", "7", "y"]
    offsets, values = t.multi["tags"]
    assert [values[offsets[i]:offsets[i + 1]].tolist() for i in range(5)] == [[3], [4], [5, 6], [], [9]]
    assert np.isnan(t.numeric["num"][1]) and t.numeric["num"][[0, 2, 3, 4]].tolist() == [1.5, 2, 3, 4]
