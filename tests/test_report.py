"""grf report: run folders -> selected epochs, seed groups, curves; on hand-written run files."""
import json
import math

import pytest

from gr_functional import report
from gr_functional.cli import main


def _write_run(path, seed=42, blocks=2, evals=(), epochs=10, finished=True, extra_config=""):
    """A run folder as runner.train writes it. evals: [(epoch, valid hr@10, test hr@10)]."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(
        f"[model]\ntask = \"retrieval\"\nnum_blocks = {blocks}\n\n[train]\nseed = {seed}\nepochs = {epochs}\neval_every = 5\n{extra_config}")
    lines, timing = [], []
    for epoch, valid, test in evals:
        lines.append({"kind": "train", "step": epoch, "epoch": epoch, "loss": 1.0, "tokens": 10})
        for split, value in (("valid", valid), ("test", test)):
            lines.append({"kind": "eval", "split": split, "epoch": epoch, "step": epoch, "hr@10": value,
                          "ndcg@10": value / 2})
        timing.append({"kind": "epoch", "epoch": epoch, "seconds": 60.0, "tokens_per_s": 1.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "timing.jsonl").write_text("".join(json.dumps(x) + "\n" for x in timing))
    if finished:
        (path / "eval.json").write_text(json.dumps({"last_epoch": evals[-1][0]}))
    return path


def test_selected_epoch_is_the_best_validation_hr10_first_of_equals(tmp_path):
    run = report.load_run(_write_run(tmp_path / "a", evals=[(4, .2, .1), (9, .3, .25), (14, .3, .4), (19, .25, .5)]))
    assert run.selected() == {"epoch": 9, "valid_hr@10": .3, "hr@10": .25, "ndcg@10": .125}
    assert run.finished and run.wall_seconds == 240.0 and run.epochs_done == 20


def test_seed_groups_give_mean_and_sample_std(tmp_path):
    for seed, test in ((1, .30), (2, .32), (3, .34)):
        _write_run(tmp_path / "runs" / f"s{seed}", seed=seed, evals=[(4, .5, test)])
    _write_run(tmp_path / "runs" / "large", blocks=8, evals=[(4, .5, .36)])
    runs = report.find_runs([tmp_path / "runs"])  # a folder of runs expands to its runs
    keys, rows = report.summary_rows(runs, ("hr@10",), group_seeds=True)
    assert keys == ["model.num_blocks"]
    by_blocks = {row["model.num_blocks"]: row for row in rows}
    mean, std = by_blocks[2]["hr@10"]
    assert math.isclose(mean, .32) and math.isclose(std, .02)  # sqrt(((.02)^2 * 2) / 2)
    assert by_blocks[2]["n"] == 3 and by_blocks[8]["hr@10"] == .36
    table = report.summary_table(runs, ("hr@10",), group_seeds=True)
    assert "0.3200 ± 0.0200" in table and "| model.num_blocks |" in table.splitlines()[0]
    # without grouping every run is a row and the seed is a differing key
    keys, rows = report.summary_rows(runs, ("hr@10",))
    assert keys == ["model.num_blocks", "train.seed"] and len(rows) == 4


def test_running_runs_report_their_best_epoch_so_far(tmp_path):
    _write_run(tmp_path / "bf16", evals=[(4, .2, .21), (9, .3, .26)], epochs=101, finished=False,
               extra_config='\n[backend]\nprecision = "bf16"\n')
    _write_run(tmp_path / "fp32", evals=[(4, .2, .22), (9, .3, .27), (14, .31, .29)], epochs=101,
               extra_config='\n[backend]\nprecision = "fp32"\n')
    from gr_functional.runlock import RunLock

    assert report.summary_rows(report.find_runs([tmp_path / "bf16"]), ("hr@10",))[1][0]["status"] == \
        "stopped, 10/101 epochs"  # unfinished and nobody holds its lock: killed or interrupted
    lock = RunLock(tmp_path / "bf16")
    lock.acquire()  # as the grf train writing it does
    try:
        runs = report.find_runs([tmp_path / "bf16", tmp_path / "fp32"])
    finally:
        lock.release()
    keys, rows = report.summary_rows(runs, ("hr@10",))
    assert keys == ["backend.precision"]
    assert rows[0]["status"] == "running, 10/101 epochs" and rows[0]["epoch"] == 9
    assert rows[1]["status"] == "done"
    curve = report.curve_table(runs, "hr@10", "test").splitlines()
    assert curve[0] == "| epoch | bf16 | fp32 |" and curve[-1] == "| 14 |  | 0.2900 |"


def test_keys_missing_from_older_configs_are_not_differences(tmp_path):
    _write_run(tmp_path / "old", evals=[(4, .2, .2)])
    _write_run(tmp_path / "new", evals=[(4, .2, .2)], extra_config='\n[backend]\ndeterministic = "auto"\n')
    assert report.differing_keys(report.find_runs([tmp_path / "old", tmp_path / "new"])) == []


def test_a_key_only_newer_runs_wrote_tells_them_apart_from_older_ones(tmp_path):
    """A key added later reads as the value older runs computed with (today's default, or
    config.migrate's exception): a newer run that set another value is a different group."""
    _write_run(tmp_path / "old", evals=[(4, .2, .2)], extra_config="\n[data]\nbatch_negatives = 0\n")
    _write_run(tmp_path / "same", seed=1, evals=[(4, .2, .2)],
               extra_config='\n[data]\nbatch_negatives = 0\nties = "file"\n')
    _write_run(tmp_path / "ablated", evals=[(4, .2, .2)], extra_config='\n[data]\nbatch_negatives = 0\nties = "shuffle"\n')
    runs = report.find_runs([tmp_path / "old", tmp_path / "same", tmp_path / "ablated"])
    assert report.differing_keys(runs, ignore=("train.seed",)) == ["data.ties"]
    _, rows = report.summary_rows(runs, ["hr@10"], group_seeds=True)
    assert sorted(r["n"] for r in rows) == [1, 2]                  # old + same (seeds 42, 1) and ablated


def test_damaged_and_wrong_inputs_are_clear_errors(tmp_path, capsys):
    run = _write_run(tmp_path / "a", evals=[(4, .2, .2), (9, .3, .3)], finished=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "eval", "spl')  # a kill mid-write: the partial last line is ignored
    assert report.load_run(run).selected()["epoch"] == 9
    (run / "metrics.jsonl").write_text('{"kind"\n{"kind": "train"}\n')
    with pytest.raises(report.ReportError, match=r"metrics.jsonl:1: not a JSON line"):
        report.load_run(run)
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "neither a run directory nor a folder of them" in capsys.readouterr().err
    good = _write_run(tmp_path / "b", evals=[(4, .2, .2)])
    assert main(["report", str(good), "--metrics", "hr@10,hr@11"]) == 2
    assert "unknown metric(s) hr@11; the runs have hr@10, ndcg@10" in capsys.readouterr().err


def test_cli_prints_tables_and_json(tmp_path, capsys):
    for seed in (1, 2):
        _write_run(tmp_path / f"s{seed}", seed=seed, evals=[(4, .5, .3 + seed / 100)])
    assert main(["report", str(tmp_path / "s1"), str(tmp_path / "s2"), "--group-seeds", "--metrics", "hr@10"]) == 0
    assert "| s1, s2 | done | 4/4 | 0.3150 ± 0.0071 | 1.0 min |" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--json", "--metrics", "hr@10"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["run"] for r in rows] == ["s1", "s2"] and rows[1]["hr@10"] == .32
    assert main(["report", str(tmp_path), "--curve", "ndcg@10", "--split", "valid"]) == 0
    assert "| 4 | 0.2500 | 0.2500 |" in capsys.readouterr().out


def test_keys_the_task_does_not_read_neither_differ_nor_split_seed_groups(tmp_path):
    """Retrieval runs whose [ranking] defaults changed between versions (Task.unused_keys) are one
    recipe: no ranking.* column, one seed group."""
    _write_run(tmp_path / "s42", evals=[(4, .2, .30)], extra_config="\n[ranking]\nembed_dim = 512\n")
    _write_run(tmp_path / "s1", seed=1, evals=[(4, .2, .32)], extra_config="\n[ranking]\nembed_dim = 256\n")
    runs = report.find_runs([tmp_path / "s42", tmp_path / "s1"])
    assert report.differing_keys(runs) == ["train.seed"]
    _, rows = report.summary_rows(runs, ["hr@10"], group_seeds=True)
    assert [r["n"] for r in rows] == [2]


def test_the_curve_is_on_validation_by_default(tmp_path, capsys):
    """Round 4: --curve defaulted to the test split; a run selects its epoch on validation."""
    from gr_functional.cli import main

    _write_run(tmp_path / "run", evals=[(4, .2, .21), (9, .3, .26)])
    assert main(["report", str(tmp_path / "run"), "--curve", "hr@10"]) == 0
    valid = capsys.readouterr().out
    assert main(["report", str(tmp_path / "run"), "--curve", "hr@10", "--split", "test"]) == 0
    assert valid != capsys.readouterr().out
