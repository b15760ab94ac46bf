"""gr-functional: HSTU generative recommenders as pure functions over jagged arrays.

The public API of an experiment script (docs/extending/index.md)::

    import gr_functional as grf

    cfg = grf.load_config("experiments/configs/quickstart.toml", ["train.epochs=2"])
    exp = grf.prepare(cfg)                 # real batches: exp.batches(epoch)
    grf.losses.register("my_loss")(fn)     # a loss of one's own, selected by loss.name
    grf.fit(cfg, "runs/mine")              # the whole training loop (what `grf train` runs)

Heavy modules load on first use, so ``import gr_functional`` stays cheap.
"""
from __future__ import annotations

import importlib

from .config import Config, replace

# configure (load_config) imports the registries, backends' among them: loaded on first use, so
# that backends can import gr_functional's leaves without importing itself back
_LAZY = {"load_config": ("configure", "load_config"), "prepare": ("experiment", "prepare"), "Experiment": ("experiment", "Experiment"),
         "fit": ("runner", "train"), "evaluate_checkpoint": ("runner", "evaluate_checkpoint")}
# submodules reachable as attributes (grf.losses.register, grf.model.loss_fn) without importing them
_SUBMODULES = ("losses", "model", "data", "batch", "plugins", "step", "optim", "optimizers", "task", "tree")

__all__ = ["Config", "Experiment", "config", "evaluate_checkpoint", "fit", "load_config", "losses", "model", "prepare",
           "replace"]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gr_functional' has no attribute {name!r}")
