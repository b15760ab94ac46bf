"""``grf bench balance``: per-rank load imbalance on the real KuaiRand-27K sequence lengths.

Data. ``log_standard_user_stats_distribution.csv`` (``dataset_path("kuairand-27k-lengths")``) has
one row per user of KuaiRand-27K's standard logs (27,285 rows, no ids; columns ``exposures``,
``clicks``, ``ctr``). ``exposures`` IS the user's sequence length (100 .. 228,000, median 8,594;
the rows sum to the 322,278,385 exposures of the dataset), so nothing is reconstructed or sampled
from a fitted distribution: the benchmark uses the 27,285 real lengths as they are, truncated at
``T`` (``min(L, T)``), and an epoch is a random permutation of all 27,285 users, each used once.
(The synthetic generator instead samples from the 101 percentiles of the same column because it
must run without the file.) Share of users at or above T (all of equal cost after truncation): 97 % at 1024, 77 % at
4096, 53 % at 8000, 23 % at 16000.

Cost. ``cost = a L^2 + b L`` with ``(a, b) = flop_cost_coefficients(512, 4, 128, 128)``: forward
FLOPs of one causal research-HSTU layer at TorchEasyRec's KuaiRand-27K size (D=512, 4 heads of
128); ``b / a = 2560``. Pass calibrated ``a, b`` (``grf bench calibrate``) to measure with the
machine's real cost ratio. Imbalance is measured with the same cost model that balances.

Cells: truncation T in {1024, 4096, 8000, 16000} x ranks R in {8, 16, 32, 64} x sequences per
rank n in {2, 4, 8, 32}. Per cell, whole epochs (one permutation each, seeded) until at least
``min_batches`` full global batches (default 64; one epoch = 27,285 // (R n) batches). Statistics
are over all batches except each epoch's last (the partial remainder / final flush is reported
as ``last_batch_imbalance_max``).

Policies. Per-batch baselines (``per_batch_plan``: the global batches are consecutive slices of
the order, each split alone, equal counts):
- ``random``: the order as it falls, n consecutive sequences per rank (what a plain loader does;
  ``dist.balance="none"``);
- ``greedy``: LPT per global batch (``balance.greedy_lpt``); ``kk``: Karmarkar-Karp per batch
  (``balance.karmarkar_karp``, without the exchange refinement that ``dist.balance="kk"`` adds);
and the planner of ``dist.balance="lookahead"`` (``balance.plan_epoch``):
- ``lookahead16`` / ``lookahead64``: windows of 16 / 64 global batches pooled.
All policies keep a per-rank token cap of ``n * T`` (the worst case of fixed counts).

Fields per JSON line (one per cell and policy): ``imbalance_mean``, ``imbalance_p95``,
``imbalance_max`` (max / mean - 1 of per-rank cost), ``waste`` (sum over batches of max - mean
rank cost / sum of mean rank cost: the share of rank time spent waiting, i.e. the throughput
lost to imbalance), ``vs_random_mean`` (ratio to random's mean
imbalance), ``meets_1pct`` (p95 <= 1 %), ``planner_ms_per_batch`` (host time of ``plan_epoch``,
or of the baseline's splits, divided by the batches), ``disp_mean_batches`` / ``disp_max_batches``
(|new position - old position| of a sample, in nominal global batches: the cost in data order).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from gr_functional import balance as bl
from gr_functional.balance.plan import check_order
from gr_functional.data.paths import dataset_path

TRUNCATIONS = (1024, 4096, 8000, 16000)
RANKS = (8, 16, 32, 64)
PER_RANK = (2, 4, 8, 32)
POLICIES = {
    "random": dict(policy="random"),
    "greedy": dict(policy="greedy"),
    "kk": dict(policy="kk"),
    "lookahead16": dict(policy="lookahead", window=16),
    "lookahead64": dict(policy="lookahead", window=64),
}
BASELINES = ("random", "greedy", "kk")  # per-batch splits: ``per_batch_plan``


def per_batch_plan(costs, order, num_ranks: int, per_rank: int, policy: str, *, cap: float | None = None,
                   sizes=None) -> bl.EpochPlan:
    """The baselines: global batches of ``G = num_ranks * per_rank`` consecutive samples of
    ``order`` (a last partial batch of ``N % G``), each split into equal-count rank shares alone.

    policy: "random" (rank r takes positions ``r * per_rank ...`` of a full batch, round-robin in
    the partial one), "greedy" (``balance.greedy_lpt``) or "kk" (``balance.karmarkar_karp``); cap:
    per-rank limit on the sum of ``sizes`` (``costs`` when None), as ``balance.plan_epoch``.
    """
    if policy not in BASELINES:
        raise ValueError(f"policy must be one of {BASELINES}, got {policy!r}")
    costs, order, tok_all = check_order(costs, order, cap, sizes)
    R, G = int(num_ranks), int(num_ranks) * int(per_rank)

    def split(items):
        c = costs[items]
        tok = None if tok_all is None else tok_all[items]
        if policy == "random":
            return np.arange(len(items)) % R if len(items) < G else np.arange(len(items)) // per_rank
        if policy == "greedy":
            return bl.greedy_lpt(c, R, equal_count=True, cap=cap, sizes=tok)
        return bl.karmarkar_karp(c, R, equal_count=True, cap=cap, sizes=tok)

    batches = (order[i:i + G] for i in range(0, len(order), G))
    return bl.EpochPlan.from_batches(((items, split(items)) for items in batches), R)


def plan(costs, order, num_ranks: int, per_rank: int, *, policy: str, cap=None, sizes=None, seed: int = 0,
         **kw) -> bl.EpochPlan:
    """One epoch's plan under a benchmark policy: a per-batch baseline or ``balance.plan_epoch``."""
    if policy in BASELINES:
        return per_batch_plan(costs, order, num_ranks, per_rank, policy, cap=cap, sizes=sizes, **kw)
    return bl.plan_epoch(costs, order, num_ranks, per_rank, policy=policy, cap=cap, sizes=sizes, seed=seed, **kw)


def load_user_lengths(path: str | Path | None = None) -> np.ndarray:
    """``[27285] int64``: the ``exposures`` column of the KuaiRand-27K per-user table (one row per user)."""
    path = Path(path) if path is not None else dataset_path("kuairand-27k-lengths")
    with open(path, encoding="utf-8-sig") as f:
        header = [h.strip() for h in f.readline().split(",")]
    if "exposures" not in header:
        raise ValueError(f"{path}: expected an 'exposures' column, got {header}")
    col = header.index("exposures")
    lengths = np.loadtxt(path, delimiter=",", skiprows=1, usecols=col, encoding="utf-8-sig").astype(np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or (lengths <= 0).any():
        raise ValueError(f"{path}: exposures must be a non-empty column of positive counts")
    return lengths


def _stats(x: np.ndarray) -> tuple[float, float, float]:
    if x.size == 0:
        return 0.0, 0.0, 0.0
    return float(x.mean()), float(np.percentile(x, 95)), float(x.max())


def run(json_lines: bool = False, *, truncations=TRUNCATIONS, ranks=RANKS, per_rank=PER_RANK,
        policies: tuple[str, ...] | None = None, min_batches: int = 64, a: float | None = None,
        b: float | None = None, seed: int = 0, lengths_path: str | Path | None = None) -> list[dict]:
    """Run the cells (see the module docstring); print JSON lines or a table; return the rows."""
    lengths = load_user_lengths(lengths_path)
    if a is None or b is None:
        a, b = bl.flop_cost_coefficients(512, 4, 128, 128)
    names = tuple(policies or POLICIES)
    rows: list[dict] = []
    if not json_lines:
        print(f"KuaiRand-27K real per-user lengths: {len(lengths)} users, cost = a L^2 + b L with b/a = {b / a:g}; "
              f"imbalance = max/mean - 1 of per-rank cost, mean / p95 over batches (%)")
        print(f"{'T':>6} {'R':>3} {'n':>3} " + " ".join(f"{p:>15}" for p in names)
              + "   ms/batch(" + ",".join(p for p in names if p not in ("random",)) + ")")
    for T in truncations:
        Lt = np.minimum(lengths, T)
        c = bl.cost(Lt, a, b)
        for R in ranks:
            for n in per_rank:
                G = R * n
                epochs = max(1, math.ceil(min_batches / max(1, len(lengths) // G)))
                orders = [np.random.default_rng((seed, T, R, n, e)).permutation(len(lengths)) for e in range(epochs)]
                cell: dict[str, dict] = {}
                for name in names:
                    kw = POLICIES[name]
                    imb, last, disp, secs, nb, lost, work = [], [], [], 0.0, 0, 0.0, 0.0
                    for e, order in enumerate(orders):
                        t0 = time.perf_counter()
                        ep = plan(c, order, R, n, cap=n * T, sizes=Lt, seed=seed + e, **kw)
                        secs += time.perf_counter() - t0
                        x = ep.imbalance(c)
                        imb.append(x[:-1])
                        rs = ep.rank_sums(c)[:-1]
                        lost += float((rs.max(axis=1) - rs.mean(axis=1)).sum())
                        work += float(rs.mean(axis=1).sum())
                        last.append(float(x[-1]))
                        disp.append(ep.displacement(order, G))
                        nb += ep.num_batches
                    x = np.concatenate(imb)
                    mean, p95, mx = _stats(x)
                    cell[name] = dict(bench="balance", truncation=T, ranks=R, per_rank=n, policy=name,
                                      window=kw.get("window", 1),
                                      epochs=epochs, batches=int(x.size), imbalance_mean=mean, imbalance_p95=p95,
                                      imbalance_max=mx, waste=lost / work if work else 0.0,
                                      last_batch_imbalance_max=max(last),
                                      planner_ms_per_batch=1e3 * secs / max(nb, 1),
                                      disp_mean_batches=float(np.mean([d["mean_batches"] for d in disp])),
                                      disp_max_batches=float(max(d["max_batches"] for d in disp)),
                                      meets_1pct=bool(p95 <= 0.01),
                                      cost_a=a, cost_b=b)
                base = cell.get("random", {}).get("imbalance_mean")
                for name in names:
                    r = cell[name]
                    r["vs_random_mean"] = (r["imbalance_mean"] / base) if base else None
                    rows.append(r)
                    if json_lines:
                        print(json.dumps(r), flush=True)
                if not json_lines:
                    print(f"{T:>6} {R:>3} {n:>3} "
                          + " ".join(f"{100 * cell[p]['imbalance_mean']:>6.2f}/{100 * cell[p]['imbalance_p95']:<7.2f}"
                                     for p in names)
                          + "   " + ",".join(f"{cell[p]['planner_ms_per_batch']:.2f}" for p in names if p != "random"),
                          flush=True)
    if not json_lines:
        print("displacement (mean / max, in global batches): "
              + "; ".join(f"{p}: {np.mean([r['disp_mean_batches'] for r in rows if r['policy'] == p]):.1f} / "
                          f"{max(r['disp_max_batches'] for r in rows if r['policy'] == p):.0f}" for p in names))
        for p in names:
            ok = [r for r in rows if r["policy"] == p]
            print(f"{p}: p95 <= 1 % in {sum(r['meets_1pct'] for r in ok)}/{len(ok)} cells")
    return rows


if __name__ == "__main__":  # python -m benchmarks.balance [--json]
    import sys
    run("--json" in sys.argv[1:])
