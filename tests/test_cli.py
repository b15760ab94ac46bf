"""The grf command line: train -> files, eval of one checkpoint on both backends, crosscheck, errors."""
import json

import numpy as np
import pytest

from gr_functional.checkpoint import load_checkpoint
from gr_functional.cli import main

TINY = ["data.synthetic_users=80", "data.synthetic_items=150", "data.synthetic_max_events=30",
        "model.max_len=16", "model.embed_dim=16", "model.dqk=8", "model.dv=8", "loss.num_negatives=8",
        "train.epochs=2", "train.batch_size=32", "train.log_every=1", "eval.batch_size=64"]


def _sets(items):
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(out)] + _sets(TINY)) == 0
    return out


def test_train_writes_the_documented_files(trained):
    for name in ("config.toml", "metrics.jsonl", "eval.json", "curves.png", "checkpoints/last.safetensors"):
        assert (trained / name).exists(), name
    result = json.loads((trained / "eval.json").read_text())
    for key in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr"):
        assert 0.0 <= result[key] <= 1.0, key
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert {line["kind"] for line in lines} == {"train", "eval"}
    assert all(np.isfinite(line["loss"]) for line in lines if line["kind"] == "train")
    assert "max_len = 16" in (trained / "config.toml").read_text()


def test_checkpoint_evaluates_the_same_on_both_backends(trained, capsys):
    ckpt = trained / "checkpoints" / "last.safetensors"
    results = {}
    for backend in ("torch", "jax"):
        assert main(["eval", "--checkpoint", str(ckpt), "--backend", backend]) == 0
        results[backend] = json.loads(capsys.readouterr().out)
        assert results[backend]["backend"] == backend and results[backend]["trained_on"] == "torch"
    n_users = 80
    for key in ("hr@10", "ndcg@10", "hr@200", "mrr"):
        # identical up to a float tie flipping one user's rank
        assert abs(results["torch"][key] - results["jax"][key]) <= 1.0 / n_users, key
    # and equal to what training reported for the last epoch
    final = json.loads((trained / "eval.json").read_text())["last_epoch_test"]
    assert abs(results["torch"]["hr@10"] - final["hr@10"]) < 1e-9


def test_checkpoint_holds_params_and_optimizer_state(trained):
    params, opt, cfg, meta = load_checkpoint(trained / "checkpoints" / "last.safetensors")
    assert cfg.model.max_len == 16 and meta["backend"] == "torch" and meta["epoch"] == 1
    assert set(opt) == {"step", "mu", "nu"} and float(opt["step"]) == meta["step"]
    assert params["item_emb"].shape == opt["mu"]["item_emb"].shape


@pytest.mark.slow
def test_crosscheck_cli(capsys):
    args = ["crosscheck", "--config", "quickstart", "--backends", "jax,torch", "--users", "8"] + _sets(TINY)
    assert main(args) == 0
    assert "all layers agree" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["first_diverging"] is None and report["backends"] == ["jax", "torch"]


def test_user_errors_exit_2_with_a_message(capsys, tmp_path, monkeypatch):
    assert main(["train", "--backend", "tpu9", "--quiet", "--out", str(tmp_path / "a")] + _sets(TINY)) == 2
    assert "--backend tpu9: backend.name='tpu9': no backend named 'tpu9' is registered" in capsys.readouterr().err
    assert main(["train", "--quiet", "--set", "model.nblocks=2", "--out", str(tmp_path / "b")]) == 2
    assert "unknown key model.nblocks" in capsys.readouterr().err
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path / "empty"))
    assert main(["train", "--quiet", "--set", "data.dataset=ml-20m", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "ML-20M data not found" in err and "grf data fetch ml-20m" in err
    assert main(["crosscheck", "--config", "quickstart", "--backends", "jax,npu"]) == 2
    assert "backend 'npu' is unavailable" in capsys.readouterr().err


def test_report_reads_what_train_wrote(trained, capsys):
    # the report's epoch rule is the runner's: it finds eval.json's epoch and metrics in metrics.jsonl
    result = json.loads((trained / "eval.json").read_text())
    assert main(["report", str(trained), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["status"] == "done" and row["epoch"] == result["epoch"]
    for key in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr"):
        assert row[key] == result[key], key


@pytest.mark.data("kuairand-27k-lengths")   # the stream's synthetic users have KuaiRand-27K lengths
def test_bench_stream_runs_its_own_preset_without_config(capsys):
    """`grf bench stream` with no --config trains on the stream with its preset (a hash table),
    not the default quickstart config (whose dense table it would refuse)."""
    rc = main(["bench", "stream", "--json", "--set", "train.max_steps=1", "--set", "train.log_every=1",
               "--set", "model.num_blocks=1", "--set", "train.batch_size=4"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["step"] == 1 and row["capacity"] == 262_144 and row["occupancy"] > 0


def test_a_run_logged_to_a_file_prints_plain_progress_lines(tmp_path, capsys):
    """Round 4: with stdout/stderr not a terminal (a log file, CI) a run printed nothing between
    epochs; now a plain line (step, steps/s, tokens/s, loss, ETA) every train.progress_every_s."""
    from gr_functional.cli import main
    from tests.reliability.common import TINY, sets

    out = tmp_path / "run"
    assert main(["train", "--config", "quickstart", "--out", str(out)]
                + sets(TINY + ["train.epochs=1", "train.progress_every_s=0.000001"])) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps/s" in line]
    assert lines and all("ETA" in line and line.startswith("step ") for line in lines)


def test_the_summary_line_holds_a_ranking_runs_metrics():
    """Round 4: a ranking run's last stdout line had no metrics (it listed HR/NDCG keys only)."""
    from gr_functional.cli import summary_line

    ranking = {"is_click/auc": 0.712345, "is_click/gauc": 0.61, "auc": 0.7, "is_like/ne": float("nan"),
               "epoch": 3, "task": "ranking", "steps": 40, "wall_seconds": 12.5, "last_epoch_test": {"auc": 0.7}}
    assert summary_line(ranking) == {"is_click/auc": 0.7123, "is_click/gauc": 0.61, "auc": 0.7}
    assert summary_line({"hr@10": 0.25, "mrr": 0.1, "wall_seconds": 3.0}) == {"hr@10": 0.25, "mrr": 0.1}
