"""``optim.name`` in ``grf train``: each registered dense optimizer (gr_functional/optimizers) trains
through the shared step, keeps its own state in the checkpoints, resumes bitwise after a SIGKILL,
and takes effect (its trajectory is not AdamW's); an optax optimizer by name on JAX does the same; a
resume under another optimizer and an optax name off JAX are refused by name. The optimizers' math is tested in tests/differential/test_optimizers.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gr_functional.checkpoint import CheckpointDir, read_checkpoint
from gr_functional.config import ConfigError
from gr_functional.tree import tree_items

from .common import grf_command, metrics, run_grf, tiny_config
from .test_resume import CKPT, _run_until_fault

STATE = {"adamw": {"mu", "nu"}, "adagrad": {"sum_of_squares"}, "sgd": {"trace"}, "lion": {"mu"}}


def _opt_keys(out) -> set[str]:
    ck = read_checkpoint(CheckpointDir(out / "checkpoints").steps()[0][1])
    return {k.split(".")[0] for k, _ in tree_items(ck.opt_state)}


@pytest.fixture(scope="module")
def adamw_losses(tmp_path_factory) -> list[float]:
    """The same run with AdamW (the default): what another optimizer's trajectory must differ from."""
    out = tmp_path_factory.mktemp("adamw") / "run"
    assert run_grf(out, *CKPT, "optim.lr=0.01", "train.epochs=2").returncode == 0
    return [r["loss"] for r in metrics(out) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adagrad", "sgd", "lion"])
def test_an_optimizer_by_name_trains_checkpoints_and_resumes_bitwise(name, tmp_path, adamw_losses):
    sets = (f"optim.name={name}", "optim.lr=0.01", "train.epochs=2")
    ref = tmp_path / "ref"
    proc = run_grf(ref, *CKPT, *sets)
    assert proc.returncode == 0, proc.stderr
    assert _opt_keys(ref) == {"step"} | STATE[name]
    assert f'name = "{name}"' in (ref / "config.toml").read_text()
    out = tmp_path / "run"
    _run_until_fault(out, "after-step@7", *sets)
    proc = run_grf(out, *CKPT, *sets)
    assert proc.returncode == 0, proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    losses = [r["loss"] for r in metrics(ref) if r["kind"] == "train"]
    assert np.all(np.isfinite(losses))
    assert losses[1:] != adamw_losses[1:]


@pytest.mark.slow
def test_sgd_on_jax_equals_torch(tmp_path):
    """The same transform on both backends: the same losses to float32 noise."""
    sets = ("optim.name=sgd", "optim.lr=0.05", "train.epochs=1")
    runs = {}
    for backend in ("torch", "jax"):
        out = tmp_path / backend
        proc = run_grf(out, *sets, args=("--backend", backend))
        assert proc.returncode == 0, proc.stderr
        runs[backend] = [r["loss"] for r in metrics(out) if r["kind"] == "train"]
    assert np.allclose(runs["torch"], runs["jax"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_resume_under_another_optimizer_is_refused(tmp_path):
    out = tmp_path / "run"
    assert run_grf(out, *CKPT, "train.epochs=1").returncode == 0
    proc = run_grf(out, *CKPT, "train.epochs=2", "optim.name=sgd")
    assert proc.returncode == 2 and "optim.name: checkpoint 'adamw', now 'sgd'" in proc.stderr


def test_unknown_and_optax_names_are_refused_by_name():
    with pytest.raises(ConfigError, match="optim.name='lino'.*did you mean 'lion'"):
        tiny_config("optim.name=lino")
    with pytest.raises(ConfigError, match="optim.name='optax:adamw'.*JAX backend only"):
        tiny_config("optim.name=optax:adamw")
    assert tiny_config("optim.name=optax:adamw", "backend.name=jax").optim.name == "optax:adamw"
    assert json.dumps(tiny_config("optim.name=lion").optim.name) == '"lion"'


# one optax optimizer is enough here: the state check that rejected them all is generic (its own
# unit tests: tests/reliability/test_checkpoint.py); their math: tests/differential/test_optimizers.py
@pytest.mark.slow
@pytest.mark.parametrize("name", ["adabelief"])
def test_an_optax_optimizer_by_name_trains_checkpoints_and_resumes_bitwise_on_jax(name, tmp_path):
    """``optim.name = "optax:NAME"`` on JAX: optax's state (NamedTuples) kept as dicts in the
    checkpoints, and a SIGKILLed run resumed (from its checkpoint, not from step 0: the bug of
    round 4 rejected every optax checkpoint as damaged and retrained) to the uninterrupted run's
    bytes, checkpoints included; ``grf eval`` takes the file (that optax:adamw is the project's
    AdamW: tests/differential/test_optimizers.py)."""
    from gr_functional.cli import main

    sets = (f"optim.name=optax:{name}", "optim.lr=0.01", "train.epochs=2")
    jax = ("--backend", "jax")
    ref = tmp_path / "ref"
    proc = run_grf(ref, *CKPT, *sets, args=jax)
    assert proc.returncode == 0, proc.stderr
    assert _opt_keys(ref) == {"step", "optax"}
    out = tmp_path / "run"
    _run_until_fault(out, "after-step@7", command=grf_command(out, *CKPT, *sets, args=jax))
    proc = run_grf(out, *CKPT, *sets, args=jax)
    assert proc.returncode == 0, proc.stderr
    assert "skipping" not in proc.stderr and "resuming" in proc.stderr and "from step-00000006" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    last = CheckpointDir(out / "checkpoints").steps()[0][1]
    mine, theirs = read_checkpoint(last), read_checkpoint(CheckpointDir(ref / "checkpoints").steps()[0][1])
    for a, b in ((mine.params, theirs.params), (mine.opt_state, theirs.opt_state)):
        assert [(k, v.tobytes()) for k, v in tree_items(a)] == [(k, v.tobytes()) for k, v in tree_items(b)]
    assert main(["eval", "--checkpoint", str(last), "--backend", "jax", "--split", "valid"]) == 0


@pytest.mark.slow
def test_a_registered_optax_chain_under_grf_fit_resumes_evaluates_and_crosschecks(tmp_path):
    """experiments/optax_chain.py (clip + adabelief registered with ``optax=True``, trained by
    ``grf.fit``): killed after step 7 and run again, it resumes from its checkpoint to the
    uninterrupted run's bytes; ``grf eval`` and ``grf crosscheck --checkpoint`` (torch beside JAX:
    evaluation builds no optimizer) take the file."""
    import subprocess
    import sys

    from .common import ROOT, TINY, subprocess_env

    script = ROOT / "experiments" / "optax_chain.py"

    def command(out):
        return [sys.executable, str(script), str(out), *TINY, *CKPT, "optim.lr=0.01", "train.epochs=2"]

    ref, out = tmp_path / "ref", tmp_path / "run"
    proc = subprocess.run(command(ref), cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert _opt_keys(ref) == {"step", "optax"} and str(script) in (ref / "config.toml").read_text()
    _run_until_fault(out, "after-step@7", command=command(out))
    proc = subprocess.run(command(out), cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr and "from step-00000006" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    last = out / "checkpoints" / "last.safetensors"
    for name in ("params", "opt_state"):
        a, b = (getattr(read_checkpoint(d / "checkpoints" / "last.safetensors"), name) for d in (out, ref))
        assert [(k, v.tobytes()) for k, v in tree_items(a)] == [(k, v.tobytes()) for k, v in tree_items(b)]
    for args in (["eval", "--checkpoint", str(last)], ["crosscheck", "--checkpoint", str(last), "--split", "valid"]):
        proc = subprocess.run([sys.executable, "-m", "gr_functional.cli", *args], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (args, proc.stderr)


def test_an_optax_builder_not_declared_as_optax_is_refused_naming_the_fix():
    import optax

    from backends import get_backend
    from gr_functional.optimizers import OPTIMIZERS, build, register_optimizer

    register_optimizer("test_undeclared_optax")(lambda cfg, lr: optax.adam(lr))
    try:
        cfg = tiny_config("optim.name=test_undeclared_optax", "backend.name=jax")
        with pytest.raises(ConfigError, match=r"register_optimizer\('test_undeclared_optax', optax=True\)"):
            build(get_backend("jax"), cfg.optim)
    finally:
        OPTIMIZERS.remove("test_undeclared_optax")


def test_an_optimizer_key_the_optimizer_does_not_read_is_refused_by_name(capsys):
    """Round 4: ``optim.momentum`` under adamw was silently ignored. A key given with the optimizer
    is refused naming who reads it; a file's key for the file's optimizer, which ``--set optim.name``
    replaced, is a warning."""
    with pytest.raises(ConfigError, match=r"optim.momentum: optim.name='adamw' does not read it.*\(sgd\)"):
        tiny_config("optim.momentum=0.5")
    with pytest.raises(ConfigError, match=r"optim.beta1: optim.name='optax:sgd' does not read it"):
        tiny_config("optim.name=optax:sgd", "backend.name=jax", "optim.beta1=0.5")
    assert tiny_config("optim.name=sgd", "optim.momentum=0.5").optim.momentum == 0.5
    assert "optim.beta1 is not read by optim.name='sgd'" in capsys.readouterr().err
