"""``grf bench pipeline [--config C] [--backend torch,jax] [--json]``: how busy the training step
keeps the machine, with the batches built in the step's thread (``train.prefetch = 0``) and ahead
on a worker thread (``prefetch = 2``, the default).

Each row runs ``steps`` training steps of the config's real loader (after ``warmup`` steps, which
compile and warm caches) and reports:

  compute_s   seconds inside the step: host-to-device copy, forward, backward, update (synchronised)
  wall_s      seconds of the whole loop (batch hand-out + step)
  busy        compute_s / wall_s: the share of wall time the step computes (TurboGR: 94% NPU use)
  build_s     seconds spent building the batches (numpy: users, negatives, dropout masks, ranks)
  wait_s      seconds the loop waited for a batch; hidden = 1 - wait_s / build_s
  tokens_per_s  real input tokens per wall second

On a CPU the worker shares cores with the step's kernels, so a hidden build can still slow the
step down a little: compare tokens_per_s as well as busy.
"""
from __future__ import annotations

import time

from .common import backends_for, device_label, emit, machine

COLUMNS = ["backend", "device", "config", "loss", "prefetch", "steps", "compute_s", "wall_s", "busy", "build_s",
           "wait_s", "hidden", "tokens_per_s"]


def run(json_lines: bool = False, cfg=None, backends=None, steps: int = 20, warmup: int = 3,
        prefetch=(0, 2)) -> list[dict]:
    import gr_functional as grf
    from gr_functional.configure import load_config
    from gr_functional.data.prefetch import PrefetchStats
    from gr_functional.step import init_opt_state, make_train_step

    cfg = cfg or load_config(None)
    exp = grf.prepare(cfg)
    host, rows = machine(), []
    n_steps = exp.loader.steps_in_epoch(0)
    if warmup + steps > n_steps:
        steps = max(1, n_steps - warmup)
    for label, B in backends_for(exp.cfg, backends):
        step_fn = make_train_step(B, exp.cfg)
        params = B.asarray_tree(exp.init_params())
        opt_state = init_opt_state(B, params, exp.cfg)
        for depth in prefetch:
            stats = PrefetchStats()
            compute = tokens = 0.0
            wall0 = None
            for i, batch in enumerate(exp.loader.epoch(0, 0, prefetch=depth, stats=stats)):
                if i == warmup:
                    stats.reset()
                    wall0 = time.perf_counter()
                elif i == warmup + steps:
                    break
                t0 = time.perf_counter()
                params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
                float(m["loss"])  # synchronise (JAX dispatches asynchronously)
                if wall0 is not None:
                    compute += time.perf_counter() - t0
                    tokens += batch.layout.num_tokens()
            wall = time.perf_counter() - wall0
            row = {"bench": "pipeline", "backend": label, "device": device_label(B), "config": cfg.data.dataset,
                   "loss": exp.cfg.loss.name, "prefetch": depth, "steps": steps, "compute_s": compute,
                   "wall_s": wall, "busy": compute / wall, "build_s": stats.build_s, "wait_s": stats.wait_s,
                   "hidden": stats.hidden, "tokens_per_s": tokens / wall, **host}
            rows.append(row)
            emit(row, json_lines, COLUMNS)
    return rows
