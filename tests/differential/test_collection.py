"""Merged tables (gr_functional/embedding/collection.py): features of one width share a table with
disjoint id spaces; lookups and gradients equal one table per feature and a float64 numpy
oracle, on every backend; one gather per group instead of per feature."""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional.embedding.collection import EmbeddingCollection, FeatureSpec, feature_rows, group_rows, plan_tables

from .common import FWD_TOL, GRAD_TOL, rel_err

FEATURES = [FeatureSpec("item", 8, "dense", num_ids=50), FeatureSpec("author", 8, "dense", num_ids=20),
            FeatureSpec("category", 4, "dense", num_ids=10), FeatureSpec("tag", 8, "hash", capacity=40),
            FeatureSpec("query", 8, "hash", capacity=30)]


def test_plan_groups_features_by_width_and_kind():
    groups = plan_tables(FEATURES)
    assert [(g.features, g.dim, g.kind, g.rows) for g in groups] == [
        (("item", "author"), 8, "dense", 71), (("category",), 4, "dense", 11), (("tag", "query"), 8, "hash", 71)]
    assert EmbeddingCollection(FEATURES).lookups_per_step == (5, 3)
    assert len(plan_tables(FEATURES, merge=False)) == 5


def test_hash_features_keep_disjoint_id_spaces():
    c = EmbeddingCollection(FEATURES)
    same = np.arange(1, 1000, dtype=np.int64)
    assert not np.intersect1d(c.keys("tag", same), c.keys("query", same)).size
    assert c.keys("tag", np.asarray([0]))[0] == 0


def _ids(rng):
    def draw(n, shape):
        x = rng.integers(1, n + 1, size=shape)
        x[rng.random(shape) < 0.2] = 0  # padding
        return x
    raw = (rng.integers(1, 25, size=(6, 3)) * 7919) ** 2  # raw ids of any size
    return {"item": draw(50, (12,)), "author": draw(20, (12,)), "category": draw(10, (12, 2)),
            "tag": np.where(rng.random((6, 3)) < 0.2, 0, raw), "query": draw(10**9, (5,))}


def _dense_init(rng):
    out = {f.name: rng.standard_normal((f.num_ids + 1, f.dim)).astype(np.float32) for f in FEATURES if f.kind == "dense"}
    for table in out.values():
        table[0] = 0.0  # the padding row
    return out


def _tables(c: EmbeddingCollection, dense: dict) -> dict:
    """Each group's table: dense features' rows at their offsets, hash groups zero (rows get
    their initial values when assigned)."""
    out = {}
    for g in c.groups:
        t = np.zeros((g.rows, g.dim), np.float32)
        for name in g.features:
            if g.kind == "dense":
                t[g.offsets[name] + 1:g.offsets[name] + 1 + FEATURES_BY[name].num_ids] = dense[name][1:]
        out[g.name] = t
    return out


FEATURES_BY = {f.name: f for f in FEATURES}


def _run(B, merge: bool, ids, dense, weights):
    """Per-feature rows and the gradient of sum_f <weights_f, rows_f> per (feature, id)."""
    c = EmbeddingCollection(FEATURES, merge=merge, seed=5)
    lookups, local = c.plan(ids, step=1)
    tables = {k: B.asarray(v) for k, v in _tables(c, dense).items()}
    dev_lookups = {k: B.asarray_tree(v) for k, v in lookups.items()}
    dev_local = {k: B.asarray(v) for k, v in local.items()}

    def loss(slots):
        rows = feature_rows(B, slots, dev_local, c.group_names)
        return sum(B.xp.sum(rows[f] * B.asarray(weights[f])) for f in sorted(rows))

    slots = group_rows(B, tables, dev_lookups)  # one gather per group
    value, grads = B.value_and_grad(loss)(slots)
    rows = {f: B.to_numpy(r) for f, r in feature_rows(B, slots, dev_local, c.group_names).items()}
    # the gradient of each (feature, id): its group row's slot
    per_id = {}
    for f, x in ids.items():
        g = c.group_of[f]
        keys = c.keys(f, np.unique(x[x != 0]))
        uniq = np.unique(np.concatenate([c.keys(n, ids[n]).ravel() for n in g.features]))
        uniq = uniq[uniq != 0]
        slot = np.searchsorted(uniq, keys) + 1
        per_id[f] = B.to_numpy(grads[g.name])[slot]
    return float(value), rows, per_id


@pytest.mark.slow
@pytest.mark.parametrize("merge", [True, False])
def test_merged_lookups_and_gradients_match_the_oracle(backend, merge):
    rng = np.random.default_rng(3)
    ids, dense = _ids(rng), _dense_init(rng)
    weights = {f: rng.standard_normal(x.shape + (FEATURES_BY[f].dim,)).astype(np.float32) for f, x in ids.items()}
    value, rows, per_id = _run(backend, merge, ids, dense, weights)
    from gr_functional.embedding.hashtable import hashed_init

    c = EmbeddingCollection(FEATURES, seed=5)
    want_value = 0.0
    for f, x in ids.items():
        if FEATURES_BY[f].kind == "dense":
            table = dense[f].astype(np.float64)
            want = table[x]
        else:
            keys = c.keys(f, x)
            want = np.where((x == 0)[..., None], 0.0, hashed_init(5, keys.ravel(), FEATURES_BY[f].dim)
                            .reshape(x.shape + (-1,)).astype(np.float64))
        assert rel_err(rows[f], want) <= FWD_TOL, f
        want_value += float(np.sum(want * weights[f]))
        # oracle gradient: the weights summed over the positions holding each id
        uniq = np.unique(x[x != 0])
        g = np.stack([weights[f][x == u].sum(axis=0) for u in uniq]).astype(np.float64)
        assert rel_err(per_id[f], g) <= GRAD_TOL, f
    assert abs(value - want_value) <= 1e-5 * max(1.0, abs(want_value))


def test_merged_equals_separate_tables(backend):
    rng = np.random.default_rng(4)
    ids, dense = _ids(rng), _dense_init(rng)
    weights = {f: rng.standard_normal(x.shape + (FEATURES_BY[f].dim,)).astype(np.float32) for f, x in ids.items()}
    a = _run(backend, True, ids, dense, weights)
    b = _run(backend, False, ids, dense, weights)
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    for f in ids:
        assert np.array_equal(a[1][f], b[1][f]) and rel_err(a[2][f], b[2][f]) <= GRAD_TOL
