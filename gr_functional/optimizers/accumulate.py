"""Gradient accumulation as a wrapper transform (optax.MultiSteps-like).

``multi_steps(tx, k)``: every call adds its gradient to an accumulator; calls 1 .. k-1 of each
group return ``-0.0`` updates (params bit-identical) and leave ``tx``'s state alone; the k-th
gives ``tx`` the mean ``sum / k`` (``use_mean=False``: the sum, for micro-gradients already
weighted, e.g. by their share of the step's tokens as ``step.py`` does) and resets the sum.
So k micro-steps of a batch split in k equal parts make one step of the whole batch.

Why a sum then one division rather than optax's running mean ``acc + (g - acc) / n``: it is the
mean of the k gradients with one rounding per add, the same arithmetic as accumulating a
loss's gradient over micro-batches, and exact to scale when k is a power of two.

State ``{"mini_step": 0-d float (calls so far in this group, 0 .. k-1), "acc": tree like params,
"inner": tx's state}``. ``tx.update`` runs at every call and is selected with ``xp.where``
(optax uses ``lax.cond``): jittable and sync-free, at the price of computing it k times.
"""
from __future__ import annotations

from ..tree import tree_map
from .transform import GradientTransformation, as_transform, counter, no_updates, select
from ..contracts import Backend


def multi_steps(tx, every_k: int, *, use_mean: bool = True) -> GradientTransformation:
    """``tx`` applied once every ``every_k`` calls, to the mean (or sum) of their updates."""
    if int(every_k) != every_k or every_k < 1:
        raise ValueError(f"multi_steps: every_k must be an integer >= 1, got {every_k!r}")
    tx = as_transform(tx)
    k = int(every_k)

    def init(B: Backend, params):
        return {"mini_step": counter(B), "acc": tree_map(B.xp.zeros_like, params), "inner": tx.init(B, params)}

    def update(B: Backend, updates, state, params=None):
        xp = B.xp
        acc = tree_map(lambda a, g: a + g, state["acc"], updates)
        mini = state["mini_step"] + 1.0
        last = mini >= float(k)
        grads = tree_map(lambda a: a / float(k), acc) if use_mean and k > 1 else acc
        new_updates, new_inner = tx.update(B, grads, state["inner"], params)
        return select(B, last, new_updates, no_updates(B, new_updates)), {
            "mini_step": xp.where(last, xp.zeros_like(mini), mini),
            "acc": tree_map(lambda a: xp.where(last, xp.zeros_like(a), a), acc),
            "inner": select(B, last, new_inner, state["inner"])}

    return GradientTransformation(init, update)

