"""``grf bench mfu [--json] [--backend torch,jax] [--set backend.device=cuda] [--set backend.precision=bf16]``:
model FLOPs per second of a full training step over the matmul peak measured in the same run.

Per backend: the peak is ``common.matmul_peak`` (a 4096^3 product in the compute dtype: fp32, or
bf16/fp16 with ``backend.precision``), then each config of ``step.STEP_CONFIGS`` (ML-1M HSTU,
HSTU-large, and a larger D = 256 x 4 blocks x length-1024 model on real KuaiRand-27K lengths) is
timed by ``step.measure_step``. FLOP model: ``gr_functional.flops`` (matmuls only, causal cells,
no padding counted). Fields: ``model_flops`` per step, ``seconds``, ``achieved_flops`` (per second),
``peak_flops``, ``mfu`` = achieved / peak, and ``flops_parts`` (where the model FLOPs are); and the
same step counted as NVIDIA recsys-examples count it (``flops.nvidia_step_flops``: their public
HSTU MFU figures' formula): ``nvidia_flops`` per step and ``mfu_nvidia`` over the same peak.
"""
from __future__ import annotations

from .common import backends_for, device_label, emit, machine, matmul_peak
from .step import STEP_CONFIGS, measure_step, step_setup

COLUMNS = ["backend", "device", "config", "precision", "tokens", "seconds", "achieved_flops", "peak_flops", "mfu",
           "mfu_nvidia"]


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS, repeats: int = 3,
        peak_n: int = 4096) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    rows, host = [], machine()
    setups = {name: step_setup(name, cfg) for name in configs}
    for label, B in backends_for(cfg, backends):
        peak = matmul_peak(B, cfg.backend.precision, n=peak_n)
        for name, (step_cfg, batch) in setups.items():
            r = measure_step(B, step_cfg, batch, repeats=repeats)
            achieved = r["model_flops"] / r["seconds"]
            row = {"bench": "mfu", "backend": label, "device": device_label(B), "config": name,
                   "precision": cfg.backend.precision, "kernel": B.hstu_kernel, **r,
                   "achieved_flops": achieved, "peak_flops": peak, "mfu": achieved / peak,
                   "mfu_nvidia": r["nvidia_flops"] / r["seconds"] / peak, **host}
            rows.append(row)
            emit(row, json_lines, COLUMNS)
    return rows
