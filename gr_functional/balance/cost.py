"""The cost model of a sequence and the imbalance metric (host-side, numpy only).

Work per sequence of ``L`` tokens is ``a * L**2 + b * L``: attention is quadratic in ``L``, the
projections linear. ``a`` and ``b`` are fitted to measured HSTU-layer timings with
:func:`fit_cost` (``grf bench calibrate``, written to ``dist.cost_a`` / ``dist.cost_b``);
:func:`flop_cost_coefficients` is the FLOP-count stand-in until then.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def cost(lengths, a: float = 1.0, b: float = 0.0) -> np.ndarray:
    """``[N] float64`` cost ``a * L**2 + b * L`` of sequences of ``lengths[N]`` tokens."""
    L = np.asarray(lengths, dtype=np.float64)
    return a * L * L + b * L


def flop_cost_coefficients(embed_dim: int, num_heads: int, dqk: int, dv: int, *, causal: bool = True
                           ) -> tuple[float, float]:
    """``(a, b)`` of one research HSTU layer's forward FLOPs (a stand-in until the cost is calibrated).

    Per sequence of ``L`` tokens: uvqk projection ``2 L D (2 H dv + 2 H dqk)`` and output projection
    ``2 L (H dv) D`` (linear in L), attention ``Q K^T`` and ``A V`` ``2 L^2 H (dqk + dv)``, halved
    when ``causal`` (only the lower triangle is computed by jagged kernels).
    """
    D, H = embed_dim, num_heads
    a = 2.0 * H * (dqk + dv) * (0.5 if causal else 1.0)
    b = 2.0 * D * (2 * H * dv + 2 * H * dqk) + 2.0 * H * dv * D
    return a, b


def part_sums(values, assignment, num_parts: int) -> np.ndarray:
    """``[num_parts] float64``: sum of ``values[N]`` per part of ``assignment[N]`` (ints in [0, num_parts))."""
    return np.bincount(np.asarray(assignment), weights=np.asarray(values, dtype=np.float64),
                       minlength=num_parts).astype(np.float64)


def imbalance(part_costs) -> np.ndarray | float:
    """``max / mean - 1`` over the last axis of ``part_costs[..., k]`` (0 where the mean is 0)."""
    x = np.asarray(part_costs, dtype=np.float64)
    mean = x.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(mean > 0, x.max(axis=-1) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)
    return float(out) if out.ndim == 0 else out


# --------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class CostFit:
    """Least-squares fit ``time ~ a L^2 + b L + c``: coefficients and the relative RMS residual."""
    a: float
    b: float
    c: float
    rel_rmse: float


def fit_cost(lengths, times, *, intercept: bool = True, relative: bool = True) -> CostFit:
    """Fit ``times[M] ~ a * L**2 + b * L (+ c)`` over ``lengths[M]`` by (non-negative) least squares.

    ``relative``: minimise relative residuals (weights 1/time), so short and long sequences count
    alike. ``intercept``: fit a constant per-call overhead ``c`` (kernel launches, Python) that the
    balancer then ignores; it is not a per-sequence cost inside a packed jagged batch. Negative
    coefficients are not physical: the fit then drops the offending term (a, b, c >= 0).
    """
    L = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if L.shape != t.shape or L.ndim != 1:
        raise ValueError(f"lengths and times must be 1-D of equal length, got {L.shape} and {t.shape}")
    if (t <= 0).any():
        raise ValueError("times must be > 0")
    cols = [L * L, L] + ([np.ones_like(L)] if intercept else [])
    if len(np.unique(L)) < len(cols):
        raise ValueError(f"need at least {len(cols)} distinct lengths to fit {len(cols)} coefficients")
    w = 1.0 / t if relative else np.ones_like(t)
    X = np.stack(cols, axis=1)
    best = None
    m = X.shape[1]
    for mask in range(1, 2 ** m):  # all supports: exact NNLS for <= 3 unknowns
        idx = [i for i in range(m) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(X[:, idx] * w[:, None], t * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(m)
        full[idx] = coef
        res = float(np.sqrt(np.mean(((X @ full - t) / t) ** 2)))
        if best is None or res < best[1] - 1e-15:
            best = (full, res)
    full, res = best
    return CostFit(a=float(full[0]), b=float(full[1]), c=float(full[2]) if intercept else 0.0, rel_rmse=res)
