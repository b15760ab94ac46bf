"""``grf bench ranking_baselines [--config kuairand_pure_rank] [--set K=V] [--json] [--record]``:
what a ranking model's test metrics must beat, on the same split as ``grf train`` (the config's
``data.split``): per task AUC, GAUC, NE and positives of

- ``base rate``: every candidate scored with the task's positive rate over the training samples'
  candidates (a constant: AUC .5, NE about 1 by construction; the floor);
- ``per-user rate``: each candidate scored with its user's positive rate over the sample's history
  (every event before the candidates, what the model sees too), shrunk toward the base rate with
  ``prior`` pseudo-events: ``(positives + prior * base) / (events + prior)``.

No model is trained, so the figures depend on the data and the split only.
"""
from __future__ import annotations

import numpy as np

from .common import emit, machine

DEFAULT_CONFIG = "kuairand_pure_rank"
COLUMNS = ["split", "baseline", "task", "auc", "gauc", "ne", "positives"]


def _bits(weights: np.ndarray, n_tasks: int) -> np.ndarray:
    """``[n, K]`` 0/1 labels of action bitmasks ``weights[n]`` (bit k = task k)."""
    return ((np.asarray(weights)[:, None] >> np.arange(n_tasks)) & 1).astype(np.float64)


def baselines(seqs, train, samples, n_tasks: int, prior: float = 10.0) -> dict[str, tuple]:
    """``{baseline: (logits[c, K], labels[c, K], users[c])}`` over the candidates of ``samples``
    (ranking/data.Samples, with ``counts``); rates from ``train``'s candidates and each sample's
    history."""
    train_labels = []
    for i, u in enumerate(train.users):
        c = int(train.counts[i])
        w = seqs.sequence(u)["action_weights"][int(train.ends[i]) - c:int(train.ends[i])]
        train_labels.append(_bits(w, n_tasks))
    base = np.clip(np.concatenate(train_labels).mean(axis=0), 1e-6, 1 - 1e-6)        # [K]
    labels, users, user_rate = [], [], []
    for i, u in enumerate(samples.users):
        seq, end = seqs.sequence(u), int(samples.ends[i])
        c = int(samples.counts[i])
        hist_end = end - c if samples.history_ends is None else int(samples.history_ends[i])
        hist = _bits(seq["action_weights"][:hist_end], n_tasks)
        rate = (hist.sum(axis=0) + prior * base) / (len(hist) + prior)
        labels.append(_bits(seq["action_weights"][end - c:end], n_tasks))
        users.append(np.full(c, seqs.users[u]))
        user_rate.append(np.repeat(rate[None, :], c, axis=0))
    labels, users = np.concatenate(labels), np.concatenate(users)
    logit = lambda p: np.log(p) - np.log1p(-p)  # noqa: E731
    return {"base rate": (np.broadcast_to(logit(base), labels.shape), labels, users),
            "per-user rate": (logit(np.clip(np.concatenate(user_rate), 1e-6, 1 - 1e-6)), labels, users)}


def run(json_lines: bool = False, cfg=None, splits=("valid", "test")) -> list[dict]:
    from gr_functional.configure import load_config
    from gr_functional.data.ranking_metrics import task_metrics
    from gr_functional.ranking.data import load_ranking_data, split_samples
    from gr_functional.ranking.model import TASKS

    cfg = cfg or load_config(DEFAULT_CONFIG)
    seqs = load_ranking_data(cfg)
    parts, _ = split_samples(seqs, cfg)
    if parts.train.counts is None:   # the windows split: every sample has num_candidates candidates
        C = cfg.ranking.num_candidates
        for s in (parts.train, parts.valid, parts.test):
            s.counts = np.full(len(s.users), C, np.int64)
    names = TASKS[:len(cfg.ranking.action_weights)]
    rows = []
    for split in splits:
        for baseline, (logits, labels, users) in baselines(seqs, parts.train, getattr(parts, split), len(names)).items():
            metrics = task_metrics(logits, labels, users, [(n, "binary") for n in names])
            for task in names:
                m = metrics[task]
                row = {"bench": "ranking_baselines", "config": cfg.data.dataset, "split": split, "baseline": baseline,
                       "task": task, "auc": m["auc"], "gauc": m["gauc"], "ne": m["ne"], "positives": m["positives"],
                       **machine()}
                emit(row, json_lines, COLUMNS)
                rows.append(row)
    return rows
