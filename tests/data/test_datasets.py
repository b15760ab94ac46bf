import numpy as np
import pytest

from gr_functional.config import DataConfig, ModelConfig
from gr_functional.data import DataError, TrainLoader, leave_one_out, load_dataset


def test_synthetic_default():
    data = load_dataset(DataConfig())
    assert len(data) == 2000 and data.num_items == 3000 and data.lengths().max() <= 400


def test_ml1m_end_to_end(real_data_env):
    data = load_dataset(DataConfig(dataset="ml-1m"))
    assert data.num_items == 3952 and len(data) == 6040
    # GR ranks every movie of movies.dat at evaluation: 3,883 ids.
    assert data.candidates is not None and len(data.candidates) == 3883
    assert np.isin(data.items, data.candidates).all()
    split = leave_one_out(data)
    loader = TrainLoader(split.train, ModelConfig(), batch_size=128, seed=42)
    assert loader.steps_per_epoch == 48  # ceil(6040 / 128)
    batch = loader.batch(0, 0)
    assert batch.tokens.b_cap == 128 and batch.tokens.lengths.max() <= 200


def test_kuairand_sample(real_data_env):
    data = load_dataset(DataConfig(dataset="kuairand"))
    assert len(data) == 4 and data.num_events == 211 and data.num_items == 211


def test_bad_config(tmp_path):
    with pytest.raises(DataError, match="registered: 'synthetic', 'ml-1m', 'ml-20m', 'kuairand'"):
        load_dataset(DataConfig(dataset="movielens"))
    with pytest.raises(DataError, match="data.path="):
        load_dataset(DataConfig(dataset="ml-1m", path=str(tmp_path / "nope.dat")))
