"""The ranking step on ``step.make_train_step`` (gr_functional/ranking/task.py
``ranking_objective``): gradient accumulation equal to one batch of all the micro-batches' users,
bf16 / fp16 against fp32 on both backends, a ``grf train`` run with both, and stale hash-row
updates (``embedding.staleness``) on both backends.

Tolerances of the precision tests (relative, ``rel_err`` = max|a - ref| / max|ref| per tensor;
worst measured on the tiny preset by a one-off script over 3 batches x 2 seeds on both backends,
in parentheses; the test runs seed 0, 3 batches on torch and 1 on JAX):

  bf16: loss 1e-2 (3.5e-4), every gradient leaf 0.15 (7.3e-2, ``action_table`` / ``wc``: small
        leaves summing many bf16 products), gradient cosine >= 0.999 (0.99992)
  fp16: loss 1e-3 (2.5e-5), every gradient leaf 5e-2 (1.8e-2), gradient cosine >= 0.9999 (0.999998)
"""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from gr_functional.configure import load_config
from gr_functional.data.sources.kuairand_ranking_synthetic import synthetic_ranking
from gr_functional.ranking.data import RankingLoader, chronological_split
from gr_functional.ranking.model import init_ranking_params, make_ranking_batch
from gr_functional.ranking.task import (RankingSteps, init_params, make_host, make_ranking_step, ranking_objective,
                                          shared_norm)
from gr_functional.runtime import make_backend
from gr_functional.step import init_opt_state, micro_grads
from gr_functional.tree import tree_items

from .differential.common import finite_grads, rel_err, tree_cosine
from .reliability.common import metrics
from .test_ranking_train import PRESET, TINY, _run

TOL = {"bf16": {"loss": 1e-2, "grad": 0.15, "cos": 0.999},
       "fp16": {"loss": 1e-3, "grad": 5e-2, "cos": 0.9999}}
HASH = ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.capacity=4000"]


def _seqs(seed=0):
    return synthetic_ranking(24, 300, 60, seed=seed, min_events=31)


def _float64_cfg(tables: str):
    """float64, Adam's eps 1e3 with lr 1e3 (no weight decay): the first step is then -g to 1e-3 of
    g, so the updated parameters compare gradients, not their signs."""
    extra = HASH + ["embedding.lr=1000"] if tables == "hash" else []
    return load_config(PRESET, TINY + extra + ["backend.dtype=float64", "train.accumulate=2", "optim.eps=1000",
                                               "optim.lr=1000", "optim.weight_decay=0"])


def _one_step(B, cfg, batches):
    """``(loss, {path: updated parameter})`` of one step from the initial parameters on the host
    ``batches`` (one, or the micro-batches of an accumulated step)."""
    from gr_functional.ranking import sparse

    host = make_host(cfg)
    if host is not None:
        batches, _ = sparse.prepare(host, batches, 1)
    params = B.asarray_tree(init_params(cfg, host))
    assert all(leaf.dtype == np.float64 for _, leaf in tree_items(B.to_numpy_tree(params)))
    dev = [B.asarray_tree(b) for b in batches]
    params, _, m = make_ranking_step(B, cfg)(params, init_opt_state(B, params, cfg), dev if len(dev) > 1 else dev[0])
    assert bool(m["finite"])
    return float(m["loss"]), dict(tree_items(B.to_numpy_tree(params)))


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["dense", "hash"])
def test_accumulated_micro_batches_are_one_batch_of_all_their_users(tables):
    """train.accumulate = 2 in float64: micro-batches of 5 and 8 users (different longest sequences
    and candidate counts) give the loss and the updated parameters (hash rows included) of one
    batch of the 13 users,
    to 1e-10, because they share the group's attention normaliser (``shared_norm``); each with its
    own normaliser they would not (``_float64_cfg``: the parameters compare gradients)."""
    cfg = _float64_cfg(tables)
    B = make_backend(cfg)
    seqs = _seqs()
    train = chronological_split(seqs, cfg.ranking.num_candidates).train
    lengths = np.minimum(train.ends, cfg.ranking.max_history + cfg.ranking.num_candidates)
    order = np.argsort(lengths, kind="stable")
    picks = [order[:5], order[-8:]]                           # the 5 shortest samples, the 8 longest
    micro = [make_ranking_batch(seqs, train.users[i], cfg.ranking, ends=train.ends[i]) for i in picks]
    whole = make_ranking_batch(seqs, np.concatenate([train.users[i] for i in picks]), cfg.ranking,
                               ends=np.concatenate([train.ends[i] for i in picks]))
    assert micro[0].norm_len < micro[1].norm_len == whole.norm_len == whole.layout.max_len

    loss_acc, acc = _one_step(B, cfg, shared_norm(micro))
    loss_one, one = _one_step(B, cfg, [whole])
    assert abs(loss_acc - loss_one) <= 1e-12 * abs(loss_one)
    for key, want in one.items():
        assert rel_err(acc[key], want) <= 1e-10, key
    _, own = _one_step(B, cfg, micro)                         # each micro-batch its own normaliser
    assert max(rel_err(own[key], want) for key, want in one.items()) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["dense", "hash"])
def test_padded_batches_train_what_exact_ones_do(tables):
    """``make_ranking_batch(pad=True)`` (what a ``static_shapes`` backend, JAX, trains and scores
    on: every size a ladder capacity) against the exact batch, float64, dropout on: 5 users (a
    padding user, padding item tokens and candidates, a wider attention) give the same real
    logits, loss and updated parameters (hash rows included) to 1e-10."""
    from gr_functional.jagged import round_up_capacity
    from gr_functional.ranking.model import ranking_logits

    cfg = _float64_cfg(tables)
    B = make_backend(cfg)
    seqs = _seqs()
    train = chronological_split(seqs, cfg.ranking.num_candidates).train
    lengths = np.minimum(train.ends, cfg.ranking.max_history + cfg.ranking.num_candidates)
    short, middle = np.unique(lengths)[:2]                      # 26 and 36 tokens: the longest is below the cap
    pick = np.concatenate([np.flatnonzero(lengths == short)[:4], np.flatnonzero(lengths == middle)[:1]])
    exact, padded = (make_ranking_batch(seqs, train.users[pick], cfg.ranking, np.random.default_rng(3),
                                        ends=train.ends[pick], pad=pad) for pad in (False, True))
    real = 5 * cfg.ranking.num_candidates
    assert exact.layout.b_cap == 5 and padded.layout.b_cap == 6 and len(padded.cand_mask) == 60
    assert padded.layout.max_len > exact.layout.max_len == float(exact.norm_len) == float(padded.norm_len)
    assert padded.layout.max_len == min(round_up_capacity(exact.layout.max_len, 1), cfg.ranking.max_seq_len)
    assert len(padded.item_ids) > len(exact.item_ids) and padded.cand_mask[real:].sum() == 0
    np.testing.assert_array_equal(padded.input_keep[:exact.layout.t_cap], exact.input_keep)
    loss_exact, want = _one_step(B, cfg, [exact])
    loss_padded, got = _one_step(B, cfg, [padded])
    assert abs(loss_padded - loss_exact) <= 1e-12 * abs(loss_exact)
    for key, ref in want.items():
        assert rel_err(got[key], ref) <= 1e-10, key
    if tables == "dense":
        params = B.asarray_tree(init_params(cfg, None))
        logits = [B.to_numpy(ranking_logits(B, params, B.asarray_tree(b), cfg.ranking)) for b in (exact, padded)]
        assert rel_err(logits[1][:real], logits[0]) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [0, 800])
def test_padding_bounds_the_batch_shapes_of_an_epoch(max_tokens):
    """JAX compiles one program per batch shape: over an epoch of loader batches (16 samples of
    26-80 tokens, or as many as fit 800 tokens), exact shapes take tens of distinct values (28 and
    34 here), padded ones at most 4."""
    cfg = load_config(PRESET, TINY + ["ranking.max_seq_len=80"])
    seqs = synthetic_ranking(200, 300, 90, seed=0, min_events=31)
    loader = RankingLoader(seqs, chronological_split(seqs, 10).train, cfg.ranking, 16, 7, max_tokens=max_tokens)

    def shapes(batch):
        return tuple(np.shape(v) for v in vars(batch).values() if hasattr(v, "shape")) + (batch.layout.max_len,)

    exact = {shapes(b) for b in loader.epoch(0)}
    padded = {shapes(b) for b in loader.epoch(0, pad=True)}
    assert len(padded) <= 4 and len(exact) >= 5 * len(padded), (len(padded), len(exact))


def test_the_runner_gives_each_step_one_normaliser():
    """``RankingSteps.batches`` (what ``grf train`` runs) groups train.accumulate loader batches
    and gives each group its longest sequence as the normaliser."""
    cfg = load_config(PRESET, TINY + ["train.accumulate=2", "ranking.max_seq_len=80"])  # no user at the cap
    seqs = _seqs()
    loader = RankingLoader(seqs, chronological_split(seqs, 10).train, cfg.ranking, 3, 7)   # 72 samples: 24 batches
    own = [float(b.norm_len) for b in loader.epoch(0)]
    steps = list(RankingSteps(make_backend(cfg), cfg, loader).batches(0, 0))
    assert [len(s) for s in steps] == [2] * 12 and any(own[i] != own[i + 1] for i in range(0, 24, 2))
    for i, group in enumerate(steps):
        assert [float(b.norm_len) for b in group] == [max(own[2 * i:2 * i + 2])] * len(group)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_low_precision_ranking_loss_and_grads_against_fp32(name):
    """bf16 / fp16 (fp32 master weights; fp16's loss scale halved on overflow, as the dynamic
    scaler does) against fp32 on loader batches (dropout masks included), every leaf: three on
    torch, one on JAX (it compiles once per batch shape and precision)."""
    seqs = _seqs()
    fns, batches = {}, None
    for precision in ("fp32", "bf16", "fp16"):
        cfg = load_config(PRESET, TINY + [f"backend.name={name}", f"backend.precision={precision}"])
        B = make_backend(cfg)
        fns[precision] = cfg, B.jit(partial(micro_grads, B, cfg=cfg, objective=ranking_objective(cfg)))
        batches = batches or list(RankingLoader(seqs, chronological_split(seqs, 10).train, cfg.ranking, 16,
                                                7).epoch(0))[:3 if name == "torch" else 1]
    params = B.asarray_tree(init_ranking_params(cfg.ranking, seed=0))
    for i, batch in enumerate(batches):
        dev, out = B.asarray_tree(batch), {}
        for precision, (cfg, fn) in fns.items():
            loss, tokens, grads = finite_grads(B, fn, params, init_opt_state(B, params, cfg), dev,
                                               f"{precision} on batch {i}")
            assert float(tokens) == float(np.sum(batch.cand_mask))
            out[precision] = float(loss), grads
        loss32, grads32 = out["fp32"]
        for precision in ("bf16", "fp16"):
            loss, grads = out[precision]
            tol = TOL[precision]
            assert abs(loss - loss32) <= tol["loss"] * abs(loss32), (i, precision)
            worst = 0.0
            for key, g in grads.items():
                assert rel_err(g, grads32[key]) <= tol["grad"], (i, precision, key)
                worst = max(worst, rel_err(g, grads32[key]))
            assert tree_cosine(grads, grads32) >= tol["cos"], (i, precision)
            assert loss != loss32 and worst > 1e-4, (i, precision)   # it did compute in 16 bits


LOW_PRECISION_RUN = HASH + ["train.accumulate=2", "train.epochs=2", "train.checkpoint_every=0", "train.loss_scale=1024"]


def _low_precision_run(out, precision: str) -> float:
    """Train ``LOW_PRECISION_RUN`` in ``precision``, check its steps and files; the mean loss of
    its last epoch."""
    proc = _run(out, *LOW_PRECISION_RUN, f"backend.precision={precision}")
    assert proc.returncode == 0, proc.stderr
    records = [r for r in metrics(out) if r["kind"] in ("train", "skip")]
    assert [(r["kind"], r["step"]) for r in records] == [("train", s) for s in range(1, 7)]
    assert all(("loss_scale" in r) == (precision == "fp16") for r in records)
    result = json.loads((out / "eval.json").read_text())
    assert result["precision"] == precision and result["steps"] == 6 and result["skipped_steps"] == 0
    return float(np.mean([r["loss"] for r in records[3:]]))


@pytest.fixture(scope="module")
def fp32_tail(tmp_path_factory):
    return _low_precision_run(tmp_path_factory.mktemp("ranking_fp32") / "run", "fp32")


@pytest.mark.data("kuairand-user-features", "kuairand-video-features")
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_grf_train_ranking_in_low_precision_with_accumulation(tmp_path, precision, fp32_tail):
    """``grf train`` of the preset with a hash table, ``step.accumulate = 2`` and bf16 / fp16: 5
    loader batches an epoch make 3 steps (the last of one batch); no step skipped (fp16 starts at a
    loss scale of 1024, below the 8192-16384 that overflow here, so every run trains 6 steps); the
    last epoch's mean loss within 1e-3 of fp32's (relative; measured 3e-5 bf16, 8e-5 fp16)."""
    tail = _low_precision_run(tmp_path / "run", precision)
    assert abs(tail - fp32_tail) <= 1e-3 * fp32_tail


@pytest.mark.slow
def test_stale_hash_rows_agree_between_torch_and_jax_and_lag_by_k():
    """embedding.staleness = 2 on the ranking model's hash table: three steps on torch and JAX
    agree (losses, dense parameters, rows); the rows step 1 looked up hold the same values after
    step 2 as after step 1 (step 1's update is due at step 3), where the synchronous run has
    moved them."""
    from gr_functional.config import replace
    from gr_functional.ranking import sparse

    base = load_config(PRESET, TINY + HASH)
    seqs = _seqs()
    batches = list(RankingLoader(seqs, chronological_split(seqs, 10).train, base.ranking, 16, 7).epoch(0))[:3]
    runs = {}
    for name, k in (("torch", 2), ("jax", 2), ("torch", 0)):
        cfg = replace(base, backend={"name": name}, embedding={"staleness": k})
        B, host = make_backend(cfg), make_host(cfg)
        params = B.asarray_tree(init_params(cfg, host))
        opt, step, losses, tables = init_opt_state(B, params, cfg), make_ranking_step(B, cfg), [], []
        for i, batch in enumerate(batches, 1):
            (local,), _ = sparse.prepare(host, [batch], i)
            if i == 1:
                first = np.asarray(local.lookup.rows)[np.asarray(local.lookup.touched)]
            params, opt, m = step(params, opt, B.asarray_tree(local))
            assert bool(m["finite"])
            losses.append(float(m["loss"]))
            tables.append(B.to_numpy(params["item_emb"])[first])
        runs[(name, k)] = losses, B.to_numpy_tree(params), tables
    (lt, pt, stale), (lj, pj, _), (_, _, sync) = runs[("torch", 2)], runs[("jax", 2)], runs[("torch", 0)]
    np.testing.assert_allclose(lt, lj, rtol=1e-5)
    for (key, a), (_, b) in zip(tree_items(pt), tree_items(pj)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5, err_msg=key)
    assert len(first) > 0 and np.array_equal(stale[0], stale[1]) and not np.array_equal(stale[1], stale[2])
    assert not np.array_equal(sync[0], sync[1])


@pytest.mark.data("kuairand-user-features", "kuairand-video-features")
@pytest.mark.slow
def test_a_ranking_run_resumes_in_another_precision(tmp_path):
    """fp32 for an epoch, resumed in fp16 (a fresh loss scaler joins the optimizer state), then in
    bf16 (the scaler is dropped): each resume trains on, and only the fp16 steps log a scale."""
    out = tmp_path / "run"
    for epochs, precision in ((1, "fp32"), (2, "fp16"), (3, "bf16")):
        proc = _run(out, "train.checkpoint_every=0", "train.loss_scale=1024", f"train.epochs={epochs}",
                    f"backend.precision={precision}")
        assert proc.returncode == 0, proc.stderr
        assert (epochs == 1) != ("resuming" in proc.stderr)
    records = [r for r in metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 16))
    assert [("loss_scale" in r) for r in records] == [False] * 5 + [True] * 5 + [False] * 5
