"""``grf bench calibrate --config NAME [--backend B] [--set ...] [--json]``: fit the balancer's
cost model ``a L^2 + b L`` (seconds per sequence of L input tokens) on this machine.

What is timed. One HSTU block of the config's model (``model.hstu_block``: LN, uvqk projection,
jagged causal attention with the relative biases, norm-mul, output projection), forward plus
backward (gradients of its parameters and its input), on a jagged batch of ``m`` sequences of
exactly ``L`` input tokens, on the config's backend. ``m`` is what one rank holds in training,
``train.batch_size // max(2, dist.nproc)``, fixed for every L: the padded-dense reference
attention's memory traffic grows with the number of slots faster than linearly, so timing many
short sequences at once would measure a batch no rank ever runs (and on a shared 2-core machine,
2 threads ran 30x slower than 1: run it with the threads a rank gets, ``OMP_NUM_THREADS=1`` for
torchrun's CPU ranks). Per length: one warm-up (and JAX compilation), then the median of
``repeats`` (5) timed runs, divided by ``m``. The fit is ``balance.fit_cost`` with an intercept ``c`` (per-sequence
overhead), which the balancer may ignore because every rank gets the same number of sequences.

What it means. With the no-padding attention (``ops.attention = "jagged"``, or the default fused C++ tiles) the
L^2 term is the causal attention's tiles. With the padded reference (``ops.attention =
"reference"``) attention costs ``max_len^2`` per sequence slot whatever L is, so the fit finds
``a ~ 0`` and the dense part lands in ``c``: the balancer then balances the linear work
(projections, loss), which is what differs between ranks.

Output: one line per length (L, sequences, seconds per sequence, fitted value) and the fit, and
the config lines to store it::

    [dist]
    cost_a = ...
    cost_b = ...

(``--json``: one object per length, then ``{"kind": "fit", "cost_a", "cost_b", "c", "rel_rmse"}``).
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from gr_functional import balance


def default_lengths(max_len: int, points: int = 8) -> list[int]:
    """``points`` distinct lengths log-spaced from ``max(2, max_len // 16)`` to ``max_len``."""
    lo = max(2, max_len // 16)
    return sorted({int(round(x)) for x in np.geomspace(lo, max_len, points)})


def layer_timer(B, cfg, sequences: int | None = None):
    """``measure(L) -> seconds per sequence`` of one HSTU block's forward+backward on ``B``, on
    batches of ``sequences`` (default ``train.batch_size // max(2, dist.nproc)``) sequences."""
    from gr_functional import model
    from gr_functional.batch import Negatives, make_batch
    from gr_functional.tree import tree_leaves

    mc = cfg.model
    params = B.asarray_tree(model.init_params(mc, seed=0, num_items=max(mc.num_items, 16))["blocks"][0])
    rng = np.random.default_rng(0)
    cache: dict[int, tuple] = {}
    m_seq = sequences or max(1, cfg.train.batch_size // max(2, cfg.dist.nproc))

    def objective(p, x, batch):
        y = model.hstu_block(B, p, x, batch, mc)
        return B.xp.sum(y * y)

    grad_fn = B.jit(B.value_and_grad(lambda px, batch: objective(px[0], px[1], batch)))

    def setup(L: int):
        m = m_seq
        hist = [rng.integers(1, 16, L + 1) for _ in range(m)]
        times = [np.cumsum(rng.integers(1, 3600, L + 1)) for _ in range(m)]
        nm = dataclasses.replace(mc, num_items=16, input_dropout=0.0, linear_dropout=0.0)
        batch = make_batch(hist, times, nm, rng=rng, num_items=16, train=True, t_cap=m * L, b_cap=m,
                           negatives=Negatives("sampled", 1))
        x = rng.standard_normal((m * L, mc.embed_dim)).astype(np.float32)
        return m, B.asarray_tree(batch), B.asarray(x)

    def run(L: int) -> float:
        if L not in cache:
            cache[L] = setup(L)
            m, batch, x = cache[L]
            _sync(B, grad_fn((params, x), batch))  # warm-up / compile
        m, batch, x = cache[L]
        t0 = time.perf_counter()
        _sync(B, grad_fn((params, x), batch))
        return (time.perf_counter() - t0) / m

    def _sync(B, out):
        value, grads = out
        for leaf in tree_leaves(grads):
            B.to_numpy(leaf)
        B.to_numpy(value)

    run.sequences = lambda L: m_seq  # type: ignore[attr-defined]
    return run


def calibrate_cost(cfg, backend=None, lengths=None, repeats: int = 5) -> dict:
    """Time one HSTU block (module docstring) and fit ``a L^2 + b L + c``. Returns
    ``{"cost_a", "cost_b", "c", "rel_rmse", "lengths", "seconds", "backend"}``."""
    from gr_functional.runtime import make_backend

    B = backend or make_backend(cfg)
    lengths = list(lengths or default_lengths(cfg.model.max_len))
    measure = layer_timer(B, cfg)
    seconds = [float(np.median([measure(L) for _ in range(max(1, repeats))])) for L in lengths]
    fit = balance.fit_cost(lengths, seconds, intercept=True)
    return {"cost_a": fit.a, "cost_b": fit.b, "c": fit.c, "rel_rmse": fit.rel_rmse, "lengths": lengths,
            "seconds": seconds, "sequences": [measure.sequences(L) for L in lengths], "backend": B.name}


def run(json_lines: bool = False, cfg=None) -> dict:
    if cfg is None:
        from gr_functional.configure import load_config

        cfg = load_config(None)
    r = calibrate_cost(cfg)
    a, b, c = r["cost_a"], r["cost_b"], r["c"]
    if a == 0.0 and b == 0.0:  # 0, 0 in the config means "FLOP stand-in", not "all equal"
        print("grf: warning: the fit found no length dependence (a = b = 0); keep the FLOP stand-in or "
              "measure longer lengths (raise model.max_len)")
    for L, m, t in zip(r["lengths"], r["sequences"], r["seconds"]):
        fitted = a * L * L + b * L + c
        if json_lines:
            print(json.dumps({"kind": "length", "L": L, "sequences": m, "seconds_per_seq": t, "fitted": fitted}))
        else:
            print(f"L={L:6d}  sequences={m:5d}  {t * 1e6:10.1f} us/seq  fit {fitted * 1e6:10.1f} us")
    if json_lines:
        print(json.dumps({"kind": "fit", "cost_a": a, "cost_b": b, "c": c, "rel_rmse": r["rel_rmse"],
                          "backend": r["backend"]}))
    else:
        print(f"fit on {r['backend']} (one HSTU block fwd+bwd, D={cfg.model.embed_dim}, H={cfg.model.num_heads}, "
              f"max_len={cfg.model.max_len}): a={a:.4g} s/token^2, b={b:.4g} s/token, c={c:.4g} s/seq, "
              f"relative RMS residual {r['rel_rmse']:.3f}")
        print("store it in the config:\n[dist]\n"
              f"cost_a = {a!r}\ncost_b = {b!r}\n"
              f"(or --set dist.cost_a={a!r} --set dist.cost_b={b!r})")
    return r
