"""``grf bench throughput [--json] [--backend torch,jax] [--set backend.device=cuda]``: training
tokens per second of each backend on each config of ``step.STEP_CONFIGS``.

The step is the training step of ``step.prepare_step`` (forward, backward, AdamW) with each
backend's defaults (kernel "default", ``kernel_used``: "best", which on CPU is the fused C++
tiles with the fused sampled logits: torch's extension, JAX's XLA FFI custom calls), and the tiled
no-padding attention (``ops.attention = "tiled"``) and the padded reference attention on the same
jagged batch in the formulation both backends share (the fused C++ ops off: ``cpu_fused.OFF``;
"jagged" runs whichever of those two ``Backend.tiles_pay_off`` picks).
For each config and kernel the backends' steps ALTERNATE (``step.alternate_steps``: one warm-up
step each, then ``repeats`` rounds, medians), so the torch / JAX ratio is not the load's drift
between two measurements. Fields: ``tokens`` (real input tokens per step), ``seconds``, ``tokens_per_s``,
``vs_fastest`` (this row's tokens/s over the fastest backend's on the same config and kernel: the
"within 1.5x" check of issue 4).
"""
from __future__ import annotations

from .common import backends_for, device_label, emit, fused_available, kernel_variant, machine
from .step import STEP_CONFIGS, alternate_steps, step_setup

COLUMNS = ["backend", "device", "config", "kernel", "kernel_used", "tokens", "seconds", "tokens_per_s", "vs_fastest"]


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS, kernels=("default", "tiled", "reference"),
        repeats: int = 3) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    host = machine()
    setups = {name: step_setup(name, cfg) for name in configs}
    rows = []
    measured = backends_for(cfg, backends)
    for name, (step_cfg, batch) in setups.items():
        for kernel in kernels:
            # "default": each backend as grf train runs it; the named kernels: the shared formulation
            variants = {label: kernel_variant(B, kernel, fused_ops=kernel == "default") for label, B in measured}
            for label, r in alternate_steps(variants, step_cfg, batch, repeats=repeats).items():
                rows.append({"bench": "throughput", "backend": label, "device": device_label(variants[label]),
                             "config": name, "kernel": kernel, "kernel_used": variants[label].hstu_kernel,
                             "cpu_fused": fused_available(variants[label]),
                             "precision": cfg.backend.precision,
                             "tokens": r["tokens"], "sequences": r["sequences"], "seconds": r["seconds"],
                             "tokens_per_s": r["tokens"] / r["seconds"], **host})
    for row in rows:  # ratios need every backend's figure first
        same = [r["tokens_per_s"] for r in rows if r["config"] == row["config"] and r["kernel"] == row["kernel"]]
        row["vs_fastest"] = row["tokens_per_s"] / max(same)
        emit(row, json_lines, COLUMNS)
    return rows
