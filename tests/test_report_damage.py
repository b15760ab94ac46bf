"""grf report on damaged run folders and wrong paths ([hardening3]): a run whose metrics.jsonl was
cut is never "done", a warning names the file and line; a missing path says it does not exist."""
import json

import pytest

from gr_functional import report
from gr_functional.cli import main

from .test_report import _write_run

EVALS = [(4, .2, .1), (9, .3, .25)]


def _cut(run, chars=0, lines=0):
    """Shorten run/metrics.jsonl by whole lines, then by characters (a cut mid-record)."""
    path = run / "metrics.jsonl"
    text = path.read_text()
    if lines:
        text = "".join(text.splitlines(keepends=True)[:-lines])
    path.write_text(text[:len(text) - chars])
    return path


def test_a_finished_run_whose_last_line_is_cut_is_incomplete(tmp_path, capsys):
    run = _write_run(tmp_path / "a", evals=EVALS)
    metrics = _cut(run, chars=20)  # the test record of epoch 9, cut mid-JSON
    loaded = report.load_run(run)
    assert not loaded.finished and loaded.incomplete == "metrics.jsonl cut at line 6"
    assert loaded.warnings[0].startswith(f"{metrics}:6: the last line is cut mid-record and was ignored")
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "| a | incomplete (metrics.jsonl cut at line 6) |" in captured.out and "done" not in captured.out
    assert f"grf: warning: {metrics}:6: the last line is cut mid-record" in captured.err


def test_a_real_eval_json_names_the_missing_test_record_too(tmp_path, capsys):
    run = _write_run(tmp_path / "a", evals=EVALS)
    (run / "eval.json").write_text(json.dumps({"hr@10": .25, "epoch": 9, "last_epoch": 9,
                                               "last_epoch_test": {"hr@10": .25}}))
    metrics = _cut(run, chars=20)
    loaded = report.load_run(run)
    assert loaded.incomplete == "metrics.jsonl cut at line 6"
    assert any(w.startswith(f"{metrics}:6: the file ends here with no test evaluation of epoch 9") for w in
               loaded.warnings)


@pytest.mark.parametrize("lines,recorded", [(3, "evaluations up to epoch 4 only"), (6, "no evaluation")])
def test_a_shortened_metrics_file_is_incomplete(tmp_path, capsys, lines, recorded):
    run = _write_run(tmp_path / "a", evals=EVALS)
    metrics = _cut(run, lines=lines)  # whole epochs gone: every remaining line parses
    loaded = report.load_run(run)
    assert not loaded.finished and loaded.incomplete == "metrics.jsonl lacks epoch 9"
    assert loaded.warnings == (f"{metrics}:{6 - lines}: the file ends here with {recorded}, but eval.json reports "
                               f"epoch 9 evaluated: records are missing (the file was cut, or replaced by an older "
                               f"copy); the metrics shown are incomplete",)
    assert main(["report", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "incomplete (metrics.jsonl lacks epoch 9)"
    assert f"grf: warning: {metrics}:{6 - lines}:" in captured.err


def test_killed_and_live_runs(tmp_path, capsys):
    run = _write_run(tmp_path / "a", evals=EVALS, finished=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "eval", "spl')  # killed mid-write: a stopped run, with a warning
    loaded = report.load_run(run)
    assert loaded.selected()["epoch"] == 9 and loaded.incomplete == ""
    assert report.summary_rows([loaded], ("hr@10",))[1][0]["status"] == "stopped, 10/10 epochs"
    assert loaded.warnings and loaded.warnings[0].startswith(f"{run / 'metrics.jsonl'}:7: the last line is cut")
    from gr_functional.runlock import RunLock

    lock = RunLock(run)
    lock.acquire()  # a live run may be writing its last line: no warning
    try:
        assert report.load_run(run).warnings == ()
    finally:
        lock.release()


def test_whole_files_are_done_without_warnings(tmp_path, capsys):
    run = _write_run(tmp_path / "a", evals=EVALS)
    loaded = report.load_run(run)
    assert loaded.finished and loaded.incomplete == "" and loaded.warnings == ()
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "| a | done | 9 | 0.2500 |" in captured.out and captured.err == ""


def test_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    assert main(["report", str(missing)]) == 2
    assert capsys.readouterr().err == (f"grf: error: {missing}: does not exist (no such file or directory), so it is "
                                       f"neither a run directory nor a folder of them; pass folders written by grf "
                                       f"train --out, or a folder holding them\n")
    good = _write_run(tmp_path / "good", evals=EVALS)
    assert main(["report", str(good), str(missing)]) == 2  # one missing among several
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(report.ReportError, match=r"nope: does not exist"):
        report.load_run(missing)
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2  # exists, holds no run: the old message
    assert "neither a run directory nor a folder of them (no metrics.jsonl)" in capsys.readouterr().err
