"""Rank-aware data loading and the loss normalisation, in one process (no process group)."""
from __future__ import annotations

import numpy as np
import pytest

from backends import get_backend
from gr_functional import balance, model
from gr_functional.config import ConfigError, replace
from gr_functional.data import batching, split
from gr_functional.data.loaders import DataError
from gr_functional.retrieval.task import load_sequences, resolve
from gr_functional.configure import validate
from gr_functional.step import init_opt_state, micro_grads, rank_grads, rank_scales
from gr_functional.tree import tree_items, tree_map

from ..differential.common import GRAD_TOL, rel_err
from .common import tiny_config


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    return cfg, split.leave_one_out(data).train


def _loader(setup, world=2, **dist):
    cfg, train = setup
    return batching.TrainLoader.from_config(train, replace(cfg, dist=dist) if dist else cfg, world_size=world)


@pytest.mark.parametrize("policy", ["none", "kk", "lookahead"])
def test_rank_shares_partition_each_global_batch(setup, policy):
    """Every sequence of a global batch goes to exactly one rank, with its own tokens, negatives
    and dropout masks; over an epoch every user is trained once."""
    L = _loader(setup, balance=policy)
    seen = []
    for s in range(L.steps_in_epoch(0)):
        whole = L.batch(0, s)
        parts = L.rank_batches(0, s)
        assign = L.rank_assignment(0, s)
        counts = np.bincount(assign, minlength=2)
        assert counts.max() - counts.min() <= 1                       # equal counts
        off = np.asarray(whole.tokens.offsets)
        for r, part in enumerate(parts):
            rows = np.concatenate([np.arange(off[b], off[b + 1]) for b in np.flatnonzero(assign == r)])
            n = len(rows)
            assert part.batch.tokens.num_tokens() == n == part.rank_tokens[r]
            for name in ("ts", "query_ts", "targets", "weights", "negatives", "input_keep"):
                np.testing.assert_array_equal(getattr(part.batch, name)[:n], getattr(whole, name)[rows])
            np.testing.assert_array_equal(part.batch.block_keep[:, :n], whole.block_keep[:, rows])
            np.testing.assert_array_equal(part.batch.tokens.values[:n], whole.tokens.values[rows])
            assert part.global_tokens == float(whole.weights.sum())
        assert sum(p.tokens for p in parts) == parts[0].global_tokens
        seen.append(L.plan(0)[s])
    assert sorted(np.concatenate(seen).tolist()) == list(range(L.num_users))


def test_kk_keeps_the_single_process_global_batches_and_balances(setup):
    single, kk, none = _loader(setup, world=1), _loader(setup, balance="kk"), _loader(setup, balance="none")
    imb = {"kk": [], "none": []}
    for e in range(3):
        for s in range(single.steps_in_epoch(e)):
            np.testing.assert_array_equal(kk.batch(e, s).negatives, single.batch(e, s).negatives)
            for name, L in (("kk", kk), ("none", none)):
                imb[name].append(balance.imbalance(L.rank_batch(e, s, 0).rank_costs))
    assert np.mean(imb["kk"]) < 0.5 * np.mean(imb["none"]), imb


def test_rank_token_cap(setup):
    cfg, _ = setup
    L = _loader(setup, balance="kk", rank_token_cap=cfg.model.max_len * 5)
    for s in range(L.steps_in_epoch(0)):
        assert L.rank_batch(0, s, 0).rank_tokens.max() <= cfg.model.max_len * 5
    with pytest.raises(DataError, match=r"dist.rank_token_cap=20: the \d+ tokens of epoch 0 step 0 cannot be split"):
        L = _loader(setup, balance="kk", rank_token_cap=20)
        [L.rank_batch(0, s, 0) for s in range(L.steps_in_epoch(0))]
    with pytest.raises(DataError, match="dist.rank_token_cap=3 is smaller than one user"):
        _loader(setup, rank_token_cap=3)


def test_lookahead_schedule_is_part_of_the_resume_state(setup):
    state = _loader(setup, balance="lookahead").state_dict()
    assert state["schedule"].startswith("lookahead R=2")
    with pytest.raises(DataError, match="resume with the original dist settings"):
        _loader(setup, world=1).load_state_dict(state)
    assert "schedule" not in _loader(setup, balance="kk").state_dict()   # kk/none: plain global batches
    with pytest.raises(DataError, match="multiple of the world size 3"):
        _loader(setup, world=3, balance="lookahead")


def test_rank_losses_normalised_by_the_global_token_count(setup):
    """Summing the ranks' gradients of (sum of their token losses) / (GLOBAL tokens) gives the
    single-batch gradient; per-rank means (local normalisation) would not."""
    cfg, _ = setup
    L = _loader(setup, balance="none")   # contiguous halves: unequal token counts
    B = get_backend("torch")
    params = B.asarray_tree(model.init_params(cfg.model, seed=1))
    opt = init_opt_state(B, params, cfg)
    whole = L.batch(0, 1)
    parts = L.rank_batches(0, 1, capacity="exact")
    assert parts[0].tokens != parts[1].tokens                      # unequal counts: the test can fail
    _, _, want = micro_grads(B, params, opt, B.asarray_tree(whole), cfg)
    G = parts[0].global_tokens
    summed, local_mean = None, None
    for p in parts:
        _, g = rank_grads(B, params, opt, [B.asarray_tree(p.batch)], rank_scales([p.tokens], G, 2), cfg)
        summed = g if summed is None else tree_map(lambda a, b: a + b, summed, g)
        _, _, gm = micro_grads(B, params, opt, B.asarray_tree(p.batch), cfg)
        local_mean = gm if local_mean is None else tree_map(lambda a, b: (a + b) / 2, local_mean, gm)
    w = dict(tree_items(B.to_numpy_tree(want)))
    worst = max(rel_err(v, w[k]) for k, v in tree_items(B.to_numpy_tree(summed)))
    assert worst <= GRAD_TOL
    assert max(rel_err(v, w[k]) for k, v in tree_items(B.to_numpy_tree(local_mean))) > 100 * GRAD_TOL


def test_dist_config_errors_name_the_key(setup, monkeypatch):
    cfg, _ = setup
    for key, value, text in [("backend", "mpi", "dist.backend: 'mpi' is not one of 'gloo', 'nccl', 'hccl'"),
                             ("balance", "lpt", "dist.balance: 'lpt'"), ("timeout_s", 0.0, "dist.timeout_s: must be > 0"),
                             ("cost_a", -1.0, "dist.cost_a: must be >= 0, got -1.0")]:
        with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(".", r"\.")):
            validate(replace(cfg, dist={key: value}))
    from gr_functional.runner import train

    monkeypatch.setenv("WORLD_SIZE", "2")  # JAX processes: where they meet is asked first, before anything is read
    for name in ("MASTER_ADDR", "MASTER_PORT", "GRF_JAX_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="several JAX processes meet at a coordinator: set GRF_JAX_COORDINATOR"):
        train(replace(cfg, backend={"name": "jax"}), "/nonexistent/never-written")
