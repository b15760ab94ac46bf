"""The loss registry's shipped losses against float64 numpy oracles, on every backend under test
(forward and gradients with respect to the user embeddings and the item table), and a short
training trajectory with each loss equal across backends."""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional import losses, model
from gr_functional.batch import Negatives, make_batch
from gr_functional.config import Config, LossConfig, ModelConfig, OptimConfig
from gr_functional.step import make_train_step

from . import oracle
from .common import FWD_TOL, GRAD_TOL, MAX_LEN, TRAJ_TOL, rel_err

N_ITEMS, D, TAU = 60, 8, 0.07
CFG = ModelConfig(num_items=N_ITEMS, embed_dim=16, num_blocks=1, num_heads=2, dqk=8, dv=8, max_len=MAX_LEN,
                  input_dropout=0.2, linear_dropout=0.2)


# (loss, negative kind, pool sampler, negatives precision): every shipped loss, the pool under
# both samplers, 16-bit negatives (per-sequence and per-pool scales)
CASES = [("sampled_softmax", "sampled", "uniform", "fp32"), ("in_batch", "in_batch", "uniform", "fp32"),
         ("shared_pool", "pool", "uniform", "fp32"), ("shared_pool", "pool", "popularity", "fp32"),
         ("sampled_softmax", "sampled", "uniform", "fp16"), ("sampled_softmax", "sampled", "uniform", "bf16"),
         ("shared_pool", "pool", "popularity", "fp16"), ("in_batch", "in_batch", "uniform", "bf16"),
         ("full_softmax", "catalogue", "uniform", "fp32"), ("full_softmax", "catalogue", "uniform", "bf16"),
         ("mixed_pool", "mixed", "uniform", "fp32"), ("mixed_pool", "mixed", "popularity", "bf16")]
# skewed and with holes: ids 1..11 are frequent, 12..N_ITEMS rare, every 5th never seen
POPULARITY = np.where(np.arange(N_ITEMS + 1) % 5 == 0, 0, np.where(np.arange(N_ITEMS + 1) < 12, 50, 1))


def _batch(kind: str, count: int, seed: int = 0, events=(5, MAX_LEN + 1, 2, 9), sampler="uniform"):
    rng = np.random.default_rng(seed)
    # a small catalogue: targets repeat, so collisions (negative == target) are exercised
    histories = [rng.integers(1, 12, n) for n in events]
    times = [np.cumsum(rng.integers(0, 10**5, n)) + 10**9 for n in events]
    return make_batch(histories, times, CFG, rng=rng, num_items=N_ITEMS, b_cap=6,
                      negatives=Negatives(kind, count, sampler, 0.75,
                                          POPULARITY if sampler == "popularity" else None,
                                          batch_count=count // 2 if kind == "mixed" else 0))


def _normalise(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def _negative_rows(name: str, items, batch, precision: str):
    """float64 rows of the negatives the loss reads: ``items[ids]`` ``[T, R, D]`` (sampled) or
    ``items[shared]`` ``[R, D]`` (pool, in-batch), or those rounded to 16 bits by the oracle with
    one scale per user sequence (sampled: the largest |value| of the rows its positions read;
    padding positions 1) or one for the whole pool."""
    ids = np.asarray(batch.negatives if name == "sampled_softmax" else batch.shared_negatives)
    rows = items[ids]
    if precision == "fp32":
        return rows
    rows32 = items.astype(np.float32)[ids]
    if name != "sampled_softmax":
        return oracle.round_16bit(rows32, np.abs(rows32).max() or 1.0, precision)
    scale = np.ones(len(ids), np.float32)
    offsets = np.asarray(batch.layout.offsets)
    for s, e in zip(offsets[:-1], offsets[1:]):
        scale[s:e] = np.abs(rows32[s:e]).max(initial=0.0) or 1.0
    return oracle.round_16bit(rows32, scale[:, None, None], precision)


def _oracle(name: str, user, items, batch, precision: str = "fp32", shift=None) -> float:
    """float64 numpy: mean over supervised positions of -log softmax([pos, negatives])[0].
    ``shift[N, D]`` moves every item row, the negatives' 16-bit copies by the same amount (the
    straight-through gradient is the derivative along such moves)."""
    t = np.asarray(batch.targets)
    w = np.asarray(batch.weights, np.float64)
    rows = _negative_rows(name, items, batch, precision)
    if shift is not None:
        rows = rows + shift[np.asarray(batch.negatives if name == "sampled_softmax" else batch.shared_negatives)]
        items = items + shift
    pos = (user * items[t]).sum(-1) / TAU
    if name == "sampled_softmax":
        ids = np.asarray(batch.negatives)
        neg = np.einsum("td,trd->tr", user, rows) / TAU
        masked = ids == t[:, None]
    else:
        shared = np.asarray(batch.shared_negatives)
        neg = user @ rows.T / TAU
        masked = (shared[None, :] == t[:, None]) | (shared[None, :] == 0)
        if name in ("shared_pool", "mixed_pool"):  # logQ: -log(expected count), from the sampler's definition
            neg = neg - np.asarray(batch.shared_logq, np.float64)[None, :]
    neg = np.where(masked, -5e4, neg)
    logits = np.concatenate([pos[:, None], neg], axis=1)
    m = logits.max(1, keepdims=True)
    nll = np.log(np.exp(logits - m).sum(1)) + m[:, 0] - pos
    return float((nll * w).sum() / max(w.sum(), 1.0))


@pytest.mark.slow
@pytest.mark.parametrize("name,kind,sampler,precision", CASES)
def test_loss_matches_numpy_oracle_forward_and_gradients(backend, name, kind, sampler, precision):
    batch = _batch(kind, 16, sampler=sampler)
    rng = np.random.default_rng(3)
    T = batch.layout.t_cap
    user = _normalise(rng.standard_normal((T, D)))
    items = _normalise(rng.standard_normal((N_ITEMS + 1, D)))
    cfg = LossConfig(name=name, temperature=TAU, num_negatives=16, negatives_precision=precision)
    fn = losses.get(name).fn

    def f(p, b):
        return fn(backend, p["user"], p["items"], b, cfg)

    value, grads = backend.value_and_grad(f)({"user": backend.asarray(user.astype(np.float32)),
                                              "items": backend.asarray(items.astype(np.float32))},
                                             backend.asarray_tree(batch))
    ref = _oracle(name, user, items, batch, precision)
    assert rel_err(backend.to_numpy(value), ref) < FWD_TOL
    if precision != "fp32":
        assert rel_err(backend.to_numpy(value), _oracle(name, user, items, batch)) > 1e-6  # it did round
    # central differences of the float64 oracle along one random direction per input
    for key, x in (("user", user), ("items", items)):
        direction = rng.standard_normal(x.shape)
        h = 1e-6
        if key == "user":
            plus, minus = (_oracle(name, user + s * direction, items, batch, precision) for s in (h, -h))
        else:
            plus, minus = (_oracle(name, user, items, batch, precision, s * direction) for s in (h, -h))
        numeric = (plus - minus) / (2 * h)
        analytic = float((backend.to_numpy(grads[key]).astype(np.float64) * direction).sum())
        assert abs(analytic - numeric) <= 1e-4 * max(abs(numeric), 1.0), (key, analytic, numeric)


@pytest.mark.parametrize("extra_rows", [0, 5000])  # the table scanned once; a large one read by rows
def test_segment_scales_are_each_sequences_largest_negative_value(backend, extra_rows, monkeypatch):
    """One scale per user sequence: the largest |value| over every row its positions read as
    negatives (items of very different sizes per sequence), 1 on padding positions and where
    every row read is zero."""
    monkeypatch.setattr(losses, "SCALE_CHUNK_POSITIONS", 7)                  # several chunks
    batch = _batch("sampled", 5)
    items = np.random.default_rng(1).standard_normal((N_ITEMS + 1 + extra_rows, D)).astype(np.float32)
    items[N_ITEMS + 1:] *= 1000.0                                            # rows nobody reads: never a scale
    ids = np.asarray(batch.negatives).copy()
    offsets = np.asarray(batch.layout.offsets)
    for b, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        ids[s:e] = 10 * b + np.arange(1, 6)          # each sequence its own rows
        items[10 * b + 1: 10 * b + 6] *= 10.0 ** b   # ... of its own size
    items[1:6] = 0.0                                 # the first sequence reads zero rows only
    got = backend.to_numpy(losses.segment_scales(backend, backend.asarray(items), backend.asarray(ids),
                                                 backend.asarray_tree(batch.layout)))
    want = np.ones(len(ids), np.float32)
    for b, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        want[s:e] = np.abs(items[10 * b + 1: 10 * b + 6]).max() or 1.0
    assert len(set(want[offsets[1]:offsets[-1]].tolist())) == np.count_nonzero(np.diff(offsets)) - 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_full_softmax_is_cross_entropy_over_every_item(backend):
    """The catalogue loss is the textbook softmax cross-entropy over ids 1..N (the target counted
    once), computed here without the shared-pool masking it is built from."""
    batch = _batch("catalogue", 0)
    np.testing.assert_array_equal(batch.shared_negatives, np.arange(1, N_ITEMS + 1))
    rng = np.random.default_rng(5)
    user = _normalise(rng.standard_normal((batch.layout.t_cap, D)))
    items = _normalise(rng.standard_normal((N_ITEMS + 1, D)))
    cfg = LossConfig(name="full_softmax", temperature=TAU)
    got = losses.get("full_softmax").fn(backend, backend.asarray(user.astype(np.float32)),
                                        backend.asarray(items.astype(np.float32)), backend.asarray_tree(batch), cfg)
    t, w = np.asarray(batch.targets), np.asarray(batch.weights, np.float64)
    logits = user @ items[1:].T / TAU                                                     # [T, N]
    m = logits.max(1)
    nll = np.log(np.exp(logits - m[:, None]).sum(1)) + m - logits[np.arange(len(t)), np.maximum(t - 1, 0)]
    assert rel_err(backend.to_numpy(got), float((nll * w).sum() / w.sum())) < FWD_TOL


def test_in_batch_negatives_are_targets_of_the_batch():
    batch = _batch("in_batch", 40)
    t = np.asarray(batch.targets)
    shared = np.asarray(batch.shared_negatives)
    assert batch.negatives is None and shared.shape == (40,) and shared.dtype == np.int32
    assert set(shared.tolist()) <= set(t[t > 0].tolist())
    again = _batch("in_batch", 40)
    np.testing.assert_array_equal(shared, again.shared_negatives)  # drawn from the step's generator


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.0])
def test_popularity_pool_draws_from_popularity_to_the_alpha(alpha):
    """The pool's empirical frequencies follow q ~ popularity ** alpha (unseen ids never drawn)
    and shared_logq is log(R q(id)) for each drawn id."""
    R = 200_000
    neg = Negatives("pool", R, "popularity", alpha, POPULARITY)
    ids, logq = neg.draw_pool(np.random.default_rng(0), N_ITEMS)
    w = np.where(POPULARITY > 0, POPULARITY.astype(np.float64) ** alpha, 0.0)
    w[0] = 0.0
    q = w / w.sum()
    freq = np.bincount(ids, minlength=N_ITEMS + 1) / R
    assert freq[q == 0].sum() == 0
    assert np.abs(freq - q).max() < 5 * np.sqrt(q.max() / R)  # 5 standard deviations
    np.testing.assert_allclose(logq, np.log(R * q[ids]), rtol=1e-6)
    uniform_ids, uniform_logq = Negatives("pool", 64).draw_pool(np.random.default_rng(0), N_ITEMS)
    assert uniform_ids.min() >= 1 and uniform_ids.max() <= N_ITEMS
    np.testing.assert_allclose(uniform_logq, np.log(64 / N_ITEMS), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["uniform", "popularity"])
def test_mixed_pool_logq_is_each_ids_expected_count(sampler):
    """The mixed pool (in-batch draws, then the sampler's): over many draws each id's mean count
    in the pool is exp(shared_logq), for ids both parts can draw alike."""
    supervised = np.array([3, 3, 3, 7, 12, 40], dtype=np.int32)
    neg = Negatives("mixed", 6, sampler, 0.5, POPULARITY if sampler == "popularity" else None, batch_count=4)
    rng, counts, trials = np.random.default_rng(0), np.zeros(N_ITEMS + 1), 40_000
    for _ in range(trials):
        ids, logq = neg.draw_mixed(rng, N_ITEMS, supervised)
        counts += np.bincount(ids, minlength=N_ITEMS + 1)
    expected = np.zeros(N_ITEMS + 1)
    expected[ids] = np.exp(logq)                     # the last draw names its ids' expectations
    assert (ids[:4] > 0).all() and set(ids[:4].tolist()) <= set(supervised.tolist())
    for i in set(ids.tolist()):
        sd = np.sqrt(expected[i] / trials)
        assert abs(counts[i] / trials - expected[i]) < 6 * sd + 1e-3, (i, counts[i] / trials, expected[i])


def test_a_pool_sampler_with_a_loss_that_draws_no_pool_is_refused():
    from gr_functional.errors import ConfigError

    cfg = Config(model=CFG, loss=LossConfig(name="sampled_softmax", sampler="popularity"))
    with pytest.raises(ConfigError, match="loss.sampler='popularity'.*shared_pool"):
        losses.negatives_for(cfg, POPULARITY)


def test_sampled_softmax_batches_are_unchanged_by_the_registry():
    """The default loss draws exactly the negatives and masks it drew before losses were a
    registry (make_batch's generator order): resumed and reproduced runs stay bitwise equal."""
    batch = _batch("sampled", 7, seed=4)
    rng = np.random.default_rng(4)
    events = (5, MAX_LEN + 1, 2, 9)
    [rng.integers(1, 12, n) for n in events]
    [np.cumsum(rng.integers(0, 10**5, n)) + 10**9 for n in events]
    real = batch.layout.num_tokens()
    np.testing.assert_array_equal(batch.negatives[:real], rng.integers(1, N_ITEMS + 1, size=(real, 7), dtype=np.int32))


# the wide-negative losses' 16-bit cases are covered per backend by the oracle test above
TRAJECTORY_CASES = [c for c in CASES if not (c[0] in ("full_softmax", "mixed_pool") and c[3] != "fp32")]


@pytest.mark.slow
@pytest.mark.parametrize("name,kind,sampler,precision", TRAJECTORY_CASES)
def test_training_trajectory_with_each_loss_agrees_across_backends(name, kind, sampler, precision):
    from backends import get_backend

    from ..conftest import test_backend_names

    names = test_backend_names()
    if len(names) < 2:
        pytest.skip("GRF_TEST_BACKENDS names one backend: nothing to compare")
    cfg = Config(model=CFG, loss=LossConfig(name=name, temperature=0.05, num_negatives=16,
                                            negatives_precision=precision),
                 optim=OptimConfig(lr=3e-3))
    batches = [_batch(kind, 16, seed=s, sampler=sampler) for s in range(8)]
    curves = {}
    for bname in names:
        B = get_backend(bname)
        step = make_train_step(B, cfg)
        from gr_functional.step import init_opt_state

        params = B.asarray_tree(model.init_params(CFG, seed=0))
        opt = init_opt_state(B, params, cfg)
        curve = []
        for b in batches * 3:
            params, opt, m = step(params, opt, B.asarray_tree(b))
            curve.append(float(m["loss"]))
        curves[bname] = curve
    ref = curves[names[0]]
    assert ref[-1] < ref[0]  # it learns
    for bname in names[1:]:
        assert rel_err(curves[bname], ref) < TRAJ_TOL, (bname, curves[bname][-3:], ref[-3:])
