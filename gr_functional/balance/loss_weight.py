"""Loss normalisation when balancing leaves the ranks with different token counts."""
from __future__ import annotations


def rank_loss_weight(global_tokens: int, world_size: int, *, grad_reduce: str = "mean") -> float:
    """Factor for a rank's *summed* per-token loss so that reduced gradients equal those of the
    global per-token mean, whatever the per-rank token counts.

    With ``grad_reduce="mean"`` (DDP averages gradients over ``world_size`` ranks) the factor is
    ``world_size / global_tokens``; with ``"sum"`` (what ``step.py`` and ``backends/dist_torch.py``
    do) it is ``1 / global_tokens``. ``global_tokens`` is the all-reduced sum of the ranks'
    loss-bearing token counts. Normalising by the local count instead (a per-rank mean)
    over-weights tokens on ranks that hold few of them, which balancing by cost makes common.
    """
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be > 0, got {global_tokens}")
    if grad_reduce == "mean":
        return world_size / global_tokens
    if grad_reduce == "sum":
        return 1.0 / global_tokens
    raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
