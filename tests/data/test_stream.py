"""The KuaiRand-27K-shaped stream: the real lengths, random-access windows, raw 60-bit ids that a
hash table trains on (ids stay int64 in the batch until the step localises them)."""
from __future__ import annotations

import numpy as np

from gr_functional.data.stream import KuaiRandStream


def test_the_stream_has_the_real_shape_and_is_random_access():
    s = KuaiRandStream(window=255)
    assert len(s.lengths) == 27_285 and s.num_events == 322_278_385
    assert len(s) == int((-(-(s.lengths - 1) // 255)).sum())
    k = int(s.order(0)[7])
    ids, times = s.window_events(k)
    again, again_t = s.window_events(k)
    assert np.array_equal(ids, again) and np.array_equal(times, again_t)
    assert ids.dtype == np.int64 and ids.min() > 0 and ids.max() >= 2**31  # raw ids beyond int32
    assert np.all(np.diff(times) > 0) and 2 <= len(ids) <= 256
    assert not np.array_equal(s.order(0), s.order(1))


def test_a_hash_table_trains_on_stream_batches():
    import gr_functional as grf
    from gr_functional.batch import Negatives, make_batch
    import dataclasses

    from gr_functional.embedding.lookup import localize_histories, make_host, table_params
    from gr_functional.model import init_params
    from gr_functional.step import init_opt_state, make_train_step

    cfg = grf.load_config(None, ["model.num_items=1", "model.embed_dim=16", "model.dqk=8", "model.dv=8",
                                 "model.max_len=32", "model.num_blocks=1", "embedding.kind=hash",
                                 "embedding.optimizer=rowwise_adagrad", "embedding.capacity=3000",
                                 "loss.name=in_batch", "loss.num_negatives=64", "optim.lr=0.05"])
    stream = KuaiRandStream(lengths=np.full(40, 500), window=32, num_items=100_000)
    host = make_host(cfg)
    from backends import get_backend

    B = get_backend("torch")
    params = B.asarray_tree(table_params(init_params(cfg.model, seed=0), host))
    opt_state = init_opt_state(B, params, cfg)
    step_fn = make_train_step(B, cfg)
    rng = np.random.default_rng(0)
    losses = []
    for step, (hist, times) in enumerate(stream.batches(0, 16), start=1):
        if step > 12:
            break
        local, ids, refs = localize_histories(hist)          # raw 60-bit ids never enter the batch
        batch = make_batch(local, times, cfg.model, rng=rng, num_items=len(ids), negatives=Negatives("in_batch", 64))
        lookup, _ = host.plan(ids, refs, step)
        batch = dataclasses.replace(batch, lookup=lookup)
        params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
        assert bool(m["finite"])
        losses.append(float(m["loss"]))
    c = host.counters()
    assert c["occupancy"] == 3000 and c["evictions"] > 0   # bounded by the capacity, not the id range
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
