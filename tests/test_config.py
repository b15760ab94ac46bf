"""Config schema: TOML loading, overrides, and errors that name the key and list valid ones."""
from pathlib import Path

import pytest
import tomllib

from gr_functional.config import ConfigError, build_config, config_to_toml

from gr_functional.configure import load_config

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
        assert cfg.loss.num_negatives == 128 and cfg.loss.temperature == 0.05


def test_overrides():
    cfg = load_config(None, ["model.num_blocks=4", "backend.name=jax", "eval.ks=[5, 10]", "model.pos_bias=false"])
    assert cfg.model.num_blocks == 4 and cfg.backend.name == "jax" and cfg.eval.ks == (5, 10)
    assert cfg.model.pos_bias is False


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nnum_block = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key model.num_block; did you mean model.num_blocks\? \(valid keys in \[model\]: task, name, num_items"):
        load_config(path)


def test_unknown_section(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[modle]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]; did you mean \[model\]\? \(valid sections: data, model"):
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
    with pytest.raises(ConfigError, match="missing.toml: no such file, and no packaged config of that name"):
        load_config(tmp_path / "missing.toml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["num_blocks=3"])


# ----------------------------------------------------------------------------- hardening: parse-time checks
def test_set_errors_name_the_override_not_the_file():
    path = Path(CONFIGS[0]).parent / "ml1m_hstu.toml"
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["model.num_block=4"])
    assert str(exc.value).startswith("--set model.num_block=4: unknown key model.num_block; did you mean "
                                     "model.num_blocks?")
    with pytest.raises(ConfigError, match=r"^--set modle.x=1: unknown section \[modle\]; did you mean \[model\]"):
        load_config(path, ["modle.x=1"])


@pytest.mark.parametrize("override,message", [
    ("optim.lr=nan", "must be a finite number >= 0, got nan"),
    ("optim.lr=inf", "must be a finite number >= 0, got inf"),
    ("optim.lr=-1e-3", "must be >= 0, got -0.001"),
    ("optim.beta2=1.0", "must be >= 0 and < 1, got 1.0"),
    ("optim.eps=0", "must be > 0"),
    ("loss.temperature=0", "must be > 0, got 0.0"),
    ("loss.temperature=nan", "must be a finite number > 0"),
    ("model.ln_eps=0", "must be > 0"),
    ("model.l2_eps=0", "must be > 0"),
    ("model.input_dropout=1.0", "must be >= 0 and < 1"),
    ("model.max_len=0", "must be >= 1, got 0"),
    ("loss.num_negatives=0", "must be >= 1"),
    ("eval.batch_size=0", "must be >= 1, got 0"),
    ("train.batch_size=0", "must be >= 1"),
    ("train.loss_scale=0.5", "must be >= 1"),
    ("train.max_update_ratio=-1", "must be >= 0"),
    ("dist.timeout_s=0", "must be > 0"),
    ("data.zipf_a=nan", "must be a finite number >= 0"),
])
def test_every_number_is_range_checked_at_parse_time(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert str(exc.value).startswith(f"--set {override}: ") and message in str(exc.value)


@pytest.mark.parametrize("override,valid", [
    ("ops.attention=flash", "'default', 'jagged', 'tiled', 'reference', 'cpu_fused', 'best', 'triton'"),
    ("backend.dtype=int8", "'float32', 'float64'"),
    ("backend.precision=fp8", "'fp32', 'bf16', 'fp16'"),
    ("backend.name=tensorflow", "'jax', 'torch', 'npu'"),
    ("backend.deterministic=maybe", "'auto', 'on', 'off'"),
    ("dist.balance=greedy", "'none', 'kk', 'lookahead'"),
    ("dist.backend=mpi", "'gloo', 'nccl', 'hccl'"),
    ("data.dataset=ml-100k", "'synthetic', 'ml-1m', 'ml-20m', 'kuairand'"),
])
def test_fixed_choices_are_literals_rejected_with_the_valid_list(override, valid):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert str(exc.value).startswith(f"--set {override}: ") and valid in str(exc.value)


def test_near_miss_choice_is_suggested():
    with pytest.raises(ConfigError, match=r"did you mean 'bf16'\?"):
        load_config(None, ["backend.precision=bf61"])


def test_cross_key_rules():
    with pytest.raises(ConfigError, match=r"ops.attention='triton': kernel 'triton' does not run on the jax backend "
                                          r"\(it runs on torch, npu\); valid for jax: 'default', 'jagged', "
                                          r"'tiled', 'reference'"):
        load_config(None, ["backend.name=jax", "ops.attention=triton"])
    with pytest.raises(ConfigError, match="must contain 10"):
        load_config(None, ["eval.ks=[5, 20]"])
    with pytest.raises(ConfigError, match="fp16 logits"):
        load_config(None, ["backend.precision=fp16", "loss.temperature=1e-6"])
    assert load_config(None, ["backend.deterministic=true"]).backend.deterministic == "on"


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlr = nan\n")
    with pytest.raises(ConfigError, match=r"bad.toml: optim.lr: must be a finite number >= 0, got nan"):
        load_config(path)
