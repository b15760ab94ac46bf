"""Dynamic loss scaling (fp16) as a pure state machine, and as a wrapper transform.

State ``{"scale": 0-d fp32, "good_steps": 0-d fp32}`` (``step.init_loss_scale``'s, stored in the
optimizer state as ``opt_state["loss_scale"]``). The loss is multiplied by ``scale`` before it is
differentiated and the gradients divided by it (a power of two: exact). After each step,
torch.amp.GradScaler's rule, with ``step.apply_update``'s arithmetic reproduced exactly::

    good = good_steps + 1;  grow = good >= window
    scale'      = scale * 0.5                          if the gradients overflowed (not finite)
                = scale * 2   if applied and grow,  else scale
    good_steps' = good        if applied and not grow, else 0

``applied`` (the step's update was taken) is ``grads_finite`` unless another guard (a
non-finite or exploding update) rejected it: such a step leaves the scale alone and restarts the
count. fp32 regardless of the master dtype, as in step.py.
"""
from __future__ import annotations

from ..tree import tree_map
from .transform import GradientTransformation, all_finite, as_transform, no_updates, select
from ..contracts import Backend


def init_loss_scale(B: Backend, initial_scale: float = 65536.0) -> dict:
    """``{"scale": initial_scale, "good_steps": 0}``, 0-d fp32 (``train.loss_scale``)."""
    f32 = B.xp.float32
    return {"scale": B.asarray(float(initial_scale), dtype=f32), "good_steps": B.asarray(0.0, dtype=f32)}


def update_loss_scale(B: Backend, state: dict, grads_finite, applied=None, window: int = 2000) -> dict:
    """The next loss-scale state (module docstring). ``grads_finite``, ``applied``: 0-d bools
    (``applied`` defaults to ``grads_finite``); ``window``: ``train.loss_scale_window``."""
    xp = B.xp
    ok = grads_finite if applied is None else applied
    scale, good = state["scale"], state["good_steps"] + 1.0
    grow = good >= float(window)
    new_scale = xp.where(grads_finite, xp.where(xp.logical_and(ok, grow), scale * 2.0, scale), scale * 0.5)
    new_good = xp.where(xp.logical_and(ok, xp.logical_not(grow)), good, xp.zeros_like(good))
    return {"scale": new_scale, "good_steps": new_good}


def unscale(B: Backend, grads, state: dict):
    """Gradients of the scaled loss divided by the scale (exact: a power of two)."""
    scale = state["scale"]
    return tree_map(lambda g: g / scale, grads)


def dynamic_loss_scaling(tx, initial_scale: float = 65536.0, window: int = 2000) -> GradientTransformation:
    """``tx`` fed with gradients of the loss times ``state["loss_scale"]["scale"]``: unscales them,
    skips the step when they are not finite (``-0.0`` updates, ``tx``'s state unchanged, as
    ``apply_if_finite``) and updates the scale (``update_loss_scale`` with applied = finite).
    State ``{"loss_scale": {"scale", "good_steps"}, "inner": tx's state}``; the step reads the
    scale to multiply its loss."""
    tx = as_transform(tx)

    def init(B: Backend, params):
        return {"loss_scale": init_loss_scale(B, initial_scale), "inner": tx.init(B, params)}

    def update(B: Backend, updates, state, params=None):
        grads = unscale(B, updates, state["loss_scale"])
        finite = all_finite(B, grads)
        new_updates, new_inner = tx.update(B, grads, state["inner"], params)
        return select(B, finite, new_updates, no_updates(B, new_updates)), {
            "loss_scale": update_loss_scale(B, state["loss_scale"], finite, window=window),
            "inner": select(B, finite, new_inner, state["inner"])}

    return GradientTransformation(init, update)
