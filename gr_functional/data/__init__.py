"""Host-side data pipeline (numpy only): raw logs -> per-user sequences -> split -> jagged batches -> metrics.

    data = load_dataset(cfg.data)                  # any registered dataset (registry.py), or:
    inter = load_movielens_1m()                    # Interactions, file order
    data = from_interactions(inter, remap_items=False)   # SequenceData, time-sorted per user
    split = leave_one_out(data)                    # train / valid / test
    for batch in TrainLoader(split.train, cfg.model, 128, seed=42): ...
    for batch, targets, exclude in iter_eval(split.test, cfg.model, 256): ...
    metrics_from_ranks(ranks_from_scores(scores, targets, exclude))
"""
# The dataset registry; its first use imports the shipped datasets (sources/) in display order.
from . import registry
from .registry import DataFile, DatasetSpec, Download, get_dataset, register_dataset, register_file
# ``fetch`` stays the submodule (``fetch.fetch(name)``): re-exporting the function would shadow it.
from . import fetch
from .datasets import load_dataset
from .batching import TrainLoader, eval_batches, iter_eval
from .loaders import DataError, Interactions
from .metrics import metrics_from_ranks, ranks_from_scores
from .paths import data_dir, dataset_label, dataset_path
from .sequences import SequenceData, from_interactions, remap_sequence_items
from .sources.interactions import load_csv
from .sources.kuairand import load_kuairand_log
from .sources.movielens import load_movielens_1m, load_movielens_20m
from .split import EvalSet, Split, leave_one_out
from .synthetic import make_synthetic

__all__ = [
    "DATASETS", "DataError", "DataFile", "DatasetSpec", "Download", "EvalSet", "Interactions", "SequenceData",
    "Split", "TrainLoader", "data_dir", "dataset_label", "dataset_path", "eval_batches", "fetch",
    "from_interactions", "get_dataset", "iter_eval", "leave_one_out", "load_csv", "load_dataset",
    "load_kuairand_log", "load_movielens_1m", "load_movielens_20m", "make_synthetic", "metrics_from_ranks",
    "ranks_from_scores", "register_dataset", "register_file", "registry", "remap_sequence_items",
]


def __getattr__(name: str):
    if name == "DATASETS":  # the registered dataset names, read live (a plugin may register more)
        return registry.names("retrieval")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
