"""Config schema: TOML loading, overrides, and errors that name the key and list valid ones."""
from pathlib import Path

import pytest
import tomllib

from gr_functional.config import ConfigError, build_config, config_to_toml, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "experiments" / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_packaged_configs_load_and_roundtrip(path):
    cfg = load_config(path)
    assert build_config(tomllib.loads(config_to_toml(cfg))) == cfg


def test_ml1m_configs_mirror_generative_recommenders():
    small = load_config(Path(CONFIGS[0]).parent / "ml1m_hstu.toml")
    large = load_config(Path(CONFIGS[0]).parent / "ml1m_hstu_large.toml")
    assert (small.model.num_blocks, small.model.num_heads, small.model.dqk) == (2, 1, 50)
    assert (large.model.num_blocks, large.model.num_heads, large.model.dqk, large.model.dv) == (8, 2, 25, 25)
    for cfg in (small, large):
        assert cfg.model.max_len == 200 and cfg.model.norm_len == 211
        assert cfg.model.input_dropout == cfg.model.linear_dropout == 0.2
        assert cfg.train.batch_size == 128 and cfg.optim.lr == 1e-3
        assert (cfg.optim.beta1, cfg.optim.beta2) == (0.9, 0.98)
        assert cfg.model.num_negatives == 128 and cfg.model.temperature == 0.05


def test_overrides():
    cfg = load_config(None, ["model.num_blocks=4", "backend.name=jax", "eval.ks=[5, 10]", "model.pos_bias=false"])
    assert cfg.model.num_blocks == 4 and cfg.backend.name == "jax" and cfg.eval.ks == (5, 10)
    assert cfg.model.pos_bias is False


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nnum_block = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key model.num_block; valid keys in \[model\]: num_items"):
        load_config(path)


def test_unknown_section(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[modle]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]; valid sections: data, model"):
        load_config(path)


@pytest.mark.parametrize("text,message", [
    ("[model]\nnum_blocks = \"two\"\n", "model.num_blocks: expected an integer, got 'two'"),
    ("[model]\npos_bias = 1\n", "model.pos_bias: expected true/false"),
    ("[optim]\nlr = true\n", "optim.lr: expected a number"),
    ("[eval]\nks = 10\n", "eval.ks: expected a list"),
])
def test_wrong_types(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["num_blocks=3"])
