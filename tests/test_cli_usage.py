"""Usage errors of ``grf crosscheck`` and ``grf bench``: exit 2 with a ``grf: error:`` line naming
the flag and the fix, refused before anything trains, compiles, builds a backend or imports a
benchmark; ``--record`` checked before the run (a folder: exit 2; unwritable: exit 5), and a write
that still fails after the run prints the measurements on stdout (exit 5).

Before: these exited 1 ("a check failed") through SystemExit, some after seconds of work
(a ranking config built both backends first; ``--tol -1`` trained and reported a divergence), an
unknown benchmark had no did-you-mean, and ``--record DIR`` ran the whole benchmark, then crashed
with IsADirectoryError."""
from __future__ import annotations

import json
import os
import sys

import pytest

from gr_functional import cli, results


@pytest.fixture
def no_work(monkeypatch):
    """Every way crosscheck does work (builds a backend, trains, evaluates) fails the test."""
    from gr_functional import crosscheck

    def work(*args, **kwargs):
        raise AssertionError("a usage error must be refused before any work")

    for name in ("backend_as_trained", "config_as_trained", "trajectory", "checkpoint_evaluations", "crosscheck",
                 "first_batch"):
        monkeypatch.setattr(crosscheck, name, work)


def _error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured, nothing printed as a result
    lines = captured.err.strip().splitlines()
    assert lines and lines[-1].startswith("grf: error: "), captured.err
    return lines[-1]


@pytest.mark.parametrize("argv, expected", [
    (["--checkpoint", "run/last.safetensors", "--config", "quickstart"], ["drop --config"]),
    (["--checkpoint", "run/last.safetensors", "--steps", "3"], ["drop --steps"]),
    (["--checkpoint", "run/last.safetensors", "--set", "model.num_blocks=1"], ["drop --set"]),
    (["--config", "quickstart", "--backends", "torch"], ["--backends torch", "two backends", "--backends jax,torch"]),
    (["--config", "quickstart", "--backends", "jax,"], ["--backends jax,", "two backends"]),
    (["--config", "quickstart", "--backends", "jax,torch,npu"], ["two backends"]),
    (["--config", "quickstart", "--tol", "-1"], ["--tol must be a finite relative tolerance >= 0", "got -1"]),
    (["--config", "quickstart", "--tol", "nan"], ["--tol must be", "got nan"]),
    (["--config", "quickstart", "--tol", "inf"], ["--tol must be", "got inf"]),
    (["--config", "quickstart", "--steps", "-3"], ["--steps must be >= 1", "got -3"]),
    (["--config", "quickstart", "--users", "0"], ["--users must be >= 1", "got 0"]),
    (["--config", "quickstart", "--out", "somewhere"], ["--out", "add --steps N"]),
    ([], ["give --config FILE", "--checkpoint PATH"]),
])
def test_crosscheck_flag_errors_exit_2_before_any_work(argv, expected, no_work, capsys):
    assert cli.main(["crosscheck", *argv]) == 2
    line = _error(capsys)
    for text in expected:
        assert text in line, line


def test_crosscheck_refuses_a_ranking_config_in_layer_mode_up_front(no_work, capsys):
    """Before: both backends were built (seconds) before the refusal, which exited 1."""
    assert cli.main(["crosscheck", "--config", "kuairand_rank"]) == 2
    line = _error(capsys)
    assert "model.task='ranking'" in line and "layer-by-layer" in line
    assert "--steps N" in line and "--checkpoint PATH" in line  # what compares a ranking model


def test_crosscheck_record_path_is_checked_before_any_work(tmp_path, no_work, capsys):
    assert cli.main(["crosscheck", "--config", "quickstart", "--record", str(tmp_path)]) == 2
    line = _error(capsys)
    assert f"--record {tmp_path}: is a folder" in line and str(tmp_path / "crosscheck.jsonl") in line
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["crosscheck", "--config", "quickstart", "--record", str(blocker / "x.jsonl")]) == 2
    assert f"{blocker} is a file, not a folder" in _error(capsys)


# a stand-in benchmark: ``run`` prints its records as ``grf bench`` benchmarks do. IMPORT_FAILS
# makes importing it fail, so a test shows a usage error is refused before the module is imported
_FAKE = '''
import json
import os

if {import_fails}:
    raise AssertionError("a usage error must be refused before the benchmark is imported")


def run(json_lines: bool = False{extra}):
    rows = [{{"bench": "fake", "i": i, "seconds": 0.5 + i}} for i in range(3)]
    for row in rows:
        print(json.dumps(row) if json_lines else row)
    spoil = os.environ.get("FAKE_BENCH_SPOIL")
    if spoil:  # the record path turns into a folder while the benchmark runs: the write fails after it
        os.makedirs(spoil)
    return rows
'''


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """``fake_bench(import_fails=..., extra=...)``: registers a stand-in benchmark, returns its name."""
    made = []
    monkeypatch.setattr(results, "machine", lambda: {"cpu": "test"})  # the stamp imports no torch/jax here

    def make(import_fails: bool = False, extra: str = "") -> str:
        module = f"grf_fake_bench_{len(made)}_{os.getpid()}"
        folder = tmp_path / "fake_benchmarks"
        folder.mkdir(exist_ok=True)
        (folder / f"{module}.py").write_text(_FAKE.format(import_fails=import_fails, extra=extra))
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(sys.modules, module, raising=False)
        name = f"fake{len(made)}"
        monkeypatch.setitem(cli.BENCHMARKS, name, module)
        made.append(name)
        return name

    return make


def test_bench_unknown_name_exits_2_with_did_you_mean(capsys):
    assert cli.main(["bench", "attnetion"]) == 2
    line = _error(capsys)
    assert "no benchmark named 'attnetion' (did you mean 'attention'?)" in line and "available: attention" in line
    assert cli.main(["bench", "zzz"]) == 2
    line = _error(capsys)
    assert "no benchmark named 'zzz'" in line and "did you mean" not in line and "device" in line


def test_bench_tiny_is_refused_naming_the_benchmarks_that_take_it(fake_bench, capsys):
    name = fake_bench(import_fails=True)
    assert cli.main(["bench", name, "--tiny"]) == 2
    line = _error(capsys)
    assert f"grf bench {name}: takes no --tiny" in line and "benchmarks that take --tiny: device" in line
    assert cli.main(["bench", "mfu", "--tiny"]) == 2  # a real one (was: SystemExit, exit 1)
    assert "takes no --tiny" in _error(capsys)


def test_bench_config_flags_are_refused_where_not_taken(fake_bench, capsys):
    name = fake_bench(import_fails=True)
    assert cli.main(["bench", name, "--set", "model.num_blocks=1", "--backend", "torch"]) == 2
    line = _error(capsys)
    assert "takes no --config, --set or --backend" in line and "drop --set, --backend" in line


def test_bench_record_to_a_folder_is_refused_before_the_run(tmp_path, fake_bench, capsys):
    """--record takes a FILE (its help): a folder is a usage error, found before the run (before:
    the whole benchmark ran, then IsADirectoryError)."""
    name = fake_bench(import_fails=True)
    folder = tmp_path / "out"
    folder.mkdir()
    assert cli.main(["bench", name, "--record", str(folder)]) == 2
    line = _error(capsys)
    assert f"--record {folder}: is a folder" in line and f"--record {folder / (name + '.jsonl')}" in line
    assert list(folder.iterdir()) == []


def test_bench_record_to_an_unwritable_folder_exits_5_before_the_run(tmp_path, fake_bench, capsys, monkeypatch):
    """As grf train's --out: a folder that cannot be written is a write failure (exit 5, the path
    and the OS's reason), found before the run (before: after it, a bare errno and exit 2)."""
    name = fake_bench(import_fails=True)
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: fail the probe as the OS would
            import errno
            import tempfile

            def refused(*args, **kwargs):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))

            monkeypatch.setattr(tempfile, "TemporaryFile", refused)
        assert cli.main(["bench", name, "--record", str(folder / "sub" / "x.jsonl")]) == 5
        line = _error(capsys)
        assert f"cannot write {folder / 'sub' / 'x.jsonl'}: Permission denied" in line
    finally:
        folder.chmod(0o700)
    assert list(folder.iterdir()) == []


def test_bench_record_that_fails_after_the_run_prints_the_measurements(tmp_path, fake_bench, capsys, monkeypatch):
    """A write that fails after the run (the disk filled, the path changed) loses nothing: the
    file's lines go to stdout, and the exit code is 5 (a file could not be written)."""
    name = fake_bench()
    path = tmp_path / "x.jsonl"
    monkeypatch.setenv("FAKE_BENCH_SPOIL", str(path))
    assert cli.main(["bench", name, "--record", str(path)]) == 5
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    stamp = next(i for i, row in enumerate(lines) if row.get("kind") == "stamp")
    assert stamp == 3 and [r["i"] for r in lines[stamp + 1:]] == [0, 1, 2]  # after the run's own lines
    assert lines[stamp]["command"] == f"grf bench {name} --record {path}"
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith(f"grf: error: cannot write {path}: Is a directory") and "nothing is lost" in err


def test_bench_record_writes_the_file_or_the_default(tmp_path, fake_bench, capsys, monkeypatch):
    name = fake_bench()
    path = tmp_path / "new" / "x.jsonl"
    assert cli.main(["bench", name, "--record", str(path)]) == 0
    stamp, rows = results.read(path)
    assert stamp["command"].startswith(f"grf bench {name}") and [r["i"] for r in rows] == [0, 1, 2]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", name, "--record"]) == 0  # default: results/bench/NAME.jsonl
    assert len(results.read(tmp_path / "results" / "bench" / f"{name}.jsonl")[1]) == 3
    capsys.readouterr()


def test_more_devices_than_sequences_per_batch_are_refused_before_jax_starts(tmp_path, capsys):
    """Round 4: `--devices 100000` on CPU printed nothing and grew past 1.2 GB."""
    from gr_functional.cli import main

    out = tmp_path / "run"
    assert main(["train", "--backend", "jax", "--devices", "100000", "--out", str(out)]) == 2
    assert "100000 ranks" in capsys.readouterr().err and not out.exists()
    # a few idle ranks are fine: tests/distributed/test_jax_mesh.py trains 4 devices on batches of 3
    from gr_functional.config import ConfigError, replace, validate
    from tests.reliability.common import tiny_config

    cfg = tiny_config("backend.name=jax", "train.batch_size=3")
    validate(replace(cfg, dist={"devices": 4}))  # 4 ranks, 3 sequences: accepted
    with pytest.raises(ConfigError, match="more than 8 x the batch"):
        validate(replace(cfg, dist={"devices": 25}))


def test_nproc_builds_the_fused_ops_once_before_the_ranks_start(monkeypatch, tmp_path):
    """Round 3: a `--nproc 2` run after a build was killed mid-compile failed when the ranks'
    rebuild outlasted their warm-up limit; the launcher now builds them first (Backend.prepare_launch)."""
    import subprocess

    from backends import cpu_fused
    from gr_functional.cli import main

    order = []
    monkeypatch.setattr(cpu_fused, "available", lambda warn=True, B=None: order.append("build") or True)

    class Launched(Exception):
        pass

    def popen(*args, **kwargs):
        order.append("ranks")
        raise Launched

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Launched):
        main(["train", "--nproc", "2", "--quiet", "--out", str(tmp_path / "run")])
    assert order == ["build", "ranks"]
