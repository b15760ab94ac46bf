"""NaN/Inf guard: a non-finite loss or gradient skips the step (state unchanged) and is logged;
train.max_bad_steps in a row abort with a message and a checkpoint of the last good state."""
from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.checkpoint import CheckpointDir, read_checkpoint
from gr_functional.data.batching import TrainLoader
from gr_functional.step import init_opt_state, train_step
from gr_functional.tree import tree_items

from ..differential.test_model import CFG, make_train_batch
from .common import TINY, metrics, sets


def _poison(batch):
    """A NaN in the input dropout mask of one real token: a corrupted feature, as data."""
    keep = batch.input_keep.copy()
    keep[0, 0] = np.nan
    return dataclasses.replace(batch, input_keep=keep)


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_non_finite_step_returns_the_state_unchanged(name):
    from gr_functional.config import Config

    B = get_backend(name)
    cfg = Config(model=CFG)
    params = B.asarray_tree(model.init_params(CFG, seed=0))
    state = init_opt_state(B, params, cfg)
    step = B.jit(partial(train_step, B, cfg=cfg))
    new_params, new_state, m = step(params, state, B.asarray_tree(_poison(make_train_batch("mixed"))))
    assert not bool(m["finite"]) and not bool(m["loss_finite"])
    for tree, new in ((params, new_params), (state, new_state)):
        for (key, a), (_, b) in zip(tree_items(B.to_numpy_tree(tree)), tree_items(B.to_numpy_tree(new))):
            assert np.array_equal(a, b), key
    # and a clean batch afterwards trains normally
    _, s2, m2 = step(new_params, new_state, B.asarray_tree(make_train_batch("mixed")))
    assert bool(m2["finite"]) and float(s2["step"]) == 1.0


@pytest.fixture
def poison_batches(monkeypatch):
    """``poisoned`` holds (epoch, batch) positions whose batch the loader hands out with a NaN."""
    poisoned: set = set()
    original = TrainLoader.batch

    def batch(self, epoch, step):
        b = original(self, epoch, step)
        return _poison(b) if (epoch, step) in poisoned or (epoch, "*") in poisoned else b

    monkeypatch.setattr(TrainLoader, "batch", batch)
    return poisoned


def test_transient_bad_step_is_skipped_and_logged(poison_batches, tmp_path):
    from gr_functional.configure import load_config
    from gr_functional.runner import train

    from .common import ROOT

    poison_batches.add((0, 2))                       # the third batch -> optimizer step 3
    cfg = load_config(ROOT / "experiments" / "configs" / "quickstart.toml", TINY + ["train.epochs=1"])
    result = train(cfg, tmp_path, progress=False)
    lines = metrics(tmp_path)
    skips = [m for m in lines if m["kind"] == "skip"]
    assert skips == [{"kind": "skip", "step": 3, "epoch": 0, "reason": "non-finite loss", "bad_in_a_row": 1}]
    assert [m["step"] for m in lines if m["kind"] == "train"] == [1, 2, 4, 5]
    assert result["skipped_steps"] == 1 and np.isfinite(result["hr@10"])


def test_too_many_bad_steps_abort_with_the_last_good_state(poison_batches, tmp_path, capsys):
    from gr_functional.cli import main

    poison_batches.add((1, "*"))                     # every batch of epoch 1 (steps 6..10)
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path)] + sets(
        TINY + ["train.max_bad_steps=3"])
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "training aborted at step 8" in err and "train.max_bad_steps=3" in err
    assert "step-00000008.safetensors" in err and "after step 5" in err
    lines = metrics(tmp_path)
    assert [m["step"] for m in lines if m["kind"] == "skip"] == [6, 7, 8]
    assert lines[-1]["kind"] == "abort" and lines[-1]["last_good_step"] == 5
    d = CheckpointDir(tmp_path / "checkpoints")
    aborted, good = read_checkpoint(d.path_for(8)), read_checkpoint(d.path_for(5))
    assert aborted.meta["reason"] == "abort" and good.meta["reason"] == "epoch"
    for (key, a), (_, b) in zip(tree_items(aborted.params), tree_items(good.params)):
        assert np.array_equal(a, b), key             # the last good params ...
    assert float(aborted.opt_state["step"]) == 5.0   # ... and optimizer state
    # fixed data: the same command resumes from the abort checkpoint and finishes
    poison_batches.clear()
    assert main(args) == 0
    assert "from step-00000008.safetensors" in capsys.readouterr().err
    assert metrics(tmp_path)[-1]["kind"] == "eval"
