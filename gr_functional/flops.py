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
