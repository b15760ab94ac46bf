"""A third task from outside the package (experiments/toy_regression_task.py: one module, a task and a
dataset registered) trains with ``grf train``, is killed and resumes to the same bytes, and is read by
``grf eval`` and ``grf report``, through the same run loop as retrieval and ranking (task.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .reliability.common import ROOT, metrics, sets, subprocess_env
from .reliability.test_resume import _run_until_fault


PLUGIN = ROOT / "experiments" / "toy_regression_task.py"
TOY = ["model.task=toy_regression", "data.dataset=toy-regression", "data.synthetic_users=400", "train.epochs=4",
       "train.batch_size=32", "train.checkpoint_every=3", "train.keep_checkpoints=0", "train.log_every=1",
       "optim.lr=0.05"]


def _grf(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "gr_functional.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env or subprocess_env(), timeout=timeout)


def _train_command(out, *extra):
    return ["train", "--config", "quickstart", "--quiet", "--plugin", str(PLUGIN), "--out", str(out),
            *sets(TOY + list(extra))]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "run"
    proc = _grf(*_train_command(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_a_plugin_task_trains_with_grf_train(toy_run):
    result = json.loads((toy_run / "eval.json").read_text())
    assert result["selected_by"] == "best valid r2" and result["task"] == "toy_regression"
    assert result["r2"] > 0.9 and result["dataset"] == "toy regression"
    assert 'task = "toy_regression"' in (toy_run / "config.toml").read_text()
    assert (toy_run / "curves.png").exists()
    evals = [r for r in metrics(toy_run) if r["kind"] == "eval"]
    assert [r["epoch"] for r in evals if r["split"] == "test"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_plugin_task_resumes_bitwise_after_sigkill(toy_run, tmp_path):
    out = tmp_path / "run"
    _run_until_fault(out, "after-step@7", command=[sys.executable, "-m", "gr_functional.cli", *_train_command(out)])
    again = _grf(*_train_command(out))
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert (out / "metrics.jsonl").read_bytes() == (toy_run / "metrics.jsonl").read_bytes()


@pytest.mark.slow
def test_grf_eval_and_report_read_a_plugin_task(toy_run):
    proc = _grf("eval", "--checkpoint", str(toy_run / "checkpoints" / "last.safetensors"), "--out",
                str(toy_run / "eval-last.json"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = json.loads((toy_run / "eval.json").read_text())["last_epoch_test"]
    assert got["task"] == "toy_regression" and got["r2"] == pytest.approx(want["r2"], rel=1e-6)
    report = _grf("report", str(toy_run))
    assert report.returncode == 0, report.stderr
    assert "r2" in report.stdout and "done" in report.stdout


def test_an_unregistered_task_is_refused_by_name():
    from gr_functional.config import ConfigError
    from gr_functional.configure import load_config

    with pytest.raises(ConfigError, match="model.task='rankin'.*did you mean 'ranking'"):
        load_config(None, ["model.task=rankin"])


@pytest.mark.slow
def test_the_plugin_task_trains_on_jax_as_on_torch(tmp_path):
    """Its batch dataclass is a JAX pytree without registration (backends/jax.py registers the
    dataclasses a step is given): the same losses on both backends to float32 noise."""
    losses = {}
    for backend in ("jax", "torch"):
        out = tmp_path / backend
        proc = _grf(*_train_command(out, "train.epochs=1"), "--backend", backend)
        assert proc.returncode == 0, proc.stderr
        losses[backend] = [r["loss"] for r in metrics(out) if r["kind"] == "train"]
    assert losses["jax"] and losses["jax"] == pytest.approx(losses["torch"], rel=1e-5)
