"""Edges of the extension points found by review: a hook or plugin that fails, saves, or is
recorded through the Python API; old run configs; evaluating a plugin loss's checkpoint."""
from __future__ import annotations

import sys
import textwrap

import pytest

from gr_functional import runner
from gr_functional.checkpoint import CheckpointDir
from gr_functional.experiment import prepare
from gr_functional.errors import ConfigError, TrainingAborted
from gr_functional.hooks import Evaluation, Hook

from .reliability.common import file_digests, metrics, tiny_config


def test_fresh_with_a_hook_that_cannot_start_leaves_the_folder_alone(tmp_path, monkeypatch):
    out = tmp_path / "run"
    runner.train(tiny_config("train.epochs=1"), out, progress=False)
    before = file_digests(out)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the package is missing
    with pytest.raises(ConfigError, match="needs the tensorboard package"):
        runner.train(tiny_config("train.epochs=1", "train.tensorboard=true"), out, progress=False, resume="never")
    assert file_digests(out) == before


class SaveEveryFive(Hook):
    def on_step(self, run, step):
        if step.step % 5 == 0:
            run.save("mine", step.epoch)


def test_a_hooks_checkpoint_after_an_epochs_last_step_keeps_that_epochs_end(tmp_path, monkeypatch):
    """5 steps per epoch: the hook's checkpoint at step 5 is written before epoch 0 ends; a crash
    in that evaluation and a resume still record epoch 0 (evaluated, its own loss)."""
    cfg = tiny_config("train.epochs=2")
    want = runner.train(cfg, tmp_path / "plain", progress=False)
    real = Evaluation.on_epoch_end
    crashed = []

    def crash_once(self, run, record):
        if not crashed:
            crashed.append(1)
            raise RuntimeError("evaluation crashed")
        return real(self, run, record)

    monkeypatch.setattr(Evaluation, "on_epoch_end", crash_once)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        runner.train(cfg, out, progress=False, hooks=[SaveEveryFive()])
    assert CheckpointDir(out / "checkpoints").steps()[0][0] == 5
    got = runner.train(cfg, out, progress=False, hooks=[SaveEveryFive()])
    assert [m["epoch"] for m in metrics(out) if m["kind"] == "eval" and m["split"] == "test"] == [0, 1]
    assert got["hr@10"] == want["hr@10"] and got["epoch"] == want["epoch"]


class BadClose(Hook):
    def on_close(self, run):
        raise RuntimeError("bug in my on_close")


def test_a_failing_on_close_never_hides_the_runs_own_error(tmp_path, capsys):
    with pytest.raises(TrainingAborted):
        runner.train(tiny_config("train.max_update_ratio=1e-6", "train.max_bad_steps=2"), tmp_path / "run",
                     progress=False, hooks=[BadClose()])
    err = capsys.readouterr().err
    assert "BadClose failed in on_close at step" in err and "RuntimeError: bug in my on_close" in err


LOSS = textwrap.dedent('''
    from gr_functional import losses

    @losses.register("edge_loss", negatives="sampled")
    def edge_loss(B, user, items, batch, cfg):
        return losses.sampled_softmax(B, user, items, batch, cfg)
''')


def test_code_api_records_plugins_as_absolute_paths_and_eval_needs_no_loss(tmp_path, monkeypatch):
    import gr_functional as grf
    from gr_functional import losses

    (tmp_path / "edge_loss.py").write_text(LOSS)
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config("train.epochs=1")
    exp = grf.prepare(cfg, plugins=["edge_loss.py"])
    assert exp.cfg.train.plugins == (str(tmp_path / "edge_loss.py"),)
    out = tmp_path / "run"
    runner.train(grf.replace(cfg, train={"plugins": ("edge_loss.py",)}, loss={"name": "edge_loss"}), out,
                 progress=False)
    assert f'plugins = ["{tmp_path / "edge_loss.py"}"]' in (out / "config.toml").read_text()
    # evaluating on another backend needs the model, not the training loss
    losses.LOSSES.remove("edge_loss")
    (tmp_path / "edge_loss.py").unlink()
    from gr_functional.checkpoint import read_checkpoint

    ck = read_checkpoint(out / "checkpoints" / "last.safetensors")
    monkeypatch.setattr("gr_functional.runner.import_plugins", lambda *a, **k: None)
    assert runner.evaluate_checkpoint(ck.path, "torch")["hr@10"] >= 0


@pytest.mark.parametrize("body, where", [("x = 1\ny = = 2\n", "bad_syntax.py:2"),
                                         ("import json\njson.loads('{')\n", "bad_json.py:2")])
def test_a_plugin_error_names_the_plugins_own_line(tmp_path, body, where):
    from gr_functional.plugins import import_plugins

    name = where.split(":")[0]
    (tmp_path / name).write_text(body)
    with pytest.raises(ConfigError, match=f"failed at {tmp_path / name}:{where.split(':')[1]}"):
        import_plugins([str(tmp_path / name)])


def test_a_string_plugins_value_with_plugin_is_a_type_error(tmp_path):
    from gr_functional.configure import load_config

    (tmp_path / "cfg.toml").write_text('[train]\nplugins = "x.py"\n')
    (tmp_path / "ok.py").write_text("")
    with pytest.raises(ConfigError, match="train.plugins: expected a list of str"):
        load_config(tmp_path / "cfg.toml", plugins=[str(tmp_path / "ok.py")])


def test_a_runs_old_config_toml_is_migrated(tmp_path):
    from gr_functional.configure import load_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("[model]\ntemperature = 0.07\nnum_negatives = 64\n")
    cfg = load_config(run / "config.toml")
    assert (cfg.loss.temperature, cfg.loss.num_negatives) == (0.07, 64)
    (tmp_path / "mine.toml").write_text("[model]\ntemperature = 0.07\n")
    with pytest.raises(ConfigError, match=r"model.temperature moved to loss.temperature"):
        load_config(tmp_path / "mine.toml")


def test_one_file_as_script_and_plugin_registers_its_loss_once(tmp_path):
    import subprocess

    from .reliability.common import ROOT, subprocess_env

    script = tmp_path / "script_loss.py"
    script.write_text(LOSS.replace("edge_loss", "script_loss") + textwrap.dedent('''
        if __name__ == "__main__":
            from gr_functional.configure import load_config
            print(load_config(None, ["loss.name=script_loss"], plugins=[__file__]).train.plugins)
    '''))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(script) in r.stdout


def test_a_taken_hook_name_is_refused_unless_replaced():
    from gr_functional.hooks import HOOKS, register_hook

    class A(Hook):
        pass

    class B(Hook):
        pass

    try:
        register_hook("edge_hook", A)
        register_hook("edge_hook", A)                       # the same class again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_hook("edge_hook", B)
        register_hook("edge_hook", B, replace=True)
        assert HOOKS.get("edge_hook") is B
    finally:
        HOOKS.remove("edge_hook")


def test_the_tie_seed_matters_on_resume_only_when_ties_are_shuffled():
    from gr_functional.config import replace
    from gr_functional.resume import resume_differences

    cfg = tiny_config()
    assert resume_differences(cfg, replace(cfg, data={"ties_seed": 7}))[0] == []
    shuffled = replace(cfg, data={"ties": "shuffle"})
    assert resume_differences(shuffled, replace(shuffled, data={"ties_seed": 7}))[0] == [
        "data.ties_seed: checkpoint 0, now 7"]


def test_code_api_resolves_a_run_long_decay():
    exp = prepare(tiny_config("optim.schedule=cosine", "optim.decay_steps=0", "optim.warmup_steps=2"))
    # TINY: 5 updates per epoch x 3 epochs, less the warmup
    assert exp.loader.steps_per_epoch == 5 and exp.cfg.optim.decay_steps == 13
