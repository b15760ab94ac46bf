"""Resource checks that run before a run allocates or writes anything (README "Bad inputs"):
``loss.num_negatives`` against the catalogue, the memory estimate of ``gr_functional.memory``
against the memory available, and the data rules (sparse ids, negative timestamps) end to end
through ``grf train``: exit 2, a message naming the file/line or key and the fix, and OUT
untouched (byte-identical when it holds a finished run, not created otherwise)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from gr_functional import memory
from gr_functional.cli import main
from gr_functional.config import ConfigError, replace
from gr_functional.configure import load_config

from .common import ROOT, file_digests, metrics, subprocess_env, tiny_config
from .test_bad_inputs import finished_run, ratings, train_args, write  # noqa: F401 (finished_run: a fixture)

STRAY = 999_999_999
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.toml"))


def _no_allocation(monkeypatch):
    """Make building params or a backend fail loudly: a check that passes this ran before both."""
    def boom(*args, **kwargs):
        raise AssertionError("the run got as far as allocating (params or backend)")

    monkeypatch.setattr("gr_functional.model.init_params", boom)
    monkeypatch.setattr("gr_functional.runner.make_backend", boom)


def _refused(args, out: Path, capsys) -> str:
    """Run ``grf`` expecting exit 2 and OUT unchanged (or still absent); return stderr."""
    before = file_digests(out) if out.exists() else None
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("grf: error: ") and "Traceback" not in err, err
    if before is None:
        assert not out.exists()
    else:
        assert file_digests(out) == before
    return err


# ------------------------------------------------------------------------------ data rules, end to end
def test_stray_item_id_is_refused_before_anything_is_written(finished_run, tmp_path, capsys, monkeypatch):
    _, out, _ = finished_run
    rows = ratings()
    rows[4][1] = STRAY
    data = write(tmp_path / "ratings.dat", rows)
    _no_allocation(monkeypatch)
    start = time.perf_counter()
    for target in (out, tmp_path / "new"):
        err = _refused(train_args(target, data), target, capsys)
        assert f"{data}:5: item id {STRAY:,} would make the item embedding table {STRAY + 1:,} rows" in err
        assert f"only {len({r[1] for r in rows})} distinct item ids" in err and "data.remap_items=true" in err
    assert time.perf_counter() - start < 10.0


def test_stray_item_id_trains_and_evaluates_when_remapped(tmp_path, capsys):
    rows = ratings()
    rows[4][1] = STRAY
    data = write(tmp_path / "ratings.dat", rows)
    out = tmp_path / "run"
    assert main(train_args(out, data, "data.remap_items=true", "train.max_steps=2")) == 0
    steps = [m for m in metrics(out) if m["kind"] == "train"]
    assert steps and all(math.isfinite(m["loss"]) for m in steps)
    assert "remap_items = true" in (out / "config.toml").read_text()
    # `grf eval` rebuilds the same mapping from the run's config (ids are sorted raw ids)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "checkpoints" / "last.safetensors")]) == 0
    got = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "eval.json").read_text())
    assert abs(got["hr@10"] - saved["hr@10"]) < 1e-6 and abs(got["mrr"] - saved["mrr"]) < 1e-6


def test_negative_timestamp_is_refused_naming_the_line(finished_run, tmp_path, capsys):
    _, out, _ = finished_run
    rows = ratings()
    rows[6][3] = -5
    data = write(tmp_path / "ratings.dat", rows)
    err = _refused(train_args(out, data), out, capsys)
    assert f"{data}:7: timestamp -5 is negative; timestamps are unix seconds" in err


# ------------------------------------------------------------------------------ loss.num_negatives
def test_num_negatives_beyond_the_catalogue_is_refused_before_allocation(finished_run, tmp_path, capsys,
                                                                         monkeypatch):
    _, out, good = finished_run
    _no_allocation(monkeypatch)
    num_items = max(r[1] for r in ratings())
    for target in (out, tmp_path / "new"):
        err = _refused(train_args(target, good, "loss.num_negatives=100000"), target, capsys)
        assert f"loss.num_negatives=100000 is more than the {num_items} items negatives are sampled from" in err
        assert f"model.num_items={num_items}" in err and f"Set loss.num_negatives <= {num_items}" in err


def test_fault_campaign_case_quickstart_with_100000_negatives(tmp_path, capsys, monkeypatch):
    """The campaign's run: 100,000 negatives on the quickstart's 3,000 items grew to 15 GB."""
    _no_allocation(monkeypatch)
    out = tmp_path / "q"
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(out), "--set", "loss.num_negatives=100000"]
    start = time.perf_counter()
    err = _refused(args, out, capsys)
    assert "loss.num_negatives=100000 is more than the 3,000 items" in err
    assert time.perf_counter() - start < 10.0


# ------------------------------------------------------------------------------ the memory check
def test_a_small_memory_limit_refuses_a_normal_config_naming_the_key(tmp_path, capsys, monkeypatch):
    _no_allocation(monkeypatch)
    monkeypatch.setenv(memory.ENV_LIMIT, "5e8")
    out = tmp_path / "q"
    err = _refused(["train", "--config", "quickstart", "--quiet", "--out", str(out)], out, capsys)
    assert err.startswith("grf: error: train.batch_size=128: the activations and dropout masks need ~")
    assert "framework runtime 419 MB included, but 500 MB is available (GRF_MEMORY_LIMIT_BYTES)" in err
    assert "lower train.batch_size or model.max_len" in err


def _quickstart(*sets, backend="torch"):
    from gr_functional.retrieval.task import load_sequences, resolve

    cfg = load_config(ROOT / "experiments" / "configs" / "quickstart.toml", [f"backend.name={backend}", *sets])
    data = load_sequences(cfg)
    return resolve(cfg, data), data


def test_negatives_dominated_run_names_model_num_negatives(monkeypatch):
    cfg, data = _quickstart("loss.num_negatives=3000")
    monkeypatch.setenv(memory.ENV_LIMIT, "2e9")
    with pytest.raises(ConfigError) as err:
        memory.check_fits(cfg, data)
    assert str(err.value).startswith("loss.num_negatives=3000: the sampled-softmax negatives need ~1.6 GB "
                                     "(per batch: T=16,384 tokens x 3,000 negatives x 32 B)")
    assert "lower loss.num_negatives or train.batch_size" in str(err.value)
    monkeypatch.setenv(memory.ENV_LIMIT, "20e9")
    memory.check_fits(cfg, data)  # fits a 20 GB machine


def test_a_huge_dense_catalogue_is_refused_without_allocating(monkeypatch):
    """model.num_items = 1e9 (a 200 GB table): refused by arithmetic, tracemalloc sees < 5 MB."""
    cfg, data = _quickstart()
    cfg = replace(cfg, model={"num_items": 10**9})
    monkeypatch.setenv(memory.ENV_LIMIT, "20e9")
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as err:
            memory.check_fits(cfg, data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5e6
    msg = str(err.value)
    # the table alone exceeds the machine, so the message names its key, not a batch size
    assert msg.startswith("model.num_items=1000000000: the parameters, gradients and AdamW state need ~512.0 GB"), msg
    assert "lower model.embed_dim, or set data.remap_items=true if the item ids are sparse" in msg


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_projects_experiment_configs_fit_20_gb(backend, monkeypatch):
    """Every experiments/configs/*.toml (ML-1M and the quickstart, HSTU-large included) passes on a
    machine with 20 GB available, with room to spare (the estimate is a bound, not a target)."""
    from gr_functional.retrieval.task import load_sequences, resolve

    monkeypatch.setenv(memory.ENV_LIMIT, "20e9")
    cache = {}
    for path in CONFIGS:
        if load_config(path).model.task == "ranking":  # its own check: test_ranking_estimate (torch ranks)
            continue
        cfg = load_config(path, [f"backend.name={backend}"])
        key = (cfg.data.dataset, cfg.data.path, cfg.data.synthetic_items)
        if key not in cache:
            cache[key] = load_sequences(cfg)
        cfg = resolve(cfg, cache[key])
        items = memory.check_fits(cfg, cache[key])
        assert memory.peak(items) < 8e9, (path.name, memory.peak(items))


def test_ranking_estimate(monkeypatch):
    """The ranking preset fits 20 GB; GR's default tables (7 x 10M rows, hundreds of GB with AdamW)
    are refused before anything is allocated, naming the key."""
    from gr_functional.ranking.task import check_ranking_fits

    monkeypatch.setenv(memory.ENV_LIMIT, "20e9")
    preset = load_config(ROOT / "experiments" / "configs" / "kuairand_rank.toml")
    assert check_ranking_fits(preset) < 1e9
    gr = load_config(None, ["model.task=ranking", "data.dataset=kuairand-rank-synthetic"])
    with pytest.raises(ConfigError, match=r"ranking.video_table: .* need ~[0-9.]+ GB .* but 20.0 GB is available"):
        check_ranking_fits(gr)
    # the same tables as one hash table of 2^20 rows: bounded by the capacity, not the id range (GR HEAD's
    # kuairand-1k: 512-wide rows, 5 layers, sequences up to 16,384 tokens)
    hashed = load_config(None, ["model.task=ranking", "data.dataset=kuairand-rank-synthetic", "embedding.kind=hash",
                                "embedding.optimizer=rowwise_adagrad", f"embedding.capacity={2**20}"])
    assert 4e9 < check_ranking_fits(hashed) < 12e9
    with pytest.raises(ConfigError, match=r"embedding.capacity=67108864: .* lower embedding.capacity"):
        check_ranking_fits(replace(hashed, embedding={"capacity": 2**26}))


def test_constants_match_the_backends():
    from backends.base import Backend
    from backends.torch import SAMPLED_LOGITS_CHUNK_ROWS

    assert memory.DENSE_LOGITS_MAX_RATIO == Backend.DENSE_LOGITS_MAX_RATIO
    assert memory.TORCH_LOGITS_CHUNK_ROWS == SAMPLED_LOGITS_CHUNK_ROWS


def test_param_count_and_token_capacity_match_the_real_ones():
    import numpy as np

    from gr_functional.data import TrainLoader, leave_one_out
    from gr_functional.model import init_params
    from gr_functional.retrieval.task import load_sequences, resolve
    from gr_functional.tree import tree_leaves

    for extra in ([], ["model.pos_bias=false", "train.max_tokens=200"]):
        cfg = tiny_config(*extra)
        data = load_sequences(cfg)
        cfg = resolve(cfg, data)
        params = init_params(cfg.model, 0)
        assert memory.param_count(cfg) == sum(int(np.asarray(x).size) for x in tree_leaves(params))
        loader = TrainLoader.from_config(leave_one_out(data).train, cfg)
        cap = memory.token_capacity(cfg, data)
        for e in range(3):
            for batch in loader.epoch(e):
                assert batch.tokens.t_cap <= cap


_MEASURE = r"""
import json, sys
from gr_functional import memory
from gr_functional.cli import main
seen = {}
check = memory.check_fits
def spy(cfg, data):
    seen["rss"] = int(open("/proc/self/statm").read().split()[1]) * 4096
    items = check(cfg, data)
    seen["estimate"] = memory.peak(items)
    return items
memory.check_fits = spy
assert main(sys.argv[1:]) == 0
# VmHWM: this process image's peak RSS (ru_maxrss would report the parent's peak when that was
# higher: Linux copies it into a forked child and keeps it across exec, e.g. a pytest of 4 GB)
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
seen["maxrss"] = int(hwm.split()[1]) * 1024
print(json.dumps(seen))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # dense-form logits; 16-bit negatives (gathered rows)
def test_the_estimate_bounds_a_measured_peak(tmp_path, precision):
    """A real quickstart-size run, negatives-heavy: the RSS it adds after the check stays below the
    estimate, and the estimate is within 5x of it (an order-of-magnitude-right upper bound)."""
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "q"),
            "--set", "data.synthetic_users=300", "--set", "loss.num_negatives=2000", "--set", "train.max_steps=2",
            "--set", "train.batch_size=64", "--set", "eval.max_users=64",
            "--set", f"loss.negatives_precision={precision}"]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = seen["maxrss"] - seen["rss"]
    assert grew <= seen["estimate"] <= 5 * grew, seen
