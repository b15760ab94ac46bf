"""A researcher's own model (with a parameter of its own) and optimizer, from a plugin file
(experiments/hstu_head_model.py), through ``grf train``: they take effect, the checkpoint holds the
extra parameter and the optimizer's state, a SIGKILLed run resumes to the same bytes, and ``grf eval``
re-imports the plugin the run recorded."""
from __future__ import annotations

import json
import subprocess
import sys

from gr_functional.checkpoint import CheckpointDir, read_checkpoint

from .reliability.common import ROOT, metrics, run_grf, subprocess_env
from .reliability.test_resume import CKPT, _run_until_fault

PLUGIN = str(ROOT / "experiments" / "hstu_head_model.py")
MINE = ("model.name=hstu_head", "optim.name=clipped_sgd", "optim.lr=0.05", "train.epochs=2")


def test_a_plugin_model_and_optimizer_train_resume_and_evaluate(tmp_path):
    ref = tmp_path / "ref"
    proc = run_grf(ref, *CKPT, *MINE, args=("--plugin", PLUGIN))
    assert proc.returncode == 0, proc.stderr
    ck = read_checkpoint(CheckpointDir(ref / "checkpoints").steps()[0][1])
    assert ck.params["head"].shape == (16, 16) and not (ck.params["head"] == ck.params["head"][0, 0] *
                                                        (ck.params["head"] != 0)).all()   # trained, not the identity
    assert set(ck.opt_state) == {"step", "trace"}                                    # SGD momentum's state
    text = (ref / "config.toml").read_text()
    assert 'name = "hstu_head"' in text and 'name = "clipped_sgd"' in text and PLUGIN in text

    plain = tmp_path / "plain"
    assert run_grf(plain, *CKPT, "optim.lr=0.05", "train.epochs=2").returncode == 0
    losses = lambda out: [r["loss"] for r in metrics(out) if r["kind"] == "train"]  # noqa: E731
    assert losses(ref)[1:] != losses(plain)[1:]

    out = tmp_path / "run"
    _run_until_fault(out, "after-step@7", *MINE, "train.plugins=[" + json.dumps(PLUGIN) + "]")
    proc = run_grf(out, *CKPT, *MINE, args=("--plugin", PLUGIN))
    assert proc.returncode == 0, proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()

    ev = subprocess.run([sys.executable, "-m", "gr_functional.cli", "eval", "--checkpoint",
                         str(ref / "checkpoints" / "last.safetensors"), "--out", str(tmp_path / "e.json")],
                        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr
    got = json.loads(ev.stdout)
    want = json.loads((ref / "eval.json").read_text())["last_epoch_test"]
    assert abs(got["hr@10"] - want["hr@10"]) < 1e-9
