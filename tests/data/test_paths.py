from pathlib import Path

import pytest

from gr_functional.data import DataError, data_dir, dataset_label, dataset_path
from gr_functional.data.paths import repo_root


def test_env_var_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path


def test_default_is_shared_checkout_dir(monkeypatch):
    monkeypatch.delenv("GRF_DATA_DIR", raising=False)
    shared = repo_root().parent / "shared" / "data"
    expected = shared if shared.is_dir() else Path.home() / ".cache" / "gr-functional" / "data"
    assert data_dir() == expected


def test_ml1m_prefers_publisher_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    recon = tmp_path / "movielens-1m" / "reconstructed" / "ratings_known.dat"
    recon.parent.mkdir(parents=True)
    recon.write_text("1::1::5::1\n")
    assert dataset_path("ml-1m") == recon
    assert dataset_label("ml-1m", recon) == "ML-1M (reconstructed)"
    official = tmp_path / "movielens-1m" / "ratings.dat"
    official.write_text("1::1::5::1\n")
    assert dataset_path("ml-1m") == official
    assert dataset_label("ml-1m", official) == "ML-1M"


def test_missing_data_says_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError) as exc:
        dataset_path("ml-1m")
    msg = str(exc.value)
    assert str(tmp_path / "movielens-1m" / "ratings.dat") in msg
    assert "reconstructed/ratings_known.dat" in msg
    assert "grf data fetch ml-1m" in msg and "GRF_DATA_DIR" in msg
    with pytest.raises(DataError, match="grf data fetch ml-20m"):
        dataset_path("ml-20m")
    with pytest.raises(DataError, match="known datasets"):
        dataset_path("ml-100m")


def test_real_layout(real_data_env):
    assert dataset_path("ml-1m").name in ("ratings.dat", "ratings_known.dat")
    assert dataset_path("kuairand-sample").is_file()
    assert dataset_path("kuairand-27k-lengths").is_file()
    assert dataset_path("kuairand-user-features").is_file() and dataset_path("kuairand-video-features").is_file()


def test_names_and_labels():
    from gr_functional.data.paths import dataset_names
    assert dataset_names() == ("ml-1m", "ml-20m", "kuairand-sample", "kuairand-27k-lengths", "kuairand-user-features",
                               "kuairand-video-features", "kuairand-pure-log", "kuairand-pure-before")
    assert dataset_path("kuairand-pure-log").name == "log_standard_pure_20220425_to_20220504.partial.csv"
    assert dataset_path("kuairand-pure-before").name == "user_sequences_pure_before_20220425.parquet"
    assert dataset_label("kuairand", "x/log_random_4_22_to_5_08_1k.head_users0-3.csv").endswith("(211-row sample)")
    assert dataset_label("kuairand", "x/log_standard_4_08_to_4_21_pure.csv") == "KuaiRand (log_standard_4_08_to_4_21_pure.csv)"
