"""AdamW as a pair of pure functions over parameter pytrees (optax style).

``state = adamw_init(B, params)``; ``params, state = adamw_update(B, grads, state, params, cfg)``.
Matches torch.optim.AdamW and optax.adamw (tests/differential/test_optim.py proves it):
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    p = p - lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * p)
"""
from __future__ import annotations

from .config import OptimConfig
from .tree import tree_map


def adamw_init(B, params: dict) -> dict:
    xp = B.xp
    return {
        "step": B.asarray(0.0, dtype=B.float_dtype),
        "mu": tree_map(xp.zeros_like, params),
        "nu": tree_map(xp.zeros_like, params),
    }


def adamw_update(B, grads: dict, state: dict, params: dict, cfg: OptimConfig):
    xp = B.xp
    b1, b2 = cfg.beta1, cfg.beta2
    step = state["step"] + 1.0
    mu = tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
    c1 = 1.0 - b1 ** step
    c2 = 1.0 - b2 ** step

    def apply(p, m, v):
        direction = (m / c1) / (xp.sqrt(v / c2) + cfg.eps)
        return p - cfg.lr * (direction + cfg.weight_decay * p)

    new_params = tree_map(apply, params, mu, nu)
    return new_params, {"step": step, "mu": mu, "nu": nu}
