"""Fixtures for the data-pipeline tests.

Tests that need real data get it through these fixtures (or ``tests/data_needs.py``): the data folder
is ``GRF_DATA_DIR`` (default ``<repo>/../shared/data``); without the data they skip naming it and
the command that gets it, and under ``GRF_REQUIRE_DATA=1`` (.ci/run) they fail.
"""
from pathlib import Path

import pytest

from gr_functional.data.registry import SAMPLES
from tests.data_needs import data_file, data_root as _data_root

# The 211-row KuaiRand-1K sample ships with the package (CC BY-SA 4.0: gr_functional/data/samples/README.md)
SHIPPED_KUAIRAND_SAMPLE = SAMPLES / "kuairand" / "KuaiRand-1K" / "data" / "log_random_4_22_to_5_08_1k.head_users0-3.csv"


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The data folder holding ML-1M and the KuaiRand files (skip / fail without them)."""
    return _data_root("ml-1m", "kuairand-27k-lengths", "kuairand-user-features", "kuairand-video-features")


@pytest.fixture
def real_data_env(data_root, monkeypatch) -> Path:
    """Point gr_functional.data.paths at the real data dir for this test."""
    monkeypatch.setenv("GRF_DATA_DIR", str(data_root))
    return data_root


@pytest.fixture(scope="session")
def ml1m_path() -> Path:
    return data_file("ml-1m")


@pytest.fixture(scope="session")
def ml1m_inter(ml1m_path):
    from gr_functional.data import load_movielens_1m
    return load_movielens_1m(ml1m_path)


@pytest.fixture(scope="session")
def ml1m(ml1m_inter):
    from gr_functional.data import from_interactions
    return from_interactions(ml1m_inter, remap_items=False)


@pytest.fixture(scope="session")
def kuairand_sample_path() -> Path:
    """The 211-row KuaiRand-1K log sample shipped with the tests (the bytes of the team copy, README there)."""
    return SHIPPED_KUAIRAND_SAMPLE


@pytest.fixture(scope="session")
def lengths_csv() -> Path:
    return data_file("kuairand-27k-lengths")
