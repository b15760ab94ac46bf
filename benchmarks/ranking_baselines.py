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

from gr_functional.configure import load_config
from gr_functional.data.ranking_metrics import task_metrics
from gr_functional.ranking.data import load_ranking_data, split_samples
from gr_functional.ranking.heads import task_labels
from gr_functional.ranking.model import TASKS

from .common import emit, machine

DEFAULT_CONFIG = "kuairand_pure_rank"
COLUMNS = ["split", "baseline", "task", "auc", "gauc", "ne", "positives"]


def baselines(seqs, train, samples, num_candidates: int, weights, prior: float = 10.0) -> dict[str, tuple]:
    """``{baseline: (logits[c, K], labels[c, K], users[c])}`` over the candidates of ``samples``
    (ranking/data.Samples; ``num_candidates`` where they hold no counts), labels ``task_labels`` of
    the action bitmasks by ``weights`` (``ranking.action_weights``); rates from ``train``'s
    candidates and each sample's history."""

    def labels_of(u, start, stop):
        return task_labels(seqs.sequence(u)["action_weights"][start:stop], weights).astype(np.float64)

    counts = train.candidates(num_candidates)
    base = np.concatenate([labels_of(u, int(e) - c, int(e)) for u, e, c in zip(train.users, train.ends, counts)])
    base = np.clip(base.mean(axis=0), 1e-6, 1 - 1e-6)                                              # [K]
    labels, users, user_rate = [], [], []
    counts = samples.candidates(num_candidates)
    for i, u in enumerate(samples.users):
        end, c = int(samples.ends[i]), int(counts[i])
        hist = labels_of(u, 0, end - c if samples.history_ends is None else int(samples.history_ends[i]))
        rate = (hist.sum(axis=0) + prior * base) / (len(hist) + prior)
        labels.append(labels_of(u, end - c, end))
        users.append(np.full(c, seqs.users[u]))
        user_rate.append(np.repeat(rate[None, :], c, axis=0))
    labels, users = np.concatenate(labels), np.concatenate(users)
    logit = lambda p: np.log(p) - np.log1p(-p)  # noqa: E731
    return {"base rate": (np.broadcast_to(logit(base), labels.shape), labels, users),
            "per-user rate": (logit(np.clip(np.concatenate(user_rate), 1e-6, 1 - 1e-6)), labels, users)}


def run(json_lines: bool = False, cfg=None, splits=("valid", "test")) -> list[dict]:
    cfg = cfg or load_config(DEFAULT_CONFIG)
    seqs = load_ranking_data(cfg)
    parts, _ = split_samples(seqs, cfg)
    weights = cfg.ranking.action_weights
    names = TASKS[:len(weights)]
    rows = []
    for split in splits:
        scored = baselines(seqs, parts.train, getattr(parts, split), cfg.ranking.num_candidates, weights)
        for baseline, (logits, labels, users) in scored.items():
            metrics = task_metrics(logits, labels, users, [(n, "binary") for n in names])
            for task in names:
                m = metrics[task]
                row = {"bench": "ranking_baselines", "config": cfg.data.dataset, "split": split, "baseline": baseline,
                       "task": task, "auc": m["auc"], "gauc": m["gauc"], "ne": m["ne"], "positives": m["positives"],
                       **machine()}
                emit(row, json_lines, COLUMNS)
                rows.append(row)
    return rows
