"""The dataset registry (gr_functional/data/registry.py): shipped entries, lookups and their errors,
and a dataset registered from outside the package, loaded and trained on end to end."""
import json

import numpy as np
import pytest

from gr_functional.cli import main
from gr_functional.config import ConfigError, DataConfig
from gr_functional.configure import load_config
from gr_functional.data import (DataError, DatasetSpec, Download, Interactions, SequenceData, dataset_label,
                                dataset_path, fetch, load_dataset, registry)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test are dropped after it (the registry is process-wide)."""
    registry.names()  # the shipped datasets are registered before the copy
    monkeypatch.setattr(registry, "_FILES", dict(registry._FILES))
    with registry.DATASETS.scoped():
        yield


# ---------------------------------------------------------------- a dataset of one's own
def load_tiny_clicks(cfg, path):
    """A user's loader: lines "user item time" (made-up rows), read with numpy."""
    rows = np.loadtxt(path, dtype=np.int64, ndmin=2)
    return Interactions(user=rows[:, 0], item=rows[:, 1], time=rows[:, 2], name="Tiny clicks", source=str(path))


TINY_CLICKS = DatasetSpec("tiny-clicks", "Tiny clicks", load_tiny_clicks, layout=("clicks/log.txt",),
                          how_to_get="export the click log to that path", default_file="log.txt")


def _write_clicks(root, users=40, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for u in range(1, users + 1):
        t = 1_650_000_000
        for _ in range(int(rng.integers(4, 12))):
            t += int(rng.integers(1, 3600))
            lines.append(f"{u} {int(rng.integers(1, 50)) * 10} {t}")
    path = root / "clicks" / "log.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_dataset_registered_from_outside_loads_by_name(tmp_path, monkeypatch, scratch_registry):
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    registry.register_dataset(TINY_CLICKS)
    assert "tiny-clicks" in registry.names() and registry.get_dataset("tiny-clicks") is TINY_CLICKS
    # the config accepts the name now (it is checked against the registry)
    assert load_config(None, ["data.dataset=tiny-clicks"]).data.dataset == "tiny-clicks"
    with pytest.raises(DataError) as exc:  # no file yet: where it looked and the spec's how-to-get
        load_dataset(DataConfig(dataset="tiny-clicks"))
    msg = str(exc.value)
    assert msg.startswith("Tiny clicks data not found: looked for " + str(tmp_path / "clicks" / "log.txt"))
    assert "To get it, export the click log to that path, or set GRF_DATA_DIR" in msg
    path = _write_clicks(tmp_path)
    assert dataset_path("tiny-clicks") == path and dataset_label("tiny-clicks") == "Tiny clicks"
    data = load_dataset(DataConfig(dataset="tiny-clicks"))
    assert isinstance(data, SequenceData) and len(data) == 40 and data.num_items == 490 and data.source == str(path)
    remapped = load_dataset(DataConfig(dataset="tiny-clicks", remap_items=True))  # data.remap_items honoured
    assert remapped.num_items == len(np.unique(data.items)) and remapped.raw_item_ids[1] == data.items.min()
    # data.path: a folder takes the spec's default_file
    assert load_dataset(DataConfig(dataset="tiny-clicks", path=str(path.parent))).num_events == data.num_events


PLUGIN = """
import numpy as np
from gr_functional.data import Interactions
from gr_functional.data.registry import DatasetSpec, register_dataset

def load(cfg, path):
    user, item, time = np.loadtxt(path, dtype=np.int64, unpack=True)
    return Interactions(user=user, item=item, time=time, name="Plugin clicks", source=str(path))

register_dataset(DatasetSpec("plugin-clicks", "Plugin clicks", load, layout=("clicks/log.txt",)))
"""


def test_grf_train_on_a_dataset_of_a_plugin_file(tmp_path, monkeypatch, scratch_registry):
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    _write_clicks(tmp_path)
    plugin = tmp_path / "my_clicks.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "run"
    sets = ["data.dataset=plugin-clicks", "model.max_len=16", "model.embed_dim=16", "model.dqk=8", "model.dv=8",
            "loss.num_negatives=8", "train.epochs=1", "train.max_steps=2", "train.batch_size=16", "eval.batch_size=64"]
    args = ["train", "--quiet", "--plugin", str(plugin), "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    assert 0.0 <= json.loads((out / "eval.json").read_text())["hr@10"] <= 1.0
    assert 'dataset = "plugin-clicks"' in (out / "config.toml").read_text()


def test_a_loader_may_return_sequences_and_the_decorator_registers(scratch_registry):
    @registry.dataset("three-users", "Three users", needs_file=False)
    def three_users(cfg, path):
        assert path is None  # needs_file=False: nothing is resolved
        return SequenceData(items=np.array([5, 9, 5, 7, 9, 9], dtype=np.int32), times=np.arange(6, dtype=np.int64),
                            offsets=np.array([0, 2, 4, 6]), user_ids=np.arange(3), num_items=9)

    assert load_dataset(DataConfig(dataset="three-users")).num_items == 9
    remapped = load_dataset(DataConfig(dataset="three-users", remap_items=True))
    assert remapped.num_items == 3 and remapped.raw_item_ids.tolist() == [-1, 5, 7, 9]

    registry.register_dataset(DatasetSpec("bad-return", "Bad", lambda cfg, path: [1, 2, 3], needs_file=False))
    with pytest.raises(TypeError, match="returns Interactions or SequenceData"):
        load_dataset(DataConfig(dataset="bad-return"))


def test_registering_a_taken_name(scratch_registry):
    registry.register_dataset(TINY_CLICKS)
    registry.register_dataset(TINY_CLICKS)  # the same loader again (a module imported twice): fine
    other = DatasetSpec("tiny-clicks", "Other", lambda cfg, path: None)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_dataset(other)
    registry.register_dataset(other, replace=True)
    assert registry.get_dataset("tiny-clicks").label == "Other"
    with pytest.raises(ValueError, match="layout must be a tuple"):
        DatasetSpec("x", "X", load_tiny_clicks, layout="x/log.txt")


# ---------------------------------------------------------------- lookups and errors
def test_shipped_datasets_in_order():
    assert registry.names()[:5] == ("synthetic", "ml-1m", "ml-20m", "kuairand", "csv")
    assert registry.file_names()[:4] == ("ml-1m", "ml-20m", "kuairand-sample", "kuairand-27k-lengths")
    assert registry.downloadable() == ("ml-1m", "ml-20m")
    assert dataset_label("kuairand") == "KuaiRand-1K random log (211-row sample)"


def test_unknown_name_is_a_config_error_with_the_registered_list():
    with pytest.raises(ConfigError) as exc:
        registry.get_dataset("ml-10m")
    msg = str(exc.value)
    assert "no dataset named 'ml-10m' is registered (did you mean 'ml-1m'?)" in msg
    assert "registered: 'synthetic', 'ml-1m', 'ml-20m', 'kuairand', 'csv'" in msg and "register_dataset" in msg
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["data.dataset=movielenz"])
    assert str(exc.value).startswith("--set data.dataset=movielenz: data.dataset='movielenz': no dataset named")
    # a config written by a run (a checkpoint's) is read without looking the name up
    from gr_functional.config import build_config
    assert build_config({"data": {"dataset": "a-plugin-dataset"}}, stored=True).data.dataset == "a-plugin-dataset"


def test_fetch_reads_downloads_from_the_registry(tmp_path, scratch_registry):
    assert fetch.SOURCES["ml-1m"].md5 == "c4d9eecfca2ab87c1945afe126590906" and "kuairand" not in fetch.SOURCES
    with pytest.raises(DataError, match=r"fetchable datasets are ml-1m, ml-20m \(synthetic is generated"):
        fetch.fetch("synthetic", tmp_path)
    with pytest.raises(DataError, match=r"fetchable datasets are ml-1m, ml-20m \(kuairand: copy the KuaiRand-1K"):
        fetch.fetch("kuairand", tmp_path)
    with pytest.raises(DataError, match=r"\(registered datasets: synthetic, ml-1m"):
        fetch.fetch("nope", tmp_path)
    registry.register_dataset(DatasetSpec(
        "mirror-1m", "ML-1M mirror", load_tiny_clicks, layout=("mirror/ratings.dat",),
        download=Download("https://example.invalid/ml-1m.zip", "0" * 32, "mirror", "ml-1m/", "ratings.dat", 6)))
    assert list(fetch.SOURCES) == ["ml-1m", "ml-20m", "mirror-1m"]
    assert fetch.SOURCES["mirror-1m"].url == "https://example.invalid/ml-1m.zip"


def test_grf_data_info_lists_datasets(capsys):
    assert main(["data", "info"]) == 0
    out = capsys.readouterr().out
    assert "datasets (data.dataset): synthetic, ml-1m, ml-20m, kuairand, csv" in out and "kuairand-sample:" in out
