"""The speed benchmarks run end to end and print well-formed JSON lines (tiny sizes: speed goals
live in the benchmarks themselves, never in tests)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks import attention, mfu, step, throughput
from gr_functional.configure import load_config


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_attention_bench_json(capsys):
    rows = attention.run(json_lines=True, truncations=(64,), token_budget=512, repeats=1)
    printed = _lines(capsys)
    assert printed == json.loads(json.dumps(rows))
    from backends import cpu_fused

    fused = {("torch", "fused")} if cpu_fused.available(warn=False) else set()  # built here (CI: always)
    assert {(r["backend"], r["variant"]) for r in printed} == {(b, v) for b in ("torch", "jax")
                                                               for v in ("padded", "jagged", "jagged+recompute")} | fused
    for r in printed:
        assert r["seconds"] > 0 and r["memory_bytes"] > 0 and r["sequences"] == 8
        assert r["ideal_layer"] >= 1.0 and r["speedup"] > 0
        if r["variant"] == "padded":
            assert r["speedup"] == 1.0 and r["memory_ratio"] == 1.0
    kept = {r["variant"]: r["memory_bytes"] for r in printed if r["backend"] == "torch"}
    assert kept["jagged+recompute"] < kept["jagged"]  # autograd keeps the attention's inputs only
    if fused:
        assert kept["fused"] < kept["jagged"]         # the fused tiles keep q, k, v only


@pytest.fixture
def small_step_config(monkeypatch):
    monkeypatch.setitem(step.SYNTHETIC, "kuairand_1k", (dataclasses.replace(
        step.KUAIRAND_1K, num_items=500, embed_dim=32, num_blocks=1, num_heads=2, dqk=16, dv=16, max_len=64), 16, False))
    monkeypatch.setitem(step.SYNTHETIC, "nvidia_hstu_512", (dataclasses.replace(
        step.NVIDIA_HSTU, num_items=500, embed_dim=32, num_blocks=1, num_heads=2, dqk=16, dv=16, max_len=32), 2, True))


@pytest.mark.slow
def test_mfu_and_throughput_bench_json(capsys, small_step_config):
    cfg = load_config(None)
    mfu.run(json_lines=True, cfg=cfg, configs=("kuairand_1k", "nvidia_hstu_512"), repeats=1, peak_n=512)
    rows = _lines(capsys)
    assert [(r["backend"], r["config"]) for r in rows] == [(b, c) for b in ("torch", "jax")
                                                            for c in ("kuairand_1k", "nvidia_hstu_512")]
    assert all(r["tokens"] == 2 * 32 for r in rows if r["config"] == "nvidia_hstu_512")  # fixed lengths
    for r in rows:
        assert r["mfu"] > 0 and r["peak_flops"] > 0 and r["model_flops"] > 0
        assert r["model_flops"] == sum(r["flops_parts"].values())
        assert r["mfu_nvidia"] == r["nvidia_flops"] / r["seconds"] / r["peak_flops"] > 0
    throughput.run(json_lines=True, cfg=cfg, configs=("kuairand_1k",), repeats=1)
    rows = _lines(capsys)
    assert len(rows) == 6 and max(r["vs_fastest"] for r in rows) == 1.0  # 2 backends x 3 kernels
    used = {(r["backend"], r["kernel"]): r["kernel_used"] for r in rows}
    assert used[("torch", "default")] == "best" and used[("jax", "default")] == "best"
    fused = {(r["backend"], r["kernel"]): r["cpu_fused"] for r in rows}
    assert fused[("torch", "default")] and fused[("jax", "default")]  # CI builds both fronts
    assert not any(fused[(b, k)] for b in ("torch", "jax") for k in ("tiled", "reference"))
    assert all(r["tokens_per_s"] > 0 for r in rows)


@pytest.mark.slow
def test_recompute_bench_json(capsys, small_step_config):
    from benchmarks import recompute

    rows = recompute.run(json_lines=True, cfg=load_config(None), configs=("kuairand_1k",), repeats=1)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [r["backend"] for r in rows] == ["torch", "jax"]
    for r in rows:
        assert r["seconds_off"] > 0 and r["seconds_on"] > 0 and r["memory_off"] > 0 and r["memory_on"] > 0
    assert rows[0]["memory_kind"] == "autograd_saved" and rows[0]["memory_on"] < rows[0]["memory_off"]


def test_roofline_bench_json(capsys, small_step_config):
    from benchmarks import roofline

    # the torch formulations (cpu_fused off): their aten ops are what the byte rules estimate
    cfg = load_config(None, ["ops.attention=jagged", "ops.sampled_logits=reference", "ops.shared_logsumexp=reference"])
    rows = roofline.run(json_lines=True, cfg=cfg, configs=("kuairand_1k",), top=None, peak_n=512, mib=16)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    [r] = rows
    assert r["peak_flops"] > 0 and r["bandwidth_bytes_s"] > 0 and r["profiled_s"] > 0 and r["roofline_s"] > 0
    assert 0 < r["matmul_share_of_roofline"] <= 1
    ops = {o["op"]: o for o in r["ops"]}
    assert "aten::bmm" in ops and ops["aten::bmm"]["gflop"] > 0 and ops["aten::bmm"]["gbytes"] > 0


def test_roofline_byte_and_flop_rules():
    from benchmarks.roofline import matmul_flops, op_bytes

    assert matmul_flops("aten::mm", [[64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::bmm", [[3, 64, 32], [3, 32, 16]]) == 3 * 2 * 64 * 32 * 16
    assert matmul_flops("aten::addmm_", [[64, 16], [64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert op_bytes("aten::mm", [[64, 32], [32, 16]], [], True) == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    # index_select along dim 1 of [2, 100, 8]: each of 5 indices moves a [2, 8] slice, read and written
    assert op_bytes("aten::index_select", [[2, 100, 8], [], [5]], [None, 1, None], True) == 4 * (2 * 5 * 16 + 5)
    assert op_bytes("aten::index_add_", [[2, 100, 8], [], [5], [2, 5, 8], []], [None, 1, None, None, 1], True) \
        == 4 * (2 * 5 * 16 + 5)
    assert op_bytes("aten::mul", [[10, 4], [10, 4]], [], False) == 4 * 120
    assert op_bytes("aten::fill_", [[10, 4], []], [], False) == 4 * 40
    assert op_bytes("aten::mul", [[10, 4], [10, 4]], [], True) == 0      # a wrapper: its children move the data
    assert op_bytes("aten::view", [[10, 4], []], [], False) == 0
    assert op_bytes("aten::cat", [[], []], [], False) is None            # tensor lists: not recorded
    assert op_bytes("FusedTilesBackward", [[8, 2, 4]], [], True) is None  # fused C++ ops: measured time


def test_embedding_bench_json(capsys):
    from benchmarks import embedding

    embedding.run(json_lines=True, quick=True)
    rows = _lines(capsys)
    sections = {r["section"] for r in rows}
    assert sections == {"step", "map", "memory", "dedup", "row_kernel"}
    kernels = {r["kernel"]: r for r in rows if r["section"] == "row_kernel"}
    assert set(kernels) == {"reference", "fbgemm"} and all(r["ms"] > 0 for r in kernels.values())
    step_rows = {r["impl"]: r for r in rows if r["section"] == "step"}
    assert {"nn_embedding_sparse_adam", "dense_lazy_adam", "hash_lazy_adam"} <= set(step_rows)
    assert all(r["ids_per_s"] > 0 for r in step_rows.values())
    memory = [r for r in rows if r["section"] == "memory"][0]
    assert memory["evictions"] == memory["stream_ids"] - memory["capacity"]
    dedup = [r for r in rows if r["section"] == "dedup"][0]
    assert dedup["unique_per_step"] < dedup["ids_per_step"] and dedup["reduction"] > 1


def test_pipeline_bench_json(capsys):
    from benchmarks import pipeline
    from gr_functional.configure import load_config

    sets = ["data.synthetic_users=120", "data.synthetic_max_events=30", "model.max_len=16", "model.embed_dim=16",
            "model.dqk=8", "model.dv=8", "loss.num_negatives=8", "train.batch_size=16"]
    rows = pipeline.run(json_lines=True, cfg=load_config(None, sets), backends=["torch"], steps=3, warmup=1)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [r["prefetch"] for r in rows] == [0, 2]
    for r in rows:
        assert r["steps"] == 3 and 0 < r["busy"] <= 1 and r["build_s"] > 0 and r["tokens_per_s"] > 0
    assert rows[0]["wait_s"] == rows[0]["build_s"] and rows[0]["hidden"] == 0.0  # synchronous: nothing hidden


@pytest.mark.slow
def test_pipeline_sharded_bench_json(capsys):
    """2 gloo ranks with a row-sharded table, every exchange delayed 10 ms, without and with the
    pipelined step: both run and report (timings are not asserted: a shared machine)."""
    from benchmarks import pipeline_sharded

    rows = pipeline_sharded.run(json_lines=True, config="quickstart", sets=["train.max_steps=6"],
                                variants=[(0.01, 0), (0.01, 2)], warmup=2)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [(r["delay_ms"], r["prefetch"]) for r in rows] == [(10.0, 0), (10.0, 2)]
    for r in rows:
        assert r["steps"] == 3 and r["step_s"] > 0 and r["compute_s"] > 0 and r["tokens_per_s"] > 0


@pytest.mark.slow
def test_negatives_bench_json(capsys):
    """Every variant runs; GR's recipe is the reference (vs_sampled 1); 16-bit negatives read
    half the bytes plus one scale per sequence (private) or per pool."""
    from benchmarks import negatives
    from gr_functional.configure import load_config

    sets = ["data.synthetic_users=120", "data.synthetic_max_events=30", "model.max_len=16", "model.embed_dim=16",
            "model.dqk=8", "model.dv=8", "train.batch_size=16"]
    variants = (("sampled_softmax", 8, "uniform", "fp32"), ("sampled_softmax", 8, "uniform", "fp16"),
                ("shared_pool", 32, "uniform", "fp32"), ("shared_pool", 32, "popularity", "bf16"),
                ("mixed_pool", 32, "uniform", "fp32"), ("full_softmax", 0, "uniform", "fp32"))
    rows = negatives.run(json_lines=True, cfg=load_config(None, sets), backends=["torch"], variants=variants,
                         steps=2, warmup=1)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [(r["loss"], r["precision"]) for r in rows] == [v[::3] for v in variants]
    assert rows[0]["vs_sampled"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    private = rows[0]["negative_bytes"]
    assert private == rows[0]["tokens"] * 8 * 16 * 4
    assert private / 2 < rows[1]["negative_bytes"] <= private / 2 + 4 * 16    # + a scale per sequence
    assert rows[2]["negative_bytes"] == 32 * 16 * 4 and rows[3]["negative_bytes"] == 32 * 16 * 2 + 4
    n_items = rows[5]["negatives"]                                          # the whole catalogue
    assert rows[4]["negatives"] == 32 + negatives.BATCH_NEGATIVES and rows[5]["negative_bytes"] == n_items * 16 * 4
    assert all(r["step_peak_mb"] is None or r["step_peak_mb"] >= 0 for r in rows)


def test_ranking_bench_json(capsys):
    """grf bench ranking: fp32 / bf16 / fp16 / accumulate 2 on the ranking preset's batches (tiny,
    hash tables), fp32 the reference; an accumulated step holds two batches' candidates."""
    from benchmarks import ranking
    from gr_functional.configure import load_config

    from .test_ranking_train import PRESET, TINY

    cfg = load_config(PRESET, TINY + ["embedding.kind=hash", "embedding.optimizer=lazy_adam",
                                      "embedding.capacity=4000", "train.batch_size=8"])
    rows = ranking.run(json_lines=True, cfg=cfg, backends=["torch"], steps=2, warmup=1)
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [(r["precision"], r["accumulate"]) for r in rows] == list(ranking.VARIANTS)
    assert rows[0]["vs_fp32"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["candidates"] == 8 * 10 and rows[3]["candidates"] == 2 * 8 * 10


def test_stream_bench_json(capsys):
    """Training on a (small) KuaiRand-shaped stream with a hash table below its ids: the rows
    report throughput, RSS, the table filling to its capacity and evicting, and dedup."""
    from benchmarks import stream
    from gr_functional.configure import load_config
    from gr_functional.data.stream import KuaiRandStream

    sets = ["model.embed_dim=16", "model.dqk=8", "model.dv=8", "model.max_len=32", "model.num_blocks=1",
            "embedding.capacity=600", "loss.num_negatives=32", "train.batch_size=8", "train.log_every=2"]
    cfg = load_config("experiments/configs/kuairand27k_stream.toml", sets)
    rows = stream.run(json_lines=True, cfg=cfg, steps=6,
                      stream=KuaiRandStream(lengths=np.full(30, 200), window=32, num_items=100_000))
    assert _lines(capsys) == json.loads(json.dumps(rows))
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert rows[-1]["occupancy"] == 600 and rows[-1]["evictions"] > 0        # bounded by the capacity
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["host_share"] < 1 and r["peak_rss_mb"] >= r["rss_mb"] > 0
        assert 0 < r["unique_per_step"] <= r["ids_per_step"] and r["bytes_after"] == r["unique_per_step"] * 64


@pytest.mark.slow
@pytest.mark.data("kuairand-27k-lengths")
def test_sharded_stream_bench_on_two_ranks():
    """The 0.2B preset's path, shrunk: two gloo ranks, the hash table row-sharded over them and
    full (evicting), all-to-all and all-reduce bytes counted, model FLOPs over the ranks' peak."""
    from benchmarks import stream
    from gr_functional.configure import load_config

    sets = ["model.embed_dim=16", "model.dqk=8", "model.dv=8", "model.max_len=32", "model.num_blocks=1",
            "model.num_heads=1", "embedding.capacity=600", "loss.num_negatives=32", "train.batch_size=8",
            "train.log_every=2"]
    rows = stream.run(cfg=load_config("experiments/configs/kuairand27k_02b.toml", sets), steps=4)
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["ranks"] == 2 and r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["alltoall_mb_per_step"] > 0
        assert r["allreduce_mb_per_step"] * 2**20 == 4 * r["params"]["dense"] and r["imbalance"] >= 0
        assert len(r["peak_rss_mb"]) == 2 and r["peak_rss_mb_max"] == max(r["peak_rss_mb"]) > 0
    assert rows[-1]["occupancy"] == rows[-1]["capacity"] == 600 and rows[-1]["evictions"] > 0
    assert rows[-1]["params"]["table"] == 600 * 16


def test_nvidia_flop_count_follows_their_formula():
    """flops.nvidia_step_flops on a hand-computed case: one layer, L = 4 tokens (1 contextual,
    2 history, 1 candidate), H = 1, d = 2, D = 3: attention (4*4*3*2 - 2*2*2*2 + 4*1*2) * 3.5 = 308,
    GEMMs (2*4*4*2*3 + 2*4*3) * 3 = 648, elementwise 2*4*2 + 4*3 = 28."""
    import types

    from gr_functional.flops import nvidia_step_flops

    mc = types.SimpleNamespace(embed_dim=3, num_heads=1, dqk=2, num_blocks=1)
    assert nvidia_step_flops(mc, [4], contextual=[1], candidates=[1]) == 308 + 648 + 28
    mc.num_blocks = 2
    assert nvidia_step_flops(mc, [4, 4], contextual=[1, 1], candidates=[1, 1]) == 4 * (308 + 648 + 28)


def test_ranking_flops_count_gr_ranking_mask():
    """flops.ranking_cells counts the (query, key) pairs GR's ranking mask allows (history causal,
    each candidate the history and itself), checked by brute force; the step's total is 3 x the
    forward parts' sum."""
    from gr_functional.configure import load_config
    from gr_functional.flops import ranking_cells, ranking_step_flops

    def brute(L, c):
        n0 = L - c
        return sum(1 for i in range(L) for j in range(L) if (j <= i if i < n0 else (j < n0 or j == i)))

    lengths, targets = [8, 13, 7], [2, 10, 1]
    assert ranking_cells(lengths, targets) == sum(brute(L, c) for L, c in zip(lengths, targets))
    rc = load_config("experiments/configs/kuairand_pure_rank.toml").ranking
    parts = ranking_step_flops(rc, lengths, targets)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert parts["attention"] == 3 * rc.num_layers * 2 * ranking_cells(lengths, targets) * rc.heads * (rc.dqk + rc.dv)


@pytest.mark.data("kuairand-user-features", "kuairand-video-features")
@pytest.mark.slow
def test_ranking_scale_bench_summarises_a_two_rank_run(capsys):
    """The ranking 0.2B preset's path, shrunk: `grf train --nproc 2` on the ranking stream with
    the merged hash table row-sharded and evicting; the row carries tokens/s, MFU, per-rank RSS,
    the all-to-all and all-reduce bytes, the imbalance and the parameter counts."""
    from benchmarks import ranking_scale

    sets = ["data.synthetic_users=40", "data.synthetic_max_events=80", "ranking.embed_dim=8", "ranking.dim=16",
            "ranking.num_layers=1", "ranking.heads=2", "ranking.dqk=4", "ranking.dv=4", "ranking.max_seq_len=40",
            "ranking.tower_hidden=8", "ranking.item_hidden=8", "ranking.task_hidden=8", "ranking.time_buckets=16",
            "ranking.position_buckets=64", "embedding.capacity=300", "train.batch_size=8", "train.max_steps=6",
            "train.log_every=2", "eval.max_users=8"]
    (row,) = ranking_scale.run(json_lines=True, sets=sets)
    assert _lines(capsys) == [json.loads(json.dumps(row))]
    assert row["ranks"] == 2 and row["steps"] == 4 and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert len(row["peak_rss_mb"]) == 2 and row["peak_rss_mb_max"] == max(row["peak_rss_mb"]) > 0
    assert row["alltoall_mb_per_step"] > 0 and row["allreduce_mb"] * 2**20 == 4 * row["params_dense"]
    assert row["params_table"] == 300 * 8 and row["params_total"] == row["params_table"] + row["params_dense"]
    assert row["occupancy"] == 300 and row["evictions"] > 0 and row["imbalance"] >= 0


@pytest.mark.data("kuairand-27k-lengths")
@pytest.mark.slow
def test_scaling_bench_byte_model_and_projection():
    """The cost model's all-to-all bytes match the ranks' counted ones (timings are not asserted:
    they depend on the machine's load); the projection covers both hardware presets."""
    from benchmarks import scaling
    from gr_functional.configure import load_config

    sets = ["model.embed_dim=16", "model.dqk=8", "model.dv=8", "model.max_len=32", "model.num_blocks=1",
            "model.num_heads=1", "embedding.capacity=5000", "loss.num_negatives=32", "train.batch_size=4"]
    rows = scaling.run(cfg=load_config("experiments/configs/kuairand27k_02b.toml", sets), steps=2, ranks=(1, 2),
                       project=(8, 16))
    valid = [r for r in rows if r["section"] == "validation"]
    assert [r["ranks"] for r in valid] == [1, 2] and valid[0]["measured_alltoall_bytes"] == 0
    assert abs(valid[1]["bytes_error"]) < 0.1 and valid[1]["collectives_per_step"] >= 4
    proj = [r for r in rows if r["section"] == "projection"]
    assert {r["hardware"] for r in proj} == set(scaling.HARDWARE) and len(proj) == 2 * 3
    for r in proj:
        for key in ("device_serial", "device_overlapped", "host_serial", "host_overlapped"):
            assert 0 < r[f"efficiency_{key}"] <= 1
        assert (r["comm_s"] == 0) == (r["ranks"] == 1) and r["tokens_per_rank"] == scaling.PROJECT_TOKENS


@pytest.mark.data("kuairand-user-features", "kuairand-video-features", "kuairand-27k-lengths")
@pytest.mark.slow
def test_device_bench_tiny_records_every_section(tmp_path, capsys):
    """``grf bench device --tiny``: the whole device command (attention kernels, the training step's
    MFU both ways on every backend, the loop's busy fraction) at toy sizes, recorded as a results file."""
    from gr_functional import cli, results

    out = tmp_path / "device.jsonl"
    assert cli.main(["bench", "device", "--tiny", "--record", str(out)]) == 0
    stamp, rows = results.read(out)
    assert stamp["command"].startswith("grf bench device --tiny")
    by = {}
    for r in rows:
        by.setdefault(r["bench"], []).append(r)
    assert set(by) == {"attention", "mfu", "pipeline", "device"}
    assert {r["backend"] for r in by["attention"]} == {r["backend"] for r in by["mfu"]} == {"torch", "jax"}
    assert {r["truncation"] for r in by["attention"]} == {64}
    assert {r["config"] for r in by["mfu"]} == {"tiny_kuairand", "tiny_nvidia"}
    assert all(r["mfu"] > 0 and r["mfu_nvidia"] > 0 for r in by["mfu"])
    assert {(r["backend"], r["prefetch"]) for r in by["pipeline"]} == {(b, p) for b in ("torch", "jax") for p in (0, 2)}
    assert all(0 < r["busy"] <= 1 for r in by["pipeline"])
    [total] = by["device"]
    assert total["rows"] == len(rows) - 1 and total["wall_s"] > 0
    assert cli.main(["bench", "mfu", "--tiny"]) == 2
    assert "takes no --tiny" in capsys.readouterr().err
