"""``grf bench profile [--json] [--set backend.device=cuda]``: where a torch training step spends
its time, per op, for each config of ``step.STEP_CONFIGS``.

One warm-up step, then one step under ``torch.profiler`` (CPU activity; CUDA too on a GPU).
Output per config: the step's profiled total and the top ops by self time, each with its share
and call count (``--json``: one object per config with ``ops: [{name, self_s, share, calls}]``).
Only the torch backend: the JAX step is one XLA program (use ``jax.profiler`` and TensorBoard).
"""
from __future__ import annotations

import json

from gr_functional import model
from gr_functional.step import init_opt_state, make_train_step

from .common import backends_for, device_label, machine
from .step import STEP_CONFIGS, step_setup

TOP = 12


def profile_step(B, cfg, batch_np, top: int = TOP) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    params = B.asarray_tree(model.init_params(cfg.model, seed=0))
    opt = init_opt_state(B, params, cfg)
    batch = B.asarray_tree(batch_np)
    step = make_train_step(B, cfg)
    B.block_until_ready(step(params, opt, batch))
    cuda = B.torch_device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        B.block_until_ready(step(params, opt, batch))
    events = [e for e in prof.key_averages() if not e.key.startswith("autograd::")]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, attr))
    ops = [{"name": e.key, "self_s": getattr(e, attr) / 1e6, "share": getattr(e, attr) / total, "calls": e.count}
           for e in events[:top]]
    return {"profiled_s": total / 1e6, "time": "device" if cuda else "cpu", "ops": ops}


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    rows = []
    for label, B in backends_for(cfg, ["torch"] if backends is None else backends):
        if label != "torch":
            raise SystemExit(f"grf bench profile: torch backends only, got {label!r}")
        for name in configs:
            step_cfg, batch = step_setup(name, cfg)
            r = {"bench": "profile", "backend": label, "device": device_label(B), "config": name,
                 **profile_step(B, step_cfg, batch), **machine()}
            rows.append(r)
            if json_lines:
                print(json.dumps(r), flush=True)
                continue
            print(f"{name} on {r['device']}: {r['profiled_s']:.3f} s of self {r['time']} time", flush=True)
            for op in r["ops"]:
                print(f"  {op['share'] * 100:5.1f}%  {op['self_s'] * 1e3:9.1f} ms  x{op['calls']:<5d} {op['name']}")
    return rows
