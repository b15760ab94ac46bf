"""FLOP model of the HSTU training step (MFU and the ideal ratios of ``grf bench``).

Counted: matrix products only, 2 FLOPs per multiply-add, in *model* terms, i.e. the work the
model needs, not what an implementation happens to compute:

  per block, on T real tokens, with S = sum_b L_b (L_b + 1) / 2 causal score cells
    uvqk projection     2 T D H (2 dv + 2 dqk)
    scores  q k^T       2 S H dqk
    weights x V         2 S H dv
    output projection   2 T H dv D
  loss (sampled softmax, R sampled negatives + the positive, on the T supervised rows)
    logits              2 T (R + 1) D
  backward = 2 x forward (the gradients of both operands of every product); the optimizer adds
  ``ADAMW_FLOPS_PER_PARAM`` per parameter (a few elementwise passes; below 1 % of any config here).

Not counted: elementwise work (SiLU, LayerNorm, biases, masks), gathers and the embedding lookup.
Padding is never counted: a padded implementation computing B * max_len^2 score cells does the
same model FLOPs as a jagged one, just slower, which is what MFU should show.
"""
from __future__ import annotations

import numpy as np

ADAMW_FLOPS_PER_PARAM = 12


def causal_cells(lengths) -> int:
    """``S = sum_b L_b (L_b + 1) / 2``: (query, key) pairs of causal attention within sequences."""
    L = np.asarray(lengths, dtype=np.int64)
    return int((L * (L + 1) // 2).sum())


def block_forward_flops(mc, tokens: int, cells: int) -> dict:
    """Forward FLOPs of one HSTU block by part (``mc``: ModelConfig)."""
    D, H, dqk, dv = mc.embed_dim, mc.num_heads, mc.dqk, mc.dv
    return {
        "uvqk": 2 * tokens * D * H * (2 * dv + 2 * dqk),
        "attention": 2 * cells * H * (dqk + dv),
        "output": 2 * tokens * H * dv * D,
    }


def loss_forward_flops(mc, supervised: int, num_negatives: int) -> int:
    return 2 * supervised * (num_negatives + 1) * mc.embed_dim


def train_step_flops(mc, lengths, supervised: int | None = None, num_params: int = 0,
                     num_negatives: int = 128) -> dict:
    """Model FLOPs of one training step (forward, backward, optimizer) on sequences of these
    input lengths; ``supervised`` defaults to every token. Returns parts and ``"total"``."""
    tokens = int(np.asarray(lengths).sum())
    cells = causal_cells(lengths)
    per_block = block_forward_flops(mc, tokens, cells)
    forward = {k: v * mc.num_blocks for k, v in per_block.items()}
    forward["loss"] = loss_forward_flops(mc, tokens if supervised is None else supervised, num_negatives)
    parts = {k: 3 * v for k, v in forward.items()}            # forward + 2 x backward
    parts["optimizer"] = ADAMW_FLOPS_PER_PARAM * num_params
    parts["total"] = sum(parts.values())
    return parts


def padded_over_jagged(lengths, max_len: int) -> dict:
    """Ideal work ratios of a padded implementation (every sequence ``max_len`` long, full
    ``max_len^2`` score matrix) over the jagged one (causal cells only, as ``causal_cells``),
    and the plain ``B max_len^2 / sum L^2`` of the issue text."""
    L = np.asarray(lengths, dtype=np.int64)
    B = len(L)
    return {
        "attention_sq": B * max_len ** 2 / max(int((L * L).sum()), 1),
        "attention_causal": B * max_len ** 2 / max(causal_cells(L), 1),
        "linear": B * max_len / max(int(L.sum()), 1),
    }


def ranking_cells(lengths, num_targets) -> int:
    """Score cells of GR's ranking mask: per sequence of L tokens with c candidates, the L - c
    contextual and history tokens attend causally, each candidate to those and to itself."""
    L, c = np.asarray(lengths, np.int64), np.asarray(num_targets, np.int64)
    n0 = L - c
    return int((n0 * (n0 + 1) // 2 + c * (n0 + 1)).sum())


def ranking_step_flops(rc, lengths, num_targets) -> dict:
    """Model FLOPs of one training step of the ranking model (``rc``: RankingConfig) on sequences
    of ``lengths`` tokens (contextual + history + candidates) with ``num_targets`` candidates each,
    counted as the module docstring counts the retrieval HSTU's: the STU layers (uvqk, attention
    over ``ranking_cells``, the output projection of [u, o, u * norm(o)]), the contextual maps
    (S per user), the content and action towers (per history or candidate token), and per
    candidate the time-aware postprocessor (D + 4 time features in), the item tower and the multitask head; x 3 for
    forward + backward. Embedding gathers and elementwise work are not counted."""
    L, c = np.asarray(lengths, np.int64), np.asarray(num_targets, np.int64)
    T, C, users = int(L.sum()), int(c.sum()), len(L)
    S, E, D, H, dqk, dv = rc.contextual, rc.embed_dim, rc.dim, rc.heads, rc.dqk, rc.dv
    items = T - users * S
    K = len(rc.action_weights)
    th, ih, kh = rc.tower_hidden, rc.item_hidden, rc.task_hidden
    per_layer = {"uvqk": 2 * T * D * 2 * H * (dv + dqk), "attention": 2 * ranking_cells(L, c) * H * (dqk + dv),
                 "output": 2 * T * 3 * H * dv * D}
    forward = {k: v * rc.num_layers for k, v in per_layer.items()}
    forward["inputs"] = 2 * users * S * E * D + 2 * items * (E * th + th * D) + 2 * items * (K * rc.action_dim * th + th * D)
    forward["heads"] = 2 * C * ((D + 4) * D + E * ih + ih * D + D * kh + kh * K)
    parts = {k: 3 * v for k, v in forward.items()}
    parts["total"] = sum(parts.values())
    return parts


def nvidia_step_flops(mc, lengths, contextual=None, candidates=None) -> int:
    """FLOPs of one HSTU training step as NVIDIA recsys-examples count them (the field's public MFU
    reference: ``examples/commons/utils/perf.py``, ``cal_hstu_flops_single_rank``, read at commit
    7cf4575), on sequences of ``lengths`` tokens with ``contextual`` / ``candidates`` tokens each
    (default 0: the retrieval HSTU). Per layer and sequence, h = L - c - k history tokens, d the
    head size (``mc.dqk``; they use one size for q, k and v):

      attention   4 H L (c + h) d - 2 H h^2 d (causal) + 4 H k d, x 3.5 for forward + backward
      GEMMs       2 L (4 H d) D (uvqk) + 2 L H D ("proj": no d factor), x 3
      elementwise 2 L H d (u * attention, forward + backward) + L H D (the residual)

    summed over ``mc.num_blocks`` layers; no embeddings, no loss, no optimizer. Against
    ``train_step_flops`` (ours): their causal attention counts the diagonal once less per cell
    row and uses 3.5x for the backward (ours 3x), their output projection omits the head size
    (H D instead of H dv D: it counts less), and they add elementwise terms we leave out."""
    L = np.asarray(lengths, np.float64)
    c = np.zeros_like(L) if contextual is None else np.asarray(contextual, np.float64)
    k = np.zeros_like(L) if candidates is None else np.asarray(candidates, np.float64)
    h = L - c - k
    D, H, d = mc.embed_dim, mc.num_heads, mc.dqk
    attention = (4 * H * L * (c + h) * d - 2 * H * h * h * d + 4 * H * k * d) * 3.5
    gemm = (2 * L * 4 * H * d * D + 2 * L * H * D) * 3
    other = 2 * L * H * d + L * H * D
    return int(round(float(np.sum(attention + gemm + other)) * mc.num_blocks))
