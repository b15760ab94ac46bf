"""Fixtures for the data-pipeline tests.

Tests that need real data read ``GRF_DATA_DIR`` (default ``<repo>/../shared/data``) and FAIL when it
is missing: the data is part of the test environment (CI sets GRF_DATA_DIR), never a reason to skip.
"""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def real_data_dir() -> Path:
    path = Path(os.environ.get("GRF_DATA_DIR") or REPO.parent / "shared" / "data")
    if not path.is_dir():
        pytest.fail(f"data dir {path} not found: set GRF_DATA_DIR to the folder holding movielens-1m/ and "
                    f"kuairand/ (the team's copy is ../shared/data)")
    return path


@pytest.fixture(scope="session")
def data_root() -> Path:
    return real_data_dir()


@pytest.fixture
def real_data_env(data_root, monkeypatch) -> Path:
    """Point gr_functional.data.paths at the real data dir for this test."""
    monkeypatch.setenv("GRF_DATA_DIR", str(data_root))
    return data_root


@pytest.fixture(scope="session")
def ml1m_path(data_root) -> Path:
    for rel in ("movielens-1m/ratings.dat", "movielens-1m/reconstructed/ratings_known.dat"):
        if (data_root / rel).is_file():
            return data_root / rel
    pytest.fail(f"no ML-1M ratings under {data_root}/movielens-1m (run `grf data fetch ml-1m` or set GRF_DATA_DIR)")


@pytest.fixture(scope="session")
def ml1m_inter(ml1m_path):
    from gr_functional.data import load_movielens_1m
    return load_movielens_1m(ml1m_path)


@pytest.fixture(scope="session")
def ml1m(ml1m_inter):
    from gr_functional.data import from_interactions
    return from_interactions(ml1m_inter, remap_items=False)


@pytest.fixture(scope="session")
def kuairand_sample_path(data_root) -> Path:
    path = data_root / "kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.head_users0-3.csv"
    if not path.is_file():
        pytest.fail(f"{path} not found (the 211-row KuaiRand sample); set GRF_DATA_DIR")
    return path


@pytest.fixture(scope="session")
def lengths_csv(data_root) -> Path:
    path = data_root / "kuairand/stats_kuairand27k_third_party/log_standard_user_stats_distribution.csv"
    if not path.is_file():
        pytest.fail(f"{path} not found (KuaiRand-27K per-user lengths); set GRF_DATA_DIR")
    return path
