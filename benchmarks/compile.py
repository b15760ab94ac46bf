"""``grf bench compile [--json]``: the train step eager vs ``backend.compile`` (torch.compile of the
loss) on each config of ``step.STEP_CONFIGS``, torch, the docs/results/speed.md "Speed" table.

After one step each (the compiled one compiles in it: ``compile_s``), eager and compiled steps
ALTERNATE on the same batch (``step.alternate_steps``), so both see the same load on a shared machine (a benchmark that
times one after the other, as ``grf bench throughput --set backend.compile=true`` does, mixes the
load's drift into the ratio). Fields: ``eager_s``, ``compiled_s`` (medians), ``speedup``.
"""
from __future__ import annotations

from .common import emit, machine
from .step import STEP_CONFIGS, alternate_steps, step_setup

COLUMNS = ["config", "eager_s", "compiled_s", "speedup", "compile_s"]


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS) -> list[dict]:
    from backends import get_backend
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    rows = []
    for name in configs:
        step_cfg, batch = step_setup(name, cfg)
        B = get_backend("torch", device=cfg.backend.device or None)
        r = alternate_steps({"eager": B.with_compile(False), "compiled": B.with_compile(True)}, step_cfg, batch,
                            repeats=3 if name == "kuairand_1k" else 5)
        eager, compiled = r["eager"]["seconds"], r["compiled"]["seconds"]
        row = {"bench": "compile", "config": name, "eager_s": eager, "compiled_s": compiled,
               "speedup": eager / compiled, "compile_s": r["compiled"]["first_s"], **machine()}
        emit(row, json_lines, COLUMNS)
        rows.append(row)
    return rows
