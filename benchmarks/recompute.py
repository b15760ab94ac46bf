"""``grf bench recompute [--json] [--backend torch,jax]``: the training step with and without
``backend.attention_recompute`` on each config of ``step.STEP_CONFIGS`` (tiled attention), the
docs/results/speed.md "Recomputed attention" table.

Per backend and config: what the step keeps for backward (``Backend.memory_profile`` of
``step.train_step``: autograd-saved bytes on torch CPU, XLA temp buffers on JAX, peak allocated on
CUDA), off and on, and the step's seconds with the two variants' steps alternating
(``step.alternate_steps``, medians). On JAX the XLA flags in force matter (README: the CPU
concurrency-optimized scheduler undoes the saving unless ``XLA_FLAGS`` turns it off).
"""
from __future__ import annotations

from functools import partial

from .common import backends_for, emit, kernel_variant, machine
from .step import STEP_CONFIGS, alternate_steps, step_setup

COLUMNS = ["backend", "config", "memory_off", "memory_on", "memory_kind", "seconds_off", "seconds_on"]


def kept_bytes(B, cfg, batch_np) -> tuple[int | None, str]:
    """``B.memory_profile`` of one training step (fresh parameters)."""
    from gr_functional import model
    from gr_functional.step import init_opt_state, train_step

    params = B.asarray_tree(model.init_params(cfg.model, seed=0))
    return B.memory_profile(partial(train_step, B, cfg=cfg), params, init_opt_state(B, params, cfg),
                            B.asarray_tree(batch_np))


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS, repeats: int = 3) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    rows = []
    for name in configs:
        step_cfg, batch = step_setup(name, cfg)
        for label, B in backends_for(cfg, backends):
            variants = {"off": kernel_variant(B, "tiled").with_attention_recompute(False),
                        "on": kernel_variant(B, "tiled").with_attention_recompute(True)}
            memory = {k: kept_bytes(V, step_cfg, batch) for k, V in variants.items()}
            steps = alternate_steps(variants, step_cfg, batch, repeats=repeats)
            row = {"bench": "recompute", "backend": label, "config": name,
                   "memory_off": memory["off"][0], "memory_on": memory["on"][0], "memory_kind": memory["on"][1],
                   "seconds_off": steps["off"]["seconds"], "seconds_on": steps["on"]["seconds"], **machine()}
            emit(row, json_lines, COLUMNS)
            rows.append(row)
    return rows
