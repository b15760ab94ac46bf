"""Dynamic load balancing of jagged sequences across data-parallel ranks (host-side, numpy only).

Every rank of a synchronous data-parallel step waits for the slowest one, so a global batch's
sequences should be split so that every rank does the same work (README "Load balancing across
ranks"). Pure functions; randomness only through explicit seeds. By concern:

- :mod:`.cost`: the cost model ``a * L**2 + b * L`` of a sequence of ``L`` tokens (:func:`cost`,
  :func:`flop_cost_coefficients`, :func:`fit_cost` for ``grf bench calibrate``) and the metric
  (:func:`part_sums`, :func:`imbalance` = ``max / mean - 1`` of per-rank cost).
- :mod:`.partition`: one batch into ``k`` parts: :func:`karmarkar_karp` (``dist.balance = "kk"``,
  equal counts, ``dist.rank_token_cap``), :func:`greedy_lpt` (its fallback), :func:`refine`
  (exchange local search).
- :mod:`.plan`: :func:`plan_epoch` -> :class:`EpochPlan`, the schedule of
  ``dist.balance = "lookahead"`` over windows of ``dist.lookahead`` global batches.
- :mod:`.loss_weight`: :func:`rank_loss_weight`, loss normalisation by the global token count.
"""
from .cost import CostFit, cost, fit_cost, flop_cost_coefficients, imbalance, part_sums
from .loss_weight import rank_loss_weight
from .partition import greedy_lpt, karmarkar_karp, refine
from .plan import POLICIES, EpochPlan, plan_epoch

__all__ = ["POLICIES", "CostFit", "EpochPlan", "cost", "fit_cost", "flop_cost_coefficients", "greedy_lpt",
           "imbalance", "karmarkar_karp", "part_sums", "plan_epoch", "rank_loss_weight", "refine"]
