"""The STU layer of generative-recommenders' dlrm_v3 ranking model (GR ``modules/stu.py`` with
its PyTorch kernels ``ops/pytorch/pt_hstu_attention.py`` / ``pt_hstu_linear.py``; spec section 3.2
of docs/design/dlrm_v3_ranking_spec.md). On ``x[T, D]`` (jagged by ``layout``, the last
``num_targets[b]`` tokens of sequence b its candidates)::

    n      = LayerNorm(x) * ln_w + ln_b                       (eps 1e-6, affine)
    u,v,q,k = split(n @ w_uvqk + b_uvqk, [H dv, H dv, H dqk, H dqk]);  u = SiLU(u)   (u only)
    o      = stu_attention(q, k, v; alpha = 1/sqrt(dqk), norm_len = N)   (target-aware)
    g      = the output norm of o[T, H dv], eps 1e-6, affine (``group_norm``):
               false: LayerNorm over all H dv values of a token  * gn_w[H dv] + gn_b[H dv]
               true:  GroupNorm, one group per head (dv values)   * gn_w[h]    + gn_b[h]
    x'     = x + dropout(concat[u, o, u * g]) @ w_out                     (no bias)

The output norm is GR's ``STULayerConfig.use_group_norm`` (``DlrmHSTUConfig.hstu_group_norm``):
``ops/pytorch/pt_hstu_linear.py`` ``pytorch_norm_mul_dropout`` normalises the attention output
(in float32) before the u gating, ``y = u * norm(o)``, and ``modules/stu.py`` sizes its
``_output_norm_weight/_bias`` ``[H dv]`` (LayerNorm) or ``[H]`` (GroupNorm). kuairand-1k used
GroupNorm at GR 2e81fab and uses the LayerNorm at GR HEAD db1bf8f (``ranking.group_norm``).

How it differs from the research HSTU block (``model.hstu_block``): SiLU on u only, a bias on
the projection, q.k scaled by 1/sqrt(dqk), no relative bias (positions and times are added to the
input tokens once), an affine input norm, an affine output norm (LayerNorm or per-head GroupNorm), and the output projection reads
u, the raw attention output and their gated product.
"""
from __future__ import annotations

import math

import numpy as np

from ..model import xavier_uniform
from ..contracts import Backend

EPS = 1e-6


def stu_param_shapes(dim: int, heads: int, dqk: int, dv: int, group_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's parameters (model width ``dim``). The output norm's ``gn_w``/``gn_b``
    are ``[heads]`` with ``group_norm`` (one scale per head), else ``[heads * dv]`` (GR's LayerNorm)."""
    norm = (heads,) if group_norm else (heads * dv,)
    return {"ln_w": (dim,), "ln_b": (dim,), "w_uvqk": (dim, 2 * heads * (dv + dqk)), "b_uvqk": (2 * heads * (dv + dqk),),
            "gn_w": norm, "gn_b": norm, "w_out": (3 * heads * dv, dim)}


def init_stu_params(dim: int, heads: int, dqk: int, dv: int, rng: np.random.Generator, group_norm: bool = True) -> dict:
    """GR's initialisation (spec section 6.1): xavier-uniform projections, zero bias, unit norms.
    The output norm's shape does not change what ``rng`` draws."""
    shapes = stu_param_shapes(dim, heads, dqk, dv, group_norm)
    return {"ln_w": np.ones(shapes["ln_w"], np.float32), "ln_b": np.zeros(shapes["ln_b"], np.float32),
            "w_uvqk": xavier_uniform(rng, shapes["w_uvqk"]), "b_uvqk": np.zeros(shapes["b_uvqk"], np.float32),
            "gn_w": np.ones(shapes["gn_w"], np.float32), "gn_b": np.zeros(shapes["gn_b"], np.float32),
            "w_out": xavier_uniform(rng, shapes["w_out"])}


def output_norm(B: Backend, o, w, b, group_norm: bool):
    """The affine output norm of the attention output ``o[T, H, dv]`` -> ``[T, H * dv]`` (eps 1e-6).
    ``group_norm``: each head's dv values normalised alone, ``w``/``b`` ``[H]`` (one per head); else
    all H * dv values of a token together (LayerNorm), ``w``/``b`` ``[H * dv]``."""
    xp = B.xp
    T, heads, dv = o.shape
    if group_norm:
        g = B.layer_norm(o, EPS) * xp.reshape(w, (1, heads, 1)) + xp.reshape(b, (1, heads, 1))   # [T, H, dv]
        return xp.reshape(g, (T, heads * dv))
    return B.layer_norm(xp.reshape(o, (T, heads * dv)), EPS) * w + b                            # [T, H dv]


def stu_layer(B: Backend, p: dict, x, layout, num_targets, norm_len, heads: int, dqk: int, keep=None, group_norm: bool = True):
    """One STU layer: ``x[T, D]`` -> ``[T, D]`` (module docstring). ``num_targets[B_cap]`` int32,
    ``norm_len`` GR's N (the batch's, or accumulated group's, longest real sequence: an int or a
    0-d array, not the padded width ``layout.max_len``), ``keep[T, 3 H dv]`` the dropout mask already
    divided by the keep probability, or None (evaluation). ``group_norm``: the output norm
    (``output_norm``; ``p["gn_w"]`` ``[H]`` if true, ``[H dv]`` if false)."""
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
    g = output_norm(B, o, p["gn_w"], p["gn_b"], group_norm)                                         # [T, H dv]
    y = xp.concat([u, xp.reshape(o, (T, hv)), u * g], axis=1)
    if keep is not None:
        y = y * keep
    return x + xp.matmul(y, p["w_out"])
