"""Ranking (CTR-style) metrics for multi-task engagement prediction: AUC, GAUC, normalised entropy,
MSE / MAE. Host-side numpy in float64, like the retrieval metrics (``metrics.py``).

Conventions, and where they differ from generative-recommenders' dlrm_v3 (which logs torchrec's
AUC, NE, MSE and MAE over a window of recent batches):

- AUC is the weighted Mann-Whitney statistic: the probability that a positive outscores a
  negative, each pair weighted by the product of the two samples' weights, ties counting one
  half (as ``sklearn.metrics.roc_auc_score``). torchrec's AUC sorts scores and integrates the
  ROC curve with ties left in ``argsort`` order, so on tied scores it can differ from this by up to
  the tied pairs' share. Undefined (NaN) when a class has no weight.
- GAUC (DIN, KDD'18) is each user's AUC averaged with weight = the user's impressions (sum of
  sample weights), over the users who have both a positive and a negative; the others carry no
  ranking information and are left out (their count is reported).
- NE (normalised entropy, He et al. 2014, torchrec's NE) is the weighted log loss of the
  predicted probabilities divided by the entropy of the weighted base rate: 1 for a model that
  always predicts the base rate, lower is better. Computed from logits (``softplus``) so a
  confident wrong prediction costs its true log loss instead of a clipped one.
"""
from __future__ import annotations

import numpy as np


def _check(scores, labels, weights=None, binary: bool = True, what: str = "labels"):
    scores = np.asarray(scores, np.float64).ravel()
    labels = np.asarray(labels, np.float64).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"scores ({scores.shape[0]}) and {what} ({labels.shape[0]}) differ in length")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    if binary and not np.isin(labels, (0.0, 1.0)).all():
        bad = labels[~np.isin(labels, (0.0, 1.0))][:3]
        raise ValueError(f"{what} of a classification task must be 0 or 1; got {bad.tolist()} "
                         f"(a continuous target is a regression task: mse / mae)")
    w = np.ones_like(scores) if weights is None else np.asarray(weights, np.float64).ravel()
    if w.shape != scores.shape:
        raise ValueError(f"weights ({w.shape[0]}) and scores ({scores.shape[0]}) differ in length")
    if (w < 0).any():
        raise ValueError("weights must be >= 0")
    return scores, labels, w


def _grouped_auc(scores, labels, weights, groups):
    """``(auc[G], impressions[G], groups[G])`` per distinct group (NaN where a class is missing):
    one lexsort by (group, score), tie blocks of equal (group, score), and for each block its
    positives times the negatives strictly below it in its group plus half its own."""
    ids, g = np.unique(groups, return_inverse=True)
    order = np.lexsort((scores, g))
    s, y, w, g = scores[order], labels[order], weights[order], g[order]
    starts = np.r_[True, (g[1:] != g[:-1]) | (s[1:] != s[:-1])] if len(s) else np.zeros(0, bool)
    block = np.cumsum(starts) - 1
    pos = np.bincount(block, w * y)
    neg = np.bincount(block, w * (1.0 - y))
    block_group = g[starts]
    below = np.cumsum(neg) - neg                                   # negatives before the block, all groups
    first = np.r_[True, block_group[1:] != block_group[:-1]] if len(block_group) else np.zeros(0, bool)
    below -= np.repeat(below[first], np.diff(np.r_[np.flatnonzero(first), len(block_group)]))
    wins = np.bincount(block_group, pos * (below + 0.5 * neg), minlength=len(ids))
    P = np.bincount(block_group, pos, minlength=len(ids))
    N = np.bincount(block_group, neg, minlength=len(ids))
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = np.where((P > 0) & (N > 0), wins / (P * N), np.nan)
    return auc, P + N, ids


def auc(scores, labels, weights=None) -> float:
    """Weighted ROC AUC of ``scores[n]`` (any monotone score: logits or probabilities) against
    ``labels[n]`` in {0, 1}; ties count one half. NaN when either class has no weight."""
    scores, labels, w = _check(scores, labels, weights)
    return float(_grouped_auc(scores, labels, w, np.zeros(len(scores), np.int64))[0][0]) if len(scores) else float("nan")


def gauc(scores, labels, groups, weights=None) -> tuple[float, int]:
    """``(gauc, users)``: the impression-weighted mean of per-group (per-user) AUC over the
    ``users`` groups that have both classes; ``groups[n]`` any integer ids. NaN (0 users) when no
    group has both."""
    scores, labels, w = _check(scores, labels, weights)
    groups = np.asarray(groups).ravel()
    if groups.shape != scores.shape:
        raise ValueError(f"groups ({groups.shape[0]}) and scores ({scores.shape[0]}) differ in length")
    per, impressions, _ = _grouped_auc(scores, labels, w, groups)
    ok = ~np.isnan(per) & (impressions > 0)
    if not ok.any():
        return float("nan"), 0
    return float((per[ok] * impressions[ok]).sum() / impressions[ok].sum()), int(ok.sum())


def normalized_entropy(logits, labels, weights=None) -> float:
    """Weighted log loss of ``sigmoid(logits)`` over the entropy of the weighted base rate (NaN
    when the base rate is 0 or 1: the entropy is 0)."""
    logits, labels, w = _check(logits, labels, weights)
    # -log p = softplus(-x) for a positive, -log(1 - p) = softplus(x) for a negative (p = sigmoid(x)):
    # exact for any x, infinite logits included (a confident right answer costs 0, a wrong one inf)
    with np.errstate(invalid="ignore"):
        loss = np.where(labels == 1.0, np.logaddexp(0.0, -logits), np.logaddexp(0.0, logits))
    total = w.sum()
    base = (w * labels).sum() / total if total > 0 else np.nan
    if not 0.0 < base < 1.0:
        return float("nan")
    entropy = -(base * np.log(base) + (1.0 - base) * np.log1p(-base))
    return float((w * loss).sum() / total / entropy)


def mse(predictions, targets, weights=None) -> float:
    """Weighted mean squared error of a regression task (e.g. watch time)."""
    p, t, w = _check(predictions, targets, weights, binary=False, what="targets")
    return float((w * (p - t) ** 2).sum() / w.sum())


def mae(predictions, targets, weights=None) -> float:
    """Weighted mean absolute error of a regression task."""
    p, t, w = _check(predictions, targets, weights, binary=False, what="targets")
    return float((w * np.abs(p - t)).sum() / w.sum())


def task_metrics(outputs, labels, users, tasks, weights=None) -> dict:
    """Every task's metrics: ``outputs[n, K]`` (logits of classification tasks, predictions of
    regression ones), ``labels[n, K]``, ``users[n]``, ``tasks`` K pairs ``(name, kind)`` with kind
    "binary" | "regression". Returns ``{name: {"auc", "gauc", "gauc_users", "ne", "positives"} | {"mse", "mae"}}``."""
    outputs, labels = np.asarray(outputs), np.asarray(labels)
    out = {}
    for k, (name, kind) in enumerate(tasks):
        if kind == "binary":
            g, n_users = gauc(outputs[:, k], labels[:, k], users, weights)
            out[name] = {"auc": auc(outputs[:, k], labels[:, k], weights), "gauc": g, "gauc_users": n_users,
                         "ne": normalized_entropy(outputs[:, k], labels[:, k], weights),
                         "positives": int(np.count_nonzero(labels[:, k]))}
        elif kind == "regression":
            out[name] = {"mse": mse(outputs[:, k], labels[:, k], weights), "mae": mae(outputs[:, k], labels[:, k], weights)}
        else:
            raise ValueError(f"task {name!r}: kind {kind!r} is not 'binary' or 'regression'")
    return out
