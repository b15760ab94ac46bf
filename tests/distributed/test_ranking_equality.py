"""Data-parallel ranking == one process: 2 gloo ranks (separate processes, CPU) of the ranking
task (``model.task = "ranking"``, dropout on) train what one process trains on the same global
batches: dense tables with accumulation, a replicated hash table with evictions in bf16, a
row-sharded hash table with stale updates, a one-process checkpoint resumed on 2 ranks.

Parameters are compared in units of one Adam step (``max |a - b| / optim.lr``): Adam divides each
gradient by its running RMS, so an element whose gradient is ~0 (a bias the batch barely moves)
turns float-summation noise into a visible relative difference, while a real fault (a wrong
normaliser, a sample on two ranks, a lost gradient) moves parameters by whole steps. Measured:
<= 1e-3 of one step in fp32 (the worst is ``bc``, a contextual bias), losses within 3e-7
relative (bf16: 1.2e-4)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from ..test_ranking_train import PRESET, TINY
from .common import final_params, metrics, sets, spawn_ranks, wait_all

LR = 1e-3             # the preset's optim.lr
STEP_TOL = 1e-2       # of one Adam step
LOSS_TOL = 1e-5
EPOCHS = ["train.epochs=2", "train.eval_every=100"]   # 72 samples, batch 16: 10 steps; evaluated at the end
HASH = ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.lr=0.001"]


def _single(out, *extra):
    from gr_functional.configure import load_config
    from gr_functional.runner import train

    train(load_config(PRESET, TINY + EPOCHS + list(extra)), out, progress=False, resume="never")
    return out


def _ranks(out, *extra, world=2):
    command = [sys.executable, "-m", "gr_functional.cli", "train", "--config", str(PRESET), "--quiet", "--out",
               str(out), *sets(TINY + EPOCHS + list(extra))]
    results = wait_all(spawn_ranks(out, world=world, command=command), timeout=300)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    return out


def _train(out) -> list[dict]:
    return [r for r in metrics(out) if r["kind"] == "train"]


def _steps_apart(got: dict, want: dict) -> tuple[float, str]:
    """``(max over leaves of max |got - want| / LR, that leaf)``."""
    assert set(got) == set(want)
    return max((float(np.abs(np.asarray(got[k]) - np.asarray(want[k])).max()) / LR, k) for k in want)


def _same_losses(got: list, want: list, tol: float = LOSS_TOL) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(got) >= 6
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (g["step"], g["loss"], w["loss"])


def _final_test(out) -> dict:
    return json.loads((out / "eval.json").read_text())["last_epoch_test"]


DENSE = ["train.accumulate=2", "train.checkpoint_every=3"]    # 3 steps per epoch: a checkpoint at its end


@pytest.fixture(scope="module")
def dense_one(tmp_path_factory):
    """One process of DENSE (the reference of the dense and the resume tests)."""
    return _single(tmp_path_factory.mktemp("ranking-dense") / "one", *DENSE)


@pytest.mark.slow
def test_dense_tables_two_ranks_equal_one_process(tmp_path, dense_one):
    """Each rank builds only its samples (dist.balance = kk), with the dropout masks and the
    attention normaliser (the global batch's longest sequence; with accumulation the step's) one
    process gives them."""
    one, two = dense_one, _ranks(tmp_path / "two", *DENSE)
    err, leaf = _steps_apart(final_params(two), final_params(one))
    assert err <= STEP_TOL, f"{leaf}: {err:.2e} of one Adam step"
    _same_losses(_train(two), _train(one))
    a, b = _final_test(two), _final_test(one)
    assert abs(a["is_click/auc"] - b["is_click/auc"]) <= 1e-4 and abs(a["auc"] - b["auc"]) <= 1e-4
    timing = [json.loads(line) for line in (two / "timing.jsonl").read_text().splitlines()]
    assert all(len(t["rank_tokens"]) == 2 for t in timing if t["kind"] == "train")
    assert all("imbalance" in t for t in timing if t["kind"] == "epoch")


@pytest.mark.slow
def test_replicated_hash_table_in_bf16_on_contiguous_shares_follows_one_process(tmp_path):
    """embedding.kind = hash below the keys the data names (evictions), backend.precision = bf16,
    dist.balance = none (contiguous equal-count shares): every rank maps the keys of the whole
    global step, so its replica takes the rows one process's table takes (the logged table
    counters match every step), and the losses agree to bf16's rounding (the ranks' partial
    gradients are rounded before they are summed)."""
    extra = [*HASH, "embedding.capacity=150", "backend.precision=bf16", "dist.balance=none"]
    one, two = _single(tmp_path / "one", *extra), _ranks(tmp_path / "two", *extra)
    got, want = _train(two), _train(one)
    _same_losses(got, want, tol=2e-3)
    assert [g["embedding"] for g in got] == [w["embedding"] for w in want]
    assert got[-1]["embedding"]["table"]["evictions"] > 0


@pytest.mark.slow
def test_row_sharded_stale_table_two_ranks_equal_one_process(tmp_path):
    """embedding.sharding = row with embedding.staleness = 1: each rank holds the keys it owns and
    looks up its samples' keys from their owners, updates landing one step late; the dense
    parameters, the table (by key), the losses and the evaluation equal one process's stale run,
    and the checkpoint evaluates on one process (``grf eval``) to the run's own metrics."""
    from gr_functional.runner import evaluate_checkpoint

    from .test_equality import _table_by_id

    extra = [*HASH, "embedding.capacity=400", "embedding.staleness=1"]
    one, two = _single(tmp_path / "one", *extra), _ranks(tmp_path / "two", *extra, "embedding.sharding=row")
    got_params, want_params = final_params(two), final_params(one)
    want_params.pop("item_emb")
    err, leaf = _steps_apart(got_params, want_params)
    assert err <= STEP_TOL, f"{leaf}: {err:.2e} of one Adam step"
    rows, ref = _table_by_id(two), _table_by_id(one)
    assert set(rows) == set(ref)
    assert max(float(np.abs(rows[k] - ref[k]).max()) for k in ref) / LR <= STEP_TOL
    got = _train(two)
    _same_losses(got, _train(one))
    assert got[-1]["embedding"]["exchange"]["ids_inter"] > 0
    final = _final_test(two)
    assert abs(final["is_click/auc"] - _final_test(one)["is_click/auc"]) <= 1e-4
    again = evaluate_checkpoint(two / "checkpoints" / "last.safetensors", "torch")
    assert abs(again["is_click/auc"] - final["is_click/auc"]) <= 1e-6


@pytest.mark.slow
def test_ranking_checkpoint_resumes_on_two_ranks(tmp_path, dense_one):
    """A one-process checkpoint at step 3 (the end of epoch 0) resumed on 2 ranks logs the losses
    the uninterrupted one-process run logs."""
    import shutil

    from gr_functional.checkpoint import CheckpointDir

    shutil.copytree(dense_one, tmp_path / "resumed")
    for step, path in CheckpointDir(tmp_path / "resumed" / "checkpoints").steps():
        if step > 3:
            path.unlink()
    resumed = _ranks(tmp_path / "resumed", *DENSE)
    events = [json.loads(line) for line in (resumed / "timing.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "resume"] == [3]
    _same_losses(_train(resumed), _train(dense_one))
