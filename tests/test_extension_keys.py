"""Extension point: a plugin's own config keys (``config.register_keys``), declared from outside the
package with a type, a default, a range, a description and a check; read as ``cfg.<section>.<key>``,
checked like a built-in key, recorded in config.toml and the checkpoint, compared on resume, shown by
``grf report``, and kept unchanged by a stored config read without the plugin."""
from __future__ import annotations

import dataclasses
import pickle
import sys
import tomllib
from dataclasses import dataclass
from typing import Literal

import pytest

from gr_functional import config
from gr_functional.checkpoint import read_checkpoint
from gr_functional.cli import main
from gr_functional.config import ConfigError, build_config, config_to_toml, register_keys, scoped_keys
from gr_functional.configure import load_config, plugins_in_use

from .reliability.common import ROOT, TINY, sets


@dataclass(frozen=True)
class FocalKeys:
    gamma: float = config.key(2.0, ge=0.0, help="focusing exponent")
    mode: Literal["mean", "sum"] = "mean"
    ks: tuple[int, ...] = (1, 2)

    def __post_init__(self):
        if self.mode == "sum" and self.gamma > 4:
            raise ValueError(f"loss.gamma={self.gamma} with loss.mode='sum' overflows: keep gamma <= 4")


@pytest.fixture
def focal():
    with scoped_keys():
        register_keys("loss", FocalKeys, when="loss.name=in_batch")
        yield


def test_declared_keys_have_their_defaults_and_are_checked_like_built_in_ones(focal):
    assert config.Config().loss.gamma == 2.0 and config.Config().loss.temperature == 0.05
    cfg = load_config(None, ["loss.name=in_batch", "loss.gamma=3", "loss.mode=sum", "loss.ks=[4]"])
    assert (cfg.loss.gamma, cfg.loss.mode, cfg.loss.ks) == (3.0, "sum", (4,))
    assert config.replace(cfg, loss={"gamma": 1.0}).loss.gamma == 1.0
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    for bad, words in (("loss.gamma=-1", "must be >= 0"), ("loss.gamma=x", "expected a number"),
                       ("loss.mode=max", "is not one of .mean., .sum."), ("loss.gama=1", "did you mean loss.gamma")):
        with pytest.raises(ConfigError, match=words) as info:
            load_config(None, ["loss.name=in_batch", bad])
        assert f"--set {bad}" in str(info.value)
    with pytest.raises(ConfigError, match="overflows: keep gamma <= 4"):  # the keys' own check
        load_config(None, ["loss.name=in_batch", "loss.gamma=5", "loss.mode=sum"])


def test_a_key_the_selected_choice_does_not_read_is_refused_naming_who_reads_it(focal):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["loss.gamma=3"])
    text = str(info.value)
    assert text.startswith("--set loss.gamma=3: loss.gamma is read only when loss.name=in_batch")
    assert "FocalKeys" in text and "loss.name='sampled_softmax' does not read it" in text


def test_without_the_declaration_the_key_is_unknown_and_the_message_says_plugins_add_keys():
    with pytest.raises(ConfigError, match=r"unknown key loss.gamma.*--plugin FILE"):
        load_config(None, ["loss.gamma=3"])


def test_config_toml_records_the_keys_and_a_stored_config_keeps_them_without_the_plugin(focal):
    cfg = load_config(None, ["loss.name=in_batch", "loss.gamma=3"])
    text = config_to_toml(cfg)
    assert "gamma = 3.0" in text and 'mode = "mean"' in text
    assert text.index("negatives_precision") < text.index("gamma")  # the built-in keys first
    with scoped_keys():
        config.EXTENSION_KEYS.clear()  # a process that has not loaded the plugin (grf report, a checkpoint check)
        with pytest.raises(ConfigError, match="unknown key loss.gamma"):
            build_config(tomllib.loads(text))  # a user's file: refused
        stored = build_config(tomllib.loads(text), stored=True)
        assert stored.loss.gamma == 3.0 and config_to_toml(stored) == text  # written back unchanged


def test_registering_refuses_what_a_toml_file_cannot_hold_or_another_key_has():
    @dataclass(frozen=True)
    class Taken:
        temperature: float = 1.0

    @dataclass(frozen=True)
    class NoDefault:
        alpha: float

    @dataclass(frozen=True)
    class BadType:
        table: dict = dataclasses.field(default_factory=dict)

    @dataclass(frozen=True)
    class OutOfRange:
        beta: float = config.key(-1.0, ge=0.0)

    @dataclass
    class Mutable:
        beta: float = 1.0

    with scoped_keys():
        for section, cls, when, words in (("loss", Taken, "", "already a key of \\[loss\\]"),
                                          ("loss", NoDefault, "", "has no default"),
                                          ("loss", BadType, "", "has no default|unsupported type"),
                                          ("loss", OutOfRange, "", "default.*must be >= 0"),
                                          ("loss", Mutable, "", "frozen"),
                                          ("losses", FocalKeys, "", "no such section"),
                                          ("loss", FocalKeys, "loss.name", "expected 'section.key=value'")):
            with pytest.raises(ValueError, match=words):
                register_keys(section, cls, when=when)
        register_keys("loss", FocalKeys)
        register_keys("loss", FocalKeys)  # the same class again (a plugin imported twice): one declaration

        @dataclass(frozen=True)
        class Again:
            gamma: float = 1.0

        with pytest.raises(ValueError, match="already a key of \\[loss\\] \\(declared by FocalKeys\\)"):
            register_keys("loss", Again)


PLUGIN = ROOT / "experiments" / "bpr_loss.py"


def _train_with_plugin(*args: str) -> int:
    """grf train with the example plugin, its keys declared for this call only (the plugin imported
    afresh, its declarations undone after: they stay out of the other tests' configs)."""
    for name in [n for n in sys.modules if n.startswith("grf_plugin_bpr_loss")]:
        del sys.modules[name]
    with scoped_keys():
        return main(["train", "--config", "quickstart", "--quiet", "--plugin", str(PLUGIN), *args])


@pytest.fixture(scope="module")
def margin_runs(tmp_path_factory):
    """Two tiny BPR runs of the shipped example plugin (its key loss.bpr_margin), trained by grf train."""
    out = tmp_path_factory.mktemp("bpr_keys")
    for margin in ("0", "0.5"):
        assert _train_with_plugin("--out", str(out / f"m{margin}"),
                                  *sets(TINY + ["loss.name=bpr", f"loss.bpr_margin={margin}", "train.epochs=1"])) == 0
    return out


def test_a_plugin_key_is_recorded_compared_on_resume_and_shown_by_report(margin_runs, capsys):
    run = margin_runs / "m0.5"
    assert "bpr_margin = 0.5" in (run / "config.toml").read_text()
    # read here without the plugin's declaration: the stored key is kept as it was written
    assert read_checkpoint(run / "checkpoints" / "last.safetensors").config.loss.bpr_margin == 0.5
    capsys.readouterr()
    assert main(["report", str(margin_runs / "m0"), str(run)]) == 0
    table = capsys.readouterr().out
    assert "| run | loss.bpr_margin |" in table and "| m0.5 | 0.5 |" in table
    code = _train_with_plugin("--out", str(run), *sets(TINY + ["loss.name=bpr", "loss.bpr_margin=0.7", "train.epochs=2"]))
    assert code == 2
    assert "loss.bpr_margin: checkpoint 0.5, now 0.7" in capsys.readouterr().err


def test_a_module_declaring_keys_is_listed_for_resume(monkeypatch):
    # keys declared by a module outside the package: a resume must import it again to read them
    module = type(sys)("my_focal_keys")
    module.__file__ = str(ROOT / "experiments" / "my_focal_keys.py")
    monkeypatch.setitem(sys.modules, "my_focal_keys", module)
    exec("from dataclasses import dataclass\n"
         "@dataclass(frozen=True)\n"
         "class SmoothingKeys:\n"
         "    smoothing: float = 0.1\n", module.__dict__)
    with scoped_keys():
        register_keys("loss", module.SmoothingKeys)
        assert plugins_in_use(load_config(None, ["loss.smoothing=0.2"])) == ("my_focal_keys",)
