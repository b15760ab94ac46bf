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
import pytest

PLUGIN = str(ROOT / "experiments" / "hstu_head_model.py")
MINE = ("model.name=hstu_head", "optim.name=clipped_sgd", "optim.lr=0.05", "train.epochs=2")


@pytest.mark.slow
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


SCRIPT = '''
import sys

import numpy as np

import gr_functional as grf
from gr_functional import optimizers as O


def init_params(cfg, seed=0, num_items=None):
    params = grf.model.init_params(cfg, seed=seed, num_items=num_items)
    params["scale"] = np.ones((1,), dtype=np.float32)
    return params


def param_shapes(cfg, num_items=None):
    return {**grf.model.param_shapes(cfg, num_items), "scale": (1,)}


@grf.model.register_model("scaled_hstu", init_params=init_params, param_shapes=param_shapes)
def encode(B, params, batch, cfg, trace=None):
    return grf.model.encode(B, params, batch, cfg, trace) * params["scale"]


@O.register_optimizer("plain_sgd")
def plain_sgd(cfg, learning_rate):
    return O.sgd(learning_rate)


GUARD
    cfg = grf.load_config("experiments/configs/quickstart.toml", [*sys.argv[2:], "model.name=scaled_hstu", "optim.name=plain_sgd"])
    grf.fit(cfg, sys.argv[1], progress=False)
'''


def _script(tmp_path, guarded: bool):
    path = tmp_path / ("fit_script.py" if guarded else "unguarded.py")
    path.write_text(SCRIPT.replace("GUARD", 'if __name__ == "__main__":' if guarded else "if True:"))
    return path


def _fit(script, out, *sets):
    return subprocess.run([sys.executable, str(script), str(out), *CKPT, *sets], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_grf_fit_records_the_script_that_registered_its_model_and_optimizer(tmp_path):
    """``grf.fit`` called by a script that registers its own model and optimizer: the script is
    recorded in train.plugins, so ``grf eval`` in a new process and a resume find them again; a
    script that would train again when imported is refused, saying how to fix it."""
    script, out = _script(tmp_path, guarded=True), tmp_path / "run"
    proc = _fit(script, out, "train.epochs=1")
    assert proc.returncode == 0, proc.stderr
    assert str(script.resolve()) in (out / "config.toml").read_text()
    ev = subprocess.run([sys.executable, "-m", "gr_functional.cli", "eval", "--checkpoint",
                         str(out / "checkpoints" / "last.safetensors")],
                        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr
    assert abs(json.loads(ev.stdout)["hr@10"] - json.loads((out / "eval.json").read_text())["last_epoch_test"]["hr@10"]) < 1e-9
    again = subprocess.run([sys.executable, "-m", "gr_functional.cli", "train", "--config", str(out / "config.toml"),
                            "--out", str(out), "--quiet"], cwd=ROOT, env=subprocess_env(), capture_output=True,
                           text=True, timeout=300)  # a new process: the run's own config names the script
    assert again.returncode == 0, again.stderr

    proc = _fit(_script(tmp_path, guarded=False), tmp_path / "bad", "train.epochs=1")
    assert proc.returncode != 0 and "if __name__ == \"__main__\":" in proc.stderr and "model.name='scaled_hstu'" in proc.stderr


def test_a_model_whose_param_shapes_disagree_with_its_init_params_is_refused_before_the_run(tmp_path, capsys):
    """Round 4 of the fault campaign: such a plugin trained with exit 0, then every checkpoint was
    "damaged" (a restart from step 0) and grf eval said the file was edited. Now: exit 2 at start,
    naming the model and the first difference, and nothing written."""
    from gr_functional.cli import main

    plugin = tmp_path / "bad_shapes.py"
    plugin.write_text(
        "import numpy as np\nimport gr_functional as grf\n\n"
        "def init_params(cfg, seed=0, num_items=None):\n"
        "    params = grf.model.init_params(cfg, seed=seed, num_items=num_items)\n"
        "    params['scale'] = np.ones((2,), dtype=np.float32)\n    return params\n\n"
        "def param_shapes(cfg, num_items=None):\n    return {**grf.model.param_shapes(cfg, num_items), 'scale': (1,)}\n\n"
        "grf.model.register_model('bad_shapes', grf.model.encode, init_params=init_params, param_shapes=param_shapes)\n")
    out = tmp_path / "run"
    assert main(["train", "--plugin", str(plugin), "--set", "model.name=bad_shapes", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'bad_shapes'" in err and "param_shapes do not describe" in err and "scale: made (2,), declared (1,)" in err
    assert not out.exists()
