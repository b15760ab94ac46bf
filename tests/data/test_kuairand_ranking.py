"""KuaiRand engagement sequences in GR dlrm_v3's layout: built from the real 211-row log sample and
the KuaiRand-Pure user features (checked against the files' own text, parsed independently here),
and GR's processed_seqs.csv format written and read back, including a file in GR's exact text."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from gr_functional.data.paths import dataset_path
from gr_functional.data.sources import kuairand_ranking as kr
from gr_functional.data.sources.kuairand import load_kuairand_log
from gr_functional.data.sources.kuairand_features import load_kuairand_features
from gr_functional.errors import DataError


@pytest.fixture(scope="module")
def seqs():
    log = load_kuairand_log(columns=kr.LOG_COLUMNS)
    return kr.sequences_from_log(log, load_kuairand_features(kind="user"))


def _csv(name):
    with open(dataset_path(name), newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def test_sequences_from_the_log_sample(seqs):
    header, rows = _csv("kuairand-sample")
    col = {c: header.index(c) for c in header}
    assert seqs.users.tolist() == [0, 1, 2, 3] and np.diff(seqs.offsets).tolist() == [63, 22, 48, 78]
    bits = {"is_click": 1, "is_like": 2, "is_follow": 4, "is_comment": 8, "is_forward": 16, "is_hate": 32,
            "long_view": 64, "is_profile_enter": 128}
    for u, uid in enumerate(seqs.users):
        mine = [r for r in rows if int(r[col["user_id"]]) == uid]                 # file order
        seq = seqs.sequence(u)
        assert seq["video_id"].tolist() == [int(r[col["video_id"]]) for r in mine]
        assert seq["time_ms"].tolist() == [int(r[col["time_ms"]]) for r in mine]
        assert seq["play_time_ms"].tolist() == [int(r[col["play_time_ms"]]) for r in mine]
        assert seq["duration_ms"].tolist() == [int(r[col["duration_ms"]]) for r in mine]
        want = [sum(b for c, b in bits.items() if float(r[col[c]]) != 0) for r in mine]
        assert seq["action_weights"].tolist() == want
    assert (seqs.columns["action_weights"] & 1).sum() > 0                      # some clicks in the sample


def test_context_codes_follow_first_appearance_in_the_feature_file(seqs):
    header, rows = _csv("kuairand-user-features")
    for name in kr.CONTEXT_FEATURES:
        j = header.index(name)
        order = list(dict.fromkeys(r[j] for r in rows))                         # first-appearance order
        want = [order.index(rows[int(uid)][j]) + 1 for uid in seqs.users]
        assert seqs.context[name].tolist() == want, name
    assert seqs.context["user_active_degree"][0] == 1                           # user 0 is the file's first row


def test_gr_processed_file_round_trip_and_gr_text(seqs, tmp_path):
    path = tmp_path / "processed_seqs.csv"
    kr.write_gr_processed(seqs, path)
    back = kr.load_gr_processed(path)
    assert back.users.tolist() == seqs.users.tolist() and back.offsets.tolist() == seqs.offsets.tolist()
    for c in kr.SEQUENCE_COLUMNS:
        assert back.columns[c].tolist() == seqs.columns[c].tolist(), c
    for c in kr.CONTEXT_FEATURES:
        assert back.context[c].tolist() == seqs.context[c].tolist(), c
    # GR's pandas to_csv text: quoted list cells, extra user-feature columns after the sequences
    gr = tmp_path / "gr.csv"
    gr.write_text('user_id,video_id,time_ms,action_weights,play_time_ms,duration_ms,user_active_degree,'
                  'is_lowactive_period,follow_user_num_range,fans_user_num_range,friend_user_num_range,'
                  'register_days_range\n'
                  '7,"[5, 9]","[1000, 2000]","[1, 65]","[300, 0]","[9000, 8000]",2,0,1,3,1,4\n')
    one = kr.load_gr_processed(gr)
    assert one.users.tolist() == [7] and one.columns["action_weights"].tolist() == [1, 65]
    assert one.context["fans_user_num_range"].tolist() == [3]


@pytest.mark.parametrize("text, message", [
    ("user_id,video_id\n1,[2]\n", ":1: GR's processed_seqs.csv has column"),
    ("user_id,video_id,time_ms,action_weights,play_time_ms,duration_ms,user_active_degree,follow_user_num_range,"
     "fans_user_num_range,friend_user_num_range,register_days_range\n"
     '1,"[1, 2]","[1]","[0, 0]","[1, 1]","[2, 2]",1,1,1,1,1\n', ":2: the sequence columns"),
    ("user_id,video_id,time_ms,action_weights,play_time_ms,duration_ms,user_active_degree,follow_user_num_range,"
     "fans_user_num_range,friend_user_num_range,register_days_range\n"
     '1,"[1, 2","[1]","[0, 0]","[1, 1]","[2, 2]",1,1,1,1,1\n', ":2: cannot read the row"),
])
def test_malformed_gr_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        kr.load_gr_processed(path)


@pytest.mark.data("kuairand-user-features")   # read before the log's columns are checked
def test_a_log_without_the_action_columns_is_refused():
    log = load_kuairand_log()                                                   # default columns: no profile enters
    with pytest.raises(DataError, match="is_profile_enter.*LOG_COLUMNS"):
        kr.sequences_from_log(log, load_kuairand_features(kind="user"))
