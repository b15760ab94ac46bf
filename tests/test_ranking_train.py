"""``grf train`` with ``model.task = "ranking"`` (gr_functional/ranking/task.py): the preset's
data generator and chronological split, the loader, the output files with per-task AUC / GAUC, a
SIGKILLed run resuming bitwise, the GR-processed-file dataset and the refusals by name."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gr_functional.checkpoint import CheckpointDir, read_checkpoint
from gr_functional.config import ConfigError
from gr_functional.configure import load_config
from gr_functional.data.sources.kuairand_ranking import ACTION_BITS, write_gr_processed

# the KuaiRand side features and the 27K lengths (its stream), read by grf train subprocesses
pytestmark = pytest.mark.data("kuairand-user-features", "kuairand-video-features", "kuairand-27k-lengths")
from gr_functional.data.sources.kuairand_ranking_synthetic import ACTION_RATES, synthetic_ranking
from gr_functional.ranking.data import RankingLoader, chronological_split
from gr_functional.ranking.model import TASKS, init_ranking_params, ranking_param_shapes
from gr_functional.tree import tree_items

from .reliability.common import ROOT, metrics, sets, subprocess_env

PRESET = ROOT / "experiments" / "configs" / "kuairand_rank.toml"
# 24 users x 60 events, windows of 10 candidates: 3 training samples per user, 72 in all; batch 16 -> 5 steps/epoch
TINY = ["data.synthetic_users=24", "data.synthetic_items=300", "data.synthetic_max_events=60",
        "ranking.embed_dim=8", "ranking.dim=16", "ranking.num_layers=1", "ranking.heads=2", "ranking.dqk=4",
        "ranking.dv=4", "ranking.max_seq_len=40", "ranking.video_table=300", "ranking.context_tables=[24, 8, 9, 9, 8, 8]",
        "ranking.tower_hidden=8", "ranking.item_hidden=8", "ranking.task_hidden=8", "ranking.position_buckets=64",
        "ranking.time_buckets=16", "train.epochs=3", "train.batch_size=16", "train.log_every=1", "eval.batch_size=8",
        "train.checkpoint_every=3", "train.keep_checkpoints=0"]


def _command(out, *extra):
    return [sys.executable, "-m", "gr_functional.cli", "train", "--config", str(PRESET), "--quiet", "--out", str(out),
            *sets(TINY + list(extra))]


def _run(out, *extra, timeout=600):
    return subprocess.run(_command(out, *extra), cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranking") / "run"
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_the_generator_matches_its_rates_and_is_deterministic():
    seqs = synthetic_ranking(num_users=300, num_items=2000, max_events=200, seed=3)
    again = synthetic_ranking(num_users=300, num_items=2000, max_events=200, seed=3)
    for name in seqs.columns:
        assert np.array_equal(seqs.columns[name], again.columns[name])
    bits = seqs.columns["action_weights"]
    n = len(bits)
    for name, bit in ACTION_BITS:                      # within 4 binomial standard errors of the target
        rate = np.count_nonzero(bits & bit) / n
        target = ACTION_RATES[name]
        assert abs(rate - target) < 4 * np.sqrt(target * (1 - target) / n) + 1e-4, (name, rate, target)
    lengths = np.diff(seqs.offsets)
    assert lengths.min() >= 31 and lengths.max() <= 200
    long_view = (bits & 64) > 0                        # KuaiRand's rule: play >= min(duration, 18 s)
    need = np.minimum(seqs.columns["duration_ms"], 18000)
    assert np.array_equal(long_view, seqs.columns["play_time_ms"] >= need)
    for u in range(len(seqs.users)):                   # time moves forward within a user
        assert (np.diff(seqs.sequence(u)["time_ms"]) >= 0).all()
    assert all(seqs.context[c].min() >= 1 for c in seqs.context)   # GR's 1-based category codes


@pytest.mark.slow
def test_chronological_split_windows():
    seqs = synthetic_ranking(num_users=5, num_items=100, max_events=60, seed=0)
    splits = chronological_split(seqs, 10)
    n = np.diff(seqs.offsets)
    assert splits.test.ends.tolist() == n.tolist() and splits.valid.ends.tolist() == (n - 10).tolist()
    for u in range(5):
        ends = sorted(splits.train.ends[splits.train.users == u].tolist())
        # disjoint windows of 10 below the validation candidates, each after >= 1 history event
        assert ends == list(range(n[u] - 20, 10, -10))[::-1]
    from gr_functional.errors import DataError
    with pytest.raises(DataError, match="needs 3 x ranking.num_candidates \\+ 1 = 61") as short:
        chronological_split(seqs, 20)
    assert "data.split='temporal'" in str(short.value)  # round 4: it said "drop them", naming no way


def test_prefetched_batches_are_the_synchronous_ones():
    cfg = load_config(PRESET, TINY)
    seqs = synthetic_ranking(24, 300, 60, seed=0)
    samples = chronological_split(seqs, 10).train
    a = list(RankingLoader(seqs, samples, cfg.ranking, 16, 7).epoch(1, 0, prefetch=0))
    loader = RankingLoader(seqs, samples, cfg.ranking, 16, 7)
    b = list(loader.epoch(1, 2, prefetch=2))
    assert loader.position == (2, 0) and len(a) == 5 and len(b) == 3
    for x, y in zip(a[2:], b):
        for (k, u), (_, v) in zip(tree_items(x.__dict__), tree_items(y.__dict__)):
            assert np.array_equal(np.asarray(u), np.asarray(v)), k


def test_param_shapes_without_allocating_tables():
    cfg = load_config(PRESET, TINY).ranking
    assert ranking_param_shapes(cfg) == {k: np.shape(v) for k, v in tree_items(init_ranking_params(cfg))}


@pytest.mark.slow
def test_ranking_run_reports_auc_and_gauc_per_task(reference):
    result = json.loads((reference / "eval.json").read_text())
    assert result["task"] == "ranking" and result["selected_by"] == "best valid is_click/auc"
    for task in TASKS:
        for key in ("auc", "gauc", "ne"):
            assert f"{task}/{key}" in result
    assert 0.0 < result["is_click/auc"] < 1.0 and result["candidates"] == 240
    lines = metrics(reference)
    evals = [m for m in lines if m["kind"] == "eval"]
    assert [(m["epoch"], m["split"]) for m in evals] == [(e, s) for e in range(3) for s in ("valid", "test")]
    assert [m["step"] for m in lines if m["kind"] == "train"] == list(range(1, 16))
    assert (reference / "curves.png").exists() and (reference / "config.toml").exists()


def test_token_budget_batches():
    """train.max_tokens: each batch holds consecutive samples of the epoch's permutation up to the
    budget (tokens as make_ranking_batch lays them out) and at most batch_size; every sample once
    per epoch; the epoch's batches depend on the epoch; a budget below one sample is refused."""
    from gr_functional.errors import DataError

    cfg = load_config(PRESET, TINY)
    seqs = synthetic_ranking(24, 300, 60, seed=0)
    samples = chronological_split(seqs, 10).train
    budget = 120
    plans = []
    for epoch in (0, 1):
        loader = RankingLoader(seqs, samples, cfg.ranking, 16, 7, max_tokens=budget)
        batches = list(loader.epoch(epoch))
        plan = loader.plan(epoch)
        assert len(batches) == len(plan) and loader.position == (epoch + 1, 0)
        assert sorted(np.concatenate(plan).tolist()) == list(range(len(samples)))
        for pick, batch in zip(plan, batches):
            assert batch.layout.num_tokens() == int(loader.tokens[pick].sum()) <= budget and len(pick) <= 16
        order = np.concatenate(plan)
        for pick, nxt in zip(plan[:-1], plan[1:]):                # greedy: the next sample did not fit
            assert int(loader.tokens[pick].sum() + loader.tokens[nxt[0]]) > budget or len(pick) == 16
        plans.append(order)
    assert not np.array_equal(plans[0], plans[1])
    with pytest.raises(DataError, match="train.max_tokens=30 is smaller than one training sample"):
        RankingLoader(seqs, samples, cfg.ranking, 16, 7, max_tokens=30)


def _reference_and_resumed(tmp_path, monkeypatch, extra: list) -> tuple:
    """``(ref, out)``: a run of the tiny preset with ``extra`` overrides, and the same run SIGKILLed
    after step 7 (mid-epoch) and resumed; asserts the resume wrote the same metrics.jsonl bytes."""
    from tests.reliability import test_resume

    ref, out = tmp_path / "ref", tmp_path / "run"
    proc = _run(ref, *extra)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setattr(test_resume, "grf_command", lambda out, *more: _command(out, *extra, *more))
    test_resume._run_until_fault(out, "after-step@7")
    proc = _run(out, *extra)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    return ref, out


@pytest.mark.slow
def test_a_token_budget_run_resumes_bitwise(tmp_path, monkeypatch):
    """grf train with train.max_tokens (a different number of batches per epoch) and
    train.accumulate = 2, SIGKILLed mid-epoch, resumes to the same metrics.jsonl bytes."""
    ref, _ = _reference_and_resumed(tmp_path, monkeypatch, ["train.max_tokens=120", "train.accumulate=2"])
    steps = [m for m in metrics(ref) if m["kind"] == "train"]
    assert len(steps) > 9 and max(m["tokens"] for m in steps) <= 240


@pytest.mark.slow
def test_sigkilled_ranking_run_resumes_bitwise(reference, tmp_path, monkeypatch):
    from tests.reliability import test_resume

    out = tmp_path / "run"
    monkeypatch.setattr(test_resume, "grf_command", lambda out, *extra: _command(out, *extra))
    test_resume._run_until_fault(out, "after-step@7")        # mid-epoch 1, one step after checkpoint 6
    assert CheckpointDir(out / "checkpoints").steps()[0][0] == 6
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr and "step-00000006.safetensors" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    ck, ref = (read_checkpoint(CheckpointDir(o / "checkpoints").steps()[0][1]) for o in (out, reference))
    assert ck.step == ref.step == 15
    for (k, a), (_, b) in zip(tree_items({"p": ck.params, "o": ck.opt_state}),
                              tree_items({"p": ref.params, "o": ref.opt_state})):
        assert np.array_equal(a, b), k


@pytest.mark.slow
def test_gr_processed_file_trains(tmp_path):
    path = tmp_path / "processed_seqs.csv"
    write_gr_processed(synthetic_ranking(24, 300, 60, seed=0), path)
    proc = _run(tmp_path / "run", "data.dataset=kuairand-rank-gr", f"data.path={json.dumps(str(path))}",
                "train.epochs=1", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["candidates"] == 240


@pytest.mark.parametrize("overrides, key", [
    (["embedding.sharding=row", "embedding.optimizer=lazy_adam"], "embedding.sharding"),
    (["embedding.optimizer=lazy_adam"], "embedding.optimizer"),                  # a dense table, row-sparse
    (["embedding.kind=hash", "embedding.optimizer=lazy_adam", "ranking.merge_tables=false"], "ranking.merge_tables"),
    (["data.dataset=ml-1m"], "data.dataset")])
def test_what_ranking_does_not_do_yet_is_refused_by_name(overrides, key):
    with pytest.raises(ConfigError, match=f"{key}=.*(model.task='ranking'|hash)"):
        load_config(PRESET, TINY + overrides)


@pytest.mark.slow
def test_ranking_steps_agree_between_torch_and_jax():
    """Three training steps of the preset's (tiny) model from the same init and batches, as
    ``grf train`` builds them (JAX's padded to capacities, ``Backend.static_shapes``): the torch
    and JAX trajectories agree (losses and every parameter) to float32 noise."""
    from gr_functional.ranking.task import make_ranking_step
    from gr_functional.runtime import make_backend
    from gr_functional.config import replace
    from gr_functional.step import init_opt_state

    cfg = load_config(PRESET, TINY)
    seqs = synthetic_ranking(24, 300, 60, seed=0, min_events=31)
    loader = RankingLoader(seqs, chronological_split(seqs, 10).train, cfg.ranking, 16, 7)
    runs = {}
    for name in ("torch", "jax"):
        B = make_backend(replace(cfg, backend={"name": name}))
        batches = list(loader.epoch(0, pad=B.static_shapes))[:3]
        params = B.asarray_tree(init_ranking_params(cfg.ranking, seed=1))
        opt = init_opt_state(B, params, cfg)
        step, losses = make_ranking_step(B, cfg), []
        for batch in batches:
            params, opt, m = step(params, opt, B.asarray_tree(batch))
            losses.append(float(m["loss"]))
            assert bool(m["finite"])
        runs[name] = losses, B.to_numpy_tree(params)
    np.testing.assert_allclose(runs["torch"][0], runs["jax"][0], rtol=1e-5)
    for (k, a), (_, b) in zip(tree_items(runs["torch"][1]), tree_items(runs["jax"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5, err_msg=k)


@pytest.mark.slow
def test_grf_eval_and_report_read_a_ranking_run(reference):
    from gr_functional import report

    proc = subprocess.run([sys.executable, "-m", "gr_functional.cli", "eval", "--checkpoint",
                           str(reference / "checkpoints" / "last.safetensors"), "--out", str(reference / "e.json")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    again = json.loads((reference / "e.json").read_text())
    last = json.loads((reference / "eval.json").read_text())["last_epoch_test"]
    assert {k: again[k] for k in last} == last              # the final checkpoint re-evaluated: the same numbers
    run = report.load_run(reference)
    evals = {e["epoch"]: e for e in run.evals}
    best = max(evals, key=lambda e: evals[e]["valid"]["is_click/auc"])
    assert run.selected()["epoch"] == best
    assert report.default_metrics([run])[:2] == ["is_click/auc", "is_click/gauc"]
    assert "is_click/auc" in report.summary_table([run], report.default_metrics([run]))


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["torch", "jax"])
def test_hash_tables_compute_what_the_dense_tables_do(backend_name):
    """ranking/sparse.py: a batch rewritten to local ids over the step's hash rows, rows holding
    the dense table's values, gives the dense model's loss, the same gradient of every dense
    parameter, and per looked-up row the dense table's gradient at that id's row."""
    from gr_functional.ranking import sparse
    from gr_functional.ranking.model import ranking_loss, table_plan
    from gr_functional.ranking.task import make_host
    from gr_functional.runtime import make_backend
    from gr_functional.step import TABLE, local_params

    cfg = load_config(PRESET, TINY + ["embedding.kind=hash", "embedding.optimizer=lazy_adam",
                                      "embedding.capacity=4000", f"backend.name={backend_name}"])
    B = make_backend(cfg)
    mc = cfg.ranking
    seqs = synthetic_ranking(24, 300, 60, seed=0, min_events=31)
    batch = next(RankingLoader(seqs, chronological_split(seqs, 10).train, mc, 16, 7).epoch(0))
    dense = init_ranking_params(mc, seed=1)
    (group,) = table_plan(mc)
    host = make_host(cfg)
    sparse.prepare(host, [batch], 1)                            # inserts every key
    (local,), stats = sparse.prepare(host, [batch], 2)          # now all hits: rows read the table
    assert not np.asarray(local.lookup.fresh).any() and stats.unique < stats.ids
    hashed = {k: v for k, v in dense.items() if k != "tables"}
    keys = np.unique(np.concatenate([np.ravel(a) for a in sparse.batch_keys(batch)]))
    table = np.zeros((host.rows, mc.embed_dim), np.float32)
    n = len(keys)                                               # the lookup's rows are padded past 1 + n
    table[np.asarray(local.lookup.rows)[1:1 + n]] = dense["tables"][group.name][keys]
    hashed[TABLE] = table

    def dense_loss(p, b):
        return ranking_loss(B, p, b, mc)[0]

    def hash_loss(view, b):
        return ranking_loss(B, sparse.model_params(view, mc), b, mc)[0]

    ld, gd = B.value_and_grad(dense_loss)(B.asarray_tree(dense), B.asarray_tree(batch))
    params = B.asarray_tree(hashed)
    dev = B.asarray_tree(local)
    view = local_params(B, params, dev.lookup)
    lh, gh = B.value_and_grad(hash_loss)(view, dev)
    np.testing.assert_allclose(float(lh), float(ld), rtol=1e-6)
    gd, gh = B.to_numpy_tree(gd), B.to_numpy_tree(gh)
    for (k, a), (_, b) in zip(tree_items({k: v for k, v in gd.items() if k != "tables"}),
                              tree_items({k: v for k, v in gh.items() if k != TABLE})):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(gh[TABLE][1:1 + n], gd["tables"][group.name][keys], rtol=1e-5, atol=1e-7)
    assert np.abs(gh[TABLE][1:1 + n]).sum() > 0 and not gh[TABLE][1 + n:].any()


HASHED = ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.capacity=150", "embedding.lr=0.001"]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [2])
def test_hashed_ranking_run_evicts_and_resumes_bitwise(tmp_path, monkeypatch, staleness):
    """A hash table far below the keys (150 rows for ~235 keys): it fills and evicts (counters in
    metrics.jsonl), and a run SIGKILLed mid-epoch resumes to the same bytes, table state and the
    two pending row updates of embedding.staleness = 2 included (staleness 0's resume is the same
    path with no pending updates; the row-sparse resume without staleness is tested for retrieval)."""
    ref, out = _reference_and_resumed(tmp_path, monkeypatch, [*HASHED, f"embedding.staleness={staleness}"])
    last = [m for m in metrics(ref) if m["kind"] == "train"][-1]["embedding"]["table"]
    assert last["occupancy"] == 150 and last["evictions"] > 0
    ck, want = (read_checkpoint(CheckpointDir(o / "checkpoints").steps()[0][1]) for o in (out, ref))
    assert len(ck.opt_state.get("pending", [])) == staleness
    for (k, a), (_, b) in zip(tree_items({"p": ck.params, "o": ck.opt_state, "h": ck.host}),
                              tree_items({"p": want.params, "o": want.opt_state, "h": want.host})):
        assert np.array_equal(a, b), k


@pytest.mark.slow
def test_the_27k_ranking_stream_is_real_where_it_can_be():
    """Lengths and per-user click rates are KuaiRand-27K's, context rows the official users'; a
    user's events are a pure function of (seed, user); nothing is materialised."""
    from gr_functional.data.sources.kuairand_features import load_kuairand_features
    from gr_functional.data.sources.kuairand_ranking import appearance_codes
    from gr_functional.data.sources.kuairand_ranking_stream import KuaiRandRankingStream, user_stats

    lengths, ctr = user_stats()
    assert len(lengths) == 27_285 and int(lengths.sum()) == 322_278_385
    s = KuaiRandRankingStream(num_users=400, seed=5)
    assert s.lengths.tolist() == lengths[:400].tolist() and s.offsets[-1] == lengths[:400].sum()
    feats = load_kuairand_features(kind="user")
    for c in s.context:
        assert s.context[c].tolist() == appearance_codes(feats.categorical[c][0])[:400].tolist()
    a = s.sequence(7)
    again = KuaiRandRankingStream(num_users=400, seed=5).sequence(7)
    assert all(np.array_equal(a[k], again[k]) for k in a) and len(a["video_id"]) == lengths[7]
    assert 1 <= a["video_id"].min() and a["video_id"].max() <= 32_038_725
    rates = np.asarray([np.mean(s.sequence(u)["action_weights"] & 1) for u in range(0, 400, 4)])
    err = rates - ctr[:400:4]
    assert abs(err.mean()) < 0.01 and np.abs(err).max() < 0.2      # each user's click rate tracks its real one


@pytest.mark.slow
def test_ranking_trains_on_the_27k_stream_with_hash_tables(tmp_path):
    proc = _run(tmp_path / "run", "data.dataset=kuairand-rank-stream", "data.synthetic_users=24",
                "data.synthetic_max_events=60", "ranking.video_table=40000000", *HASHED[:2],
                "embedding.capacity=2000", "train.epochs=1", "train.max_steps=3")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["candidates"] == 240 and result["steps"] == 3


def test_a_ranking_dataset_without_the_ranking_task_says_so():
    with pytest.raises(ConfigError, match="data.dataset='kuairand-rank-synthetic': is a ranking dataset, but "
                                          r"model.task='retrieval' .*\(or set model.task='ranking'\)"):
        load_config(None, ["data.dataset=kuairand-rank-synthetic"])



def test_a_run_from_before_group_norm_keeps_its_per_head_group_norm(tmp_path):
    """``ranking.group_norm`` (GR HEAD's LayerNorm over heads x dv by default) came after runs were
    written with the per-head GroupNorm: their stored configs (a checkpoint's, OUT/config.toml) lack
    the key and read as ``true`` (``config.ADDED_KEYS``), so their parameters keep their shapes; a
    config a user writes without it gets the new default; a stored ``false`` stays false."""
    import tomllib

    from gr_functional.config import build_config, config_to_toml, migrate

    legacy = ROOT / "tests" / "fingerprints" / "legacy" / "ranking"
    ck = read_checkpoint(legacy / "checkpoints" / "last.safetensors", verify=False)   # written before the key
    assert ck.config.ranking.group_norm is True
    shapes = ranking_param_shapes(ck.config.ranking)
    assert ck.params["stu"]["layer0"]["gn_w"].shape == shapes["stu.layer0.gn_w"] == (ck.config.ranking.heads,)
    stored = tomllib.loads((legacy / "config.toml").read_text())
    assert "group_norm" not in stored["ranking"]
    assert build_config(stored, stored=True).ranking.group_norm is True             # OUT/config.toml of such a run
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.toml").write_text((legacy / "config.toml").read_text())
    assert load_config(folder / "config.toml").ranking.group_norm is True          # grf train --config OUT/config.toml
    user = {name: body for name, body in stored.items() if name in ("model", "data", "ranking")}
    assert build_config(user).ranking.group_norm is False                           # a user's file: the new default
    assert migrate({"model": {"task": "ranking"}}) == {"model": {"task": "ranking"}}  # no [ranking]: nothing added
    new = load_config(PRESET, TINY)
    assert new.ranking.group_norm is False
    written = tomllib.loads(config_to_toml(new))                                    # what a new run stores
    assert written["ranking"]["group_norm"] is False
    assert build_config(written, stored=True).ranking.group_norm is False
    assert ranking_param_shapes(new.ranking)["stu.layer0.gn_w"] == (new.ranking.heads * new.ranking.dv,)
