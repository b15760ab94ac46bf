"""Host-side data pipeline (numpy only): raw logs -> per-user sequences -> split -> jagged batches -> metrics.

    inter = load_movielens_1m()                    # Interactions, file order
    data = from_interactions(inter, remap_items=False)   # SequenceData, time-sorted per user
    split = leave_one_out(data)                    # train / valid / test
    for batch in TrainLoader(split.train, cfg.model, 128, seed=42): ...
    for batch, targets, exclude in iter_eval(split.test, cfg.model, 256): ...
    metrics_from_ranks(ranks_from_scores(scores, targets, exclude))
"""
# ``fetch`` stays the submodule (``fetch.fetch(name)``): re-exporting the function would shadow it.
from . import fetch
from .datasets import DATASETS, load_dataset
from .batching import TrainLoader, eval_batches, iter_eval
from .loaders import DataError, Interactions, load_kuairand_log, load_movielens_1m, load_movielens_20m
from .metrics import metrics_from_ranks, ranks_from_scores
from .paths import data_dir, dataset_label, dataset_path
from .sequences import SequenceData, from_interactions, remap_sequence_items
from .split import EvalSet, Split, leave_one_out
from .synthetic import make_synthetic

__all__ = [
    "DATASETS", "DataError", "EvalSet", "Interactions", "SequenceData", "Split", "TrainLoader",
    "data_dir", "dataset_label", "dataset_path", "eval_batches", "fetch", "from_interactions", "iter_eval",
    "leave_one_out", "load_dataset", "load_kuairand_log", "load_movielens_1m", "load_movielens_20m",
    "make_synthetic", "metrics_from_ranks", "ranks_from_scores", "remap_sequence_items",
]
