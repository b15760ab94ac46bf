"""The STU layer of generative-recommenders' dlrm_v3 ranking model (GR ``modules/stu.py`` with
its PyTorch kernels ``ops/pytorch/pt_hstu_attention.py`` / ``pt_hstu_linear.py``; spec section 3.2
of docs/design/dlrm_v3_ranking_spec.md). On ``x[T, D]`` (jagged by ``layout``, the last
``num_targets[b]`` tokens of sequence b its candidates)::

    n      = LayerNorm(x) * ln_w + ln_b                       (eps 1e-6, affine)
    u,v,q,k = split(n @ w_uvqk + b_uvqk, [H dv, H dv, H dqk, H dqk]);  u = SiLU(u)   (u only)
    o      = stu_attention(q, k, v; alpha = 1/sqrt(dqk), norm_len = N)   (target-aware)
    g      = GroupNorm(o, one group per head, eps 1e-6) * gn_w[h] + gn_b[h]
    x'     = x + dropout(concat[u, o, u * g]) @ w_out                     (no bias)

How it differs from the research HSTU block (``model.hstu_block``): SiLU on u only, a bias on
the projection, q.k scaled by 1/sqrt(dqk), no relative bias (positions and times are added to the
input tokens once), an affine input norm, a per-head GroupNorm, and the output projection reads
u, the raw attention output and their gated product.
"""
from __future__ import annotations

import math

import numpy as np

from ..model import xavier_uniform

EPS = 1e-6


def stu_param_shapes(dim: int, heads: int, dqk: int, dv: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's parameters (model width ``dim``)."""
    return {"ln_w": (dim,), "ln_b": (dim,), "w_uvqk": (dim, 2 * heads * (dv + dqk)), "b_uvqk": (2 * heads * (dv + dqk),),
            "gn_w": (heads,), "gn_b": (heads,), "w_out": (3 * heads * dv, dim)}


def init_stu_params(dim: int, heads: int, dqk: int, dv: int, rng: np.random.Generator) -> dict:
    """GR's initialisation (spec section 6.1): xavier-uniform projections, zero bias, unit norms."""
    shapes = stu_param_shapes(dim, heads, dqk, dv)
    return {"ln_w": np.ones(shapes["ln_w"], np.float32), "ln_b": np.zeros(shapes["ln_b"], np.float32),
            "w_uvqk": xavier_uniform(rng, shapes["w_uvqk"]), "b_uvqk": np.zeros(shapes["b_uvqk"], np.float32),
            "gn_w": np.ones(shapes["gn_w"], np.float32), "gn_b": np.zeros(shapes["gn_b"], np.float32),
            "w_out": xavier_uniform(rng, shapes["w_out"])}


def stu_layer(B, p: dict, x, layout, num_targets, norm_len, heads: int, dqk: int, keep=None):
    """One STU layer: ``x[T, D]`` -> ``[T, D]`` (module docstring). ``num_targets[B_cap]`` int32,
    ``norm_len`` GR's N (the batch's, or accumulated group's, longest real sequence: an int or a
    0-d array, not the padded width ``layout.max_len``), ``keep[T, 3 H dv]`` the dropout mask already
    divided by the keep probability, or None (evaluation)."""
    xp = B.xp
    T = x.shape[0]
    dv = p["w_out"].shape[0] // (3 * heads)
    n = B.layer_norm(x, EPS) * p["ln_w"] + p["ln_b"]
    uvqk = xp.matmul(n, p["w_uvqk"]) + p["b_uvqk"]
    hv, hq = heads * dv, heads * dqk
    u = B.silu(uvqk[:, :hv])
    v = xp.reshape(uvqk[:, hv:2 * hv], (T, heads, dv))
    q = xp.reshape(uvqk[:, 2 * hv:2 * hv + hq], (T, heads, dqk))
    k = xp.reshape(uvqk[:, 2 * hv + hq:], (T, heads, dqk))
    o = B.stu_attention(q, k, v, layout, num_targets, norm_len, 1.0 / math.sqrt(dqk))              # [T, H, dv]
    g = B.layer_norm(o, EPS) * xp.reshape(p["gn_w"], (1, heads, 1)) + xp.reshape(p["gn_b"], (1, heads, 1))
    o, g = xp.reshape(o, (T, hv)), xp.reshape(g, (T, hv))
    y = xp.concat([u, o, u * g], axis=1)
    if keep is not None:
        y = y * keep
    return x + xp.matmul(y, p["w_out"])
