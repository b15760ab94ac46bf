"""Semi-asynchronous sparse updates (embedding.staleness = k): the row update of step i lands at
step i + k. Checked against a plain re-implementation (a queue of (rows, gradients) applied
with the synchronous row update), on both backends, through evictions, and across kill -9 +
resume (the pending updates live in the optimizer state, so in every checkpoint)."""
from __future__ import annotations

import numpy as np
import pytest

import gr_functional as grf
from gr_functional.embedding.lookup import Lookup
from ..differential.optim_oracle import adamw_update
from gr_functional.step import (TABLE, init_opt_state, local_params, make_train_step, micro_grads, refresh_rows,
                                 sparse_update)

from ..reliability.common import metrics, run_grf
from ..reliability.test_resume import _run_until_fault

TINY = ["data.synthetic_users=60", "data.synthetic_items=90", "data.synthetic_max_events=30", "model.max_len=12",
        "model.embed_dim=16", "model.num_heads=2", "model.dqk=8", "model.dv=8", "loss.num_negatives=6",
        "train.batch_size=12", "train.epochs=2", "train.log_every=1", "embedding.optimizer=lazy_adam"]


def _queue_oracle(B, exp, batches, k: int):
    """The definition, written plainly: every step's dense update at once; its row gradient
    queued and applied k steps later, by the synchronous row update at that step's lr."""
    cfg = exp.cfg
    params = B.asarray_tree(exp.init_params())
    sync_cfg = grf.config.replace(cfg, embedding={"staleness": 0})
    state = init_opt_state(B, params, sync_cfg)
    queue, losses = [], []
    for batch in batches:
        dev = B.asarray_tree(batch)
        lookup = batch.lookup
        view = local_params(B, params, dev.lookup)
        loss, _, grads = micro_grads(B, view, state, dev, cfg)
        losses.append(float(loss))
        dense = {k_: v for k_, v in params.items() if k_ != TABLE}
        new_dense, new_adam = adamw_update(B, {k_: v for k_, v in grads.items() if k_ != TABLE},
                                           {k_: state[k_] for k_ in ("step", "mu", "nu")}, dense, cfg.optim)
        queue.append((np.asarray(lookup.rows) * np.asarray(lookup.touched), B.to_numpy(grads[TABLE])))
        table = params[TABLE]
        if len(queue) > k:
            rows, g = queue.pop(0)
            due = Lookup(B.asarray(rows), B.asarray(rows > 0), B.asarray(np.zeros(len(rows), bool)), None)
            _, new_rows, _, new_state = sparse_update(B, state["rows"], B.gather_rows(table, due.rows),
                                                      B.asarray(g), due, new_adam["step"], cfg)
            table = B.set_rows(table, due.rows, new_rows)
            state = {**state, "rows": grf.tree.tree_map(lambda s, n: B.set_rows(s, due.rows, n), state["rows"],
                                                        new_state)}
        params = {**new_dense, TABLE: table}
        state = {**state, **new_adam}
    return np.asarray(losses), B.to_numpy(params[TABLE])


def _steps(exp, n):
    host = exp.embedding_host()
    out = []
    for step, batch in enumerate(exp.batches(0), start=1):
        if step > n:
            break
        (batch,), _ = host.prepare([batch], step)
        out.append(batch)
    return out


def test_stale_step_is_the_queue_definition():
    """A dense-kind table (no evictions): the step's stale path equals the queue oracle (torch;
    JAX follows from the cross-backend test below)."""
    k = 2
    exp = grf.prepare("quickstart", [*TINY, f"embedding.staleness={k}"])
    B = exp.backend("torch")
    batches = _steps(exp, 6)
    want_losses, want_table = _queue_oracle(B, exp, batches, k)
    step = make_train_step(B, exp.cfg)
    params = B.asarray_tree(exp.init_params())
    state = init_opt_state(B, params, exp.cfg)
    assert len(state["pending"]) == k
    losses = []
    for batch in batches:
        params, state, m = step(params, state, B.asarray_tree(batch))
        assert bool(m["finite"])
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(B.to_numpy(params[TABLE]), want_table, rtol=1e-5, atol=1e-6)
    # the last k steps' updates are still pending: they are not in the table yet
    assert all(int((np.asarray(B.to_numpy(p["rows"])) > 0).sum()) > 0 for p in state["pending"])


def test_refresh_writes_fresh_rows_now_and_drops_their_pending_updates():
    from backends import get_backend

    B = get_backend("torch")
    table = B.asarray(np.arange(8 * 2, dtype=np.float32).reshape(8, 2))
    state = {"acc": B.asarray(np.array([0, 5, 5, 5, 5, 5, 5, 5], np.float32))}  # row 0: padding, never updated
    pending = [{"rows": B.asarray(np.array([3, 5, 0], np.int32)), "grads": B.asarray(np.ones((3, 2), np.float32))},
               {"rows": B.asarray(np.array([5, 6], np.int32)), "grads": B.asarray(np.ones((2, 2), np.float32))}]
    lookup = Lookup(B.asarray(np.array([0, 5, 6, 0], np.int32)), B.asarray(np.array([False, True, True, False])),
                    B.asarray(np.array([False, True, False, False])), None)
    view = B.asarray(np.array([[0, 1], [-1, -1], [12, 13], [0, 1]], np.float32))  # row 5 fresh: its init
    table, state, pending = refresh_rows(B, table, state, pending, view, lookup)
    t = B.to_numpy(table)
    assert t[5].tolist() == [-1, -1] and t[6].tolist() == [12, 13] and t[3].tolist() == [6, 7]
    assert B.to_numpy(state["acc"]).tolist() == [0, 5, 5, 5, 5, 0, 5, 5] and t[0].tolist() == [0, 1]
    assert [B.to_numpy(p["rows"]).tolist() for p in pending] == [[3, 0, 0], [0, 6]]


@pytest.mark.slow
def test_staleness_runs_agree_across_backends_through_evictions():
    """A hash table below the catalogue (evictions every step) with k = 1, 3 steps (two stale
    updates applied; JAX compiles each step's shapes anew, so the run is short): torch and JAX."""
    exp = grf.prepare("quickstart", [*TINY, "embedding.kind=hash", "embedding.capacity=50", "embedding.staleness=1"])
    curves = {}
    for name in ("torch", "jax"):
        B = exp.backend(name)
        step = make_train_step(B, exp.cfg)
        params = B.asarray_tree(exp.init_params())
        state = init_opt_state(B, params, exp.cfg)
        curve = []
        for batch in _steps(exp, 3):
            params, state, m = step(params, state, B.asarray_tree(batch))
            curve.append(float(m["loss"]))
        curves[name] = np.asarray(curve)
    assert np.max(np.abs(curves["torch"] - curves["jax"])) <= 1e-4 * np.max(np.abs(curves["torch"]))


@pytest.mark.slow
def test_stale_run_killed_and_resumed_is_bitwise_the_uninterrupted_run(tmp_path):
    sets = ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.capacity=60", "embedding.staleness=2",
            "train.checkpoint_every=3", "train.keep_checkpoints=0", "train.epochs=2"]
    ref = tmp_path / "ref"
    assert run_grf(ref, *sets).returncode == 0
    out = tmp_path / "run"
    _run_until_fault(out, "after-step@5", *sets)
    proc = run_grf(out, *sets)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr
    assert metrics(out) == metrics(ref)


def test_staleness_needs_a_row_sparse_optimizer():
    with pytest.raises(grf.config.ConfigError, match=r"embedding\.staleness"):
        grf.load_config(None, ["embedding.staleness=1"])
    grf.load_config(None, ["embedding.staleness=1", "embedding.optimizer=lazy_adam", "embedding.sharding=row"])


def test_a_skipped_step_queues_no_non_finite_gradient(tmp_path, monkeypatch):
    """A step the guard skips (NaN loss) with k = 2: its row gradient is not queued as NaN, so
    the next checkpoints are written (they refuse non-finite state) and the run finishes."""
    from gr_functional import step as train_module
    from gr_functional.checkpoint import read_checkpoint
    from gr_functional.runner import train

    calls = [0]
    real = train_module._loss

    def poisoned(B, params, *args, **kwargs):
        calls[0] += 1
        loss, aux = real(B, params, *args, **kwargs)
        return (loss * float("nan") if calls[0] == 2 else loss), aux

    monkeypatch.setattr(train_module, "_loss", poisoned)
    cfg = grf.load_config("experiments/configs/quickstart.toml",
                          [*TINY, "embedding.staleness=2", "train.max_steps=4", "train.checkpoint_every=3",
                           "train.epochs=1", "eval.max_users=10"])
    train(cfg, tmp_path / "run", progress=False, resume="never")
    ck = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.safetensors")
    assert all(np.isfinite(np.asarray(p["grads"])).all() for p in ck.opt_state["pending"])
    assert [r["step"] for r in metrics(tmp_path / "run") if r.get("kind") == "skip"] == [2]
