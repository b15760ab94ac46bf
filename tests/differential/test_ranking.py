"""dlrm_v3's STU layer (gr_functional/ranking/stu.py) on every backend under test: forward vs a
float64 numpy oracle written from the spec (docs/design/dlrm_v3_ranking_spec.md section 3.2), with and
without a dropout mask, and all gradients vs the reference ops in float64."""
from __future__ import annotations

import math

import numpy as np
import pytest

from backends import get_backend
from gr_functional.ranking.stu import init_stu_params, stu_layer

from . import oracle
from .common import (FWD_TOL, GRAD_TOL, LAYOUT_CASES, backends_under_test, grads, make_layout,
                     reference_grad_backend, rel_err)

D, H, DQK, DV, N = 8, 2, 3, 4, 13


def _output_norm_oracle(o, w, b, group_norm):
    """float64 numpy: GR's output norm of ``o[T, H, dv]`` -> ``[T, H dv]`` (``pt_hstu_linear.py``:
    ``F.group_norm(num_groups=H)`` or ``F.layer_norm`` over all H dv values), eps 1e-6, affine."""
    T = o.shape[0]
    if group_norm:
        return (oracle.layer_norm(o) * w[None, :, None] + b[None, :, None]).reshape(T, -1)
    flat = o.reshape(T, -1)
    mean = flat.mean(axis=1, keepdims=True)
    var = ((flat - mean) ** 2).mean(axis=1, keepdims=True)                    # biased, as torch
    return (flat - mean) / np.sqrt(var + 1e-6) * w + b


def _oracle(p, x, offsets, targets, keep, group_norm=True):
    """float64: the layer, token by token, as the spec writes it."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    n = oracle.layer_norm(x) * p["ln_w"] + p["ln_b"]
    uvqk = n @ p["w_uvqk"] + p["b_uvqk"]
    hv, hq = H * DV, H * DQK
    u = oracle.silu(uvqk[:, :hv])
    v = uvqk[:, hv:2 * hv].reshape(-1, H, DV)
    q = uvqk[:, 2 * hv:2 * hv + hq].reshape(-1, H, DQK)
    k = uvqk[:, 2 * hv + hq:].reshape(-1, H, DQK)
    o = oracle.stu_attention(q, k, v, offsets, targets, N, 1 / math.sqrt(DQK))
    g = _output_norm_oracle(o, p["gn_w"], p["gn_b"], group_norm)
    y = np.concatenate([u, o.reshape(-1, hv), u * g], axis=1)
    if keep is not None:
        y = y * keep
    return x + y @ p["w_out"]


def _inputs(case, seed=0, group_norm=True):
    rng = np.random.default_rng(seed)
    layout = make_layout(case)
    p = init_stu_params(D, H, DQK, DV, rng, group_norm)
    G = H if group_norm else H * DV                                  # the output norm's width
    p["ln_w"] = rng.uniform(0.5, 1.5, D).astype(np.float32)        # non-trivial affine parts
    p["ln_b"] = rng.normal(0, 0.1, D).astype(np.float32)
    p["b_uvqk"] = rng.normal(0, 0.1, p["b_uvqk"].shape).astype(np.float32)
    p["gn_w"] = rng.uniform(0.5, 1.5, G).astype(np.float32)
    p["gn_b"] = rng.normal(0, 0.1, G).astype(np.float32)
    x = rng.standard_normal((layout.t_cap, D)).astype(np.float32)
    lengths = np.asarray(layout.lengths)
    targets = np.minimum(np.arange(len(lengths)) % 3 + 1, lengths).astype(np.int32)
    keep = (rng.random((layout.t_cap, 3 * H * DV)) > 0.1).astype(np.float32) / 0.9
    return layout, p, x, targets, keep


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("group_norm", [True, False])
def test_stu_layer_vs_oracle(backend, case, dropout, group_norm):
    layout, p, x, targets, keep = _inputs(case, group_norm=group_norm)
    keep = keep if dropout else None
    out = stu_layer(backend, backend.asarray_tree(p), backend.asarray(x), backend.asarray_tree(layout),
                    backend.asarray(targets), N, H, DQK, None if keep is None else backend.asarray(keep),
                    group_norm=group_norm)
    want = _oracle(p, x.astype(np.float64), np.asarray(layout.offsets), targets, keep, group_norm)
    real = layout.num_tokens()
    assert rel_err(backend.to_numpy(out)[:real], want[:real]) <= FWD_TOL


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixed", "empty_slots"])
@pytest.mark.parametrize("group_norm", [True, False])
def test_stu_layer_gradients(case, group_norm):
    layout, p, x, targets, keep = _inputs(case, seed=1, group_norm=group_norm)
    real = np.zeros((layout.t_cap, 1), np.float32)
    real[:layout.num_tokens()] = 1.0
    cot = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32) * real   # real tokens only
    inputs = {"p": p, "x": x, "layout": layout, "targets": targets, "keep": keep, "cot": cot}

    def f(B, a):
        out = stu_layer(B, a["p"], a["x"], a["layout"], a["targets"], N, H, DQK, a["keep"], group_norm=group_norm)
        return B.xp.sum(out * a["cot"])

    ref = grads(reference_grad_backend(), f, inputs)
    for name in backends_under_test():
        got = grads(get_backend(name), f, inputs)
        assert rel_err(got["x"], ref["x"]) <= GRAD_TOL, name
        for key in p:
            assert rel_err(got["p"][key], ref["p"][key]) <= GRAD_TOL, (name, key)


# ------------------------------------------------------------------ position and time encodings
def test_position_indices_count_back_from_the_newest_history_event():
    from gr_functional.ranking.encoding import position_indices

    # 6 contextual + 4 history + 2 candidates; 6 contextual + 1 history + 0 candidates; a sequence
    # longer than the table (positions clamp to max_pos - 1)
    got = position_indices([12, 7, 30], [2, 0, 1], contextual=6, max_pos=20)
    assert got[:12].tolist() == [0, 1, 2, 3, 4, 5, 10, 9, 8, 7, 6, 6]
    assert got[12:19].tolist() == [0, 1, 2, 3, 4, 5, 7]
    third = got[19:]
    assert third[:6].tolist() == list(range(6)) and third[-1] == 6 and third[-2] == 7
    assert third[6:9].tolist() == [19, 19, 19]                 # 29 - 6 + 6 = 29 -> clamped to 19


def test_time_buckets_follow_gr_float32_sqrt_rule():
    from gr_functional.ranking.encoding import gr_time_bucket_cap, time_buckets

    minute = 60
    # one sequence: ages 0, 1 min, 4 min - 1 s, 4 min, 100 min; its last token is the query time
    t = np.array([10**9 - 100 * minute, 10**9 - 4 * minute, 10**9 - 4 * minute + 1, 10**9 - minute, 10**9, 10**9])
    got = time_buckets(t, [0, 6], cap=gr_time_bucket_cap(512))
    assert got.tolist() == [10, 2, 1, 1, 0, 0]
    # contextual tokens carry time 0: their age is the query time itself -> the cap
    assert time_buckets(np.array([0, 1_651_314_030_792]), [0, 2], cap=511).tolist() == [511, 0]
    assert time_buckets(np.array([5, 3]), [0, 2], cap=511).tolist() == [0, 0]    # newer than the query: 0
    for age in (59, 60, 239, 240, 10**6, 10**9):              # the float32 rule, spelled out
        want = min(int(np.sqrt(np.float32(age) / np.float32(60))), 511)
        assert time_buckets(np.array([0, age]), [0, 2], cap=511)[0] == want


def test_add_position_time_vs_numpy(backend):
    from gr_functional.ranking.encoding import add_position_time

    rng = np.random.default_rng(0)
    tok = rng.standard_normal((5, 4)).astype(np.float32)
    P, Tm = rng.standard_normal((9, 4)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    pos, tau = np.array([0, 3, 8, 3, 1], np.int32), np.array([6, 0, 2, 2, 5], np.int32)
    got = add_position_time(backend, *(backend.asarray(a) for a in (tok, pos, tau, P, Tm)))
    want = tok.astype(np.float64) * 2.0 + P[pos] + Tm[tau]
    assert rel_err(backend.to_numpy(got), want) <= FWD_TOL


# ------------------------------------------------------------------ input tokens
def _ln(x, w, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _tower(p, x):
    p = {k: v.astype(np.float64) for k, v in p.items()}
    h = x @ p["w1"] + p["b1"]
    h = h / (1 + np.exp(-_ln(h, p["sw_w"], p["sw_b"])))                    # x * sigmoid(LN(x))
    return _ln(h @ p["w2"] + p["b2"], p["ln_w"], p["ln_b"])


def _token_inputs(seed=0):
    from gr_functional.ranking.tokens import init_tower

    rng = np.random.default_rng(seed)
    p = {"content": init_tower(6, 5, 8, rng), "action": init_tower(12, 5, 8, rng),
         "bits": rng.standard_normal((4, 3)).astype(np.float32), "target": rng.standard_normal((1, 12)).astype(np.float32),
         "wc": rng.standard_normal((2, 6, 8)).astype(np.float32), "bc": rng.standard_normal((2, 8)).astype(np.float32)}
    for t in ("content", "action"):                                             # non-trivial norms and biases
        for k in ("b1", "sw_b", "b2", "ln_b"):
            p[t][k] = rng.normal(0, 0.2, p[t][k].shape).astype(np.float32)
        for k in ("sw_w", "ln_w"):
            p[t][k] = rng.uniform(0.5, 1.5, p[t][k].shape).astype(np.float32)
    items = rng.standard_normal((7, 6)).astype(np.float32)                      # 3 + 4 item tokens
    bitmask = np.array([0, 1, 6, 15, 9, 0, 0], np.int32)                         # the last two: candidates
    is_cand = np.array([0, 0, 1, 0, 0, 0, 1], np.float32)[:, None]
    ctx = rng.standard_normal((2, 2, 6)).astype(np.float32)
    return p, items, bitmask, is_cand, ctx


def _tokens(B, a):
    from gr_functional.ranking.tokens import action_bits, assemble, contextual_tokens, tower

    acts = action_bits(B, a["p"]["bits"], a["bitmask"], (1, 2, 4, 8))
    acts = acts * (1.0 - a["is_cand"]) + a["p"]["target"] * a["is_cand"]
    items = tower(B, a["p"]["content"], a["items"]) + tower(B, a["p"]["action"], acts)
    ctx = contextual_tokens(B, a["ctx"], a["p"]["wc"], a["p"]["bc"])
    return assemble(B, ctx, items, a["source"])


@pytest.mark.slow
def test_input_tokens_vs_oracle_and_grads(backend):
    from gr_functional.ranking.tokens import assembly_index

    p, items, bitmask, is_cand, ctx = _token_inputs()
    source = assembly_index(2, 2, [3, 4], t_cap=14)
    a = {"p": p, "items": items, "bitmask": bitmask, "is_cand": is_cand, "ctx": ctx, "source": source}
    got = backend.to_numpy(_tokens(backend, backend.asarray_tree(a)))
    # float64 oracle, written out: bits concatenated per action type, candidates read the target
    acts = np.stack([np.concatenate([p["bits"][k] * bool(m & (1 << k)) for k in range(4)]) for m in bitmask])
    acts = np.where(is_cand > 0, p["target"], acts)
    item_tok = _tower(p["content"], items.astype(np.float64)) + _tower(p["action"], acts.astype(np.float64))
    ctx_tok = np.einsum("bse,sed->bsd", ctx.astype(np.float64), p["wc"]) + p["bc"]
    want = np.concatenate([ctx_tok[0], item_tok[:3], ctx_tok[1], item_tok[3:], np.zeros((14 - 11, 8))])
    assert source.tolist()[:11] == [0, 1, 4, 5, 6, 2, 3, 7, 8, 9, 10] and set(source[11:]) == {11}
    assert rel_err(got, want) <= FWD_TOL
    cot = np.random.default_rng(5).standard_normal(want.shape).astype(np.float32)
    inputs = {**a, "cot": cot}
    f = lambda B, x: B.xp.sum(_tokens(B, x) * x["cot"])  # noqa: E731
    ref = grads(reference_grad_backend(), f, inputs)
    for name in backends_under_test():
        got_g = grads(get_backend(name), f, inputs)
        for key in ("bits", "target", "wc", "bc"):
            assert rel_err(got_g["p"][key], ref["p"][key]) <= GRAD_TOL, (name, key)
        for tw in ("content", "action"):
            for key in p[tw]:
                assert rel_err(got_g["p"][tw][key], ref["p"][tw][key]) <= GRAD_TOL, (name, tw, key)
        assert rel_err(got_g["items"], ref["items"]) <= GRAD_TOL and rel_err(got_g["ctx"], ref["ctx"]) <= GRAD_TOL


# ------------------------------------------------------------------ output side
def test_time_features_follow_gr_float32_rule():
    """Against the same operations done by torch as GR's postprocessor does them (int64
    timestamps divided by a float32 period with floor rounding, remainder, 2 * 3.14, polar):
    millisecond timestamps near 1.65e12 are coarse in float32 and must come out the same."""
    import torch

    from gr_functional.ranking.heads import TIME_PERIODS, time_features

    t = np.array([0, 3600, 7 * 3600 + 5, 86400 * 3 + 3600 * 23, 1_651_314_030_792, 1_651_466_607_423, 1_649_000_000_001])
    got = time_features(t)
    ts = torch.tensor(t).unsqueeze(-1)
    unit = torch.tensor([[float(u) for u, _ in TIME_PERIODS]])
    cycle = torch.tensor([[float(c) for _, c in TIME_PERIODS]])
    theta = torch.remainder(torch.div(ts, unit, rounding_mode="floor"), cycle) / cycle * 2 * 3.14
    want = torch.view_as_real(torch.polar(torch.ones_like(theta), theta)).flatten(-2, -1).numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[0].tolist() == [1.0, 0.0, 1.0, 0.0]


def _head_inputs(seed=0):
    from gr_functional.ranking.tokens import init_tower

    rng = np.random.default_rng(seed)
    n, D, K = 6, 8, 3
    p = {"post": {"w": rng.standard_normal((D + 4, D)).astype(np.float32) * 0.3, "b": rng.normal(0, 0.1, D).astype(np.float32),
                  "ln_w": rng.uniform(0.5, 1.5, D).astype(np.float32), "ln_b": rng.normal(0, 0.1, D).astype(np.float32)},
         "item": init_tower(5, D, D, rng),
         "task": {"w1": rng.standard_normal((D, D)).astype(np.float32) * 0.3, "b1": rng.normal(0, 0.1, D).astype(np.float32),
                  "sw_w": rng.uniform(0.5, 1.5, D).astype(np.float32), "sw_b": rng.normal(0, 0.1, D).astype(np.float32),
                  "w2": rng.standard_normal((D, K)).astype(np.float32), "b2": rng.normal(0, 0.1, K).astype(np.float32)}}
    x = rng.standard_normal((n, D)).astype(np.float32)
    emb = rng.standard_normal((n, 5)).astype(np.float32)
    feats = rng.uniform(-1, 1, (n, 4)).astype(np.float32)
    from gr_functional.ranking.heads import task_labels
    labels = task_labels(np.array([0, 1, 3, 4, 7, 2]), (1, 2, 4))
    mask = np.array([1, 1, 1, 1, 1, 0], np.float32)                           # the last: padding
    return {"p": p, "x": x, "emb": emb, "feats": feats, "labels": labels, "mask": mask}


def _head_loss(B, a):
    from gr_functional.ranking.heads import multitask_logits, multitask_loss, postprocess
    from gr_functional.ranking.tokens import tower

    user = postprocess(B, a["p"]["post"], a["x"], a["feats"])
    item = tower(B, a["p"]["item"], a["emb"])
    return multitask_loss(B, multitask_logits(B, a["p"]["task"], user, item), a["labels"], a["mask"])


@pytest.mark.slow
def test_heads_and_multitask_loss_vs_oracle_and_grads(backend):
    a = _head_inputs()
    total, per_task = _head_loss(backend, backend.asarray_tree(a))
    p = {k: {n: v.astype(np.float64) for n, v in d.items()} for k, d in a["p"].items()}
    user = _ln(np.concatenate([a["x"], a["feats"]], 1) @ p["post"]["w"] + p["post"]["b"], p["post"]["ln_w"], p["post"]["ln_b"])
    item = _tower(a["p"]["item"], a["emb"].astype(np.float64))
    h = (user * item) @ p["task"]["w1"] + p["task"]["b1"]
    h = h / (1 + np.exp(-_ln(h, p["task"]["sw_w"], p["task"]["sw_b"])))
    z = h @ p["task"]["w2"] + p["task"]["b2"]
    y = a["labels"]
    bce = np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0) - y * z
    want = 0.2 * (bce[:5]).mean(axis=0)
    assert a["labels"].tolist()[:5] == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 0, 1], [1, 1, 1]]
    assert rel_err(backend.to_numpy(per_task), want) <= FWD_TOL
    assert rel_err(backend.to_numpy(total), want.sum()) <= FWD_TOL
    f = lambda B, x: _head_loss(B, x)[0]  # noqa: E731
    ref = grads(reference_grad_backend(), f, a)
    for name in backends_under_test():
        got = grads(get_backend(name), f, a)
        assert rel_err(got["x"], ref["x"]) <= GRAD_TOL and rel_err(got["emb"], ref["emb"]) <= GRAD_TOL
        for part in a["p"]:
            for key in a["p"][part]:
                assert rel_err(got["p"][part][key], ref["p"][part][key]) <= GRAD_TOL, (name, part, key)


# ------------------------------------------------------------------ the joined model
SMALL = dict(embed_dim=8, dim=12, num_layers=2, heads=2, dqk=3, dv=4, max_seq_len=46, num_candidates=5,
             video_table=97, context_tables=(50, 8, 9, 9, 8, 8), action_dim=2, tower_hidden=6,
             position_buckets=64, time_buckets=32)


@pytest.fixture(scope="module")
def sample_seqs():
    from gr_functional.data.sources import kuairand_ranking as kr
    from gr_functional.data.sources.kuairand import load_kuairand_log
    from gr_functional.data.sources.kuairand_features import load_kuairand_features

    return kr.sequences_from_log(load_kuairand_log(columns=kr.LOG_COLUMNS), load_kuairand_features(kind="user"))


@pytest.mark.slow
def test_ranking_batch_of_the_log_sample(sample_seqs):
    from gr_functional.ranking.model import RankingModelConfig, make_ranking_batch

    cfg = RankingModelConfig(**SMALL)                       # max history 46 - 5 - 6 = 35
    b = make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg)
    counts = np.diff(sample_seqs.offsets)                    # 63, 22, 48, 78 events
    hist = np.minimum(counts - 5, 35)
    assert np.diff(b.layout.offsets).tolist()[:4] == (6 + hist + 5).tolist()
    seq0 = sample_seqs.sequence(0)
    start = 1                                                               # video ids: rows 1..97 of the merged table
    assert b.item_ids[:35].tolist() == (seq0["video_id"][:35] % 97 + start).tolist()  # the OLDEST 35 kept
    assert b.item_ids[35:40].tolist() == (seq0["video_id"][-5:] % 97 + start).tolist()  # the last 5: candidates
    bits = seq0["action_weights"][-5:]
    assert b.labels[:5].tolist() == [[float(m & w > 0) for w in (1, 2, 4, 8, 16, 32, 64, 128)] for m in bits]
    assert b.bitmask[35:40].tolist() == [0] * 5 and b.is_cand[35:40, 0].tolist() == [1.0] * 5
    assert b.cand_rows[:5].tolist() == list(range(6 + 35, 6 + 35 + 5))
    assert b.pos_idx[:6].tolist() == list(range(6)) and b.pos_idx[6] == 6 + 35 and b.pos_idx[6 + 35] == 6
    q = seq0["time_ms"][:35].max()
    assert b.time_idx[6 + 35] == 0 and b.time_idx[0] == cfg.cap                      # candidates: age 0; context: capped
    assert min(int(np.sqrt(np.float32(q - seq0["time_ms"][0]) / np.float32(60))), cfg.cap) == b.time_idx[6]
    assert b.ctx_ids[:, 0].tolist() == [98, 99, 100, 101]                    # user ids 0..3 after the 97 video rows


def test_a_batch_with_a_count_of_candidates_per_user(sample_seqs):
    """GR's model takes a number of candidates per sample (``num_targets``): a batch whose users
    have 5, 2, 4 and 1 candidates scores each user as a batch of that user alone with that many
    candidates would (the same normaliser N; history long enough not to be truncated), padded or
    exact; with ``own_query_times``
    each candidate is aged from its own event time."""
    import dataclasses

    from backends import get_backend
    from gr_functional.ranking.model import RankingModelConfig, init_ranking_params, make_ranking_batch, ranking_logits

    B = get_backend("torch")
    wide = dict(SMALL, max_seq_len=200)
    cfg = RankingModelConfig(**wide)
    params = B.asarray_tree(init_ranking_params(cfg, seed=0))
    counts = [5, 2, 4, 1]

    def logits(batch, c):
        return B.to_numpy(ranking_logits(B, params, B.asarray_tree(batch), c))

    mixed = make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg, num_targets=counts)
    got = logits(mixed, cfg)[:sum(counts)]
    padded = logits(make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg, num_targets=counts, pad=True), cfg)
    owners = np.repeat(np.arange(4), counts)
    for u, c in enumerate(counts):
        alone = dataclasses.replace(cfg, num_candidates=c)
        single = make_ranking_batch(sample_seqs, [u], alone)
        single = dataclasses.replace(single, norm_len=mixed.norm_len)   # GR's N: the batch's longest sequence
        ref = logits(single, alone)[:c]
        np.testing.assert_allclose(got[owners == u], ref, rtol=1e-5, atol=1e-6)
    # padding users and candidates come after the real ones and change nothing
    np.testing.assert_allclose(padded[:sum(counts)], got, rtol=1e-5, atol=1e-6)
    own = make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg, num_targets=counts, own_query_times=True)
    assert not np.array_equal(own.time_idx, mixed.time_idx)
    with pytest.raises(ValueError, match="num_targets"):
        make_ranking_batch(sample_seqs, [0, 1], cfg, num_targets=[6, 1])


@pytest.mark.slow
@pytest.mark.parametrize("group_norm", [False, True])
def test_ranking_model_agrees_across_backends_and_learns(sample_seqs, group_norm):
    """The joined model on the real log sample (with dropout masks): per-task losses and every
    gradient equal across backends, and 8 steps of plain gradient descent lower the loss on both;
    with either output norm (``ranking.group_norm``)."""
    from gr_functional.ranking.model import RankingModelConfig, init_ranking_params, make_ranking_batch, ranking_loss
    from gr_functional.tree import tree_leaves, tree_map

    from ..conftest import test_backend_names

    cfg = RankingModelConfig(**SMALL, group_norm=group_norm)
    batch = make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg, rng=np.random.default_rng(0))
    params = init_ranking_params(cfg, seed=0)
    results = {}
    for name in test_backend_names():
        B = get_backend(name)
        vg = B.value_and_grad(lambda p, b: ranking_loss(B, p, b, cfg), has_aux=True)
        dev = B.asarray_tree(batch)
        (_, per_task), first = vg(B.asarray_tree(params), dev)
        p, curve = B.asarray_tree(params), []
        for _ in range(8):
            (loss, _), g = vg(p, dev)
            curve.append(float(loss))
            p = tree_map(lambda a, d: a - 0.05 * d, p, g)
        results[name] = (B.to_numpy(per_task), B.to_numpy_tree(first), curve)
    names = list(results)
    ref_tasks, ref_grads, ref_curve = results[names[0]]
    assert ref_tasks.shape == (8,) and ref_curve[-1] < ref_curve[0]
    for name in names[1:]:
        tasks, grads_, curve = results[name]
        assert rel_err(tasks, ref_tasks) <= 1e-5
        assert all(rel_err(a, b) <= 1e-4 for a, b in zip(tree_leaves(grads_), tree_leaves(ref_grads)))
        assert rel_err(curve, ref_curve) <= 1e-4


def test_output_norm_shapes_follow_group_norm():
    """``ranking.group_norm``: GR HEAD's LayerNorm over all heads' values (weights ``[H dv]``, the
    default) or 2e81fab's per-head GroupNorm (``[H]``); nothing else changes, not even the other
    parameters' values (the norm's init draws nothing)."""
    from gr_functional.config import RankingConfig
    from gr_functional.ranking.model import RankingModelConfig, init_ranking_params, ranking_param_shapes
    from gr_functional.ranking.stu import stu_param_shapes
    from gr_functional.tree import tree_items

    assert RankingConfig().group_norm is False                                 # GR HEAD db1bf8f's kuairand-1k
    assert stu_param_shapes(12, 2, 3, 4, group_norm=False)["gn_w"] == (8,)
    assert stu_param_shapes(12, 2, 3, 4, group_norm=True)["gn_b"] == (2,)
    out = {}
    for group_norm in (False, True):
        cfg = RankingModelConfig(**SMALL, group_norm=group_norm)
        params = dict(tree_items(init_ranking_params(cfg, seed=0)))
        shapes = ranking_param_shapes(cfg)
        width = cfg.heads if group_norm else cfg.heads * cfg.dv
        for i in range(cfg.num_layers):
            for name in ("gn_w", "gn_b"):
                assert params[f"stu.layer{i}.{name}"].shape == shapes[f"stu.layer{i}.{name}"] == (width,)
            assert np.all(params[f"stu.layer{i}.gn_w"] == 1) and np.all(params[f"stu.layer{i}.gn_b"] == 0)
        out[group_norm] = params
    assert out[False].keys() == out[True].keys()
    for key, value in out[False].items():
        if key.rsplit(".", 1)[-1] not in ("gn_w", "gn_b"):
            np.testing.assert_array_equal(value, out[True][key])


@pytest.mark.slow
def test_group_norm_false_is_one_layer_norm_over_all_heads(backend):
    """``group_norm = false`` on a token whose heads differ in scale: one mean and variance over all
    H dv values (float64 numpy), not one per head; ``true`` is the per-head GroupNorm."""
    from gr_functional.ranking.stu import output_norm

    rng = np.random.default_rng(3)
    o = rng.standard_normal((5, H, DV)) * np.asarray([1.0, 7.0])[None, :, None] + np.asarray([0.0, 3.0])[None, :, None]
    o = o.astype(np.float32)
    for group_norm, width in ((False, H * DV), (True, H)):
        w = rng.uniform(0.5, 1.5, width).astype(np.float32)
        b = rng.normal(0, 0.1, width).astype(np.float32)
        got = backend.to_numpy(output_norm(backend, backend.asarray(o), backend.asarray(w), backend.asarray(b), group_norm))
        want = _output_norm_oracle(o.astype(np.float64), w.astype(np.float64), b.astype(np.float64), group_norm)
        assert got.shape == (5, H * DV)
        assert rel_err(got, want) <= FWD_TOL, group_norm
    flat = o.reshape(5, -1).astype(np.float64)
    ln = (flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-6)
    ones = backend.asarray(np.ones(H * DV, np.float32))
    got = backend.to_numpy(output_norm(backend, backend.asarray(o), ones, ones * 0, False))
    assert rel_err(got, ln) <= FWD_TOL
    per_head = backend.to_numpy(output_norm(backend, backend.asarray(o), backend.asarray(np.ones(H, np.float32)),
                                            backend.asarray(np.zeros(H, np.float32)), True))
    assert np.abs(per_head - got).max() > 0.1                                   # the two norms differ here


def test_item_tower_and_task_head_widths_are_gr_constants():
    """GR hard-codes 512 as the hidden width of the item tower and the task head
    (modules/dlrm_hstu.py:142-146, 234-246), whatever the model width; tools/gr_ranking_crosscheck.py
    copies these shapes into GR's modules."""
    from gr_functional.ranking.model import RankingModelConfig, init_ranking_params

    cfg = RankingModelConfig(**SMALL)
    p = init_ranking_params(cfg)
    assert p["item"]["w1"].shape == (8, 512) and p["item"]["w2"].shape == (512, 12)
    assert p["task"]["w1"].shape == (12, 512) and p["task"]["w2"].shape == (512, 8)
    assert p["content"]["w1"].shape == (8, 6) and p["action"]["w1"].shape == (16, 6)   # tower_hidden=6 here


def test_ranking_config_and_batch_refuse_what_cannot_work(sample_seqs):
    from gr_functional.ranking.model import RankingModelConfig, make_ranking_batch

    with pytest.raises(ValueError, match="time_buckets=4: time buckets reach 11"):
        RankingModelConfig(**{**SMALL, "time_buckets": 4})                     # GR's cap dim - 1 = 11 > 4
    RankingModelConfig(**{**SMALL, "time_buckets": 4, "time_bucket_cap": 4})
    with pytest.raises(ValueError, match="ranking.max_seq_len=11 leaves no history"):
        RankingModelConfig(**{**SMALL, "max_seq_len": 11})
    with pytest.raises(ValueError, match="at least one user"):
        make_ranking_batch(sample_seqs, [], RankingModelConfig(**SMALL))


def test_evaluate_ranking_reports_auc_and_gauc_per_task(sample_seqs):
    """Metrics over batches of users equal the metrics of the logits of one batch of all users."""
    from gr_functional.data.ranking_metrics import auc, gauc
    from gr_functional.ranking.model import (TASKS, RankingModelConfig, evaluate_ranking, init_ranking_params,
                                             make_ranking_batch, ranking_logits)

    B = get_backend("torch")
    cfg = RankingModelConfig(**SMALL)
    params = B.asarray_tree(init_ranking_params(cfg, seed=3))
    got = evaluate_ranking(B, params, sample_seqs, [0, 1, 2, 3], cfg, batch_size=3)
    whole = make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg)
    z = B.to_numpy(ranking_logits(B, params, B.asarray_tree(whole), cfg))
    users = np.repeat(np.asarray(sample_seqs.users), 5)
    assert got["candidates"] == 20 and set(got) == set(TASKS) | {"candidates"}
    for k, task in enumerate(TASKS):
        want = auc(z[:, k], whole.labels[:, k])
        assert (np.isnan(want) and np.isnan(got[task]["auc"])) or abs(got[task]["auc"] - want) <= 1e-6, task
        g, n = gauc(z[:, k], whole.labels[:, k], users)
        assert got[task]["gauc_users"] == n and ((np.isnan(g) and np.isnan(got[task]["gauc"])) or abs(got[task]["gauc"] - g) <= 1e-6)
    assert not np.isnan(got["is_click"]["auc"])                                 # the sample has clicks and non-clicks


def test_merged_tables_are_one_gather_and_change_nothing(sample_seqs):
    """The 7 id features in one physical table (default) or one table each: the same logits and
    per-feature gradients (same initial values); 1 gather per step instead of 7."""
    from gr_functional.ranking.model import (RankingModelConfig, feature_tables, init_ranking_params,
                                             make_ranking_batch, ranking_loss, table_plan)

    B = get_backend("torch")
    out = {}
    for merge in (True, False):
        cfg = RankingModelConfig(**SMALL, merge_tables=merge)
        batch = B.asarray_tree(make_ranking_batch(sample_seqs, [0, 1, 2, 3], cfg))
        params = B.asarray_tree(init_ranking_params(cfg, seed=0))
        (loss, _), g = B.value_and_grad(lambda p, b: ranking_loss(B, p, b, cfg), has_aux=True)(params, batch)
        out[merge] = (len(table_plan(cfg)), float(loss), B.to_numpy_tree(feature_tables(g["tables"], cfg)),
                      B.to_numpy_tree(feature_tables(params["tables"], cfg)))
    assert out[True][0] == 1 and out[False][0] == 7
    assert abs(out[True][1] - out[False][1]) <= 1e-6 * abs(out[False][1])
    from gr_functional.tree import tree_leaves
    for a, b in zip(tree_leaves(out[True][3]), tree_leaves(out[False][3])):
        np.testing.assert_array_equal(a, b)                                   # the same initial rows
    for a, b in zip(tree_leaves(out[True][2]), tree_leaves(out[False][2])):
        assert rel_err(a, b) <= 1e-6
