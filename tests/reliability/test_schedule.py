"""Learning-rate schedules in a real run: the lr follows the update count in the optimizer state,
so a run stopped and resumed writes the metrics of the uninterrupted one."""
from __future__ import annotations

from gr_functional.cli import main

from .common import TINY, sets

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
