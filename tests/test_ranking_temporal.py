"""``data.split = "temporal"`` (gr_functional/ranking/data.py ``temporal_split``): samples by time
cutoffs, as KuaiRand papers split real logs: training windows before ``valid_start``, each user's
impressions of the validation and test windows as candidates (a variable number per user, in chunks
of up to C) with the history before the window; bad cutoffs refused naming the key."""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional.config import ConfigError, cutoff_ms
from gr_functional.configure import load_config
from gr_functional.data.sources.kuairand_ranking import CONTEXT_FEATURES, SEQUENCE_COLUMNS, RankingSequences
from gr_functional.errors import DataError
from gr_functional.ranking.data import temporal_split

DAY = 86_400_000


def _seqs(days_per_user: list[list[int]]) -> RankingSequences:
    """One event per listed day (ms = day * DAY) per user, video id = event number."""
    times = [np.asarray(d, np.int64) * DAY for d in days_per_user]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in times])]).astype(np.int64)
    T = int(offsets[-1])
    columns = {c: np.arange(T, dtype=np.int64) for c in SEQUENCE_COLUMNS}
    columns["time_ms"] = np.concatenate(times)
    users = np.arange(len(times), dtype=np.int64)
    return RankingSequences(users, offsets, columns, {c: np.ones(len(times), np.int64) for c in CONTEXT_FEATURES})


def test_windows_by_time_with_a_variable_number_of_candidates():
    seqs = _seqs([list(range(10)) + [10, 10, 10, 11, 12, 13, 13],   # 10 before, 4 in valid, 3 in test
                  [10, 11],                                          # no history before valid: left out there
                  [0, 1, 2, 12]])                                    # nothing in valid; 1 test candidate
    splits, skipped = temporal_split(seqs, 2, valid_start=10 * DAY, test_start=12 * DAY)
    # training: windows of 2 ending at the last pre-cutoff event (10), then 8, 6, 4 and a window of 1
    # after the first event (every window after >= 1 history event)
    assert splits.train.users.tolist() == [0, 0, 0, 0, 0, 2] and splits.train.ends.tolist() == [10, 8, 6, 4, 2, 3]
    assert splits.train.counts.tolist() == [2, 2, 2, 2, 1, 2]
    # validation: user 0's 4 events in days [10, 12) as 2 chunks of 2, history = its 10 earlier events
    assert splits.valid.users.tolist() == [0, 0] and splits.valid.ends.tolist() == [12, 14]
    assert splits.valid.counts.tolist() == [2, 2] and splits.valid.history_ends.tolist() == [10, 10]
    # test: user 0's 3 events (chunks of 2 and 1, history its 14 earlier ones), user 2's 1
    assert splits.test.users.tolist() == [0, 0, 2] and splits.test.ends.tolist() == [16, 17, 4]
    assert splits.test.counts.tolist() == [2, 1, 1] and splits.test.history_ends.tolist() == [14, 14, 3]
    assert skipped == {"valid_no_history": 1, "test_no_history": 0}
    # the tokens each sample lays out: contextual 6 + history + candidates
    from gr_functional.ranking.model import RankingModelConfig

    cfg = RankingModelConfig(num_candidates=2, max_seq_len=64, video_table=100, context_tables=(3, 2, 2, 2, 2, 2))
    assert splits.test.tokens(cfg).tolist() == [6 + 14 + 2, 6 + 14 + 1, 6 + 3 + 1]
    test_end = temporal_split(seqs, 2, valid_start=10 * DAY, test_start=12 * DAY, test_end=13 * DAY)[0].test
    assert test_end.counts.tolist() == [1, 1]                        # day 13 is out


def test_a_batch_of_a_window_sees_only_the_history_before_it():
    from gr_functional.ranking.model import RankingModelConfig, make_ranking_batch

    seqs = _seqs([list(range(10)) + [10, 10, 10, 11, 12, 13, 13]])
    splits, _ = temporal_split(seqs, 2, valid_start=10 * DAY, test_start=12 * DAY)
    cfg = RankingModelConfig(num_candidates=2, max_seq_len=64, video_table=100, context_tables=(3, 2, 2, 2, 2, 2),
                             embed_dim=4, dim=4, heads=1, dqk=2, dv=2, tower_hidden=4, item_hidden=4, task_hidden=4)
    pick = np.arange(2)
    b = make_ranking_batch(seqs, splits.valid.users[pick], cfg, **splits.valid.batch_args(pick))
    # both chunks: 6 contextual + the 10 events before the window + their 2 candidates
    assert np.diff(b.layout.offsets)[:2].tolist() == [6 + 10 + 2, 6 + 10 + 2]
    assert b.num_targets[:2].tolist() == [2, 2]
    assert b.cand_items[:4].tolist() == [11, 12, 13, 14]             # events 10..13 (+1: table rows)


@pytest.mark.parametrize("recent", [-1, 0, 3, 50])
def test_recent_history_keeps_the_newest_events_and_the_query_time(recent):
    """ranking.recent_history = N keeps the N most recent history events (0: none, the
    non-sequential model); -1 is GR's (the oldest max_history). The candidates' query time is
    the newest history event's either way, and Samples.tokens counts what the batch lays out."""
    import dataclasses

    from gr_functional.ranking.heads import time_features
    from gr_functional.ranking.model import RankingModelConfig, make_ranking_batch

    seqs = _seqs([list(range(10)) + [10, 10, 10, 11, 12, 13, 13]])
    splits, _ = temporal_split(seqs, 2, valid_start=10 * DAY, test_start=12 * DAY)
    base = RankingModelConfig(num_candidates=2, max_seq_len=14, video_table=100, context_tables=(3, 2, 2, 2, 2, 2),
                              embed_dim=4, dim=4, heads=1, dqk=2, dv=2, tower_hidden=4, item_hidden=4, task_hidden=4)
    cfg = dataclasses.replace(base, recent_history=recent)
    pick = np.arange(1)
    b = make_ranking_batch(seqs, splits.valid.users[pick], cfg, **splits.valid.batch_args(pick))
    kept = {-1: 6, 0: 0, 3: 3, 50: 6}[recent]                         # max_history = 14 - 2 - 6 = 6
    assert int(b.layout.offsets[1]) == 6 + kept + 2 == int(splits.valid.tokens(cfg)[0])
    history = b.item_ids[:kept] - 1                                  # video id = event number (row - 1)
    # GR keeps events 0..5 of the 10 before the window; recent_history the newest ones
    want = list(range(6)) if recent == -1 else list(range(10 - kept, 10))
    assert history.tolist() == want
    # query time: the newest KEPT event's for GR (event 5), the newest before the window otherwise
    newest = 5 if recent == -1 else 9
    assert np.allclose(b.cand_feats[:2], time_features(np.full(2, newest * DAY)))


@pytest.mark.slow
def test_a_log_in_parts_or_appended_gives_the_sequences_of_the_whole(tmp_path):
    """data.path as a glob of a log's parts (the earlier period's file first, as the official
    KuaiRand logs come), or a later part appended to an earlier one, reads the per-user
    sequences (and fingerprint) of the whole log; a glob matching nothing names data.path."""
    from gr_functional.data.paths import dataset_path
    from gr_functional.ranking.data import fingerprint, load_ranking_data

    header, *rows = open(dataset_path("kuairand-sample")).read().splitlines()
    cols = header.split(",")
    key = lambda r: (int(r.split(",")[cols.index("user_id")]), int(r.split(",")[cols.index("time_ms")]))  # noqa: E731
    rows.sort(key=key)                                                # by user, then time, as the official files
    cut = sorted(key(r)[1] for r in rows)[len(rows) // 2]
    early = [r for r in rows if key(r)[1] < cut]
    late = [r for r in rows if key(r)[1] >= cut]
    (tmp_path / "parts").mkdir()
    (tmp_path / "whole.csv").write_text("\n".join([header, *rows]) + "\n")
    (tmp_path / "parts" / "log_1_early.csv").write_text("\n".join([header, *early]) + "\n")
    (tmp_path / "parts" / "log_2_late.csv").write_text("\n".join([header, *late]) + "\n")
    (tmp_path / "appended.csv").write_text("\n".join([header, *early, *late]) + "\n")

    def load(path):
        return load_ranking_data(load_config("experiments/configs/kuairand_pure_rank.toml", [f"data.path={path}"]))

    whole = load(tmp_path / "whole.csv")
    for other in (load(tmp_path / "parts" / "log_*.csv"), load(tmp_path / "appended.csv")):
        assert fingerprint(other) == fingerprint(whole)
        assert np.array_equal(other.offsets, whole.offsets)
        assert all(np.array_equal(other.columns[c], whole.columns[c]) for c in SEQUENCE_COLUMNS)
    with pytest.raises(DataError, match=r"data.path=.*nothing_\*\.csv.*no file matches"):
        load(tmp_path / "nothing_*.csv")


def test_a_pre_period_prefix_is_history_never_a_candidate(tmp_path):
    """data.history_prefix: each user's pre-period ids (Parquet, as the data folder's KuaiRand-Pure
    file) come before its log events with the file's one time and its like / long-view bits; the
    temporal split never makes them candidates, but every window sees them as history."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gr_functional.data.sources.kuairand_ranking import prefix_history, read_prefix
    from gr_functional.ranking.model import RankingModelConfig, make_ranking_batch

    seqs = _seqs([[5, 6, 7, 10, 11, 12], [10, 12]])                  # user 1 has no history before day 10
    path = tmp_path / "before.parquet"
    pq.write_table(pa.table({"user_id": [0, 1, 9], "history_len": [70, 2, 1], "last_time_ms": [4 * DAY, 3 * DAY, DAY],
                             "watch_seq": [[100, 101, 102], [200, 201], [300]], "like_seq": [[101], [], []],
                             "long_watch_seq": [[101, 102], [201], []]}), path)
    pre = prefix_history(seqs, read_prefix(path))
    assert pre.history_only.tolist() == [3, 2] and np.diff(pre.offsets).tolist() == [9, 4]
    first = pre.sequence(0)
    assert first["video_id"][:4].tolist() == [100, 101, 102, 0] and first["time_ms"][:3].tolist() == [4 * DAY] * 3
    assert first["action_weights"][:3].tolist() == [0, 2 + 64, 64]    # like = 2, long view = 64; no click
    splits, skipped = temporal_split(pre, 2, valid_start=10 * DAY, test_start=12 * DAY)
    # user 0: training candidates are its 3 log events before day 10 only (windows [4, 6) and [3, 4));
    # user 1 now has history (its prefix) before the validation window
    assert splits.train.users.tolist() == [0, 0] and splits.train.ends.tolist() == [6, 4]
    assert splits.train.counts.tolist() == [2, 1] and skipped["valid_no_history"] == 0
    assert splits.valid.users.tolist() == [0, 1] and splits.valid.history_ends.tolist() == [6, 2]
    cfg = RankingModelConfig(num_candidates=2, max_seq_len=64, video_table=1000, context_tables=(3, 2, 2, 2, 2, 2),
                             embed_dim=4, dim=4, heads=1, dqk=2, dv=2, tower_hidden=4, item_hidden=4, task_hidden=4)
    b = make_ranking_batch(pre, splits.valid.users[1:], cfg, **splits.valid.batch_args(slice(1, 2)))
    assert (b.item_ids[:2] - 1).tolist() == [200, 201] and (b.cand_items[:1] - 1).tolist() == [6]   # its own event
    # refusals: a prefix after the log, a file without the columns, the windows split, another dataset
    late = tmp_path / "late.parquet"
    pq.write_table(pa.table({"user_id": [0], "last_time_ms": [6 * DAY], "watch_seq": [[1]], "like_seq": [[]],
                             "long_watch_seq": [[]]}), late)
    with pytest.raises(DataError, match="later than its first log event"):
        prefix_history(seqs, read_prefix(late))
    bare = tmp_path / "bare.parquet"
    pq.write_table(pa.table({"user_id": [0]}), bare)
    with pytest.raises(DataError, match=r"no column\(s\) last_time_ms, watch_seq"):
        read_prefix(bare)
    from gr_functional.ranking.data import chronological_split

    with pytest.raises(DataError, match="needs data.split='temporal'"):
        chronological_split(pre, 2)
    with pytest.raises(ConfigError, match="data.history_prefix"):
        load_config("experiments/configs/kuairand_rank.toml", ["data.history_prefix=kuairand-pure-before"])


@pytest.mark.slow
def test_the_real_pre_period_prefix_loads():
    """The data folder's KuaiRand-Pure prefix on the real log: most users get up to 50 earlier ids,
    the split's training samples keep their candidates and gain history."""
    from gr_functional.ranking.data import load_ranking_data, split_samples

    cfg = load_config("experiments/configs/kuairand_pure_rank.toml")
    plain = load_ranking_data(cfg)
    pre = load_ranking_data(load_config("experiments/configs/kuairand_pure_rank.toml",
                                        ["data.history_prefix=kuairand-pure-before"]))
    assert pre.history_only.max() == 50 and (pre.history_only > 0).mean() > 0.9
    assert int(pre.offsets[-1]) == int(plain.offsets[-1]) + int(pre.history_only.sum())
    a, b = split_samples(plain, cfg)[0], split_samples(pre, cfg)[0]
    # a user's first log event, which had no history, becomes a candidate; prefix events never do
    before = sum(int(np.searchsorted(plain.sequence(u)["time_ms"], 1651507200000)) for u in range(len(plain.users)))
    assert a.train.candidates(10).sum() < b.train.candidates(10).sum() <= before
    assert len(b.test) >= len(a.test)


def test_cutoffs_outside_the_data_are_refused_naming_the_key():
    seqs = _seqs([list(range(10))])
    with pytest.raises(DataError, match="data.test_start.*no valid"):
        temporal_split(seqs, 2, valid_start=20 * DAY, test_start=30 * DAY)
    with pytest.raises(DataError, match="data.valid_start.*no train"):
        temporal_split(seqs, 2, valid_start=0, test_start=5 * DAY)
    unsorted = _seqs([[3, 1, 2, 5]])
    with pytest.raises(DataError, match="not in time order"):
        temporal_split(unsorted, 1, valid_start=2 * DAY, test_start=4 * DAY)


@pytest.mark.parametrize("sets, key", [
    (["data.split=temporal"], "data.valid_start"),
    (["data.split=temporal", "data.valid_start=2022-05-01", "data.test_start=2022-04-01"], "data.test_start"),
    (["data.split=temporal", "data.valid_start=yesterday", "data.test_start=2022-05-02"], "data.valid_start"),
    (["data.valid_start=2022-05-01"], "data.valid_start"),
])
def test_bad_cutoffs_are_config_errors(sets, key):
    with pytest.raises(ConfigError, match=key):
        load_config("experiments/configs/kuairand_rank.toml", sets)


def test_cutoffs_read_dates_times_and_milliseconds():
    assert cutoff_ms("1651334400000") == 1651334400000
    assert cutoff_ms("2022-05-01") == 1651363200000                        # midnight UTC
    assert cutoff_ms("2022-05-01T00:00:00+08:00") == 1651334400000         # midnight in Beijing


def _log_copy(tmp_path, name: str, lines: int = 400, edit=None):
    """The first ``lines`` rows of the real KuaiRand-Pure log in the data folder, ``edit``ed."""
    from gr_functional.data.paths import dataset_path

    rows = dataset_path("kuairand-pure-log").read_text().splitlines()[:lines + 1]
    rows = edit(rows) if edit else rows
    path = tmp_path / name
    path.write_text("\n".join(rows) + "\n")
    return path


def _train(path, out, *sets):
    from gr_functional.cli import main

    return main(["train", "--config", "experiments/configs/kuairand_pure_rank.toml", "--quiet", "--out", str(out),
                 "--set", f"data.path={path}", *[a for s in sets for a in ("--set", s)]])


@pytest.mark.slow
def test_bad_logs_and_cutoffs_stop_before_anything_is_written(tmp_path, capsys):
    """A malformed line, a missing column, cutoffs outside the data: exit 2, a message naming the
    file and line or the key, and no run folder."""
    def bad_line(rows):
        rows[7] = rows[7].split(",", 3)[0] + ",oops"
        return rows

    cases = [
        (_log_copy(tmp_path, "bad_line.csv", edit=bad_line), [], "bad_line.csv:8"),
        (_log_copy(tmp_path, "no_column.csv", edit=lambda r: [",".join(x.split(",")[:-3]) for x in r]), [],
         "lacks column(s) is_profile_enter"),
        (_log_copy(tmp_path, "fine.csv"), ["data.valid_start=2023-01-01", "data.test_start=2023-02-01"],
         "data.test_start"),
    ]
    for i, (path, sets, expected) in enumerate(cases):
        out = tmp_path / f"run{i}"
        assert _train(path, out, *sets) == 2
        assert expected in capsys.readouterr().err and not out.exists()


def test_rate_baselines_score_each_candidate_with_what_precedes_it():
    """``grf bench ranking_baselines``: the base rate is the training candidates' rate (one score for
    all: AUC .5); the per-user rate is the user's rate over the sample's history, shrunk to it."""
    from benchmarks.ranking_baselines import baselines

    seqs = _seqs([list(range(10)) + [10, 10, 12, 12], [0, 1, 2, 3, 12, 12]])
    seqs.columns["action_weights"] = np.asarray([1, 0] * 5 + [1, 0, 1, 0] + [1, 1, 1, 1, 0, 1], np.int64)
    splits, _ = temporal_split(seqs, 2, valid_start=10 * DAY, test_start=12 * DAY)
    out = baselines(seqs, splits.train, splits.test, 2, weights=(1,), prior=2.0)
    logits, labels, users = out["base rate"]
    assert labels[:, 0].tolist() == [1, 0, 0, 1] and users.tolist() == [0, 0, 1, 1]
    train = [0, 1, 0, 1, 0, 1, 0, 1, 0] + [1, 1, 1]                  # the training windows' candidates (events 1-9; 1-3)
    base = np.mean(train)
    np.testing.assert_allclose(1 / (1 + np.exp(-logits[:, 0])), base)
    rates = 1 / (1 + np.exp(-out["per-user rate"][0][:, 0]))
    # user 0's history: its 12 events before day 12 (6 clicks); user 1's: 4 events, all clicks
    np.testing.assert_allclose(rates, [(6 + 2 * base) / 14] * 2 + [(4 + 2 * base) / 6] * 2)
