import numpy as np
import pytest

from gr_functional.batch import Negatives
from gr_functional.config import ModelConfig
from gr_functional.data import DataError, SequenceData, TrainLoader, eval_batches, iter_eval, leave_one_out, make_synthetic
from gr_functional.jagged import round_up_capacity

CFG = ModelConfig(max_len=20, embed_dim=8, num_blocks=1, num_heads=1, dqk=8, dv=8)
NEGATIVES = Negatives("sampled", 4)


@pytest.fixture(scope="module")
def split():
    return leave_one_out(make_synthetic(num_users=150, num_items=200, max_events=60, seed=3))


def _check_batch(batch, users, data, loader):
    """Jagged invariants plus: the batch holds exactly these users' (truncated) training inputs."""
    tok = batch.tokens
    offsets = np.asarray(tok.offsets)
    assert tok.b_cap == loader.batch_size
    assert offsets[0] == 0 and (np.diff(offsets) >= 0).all()
    n_tokens = int(loader.tokens[users].sum())
    assert tok.num_tokens() == offsets[-1] == n_tokens
    assert tok.t_cap == round_up_capacity(n_tokens)
    assert (np.asarray(tok.seq_id)[n_tokens:] == tok.b_cap).all()
    assert (np.asarray(tok.values)[n_tokens:] == 0).all()
    assert (np.asarray(batch.targets)[n_tokens:] == 0).all() and (np.asarray(batch.targets)[:n_tokens] > 0).all()
    assert batch.negatives.shape == (tok.t_cap, loader.negatives.count)
    assert (batch.negatives[:n_tokens] >= 1).all() and (batch.negatives[:n_tokens] <= data.num_items).all()
    assert (batch.negatives[n_tokens:] == 0).all()
    assert tok.lengths.max() <= CFG.max_len
    seqs = tok.to_sequences()
    for b, u in enumerate(users):
        items, _ = data.sequence(int(u))
        np.testing.assert_array_equal(seqs[b], items[:-1][-CFG.max_len:])
    assert all(len(s) == 0 for s in seqs[len(users):])


def test_every_user_once_per_epoch(split):
    data = split.train
    loader = TrainLoader(data, CFG, batch_size=32, seed=7, negatives=NEGATIVES)
    assert loader.num_items == data.num_items
    assert loader.steps_per_epoch == -(-len(data) // 32)
    for epoch in range(2):
        plan = loader.plan(epoch)
        assert [len(p) for p in plan[:-1]] == [32] * (len(plan) - 1)
        assert 1 <= len(plan[-1]) <= 32  # the last partial batch is kept
        np.testing.assert_array_equal(np.sort(np.concatenate(plan)), np.arange(len(data)))
        batches = list(loader.epoch(epoch))
        assert len(batches) == len(plan)
        for batch, users in zip(batches, plan):
            _check_batch(batch, users, data, loader)
    assert not np.array_equal(loader.plan(0)[0], loader.plan(1)[0])  # reshuffled each epoch


def test_deterministic(split):
    a = TrainLoader(split.train, CFG, 32, seed=7, negatives=NEGATIVES).batch(1, 2)
    b = TrainLoader(split.train, CFG, 32, seed=7, negatives=NEGATIVES).batch(1, 2)
    c = TrainLoader(split.train, CFG, 32, seed=8, negatives=NEGATIVES).batch(1, 2)
    np.testing.assert_array_equal(a.negatives, b.negatives)
    np.testing.assert_array_equal(a.input_keep, b.input_keep)
    np.testing.assert_array_equal(a.tokens.values, b.tokens.values)
    assert not np.array_equal(a.negatives[:10], c.negatives[:10])


def test_resume_mid_epoch_and_at_epoch_end(split):
    full = TrainLoader(split.train, CFG, 32, seed=7, negatives=NEGATIVES)
    reference = list(full.epoch(0)) + list(full.epoch(1))

    first = TrainLoader(split.train, CFG, 32, seed=7, negatives=NEGATIVES)
    seen = []
    for i, batch in enumerate(first):
        seen.append(batch)
        if i == 1:
            break
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (0, 2)

    resumed = TrainLoader(split.train, CFG, 32, seed=7, negatives=NEGATIVES)
    resumed.load_state_dict(state)
    seen += list(resumed)                      # rest of epoch 0
    assert resumed.position == (1, 0)          # next batch: first of epoch 1
    seen += list(resumed)                      # epoch 1
    assert len(seen) == len(reference)
    for got, want in zip(seen, reference):
        np.testing.assert_array_equal(got.tokens.values, want.tokens.values)
        np.testing.assert_array_equal(got.negatives, want.negatives)

    with pytest.raises(DataError, match="seed=7"):
        TrainLoader(split.train, CFG, 32, seed=9, negatives=NEGATIVES).load_state_dict(state)


def test_token_budget(split):
    data = split.train
    loader = TrainLoader(data, CFG, batch_size=16, seed=1, max_tokens=120, negatives=NEGATIVES)
    plan = loader.plan(0)
    np.testing.assert_array_equal(np.sort(np.concatenate(plan)), np.arange(len(data)))
    for users in plan:
        assert 1 <= len(users) <= 16
        assert loader.tokens[users].sum() <= 120
    # Greedy: a batch closes only when the next user would not fit (or batch_size is reached).
    for users, nxt in zip(plan[:-1], plan[1:]):
        assert len(users) == 16 or loader.tokens[users].sum() + loader.tokens[nxt[0]] > 120
    for batch, users in zip(loader.epoch(0), plan):
        _check_batch(batch, users, data, loader)
    assert loader.steps_per_epoch == len(plan)
    with pytest.raises(DataError, match="max_tokens=10"):
        TrainLoader(data, CFG, 16, seed=1, max_tokens=10, negatives=NEGATIVES)


def test_rejects_users_without_a_target():
    data = SequenceData(np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.int64),
                        np.array([0, 2, 3], np.int64), np.array([5, 6], np.int64), num_items=3)
    with pytest.raises(DataError, match=r"user row 1 \(id 6\) has 1 event\(s\); training needs >= 2"):
        TrainLoader(data, CFG, 8, seed=0, negatives=NEGATIVES)


def test_eval_batches(split):
    test = split.test
    histories, times = test.history.sequences()
    got = list(eval_batches(histories, times, test.targets, test.target_times, CFG, batch_size=64))
    assert [len(t) for _, t, _ in got] == [64, 64, len(test) - 128]
    start = 0
    for batch, targets, exclude in got:
        tok = batch.tokens
        assert tok.b_cap == 64 and batch.negatives is None
        np.testing.assert_array_equal(targets, test.targets[start:start + len(targets)])
        seqs = tok.to_sequences()
        q = np.asarray(batch.query_ts)
        ts = np.asarray(batch.ts)
        last = np.asarray(tok.last_index)
        origin = min(int(t[-CFG.max_len:].min()) for t in times[start:start + len(targets)])
        for b in range(len(targets)):
            h = histories[start + b]
            np.testing.assert_array_equal(seqs[b], h[-CFG.max_len:])
            np.testing.assert_array_equal(exclude[b], h[-CFG.max_len:])
            # The last position is queried at the held-out item's time.
            assert q[last[b]] + origin == test.target_times[start + b]
            assert ts[last[b]] + origin == times[start + b][-1]
        start += len(targets)
    again = list(iter_eval(test, CFG, 64))
    np.testing.assert_array_equal(again[1][0].tokens.values, got[1][0].tokens.values)
    # EvalSet form (what the runner calls), with max_users.
    head = list(iter_eval(test, CFG, 64, max_users=70))
    assert [len(t) for _, t, _ in head] == [64, 6]
    np.testing.assert_array_equal(head[1][0].tokens.values[:5], got[1][0].tokens.values[:5])
    np.testing.assert_array_equal(head[1][1], test.targets[64:70])


def test_from_config(split):
    from gr_functional.config import Config, replace
    cfg = replace(Config(), model={"max_len": 20}, loss={"num_negatives": 4}, train={"batch_size": 16, "seed": 5})
    loader = TrainLoader.from_config(split.train, cfg)
    assert (loader.batch_size, loader.seed, loader.max_tokens) == (16, 5, 0)
    assert loader.num_items == split.train.num_items
