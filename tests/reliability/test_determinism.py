"""No hidden randomness: the checkpointed (seed, epoch, batch) position is the whole RNG state."""
from __future__ import annotations

import random

import numpy as np
import torch

from backends import get_backend
from gr_functional import model
from gr_functional.config import Config
from gr_functional.data.batching import TrainLoader
from gr_functional.data.split import leave_one_out
from gr_functional.data.synthetic import make_synthetic
from gr_functional.step import init_opt_state, make_train_step
from gr_functional.tree import tree_items

from ..differential.test_model import CFG


def _one_step(seed):
    # scramble every global generator a library or a user might touch: results must not move
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    data = leave_one_out(make_synthetic(40, CFG.num_items, 20, 1.05, 0)).train
    loader = TrainLoader(data, CFG, batch_size=8, seed=3)
    loader.load_state_dict({"epoch": 2, "step": 1})
    batch = next(iter(loader))
    B = get_backend("torch")
    cfg = Config(model=CFG)
    params = B.asarray_tree(model.init_params(CFG, seed=0))
    p, _, m = make_train_step(B, cfg)(params, init_opt_state(B, params, cfg), B.asarray_tree(batch))
    return float(m["loss"]), dict(tree_items(B.to_numpy_tree(p)))


def test_global_rngs_do_not_matter():
    loss_a, params_a = _one_step(0)
    loss_b, params_b = _one_step(12345)
    assert loss_a == loss_b
    for key, value in params_a.items():
        assert np.array_equal(value, params_b[key]), key


def test_deterministic_mode_switch():
    from gr_functional.runtime import make_backend

    from gr_functional.configure import load_config

    make_backend(Config())                      # backend.deterministic "auto": on, on CPU
    assert torch.are_deterministic_algorithms_enabled()
    make_backend(load_config(None, ["backend.deterministic=false"]))   # TOML booleans -> "off"
    assert not torch.are_deterministic_algorithms_enabled()
    make_backend(load_config(None, ["backend.deterministic=true"]))
    assert torch.are_deterministic_algorithms_enabled()
    # "auto" leaves accelerators non-deterministic (meta stands in for a CUDA device here)
    from backends import get_backend

    get_backend("torch", device="meta").set_deterministic("auto")
    assert not torch.are_deterministic_algorithms_enabled()
    get_backend("torch").set_deterministic("auto")
    assert torch.are_deterministic_algorithms_enabled()
