"""A backend of one's own is one file and one registration: a ``--plugin`` module that subclasses a
backend and calls ``backends.register_backend``; ``grf train --backend NAME`` trains with it (every
op its reference, which runs on any backend), and ``grf eval`` in a new process re-imports it from
the run's config."""
from __future__ import annotations

import json
import subprocess
import sys

from .reliability.common import ROOT, metrics, run_grf, subprocess_env
from .reliability.test_resume import CKPT
import pytest

PLUGIN = '''
from backends import register_backend
from backends.base import Backend
from backends.torch import TorchBackend


class TorchReference(TorchBackend):
    """torch running every op's reference implementation."""

    name = "torch_ref"
    default_ops = dict(Backend.default_ops)


register_backend("torch_ref", __name__, "TorchReference")
'''


@pytest.mark.slow
def test_a_backend_registered_by_a_plugin_trains_and_evaluates(tmp_path):
    plugin = tmp_path / "torch_ref_backend.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "run"
    proc = run_grf(out, *CKPT, "train.epochs=1", args=("--plugin", str(plugin), "--backend", "torch_ref"))
    assert proc.returncode == 0, proc.stderr
    assert 'name = "torch_ref"' in (out / "config.toml").read_text()
    assert [r for r in metrics(out) if r["kind"] == "train"]
    ev = subprocess.run([sys.executable, "-m", "gr_functional.cli", "eval", "--checkpoint",
                         str(out / "checkpoints" / "last.safetensors")],
                        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr
    want = json.loads((out / "eval.json").read_text())["last_epoch_test"]["hr@10"]
    assert abs(json.loads(ev.stdout)["hr@10"] - want) < 1e-9
    refused = run_grf(tmp_path / "no", "ops.attention=best", args=("--plugin", str(plugin), "--backend", "torch_ref"))
    assert refused.returncode == 2 and "kernel 'best' does not run on the torch_ref backend" in refused.stderr
