"""``grf bench compile [--json]``: the train step eager vs ``backend.compile`` (torch.compile of the
loss) on each config of ``step.STEP_CONFIGS``, torch, the README "Speed" table.

After one step each (the compiled one compiles in it: ``compile_s``), eager and compiled steps
ALTERNATE on the same batch, so both see the same load on a shared machine (a benchmark that
times one after the other, as ``grf bench throughput --set backend.compile=true`` does, mixes the
load's drift into the ratio). Fields: ``eager_s``, ``compiled_s`` (medians), ``speedup``.
"""
from __future__ import annotations

import statistics
import time

from .common import emit, machine
from .step import STEP_CONFIGS, step_setup

COLUMNS = ["config", "eager_s", "compiled_s", "speedup", "compile_s"]


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS) -> list[dict]:
    from backends import get_backend
    from gr_functional import model
    from gr_functional.config import load_config
    from gr_functional.train import init_opt_state, make_train_step

    cfg = cfg or load_config(None)
    rows = []
    for name in configs:
        step_cfg, batch = step_setup(name, cfg)
        B = get_backend("torch", device=cfg.backend.device or None)
        variants = {"eager": B.with_compile(False), "compiled": B.with_compile(True)}
        params = B.asarray_tree(model.init_params(step_cfg.model, seed=0, num_items=step_cfg.model.num_items))
        b = B.asarray_tree(batch)
        steps, first = {}, {}
        for label, V in variants.items():
            opt = init_opt_state(V, params, step_cfg)
            fn = make_train_step(V, step_cfg)
            t0 = time.perf_counter()
            V.block_until_ready(fn(params, opt, b))
            first[label] = time.perf_counter() - t0
            steps[label] = (V, fn, opt)
        times = {label: [] for label in variants}
        for _ in range(3 if name == "kuairand_1k" else 5):
            for label, (V, fn, opt) in steps.items():
                t0 = time.perf_counter()
                V.block_until_ready(fn(params, opt, b))
                times[label].append(time.perf_counter() - t0)
        eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
        row = {"bench": "compile", "config": name, "eager_s": eager, "compiled_s": compiled,
               "speedup": eager / compiled, "compile_s": first["compiled"], **machine()}
        emit(row, json_lines, COLUMNS)
        rows.append(row)
    return rows
