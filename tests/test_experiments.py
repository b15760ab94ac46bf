"""The research experiment scripts run end to end (tiny settings) and print their tables."""
import importlib.util
import json
import sys
from pathlib import Path

from gr_functional.config import scoped_keys
from tests.test_cli import TINY
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does (a dataclass in it looks its module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rab_ablation_trains_every_variant_and_tabulates_them(tmp_path, monkeypatch, capsys):
    sets = [arg for item in TINY + ["train.epochs=1"] for arg in ("--set", item)]
    monkeypatch.setattr(sys, "argv", ["rab_ablation.py", "--config", str(ROOT / "experiments/configs/quickstart.toml"),
                                      "--backend", "torch", "--out", str(tmp_path)] + sets)
    _load("rab_ablation").main()
    out = capsys.readouterr().out
    assert "| run | model.pos_bias | model.time_bias | status | epoch | hr@10 |" in out
    for folder, pos, time in (("pos_time", "True", "True"), ("pos_only", "True", "False"),
                              ("time_only", "False", "True"), ("none", "False", "False")):
        assert f"| {folder} | {pos} | {time} | done | 0 |" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"pos+time", "pos only", "time only", "none"}


@pytest.mark.slow
def test_bpr_loss_example_runs_on_real_ml1m_batches_on_both_backends(capsys):
    """README "A loss of one's own": the plugin's loss on real ML-1M batches (GRF_DATA_DIR), the
    same value on torch and jax."""
    with scoped_keys():  # its loss.bpr_margin stays out of the configs of later tests in this process
        losses = _load("bpr_loss").main(["--config", "ml1m_hstu", "--batches", "1", "--set", "train.batch_size=16"])
    out = capsys.readouterr().out
    assert "6,040 users" in out and "bpr loss of the first 1 batches" in out
    assert abs(losses["torch"][0] - losses["jax"][0]) <= 1e-5 * abs(losses["jax"][0])
    assert 0.0 < losses["torch"][0] < 10.0
