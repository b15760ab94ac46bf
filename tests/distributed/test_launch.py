"""`grf train --nproc 2` starts 2 ranks through torch.distributed.run and writes the run once."""
from __future__ import annotations

import json
import subprocess

from .common import ROOT, subprocess_env, train_command
import pytest


@pytest.mark.slow
def test_nproc_launches_torchrun_and_writes_files_once(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(train_command(out, "train.max_steps=4", "train.epochs=1", args=["--nproc", "2"]), cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.distributed.run" in r.stderr and "--nproc-per-node=2" in r.stderr
    results = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1 and json.loads(results[0])["out"] == str(out)   # rank 0 only
    for name in ("config.toml", "metrics.jsonl", "timing.jsonl", "eval.json", "curves.png",
                 "checkpoints/last.safetensors"):
        assert (out / name).exists(), name
    assert json.loads((out / "eval.json").read_text())["world_size"] == 2
