"""Learning-rate schedules in a real run: the lr follows the update count in the optimizer state,
so a run stopped and resumed writes the metrics of the uninterrupted one."""
from __future__ import annotations

from gr_functional.cli import main

from .common import TINY, sets
import pytest

WARMUP_COSINE = ["optim.schedule=cosine", "optim.warmup_steps=3", "optim.decay_steps=7", "optim.end_lr_factor=0.1"]


def _args(out, *extra):
    return ["train", "--config", "quickstart", "--quiet", "--out", str(out)] + sets(TINY + WARMUP_COSINE + list(extra))


def test_warmup_cosine_run_resumes_exactly(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(_args(whole, "train.epochs=2")) == 0
    assert main(_args(parts, "train.epochs=1")) == 0
    assert main(_args(parts, "train.epochs=2")) == 0
    assert (parts / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()


def test_schedule_changes_training(tmp_path):
    assert main(_args(tmp_path / "a", "train.epochs=1")) == 0
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "b")]
                + sets(TINY + ["train.epochs=1"])) == 0
    assert (tmp_path / "a" / "metrics.jsonl").read_text() != (tmp_path / "b" / "metrics.jsonl").read_text()


def _resolved_decay(out) -> int:
    import tomllib

    return tomllib.loads((out / "config.toml").read_text())["optim"]["decay_steps"]


@pytest.mark.slow
def test_decay_steps_0_decays_over_the_whole_run(tmp_path):
    # TINY: 5 updates per epoch; 3 epochs -> 15 updates, warmup 3 -> a decay of 12, recorded in
    # config.toml, and the run is the one with decay_steps = 12 written out
    run_long = ["optim.schedule=cosine", "optim.warmup_steps=3", "optim.decay_steps=0", "optim.end_lr_factor=0.1"]
    base = ["train", "--config", "quickstart", "--quiet", "--out"]
    assert main(base + [str(tmp_path / "auto")] + sets(TINY + run_long)) == 0
    assert _resolved_decay(tmp_path / "auto") == 12
    assert main(base + [str(tmp_path / "explicit")] + sets(TINY + run_long + ["optim.decay_steps=12"])) == 0
    assert (tmp_path / "auto" / "metrics.jsonl").read_bytes() == (tmp_path / "explicit" / "metrics.jsonl").read_bytes()
    # --set train.epochs=2 on the same recipe: the decay ends with the shorter run
    assert main(base + [str(tmp_path / "short")] + sets(TINY + run_long + ["train.epochs=2"])) == 0
    assert _resolved_decay(tmp_path / "short") == 7


def test_decay_steps_0_with_a_warmup_as_long_as_the_run_is_refused(tmp_path, capsys):
    too_long = ["optim.schedule=linear", "optim.warmup_steps=15", "optim.decay_steps=0"]
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "r")] + sets(TINY + too_long)) == 2
    err = capsys.readouterr().err
    assert "optim.decay_steps = 0" in err and "optim.warmup_steps = 15" in err and "15 update(s)" in err
    assert not (tmp_path / "r").exists()
