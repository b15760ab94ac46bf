"""Gradient accumulation: k micro-batches give the update of one batch holding all their sequences
(fp32, up to rounding), with the loss normalised by supervised tokens over the jagged batches."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.batch import HSTUBatch, Negatives, make_batch
from gr_functional.config import Config, ModelConfig, OptimConfig
from gr_functional.jagged import Jagged
from gr_functional.step import accumulate, finish, init_opt_state, make_train_step, micro_grads, train_step
from gr_functional.tree import tree_items

from ..differential.common import FWD_TOL, GRAD_TOL, rel_err

MODEL = ModelConfig(num_items=120, embed_dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, max_len=12,
                    input_dropout=0.2, linear_dropout=0.2)
NEGATIVES = Negatives("sampled", 8)
CFG = Config(model=MODEL, optim=OptimConfig(lr=1e-3, weight_decay=0.01))
# events per user of each micro-batch: very different token counts (2..13 events -> 1..12 tokens),
# so a plain mean of the micro-batch losses would be visibly wrong
MICRO = [[2, 13, 5], [13, 13, 13, 9], [3]]


def micro_batches(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for events in MICRO:
        histories = [rng.integers(1, MODEL.num_items + 1, n) for n in events]
        times = [np.cumsum(rng.integers(0, 10**5, n)) + 10**9 for n in events]
        # one capacity for all (and for the concatenation): JAX compiles each program once
        out.append(make_batch(histories, times, MODEL, rng=rng, b_cap=8, t_cap=64, negatives=NEGATIVES))
    return out


def concat_batches(batches: list[HSTUBatch]) -> HSTUBatch:
    """One jagged batch holding every sequence of ``batches`` with the same negatives and dropout
    masks (times stay relative to each micro-batch's origin: attention only sees differences
    inside a sequence)."""
    seqs = []
    for b in batches:
        L = b.tokens
        seqs += [L.values[L.offsets[i]:L.offsets[i + 1]] for i in range(L.b_cap) if L.lengths[i] > 0]
    tokens = Jagged.from_sequences(seqs, max_len=MODEL.max_len, b_cap=8, t_cap=64)
    T, real = tokens.t_cap, tokens.num_tokens()

    def cat(name, axis=0):
        parts = [np.take(getattr(b, name), np.arange(b.tokens.num_tokens()), axis=axis) for b in batches]
        whole = np.concatenate(parts, axis=axis)
        shape = list(whole.shape)
        shape[axis] = T
        padded = np.zeros(shape, whole.dtype)
        index = [slice(None)] * len(shape)
        index[axis] = slice(0, real)
        padded[tuple(index)] = whole
        return padded

    return HSTUBatch(tokens, cat("ts"), cat("query_ts"), cat("targets"), cat("weights"), cat("negatives"),
                     cat("input_keep"), cat("block_keep", axis=1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_k_micro_batches_equal_one_big_batch(name):
    B = get_backend(name)
    micro = micro_batches()
    big = concat_batches(micro)
    assert big.tokens.num_tokens() == sum(b.tokens.num_tokens() for b in micro)
    params = B.asarray_tree(model.init_params(MODEL, seed=3))
    opt = init_opt_state(B, params, CFG)
    dev_micro = [B.asarray_tree(b) for b in micro]
    dev_big = B.asarray_tree(big)

    # gradients: token-weighted combination of the micro-batches vs the big batch (jitted: eager
    # JAX dispatches op by op and is slow)
    grads_fn = B.jit(partial(micro_grads, B, cfg=CFG))
    acc = None
    for mb in dev_micro:
        acc = accumulate(B, acc, *grads_fn(params, opt, mb))
    loss_k, tokens_k, grads_k = finish(B, acc)
    loss_1, tokens_1, grads_1 = grads_fn(params, opt, dev_big)
    assert float(tokens_k) == float(tokens_1) == float(big.weights.sum())
    assert rel_err(B.to_numpy(loss_k), B.to_numpy(loss_1)) <= FWD_TOL
    g1 = dict(tree_items(B.to_numpy_tree(grads_1)))
    for key, value in tree_items(B.to_numpy_tree(grads_k)):
        assert rel_err(value, g1[key]) <= GRAD_TOL, key

    # the whole step (the runner's jitted composition, and on torch the pure function): same params
    step = make_train_step(B, CFG)
    p_big, _, m_big = step(params, opt, dev_big)
    p_run, _, m_run = step(params, opt, dev_micro)
    assert bool(m_run["finite"])
    results = [p_run]
    if name == "torch":  # eager; under JAX it would be one more multi-second compile
        results.append(train_step(B, params, opt, dev_micro, CFG)[0])
    want = dict(tree_items(B.to_numpy_tree(p_big)))
    for got in results:
        for key, value in tree_items(B.to_numpy_tree(got)):
            assert rel_err(value, want[key]) <= FWD_TOL, key
    assert rel_err(B.to_numpy(m_run["loss"]), B.to_numpy(m_big["loss"])) <= FWD_TOL


def test_plain_mean_of_micro_losses_would_differ():
    """Guard that the test above can fail: the unweighted mean of micro-batch losses is not the
    big batch's loss here (token counts 16, 44 and 2)."""
    B = get_backend("torch")
    micro = micro_batches()
    params = B.asarray_tree(model.init_params(MODEL, seed=3))
    losses = [float(model.loss_fn(B, params, B.asarray_tree(b), MODEL)) for b in micro]
    big = float(model.loss_fn(B, params, B.asarray_tree(concat_batches(micro)), MODEL))
    assert abs(np.mean(losses) - big) > 1e-3 * abs(big)


def test_one_micro_batch_is_the_plain_step():
    """accumulate=1 (or a list of one) is bit-identical to the single-batch step."""
    B = get_backend("torch")
    batch = B.asarray_tree(micro_batches()[1])
    params = B.asarray_tree(model.init_params(MODEL, seed=3))
    opt = init_opt_state(B, params, CFG)
    step = make_train_step(B, CFG)
    a, _, _ = step(params, opt, batch)
    b, _, _ = step(params, opt, [batch])
    for (key, x), (_, y) in zip(tree_items(B.to_numpy_tree(a)), tree_items(B.to_numpy_tree(b))):
        assert np.array_equal(x, y), key


def test_runner_with_accumulation(tmp_path):
    """train.accumulate=2 in a real run: half the optimizer steps, logged per optimizer step."""
    from gr_functional.runner import train

    from .common import metrics, tiny_config

    cfg = tiny_config("train.epochs=1", "train.accumulate=2")
    result = train(cfg, tmp_path, progress=False)
    lines = [m for m in metrics(tmp_path) if m["kind"] == "train"]
    assert [m["step"] for m in lines] == [1, 2, 3]           # 5 loader batches -> groups of 2, 2, 1
    assert result["steps"] == 3 and all(np.isfinite(m["loss"]) for m in lines)
