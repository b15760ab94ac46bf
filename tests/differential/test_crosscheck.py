"""crosscheck passes on agreeing backends and names the first diverging layer on an injected fault."""
from __future__ import annotations

import json

import pytest

from backends import get_backend
from backends.torch import TorchBackend
from gr_functional import model, results
from gr_functional.configure import load_config
from gr_functional.crosscheck import crosscheck, random_batch

CFG = load_config(None, ["model.num_items=300", "model.max_len=20", "model.num_blocks=3",
                         "model.num_heads=2", "model.dqk=8", "model.dv=8", "model.embed_dim=16"])


class FaultyAttention(TorchBackend):
    """A torch backend whose attention is wrong by 1e-3 in block 1 only (2nd call per forward)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def hstu_attention(self, *args, **kwargs):
        out = super().hstu_attention(*args, **kwargs)
        self.calls += 1
        return out * 1.001 if self.calls % CFG.model.num_blocks == 2 else out


class FaultyBackward(TorchBackend):
    """Correct forward, wrong gradient of the uvqk projection (a backward-only kernel bug)."""

    def hstu_uvqk(self, x, w, splits):
        import torch

        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                return g * 1.01

        return super().hstu_uvqk(x, Scaled.apply(w), splits)


def _report(other):
    params = model.init_params(CFG.model, seed=0)
    batch = random_batch(CFG, seed=0, num_users=6)
    return crosscheck((get_backend("jax"), other), params, batch, CFG)


@pytest.mark.slow
def test_agreeing_backends_pass():
    report = _report(get_backend("torch"))
    assert report.ok, report.to_table()
    assert report.first_failure is None
    names = [r.name for r in report.rows]
    assert names[:3] == ["input", "blocks.0.uvqk", "blocks.0.attention"]
    assert names.index("loss") < names.index("blocks.2.w_o") < names.index("blocks.0.w_o")


def test_forward_fault_names_first_diverging_layer():
    report = _report(FaultyAttention())
    assert not report.ok
    assert report.first_failure.name == "blocks.1.attention"
    assert "first diverging layer: blocks.1.attention" in report.to_table()
    assert json.loads(report.to_json())["first_diverging"] == "blocks.1.attention"


def test_backward_fault_is_named_by_gradient():
    report = _report(FaultyBackward())
    first = report.first_failure
    assert first is not None and first.kind == "gradient"
    assert first.name == f"blocks.{CFG.model.num_blocks - 1}.w_uvqk"


@pytest.mark.parametrize("bad", ["nan"])
def test_non_finite_output_fails(bad):
    class NanBackend(TorchBackend):
        def hstu_norm_mul(self, av, u, eps=1e-6):
            return super().hstu_norm_mul(av, u, eps) * float(bad)

    report = _report(NanBackend())
    assert report.first_failure.name == "blocks.0.norm_mul"


# ----------------------------------------------------------------------------- built as grf train builds it
_WRONG_KERNEL = '''
from backends.kernels import register_kernel


@register_kernel("wrong_on_purpose", backends=("torch",))
def wrong(B, q, k, v, layout, norm_len, bias):
    """The reference attention, 1 % too large: a kernel bug crosscheck must catch."""
    return B.hstu_attention_padded(q, k, v, layout, norm_len, bias) * 1.01
'''


def _crosscheck(*args, timeout=600):
    import subprocess
    import sys

    from ..reliability.common import ROOT, subprocess_env

    return subprocess.run([sys.executable, "-m", "gr_functional.cli", "crosscheck", "--config", "quickstart",
                           "--backends", "jax,torch", "--users", "4", *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_crosscheck_runs_the_configured_kernel_and_catches_a_wrong_one(tmp_path):
    """Before: crosscheck built both sides with the dtype only, so a wrong kernel selected by
    ops.attention passed "all layers agree"."""
    plugin = tmp_path / "wrong_kernel.py"
    plugin.write_text(_WRONG_KERNEL)
    proc = _crosscheck("--plugin", str(plugin), "--set", "ops.attention=wrong_on_purpose")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "attention" in proc.stdout


@pytest.mark.slow
def test_crosscheck_refuses_a_device_grf_train_refuses():
    """Before: --set backend.device=cuda on a CPU-only torch passed, where grf train refuses it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here: the refusal is for CPU-only torch")
    proc = _crosscheck("--set", "backend.device=cuda")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cuda" in proc.stderr


SMALL = ["--set", "data.synthetic_users=120", "--set", "model.num_blocks=1", "--set", "model.embed_dim=16",
         "--set", "model.dqk=8", "--set", "model.dv=8"]


@pytest.mark.slow
def test_crosscheck_steps_and_checkpoint_compare_training_and_a_trained_run(tmp_path):
    """--steps N trains N steps on each side as grf train would: the losses step by step and every
    parameter after the last agree for jax/torch, and a wrong kernel on one side fails (exit 1).
    --checkpoint evaluates one of those trained runs on both sides (its own config, its kernels
    where they run): equal metrics, and its trained weights agree layer by layer on a batch of its
    data; the run trained with the wrong torch kernel fails on torch (its metrics barely move, its
    attention does). A device grf train refuses is refused before either side trains."""
    import subprocess
    import sys

    from ..reliability.common import ROOT, subprocess_env

    proc = _crosscheck("--steps", "3", "--json", "--out", str(tmp_path / "good"), *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    kinds = [r["kind"] for r in report["rows"]]
    assert report["ok"] and kinds.count("loss") == 3 and "param" in kinds
    plugin = tmp_path / "wrong_kernel.py"
    plugin.write_text(_WRONG_KERNEL)
    proc = _crosscheck("--steps", "3", "--json", "--out", str(tmp_path / "wrong"), "--plugin", str(plugin), "--set",
                       "ops.attention=wrong_on_purpose", *SMALL)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [r for r in json.loads(proc.stdout)["rows"] if not r["ok"]]
    assert failed and all(r["kind"] in ("loss", "param") for r in failed)

    def checkpoint(run, *args):
        return subprocess.run([sys.executable, "-m", "gr_functional.cli", "crosscheck", "--checkpoint",
                               str(run / "checkpoints" / "last.safetensors"), *args], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=600)

    good = checkpoint(tmp_path / "good" / "jax", "--json", "--record", str(tmp_path / "recorded.jsonl"))
    assert good.returncode == 0, good.stdout + good.stderr
    rows = json.loads(good.stdout)["rows"]
    assert {r["name"] for r in rows} >= {"hr@10", "ndcg@10", "mrr"} and {"activation", "gradient"} <= {r["kind"] for r in rows}
    stamp, recorded = results.read(tmp_path / "recorded.jsonl")  # the same rows, as data for a results page
    assert stamp["command"].startswith("grf crosscheck --checkpoint") and len(recorded) == len(rows)
    assert all(r["reference"] == "jax" and r["other"] == "torch" and r["ok"] for r in recorded)
    wrong = checkpoint(tmp_path / "wrong" / "torch")
    assert wrong.returncode == 1 and "attention" in wrong.stdout, wrong.stdout + wrong.stderr

    proc = _crosscheck("--steps", "3", "--set", "backend.device=cuda", *SMALL)
    assert proc.returncode == 2 and "cuda" in proc.stderr  # refused before either side trains
