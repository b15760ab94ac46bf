"""gr_functional/interop/flax_nnx.py: the retrieval HSTU and the ranking model as flax.nnx modules hold the
functional parameter tree one-to-one (same paths, shapes and values, both ways), compute the
functional model's outputs and gradients, and a plain nnx + optax loop on real ML-1M batches
lands on ``grf train --backend jax``'s losses (experiments/flax_optax_loop.py, the README's example)."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from backends import get_backend
from gr_functional.interop.flax_nnx import HSTU, RankingModel
from experiments import flax_optax_loop
from gr_functional import model
from gr_functional.batch import Negatives, make_batch
from gr_functional.config import LossConfig, ModelConfig
from gr_functional.configure import load_config
from gr_functional.ranking.data import RankingLoader, chronological_split
from gr_functional.ranking.model import init_ranking_params, ranking_logits
from gr_functional.runner import train
from gr_functional.tree import tree_items

from ..test_ranking_step import _seqs
from ..test_ranking_train import PRESET, TINY
import pytest

CFG = ModelConfig(num_items=50, embed_dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, max_len=12,
                  input_dropout=0.2, linear_dropout=0.2)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    events = (5, 13, 2, 9)
    histories = [rng.integers(1, 51, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**5, n)) + 10**9 for n in events]
    return make_batch(histories, times, CFG, rng=rng, num_items=50, b_cap=6, negatives=Negatives("sampled", 8))


def _flat_state(module) -> dict:
    return {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _same_tree(a: dict, b: dict) -> None:
    a, b = dict(tree_items(a)), dict(tree_items(b))
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_hstu_module_holds_the_functional_tree_one_to_one():
    tree = model.init_params(CFG, seed=3)
    hstu = HSTU(CFG, tree)
    _same_tree(_flat_state(hstu), {p: v for p, v in tree_items(tree)})   # nnx paths == functional paths
    _same_tree(hstu.params(), tree)                                       # and back
    _same_tree(HSTU(CFG, seed=3).params(), tree)                           # seeded init == init_params


@pytest.mark.slow
def test_hstu_module_outputs_and_gradients_are_the_functional_models():
    B = get_backend("jax")
    tree = B.asarray_tree(model.init_params(CFG, seed=1))
    batch = B.asarray_tree(_batch())
    hstu = HSTU(CFG, tree)
    np.testing.assert_array_equal(np.asarray(hstu(batch)), np.asarray(model.encode(B, tree, batch, CFG)))
    loss_cfg = LossConfig(num_negatives=8)
    value, grads = nnx.value_and_grad(lambda m: m.loss(batch, loss_cfg))(hstu)
    ref_value, ref_grads = B.value_and_grad(lambda p: model.loss_fn(B, p, batch, CFG, loss=loss_cfg))(tree)
    assert float(value) == float(ref_value)
    got = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    _same_tree(got, dict(tree_items(ref_grads)))


@pytest.mark.slow
def test_ranking_module_holds_the_tree_and_computes_the_functional_logits():
    cfg = load_config(PRESET, TINY + ["backend.name=jax"])
    tree = init_ranking_params(cfg.ranking, seed=0)
    ranker = RankingModel(cfg.ranking, tree)
    _same_tree(_flat_state(ranker), dict(tree_items(tree)))
    _same_tree(ranker.params(), tree)
    seqs = _seqs()
    host_batch = next(iter(RankingLoader(seqs, chronological_split(seqs, 10).train, cfg.ranking, 8, 7).epoch(0)))
    B = ranker.backend
    batch = B.asarray_tree(host_batch)
    np.testing.assert_array_equal(np.asarray(ranker(batch)),
                                  np.asarray(ranking_logits(B, B.asarray_tree(tree), batch, cfg.ranking)))


@pytest.mark.slow
def test_the_flax_optax_loop_follows_grf_train_on_real_ml1m(tmp_path):
    """The README's example: nnx.Optimizer(optax.adamw) over HSTU on real ML-1M batches gives the
    losses ``grf train --backend jax`` logs for the same steps."""
    config = str(Path(__file__).resolve().parents[2] / "experiments" / "configs" / "ml1m_hstu.toml")
    sets = ["train.max_steps=3", "train.log_every=1", "train.epochs=1", "train.checkpoint_every=0"]
    ours = flax_optax_loop.train(config, 3, sets)
    train(load_config(config, ["backend.name=jax", *sets]), tmp_path / "run", progress=False)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "train"]
    assert len(logged) == 3
    np.testing.assert_allclose(ours, logged, rtol=1e-6)
    assert jax.default_backend() == "cpu"
