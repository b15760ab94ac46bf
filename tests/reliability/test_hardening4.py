"""[hardening4] regressions of the fault campaign: the user's registered code (an optimizer builder,
a model's encode / init_params, a loss) raising or calling sys.exit, a plugin calling sys.exit at
import, ``--plugin`` given a folder or a non-.py file, ``data.path`` naming a folder. Each test
failed before the change it guards (the campaign's reproduction is in each docstring).

In-process (``main([...])``) on the tiny synthetic run; the plugins register with ``replace=True``
inside ``scoped`` registries, so nothing they add outlives the test.
"""
from __future__ import annotations

import contextlib
import sys
import textwrap

import pytest

from gr_functional import losses, model, plugins
from gr_functional.checkpoint import CheckpointDir
from gr_functional.cli import main
from gr_functional.data.registry import DATASETS
from gr_functional.errors import DataError
from gr_functional.optimizers.registry import OPTIMIZERS

from .common import TINY, sets

RESUMES = "Nothing was lost: the checkpoints already written are kept, and the same command"


@pytest.fixture(autouse=True)
def scoped_registries():
    with contextlib.ExitStack() as stack:
        for registry in (OPTIMIZERS, model.MODELS, losses.LOSSES, DATASETS):
            stack.enter_context(registry.scoped())
        yield


def _train(out, plugin, *extra, epochs: int = 1) -> list[str]:
    return (["train", "--config", "quickstart", "--quiet", "--out", str(out), "--plugin", str(plugin)]
            + sets(TINY + [f"train.epochs={epochs}", *extra]))


_USER_CODE = '''
import os
import sys

import gr_functional as grf
from gr_functional import losses
from gr_functional.optimizers import register_optimizer


def _failing(what):
    return os.environ.get("H4_FAIL") == what


@register_optimizer("h4_opt", replace=True)
def h4_opt(cfg, learning_rate):
    if _failing("builder"):
        raise RuntimeError("the builder's own bug")
    if _failing("exit"):
        sys.exit(3)
    return grf.optimizers.OPTIMIZERS.get("adamw")(cfg, learning_rate)


def h4_init(cfg, seed=0, num_items=None):
    if _failing("init"):
        raise KeyError("init's own bug")
    return grf.model.init_params(cfg, seed=seed, num_items=num_items)


@grf.model.register_model("h4_model", init_params=h4_init, param_shapes=grf.model.param_shapes, replace=True)
def h4_encode(B, params, batch, cfg, trace=None):
    if _failing("encode") and os.path.exists(os.environ["H4_AFTER"]):
        raise ValueError("the encoder's own bug")
    if _failing("project"):
        params = {}          # the project's encode then fails on its own line: the project's error
    return grf.model.encode(B, params, batch, cfg, trace)


@losses.register("h4_loss", replace=True)
def h4_loss(B, user, items, batch, loss):
    if _failing("loss"):
        return 1 / 0
    return losses.get("sampled_softmax").fn(B, user, items, batch, loss)
'''


@pytest.fixture
def user_code(tmp_path):
    path = tmp_path / "user_code.py"
    path.write_text(_USER_CODE)
    return path


def _line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ----------------------------------------------------------------------------- 1. the user's registered code fails
@pytest.mark.slow
@pytest.mark.parametrize("fail, key, named, said, raised_at", [
    ("builder", "optim.name=h4_opt", "optimizer 'h4_opt' (h4_opt)", "raised RuntimeError: the builder's own bug",
     "raise RuntimeError"),
    ("exit", "optim.name=h4_opt", "optimizer 'h4_opt' (h4_opt)", "called sys.exit(3)", "sys.exit(3)"),
    ("init", "model.name=h4_model", "retrieval model 'h4_model' (init_params: h4_init)",
     "raised KeyError: \"init's own bug\"", "raise KeyError"),
    ("loss", "loss.name=h4_loss", "loss 'h4_loss' (h4_loss)", "raised ZeroDivisionError: division by zero",
     "return 1 / 0"),
])
def test_a_registered_function_of_a_plugin_failing_exits_6_naming_it(tmp_path, user_code, monkeypatch, capsys,
                                                                    fail, key, named, said, raised_at):
    """Before: a plugin's optimizer builder (or model init_params, loss) raising ended in a
    traceback and exit 1; one calling sys.exit(3) exited 3, "diverged". Now: exit 6 and one line
    naming the registered entry, the plugin, FILE:LINE of the raise, the exception, and that the
    same command goes on once fixed."""
    monkeypatch.setenv("H4_FAIL", fail)
    out = tmp_path / "run"
    assert main(_train(out, user_code, key)) == 6
    err = capsys.readouterr().err
    assert f"grf: error: the plugin {user_code} failed: {named} {said}" in err, err
    assert f"(at {user_code}:{_line_of(user_code, raised_at)})" in err and RESUMES in err
    assert "Traceback" not in err
    monkeypatch.delenv("H4_FAIL")                           # the cause fixed: the same command runs
    assert main(_train(out, user_code, key)) == 0


def test_a_plugin_encode_failing_mid_run_exits_6_and_the_same_command_resumes(tmp_path, user_code, monkeypatch,
                                                                             capsys):
    """Before: a plugin model's encode raising at step 4 ended in a traceback and exit 1."""
    out = tmp_path / "run"
    monkeypatch.setenv("H4_FAIL", "encode")
    monkeypatch.setenv("H4_AFTER", str(out / "checkpoints" / "step-00000003.safetensors"))
    args = _train(out, user_code, "model.name=h4_model", "train.checkpoint_every=3")
    assert main(args) == 6
    err = capsys.readouterr().err
    assert "retrieval model 'h4_model' (encode: h4_encode) raised ValueError: the encoder's own bug" in err, err
    assert f"(at {user_code}:{_line_of(user_code, 'raise ValueError')})" in err and RESUMES in err
    assert CheckpointDir(out / "checkpoints").steps()[0][0] == 3                      # kept
    monkeypatch.delenv("H4_FAIL")
    assert main(args) == 0
    assert "resuming" in capsys.readouterr().err


def test_the_projects_own_error_under_a_plugin_keeps_its_traceback(tmp_path, user_code, monkeypatch):
    """The decision comes from where the exception was raised: the project's encode failing (here on
    parameters a plugin passed it) is the project's error, not exit 6."""
    monkeypatch.setenv("H4_FAIL", "project")
    with pytest.raises(KeyError, match="item_emb"):
        main(_train(tmp_path / "run", user_code, "model.name=h4_model"))


def test_plugin_failure_decides_by_the_innermost_frame_of_the_plugin_or_the_project(tmp_path):
    path = tmp_path / "frames.py"
    path.write_text(textwrap.dedent("""
        import textwrap
        import gr_functional.model as m

        def own():
            raise OSError("own")

        def through_a_library():
            return textwrap.dedent(5)              # the stdlib raises: still the plugin's call

        def through_the_project():
            return m.model_of(None)                # the project raises: the project's
    """))
    plugins.import_plugins([str(path)])
    module = next(mod for name, mod in sys.modules.items() if name.startswith("grf_plugin_frames_"))

    def failure(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return plugins.plugin_failure(exc, resumes=False)
        raise AssertionError("did not raise")

    own = failure(module.own)
    assert f"the plugin {path} failed: its function own raised OSError: own" in own
    assert f"(at {path}:{_line_of(path, 'raise OSError')})" in own
    assert own.endswith("Nothing was written; fix the plugin and rerun the same command")
    library = failure(module.through_a_library)
    assert "its function through_a_library raised TypeError" in library
    assert f"(at {path}:{_line_of(path, 'textwrap.dedent(5)')})" in library
    assert failure(module.through_the_project) is None
    assert failure(lambda: {}["x"]) is None                                          # no plugin frame at all


# ----------------------------------------------------------------------------- 2. sys.exit at import
@pytest.mark.parametrize("code", [3, 0])
def test_a_plugin_calling_sys_exit_at_import_is_a_user_error_naming_it(tmp_path, capsys, code):
    """Before: a plugin calling sys.exit(3) at import made grf exit 3 with no message."""
    plugin = tmp_path / "exits.py"
    plugin.write_text(f"import sys\n\nsys.exit({code})\n")
    out = tmp_path / "run"
    assert main(_train(out, plugin)) == 2
    err = capsys.readouterr().err
    assert "grf: error: --plugin" in err and f"called sys.exit({code}) at import ({plugin}:3)" in err, err
    assert "if __name__ == \"__main__\":" in err and not out.exists()


# ----------------------------------------------------------------------------- 3. --plugin a folder, a non-.py file
def test_plugin_given_a_folder_or_a_non_py_file_says_so(tmp_path, capsys, monkeypatch):
    """Before: `--plugin FOLDER` and `--plugin notes.txt` said "No module named ..." (taken for
    module names)."""
    folder, text = tmp_path / "plugins", tmp_path / "notes.txt"
    folder.mkdir()
    text.write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    takes = "takes a .py file's path or an importable module's name"
    for entry, said in [(str(folder), "is a folder"), ("plugins", "is a folder"), (str(folder) + "/", "is a folder"),
                        (str(text), "is not a .py file"), ("notes.txt", "is not a .py file"),
                        (str(tmp_path / "none"), "is neither an existing .py file nor a module name"),
                        ("no_such_module_h4", "no module of that name can be imported")]:
        assert main(_train(tmp_path / "run", entry)) == 2, entry
        err = capsys.readouterr().err
        assert f"plugin {entry!r} {said}" in err or f"plugin {entry!r}: {said}" in err, err
        assert takes in err and "Traceback" not in err
    folder_py = tmp_path / "odd.py"
    folder_py.mkdir()
    assert main(_train(tmp_path / "run", folder_py)) == 2
    assert "is a folder, not a .py file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 4. data.path a folder
def test_data_path_naming_a_folder_says_it_is_a_folder(tmp_path, capsys):
    """Before: the interactions loader given a folder said "no such file"."""
    from gr_functional.data.datasets import resolve_path
    from gr_functional.data.registry import get_dataset
    from gr_functional.data.sources.interactions import load_csv

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "events.csv").write_text("user_id,item_id,timestamp\n1,2,3\n")
    with pytest.raises(DataError, match=r"data is a folder \(it holds events.csv\); data.path takes the "
                                        r"interactions file itself .*data.path=.*events.csv"):
        load_csv(folder)
    with pytest.raises(DataError, match=r"is a folder without ratings.dat .* data.path takes the ML-1M file itself"):
        resolve_path(get_dataset("ml-1m"), str(tmp_path))
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "run")]
                + sets(TINY + ["data.dataset=csv", f"data.path={folder}"])) == 2
    err = capsys.readouterr().err
    assert "is a folder; name the CSV/TSV file in it" in err and "data.path takes a file" in err, err


def test_a_ranking_log_path_naming_a_folder_says_it_is_a_folder(tmp_path):
    """The ranking logs read through loaders._check_file, which said "no such file" for a folder."""
    from gr_functional.data.loaders import _check_file

    with pytest.raises(DataError, match="is a folder; data.path takes the data file itself"):
        _check_file(tmp_path)
