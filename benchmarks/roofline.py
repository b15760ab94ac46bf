"""``grf bench roofline [--json]``: what bounds a torch training step on the CPU (fp32),
op by op: each op's FLOPs and bytes moved against the machine's measured matmul peak and memory
bandwidth, for each config of ``step.STEP_CONFIGS``.

One warm-up step, then one step under ``torch.profiler`` (``record_shapes``). Per
op name: self time, FLOPs (2 m k n of each matmul from its operands' shapes; elementwise work is
free next to its memory traffic), bytes (estimated from the recorded input shapes, 4 bytes per element: a
matmul reads both operands and writes its output; a gather or index op moves its index's rows
twice, plus the index; fill writes, copy reads and writes; any other leaf op reads its inputs and
writes one output as large as the largest; views, and ops whose children do work (wrappers),
move nothing themselves; ops taking tensor lists (cat, stack, advanced indexing), whose shapes the
profiler does not record, and the fused C++ ops of backends/cpu_fused (``ops.*="best"``, on
by default: their tiles never exist as tensors) are not estimated and count at their measured
time), the intensity
(FLOP/byte), and ``roofline_s = max(flops / peak, bytes / bandwidth)``: the least time the op could
take on this machine. ``efficiency = roofline_s / self_s``. The step's ``roofline_s`` is the sum:
the fastest step these ops allow without fusing them, and ``mfu_at_roofline`` the MFU of that step
(model FLOPs of ``gr_functional.flops`` over its time and the peak), the bound that fusion (fewer
bytes) or a better kernel (closer to the roofline) must lift.

Peak: ``common.matmul_peak`` (a 4096^3 fp32 product); bandwidth: the median of 5 copies of a
256 MiB fp32 array (read + write), both in the same run. Estimates, not counters: strided reads,
cache reuse and int64 indices are not modelled.
"""
from __future__ import annotations

import json

import numpy as np

from .common import backends_for, device_label, emit, machine, matmul_peak, median_seconds
from .step import STEP_CONFIGS, prepare_step, step_setup

TOP = 14
MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
INDEX_OPS = {"aten::index_select": 2, "aten::gather": 2, "aten::index_add_": 2,
             "aten::scatter_add_": 2}  # position of the index argument in input_shapes
# ops whose inputs are tensor lists, which the profiler records as []: bytes not estimated, the
# op counts at its measured time
UNESTIMATED = {"aten::cat", "aten::stack", "aten::index", "aten::index_put_", "aten::_index_put_impl_"}
# the fused C++ ops (backends/cpu_fused): their work is in their own self time, not in children
FUSED = {"FusedTiles", "FusedTilesBackward", "FusedSampledLogits", "FusedSampledLogitsBackward"}
COLUMNS = ["config", "op", "self_s", "share", "gflop", "gbytes", "intensity", "roofline_s", "efficiency"]


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 1


# children that move no data: an op whose children are all of these does its own work
VIEWS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::as_strided", "aten::expand",
         "aten::resolve_conj", "aten::view", "aten::select", "aten::slice", "aten::t", "aten::transpose",
         "aten::reshape", "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze", "aten::permute",
         "aten::alias", "aten::detach", "detach", "aten::lift_fresh", "aten::resize_", "aten::result_type",
         "aten::_unsafe_view", "aten::broadcast_to", "aten::to", "aten::new_empty", "aten::narrow",
         "aten::contiguous", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk",
         "aten::unflatten", "aten::flatten", "aten::expand_as", "aten::movedim", "aten::swapaxes",
         "aten::mT", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::numpy_T"}


def matmul_flops(name: str, shapes: list) -> int:
    """2 m k n (times the batch) of a matmul from its operands' shapes."""
    mats = [s for s in shapes if isinstance(s, (list, tuple)) and len(s) >= 2]
    if name not in MATMULS or len(mats) < 2:
        return 0
    a, b = mats[-2], mats[-1]
    return 2 * _numel(a) * b[-1]


def op_bytes(name: str, shapes: list, args: list, has_children: bool) -> int | None:
    """Estimated bytes an op moves, from its input shapes and scalar ``args`` (module docstring);
    None where the shapes do not tell (``UNESTIMATED``)."""
    if (name in UNESTIMATED and not has_children) or name in FUSED:
        return None
    shapes = [s if isinstance(s, (list, tuple)) else [] for s in shapes]
    if name in MATMULS:
        mats = [s for s in shapes if len(s) >= 2]
        if len(mats) >= 2:
            a, b = mats[-2], mats[-1]
            out = _numel(a[:-1]) * b[-1]
            return 4 * (_numel(a) + _numel(b) + out * (2 if name in ("aten::addmm_", "aten::baddbmm") else 1))
        return 0
    if name in INDEX_OPS:
        pos = INDEX_OPS[name]
        if len(shapes) <= pos or not shapes[0]:
            return 0
        idx = _numel(shapes[pos])
        if name in ("aten::gather", "aten::scatter_add_"):  # element-wise index: index-shaped values
            return 4 * (2 * idx + idx)
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        row = _numel(shapes[0]) // max(1, shapes[0][dim])   # one index moves a slice along dim
        return 4 * (2 * idx * row + idx)
    if name == "aten::searchsorted":
        return 4 * 2 * (_numel(shapes[1]) if len(shapes) > 1 else 0)
    if name in VIEWS or has_children or not shapes or not name.startswith("aten::"):
        return 0  # views, wrappers, autograd nodes and Python Functions: their children do the work
    if name in ("aten::fill_", "aten::zero_"):     # writes only
        return 4 * _numel(shapes[0])
    if name == "aten::copy_":                        # reads the source, writes the destination
        return 4 * 2 * _numel(shapes[0])
    sizes = [_numel(s) for s in shapes if s]
    return 4 * (sum(sizes) + max(sizes)) if sizes else 0


def memory_bandwidth(B, mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of copying a ``mib`` MiB fp32 array (read + write)."""
    a = B._torch.ones(mib << 18, device=B.torch_device)
    b = B._torch.empty_like(a)
    return 2 * a.numel() * 4 / median_seconds(B, b.copy_, a, repeats=repeats)


def roofline_step(B, cfg, batch_np, peak: float, bandwidth: float, top: int | None = TOP) -> dict:
    from torch.profiler import ProfilerActivity, profile

    one, info = prepare_step(B, cfg, batch_np)
    B.block_until_ready(one())
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        B.block_until_ready(one())
    per_op: dict[str, dict] = {}
    for e in prof.events():
        if e.name.startswith("autograd::"):
            continue
        r = per_op.setdefault(e.name, {"self_s": 0.0, "flops": 0, "bytes": 0, "calls": 0, "unestimated_s": 0.0})
        r["self_s"] += e.self_cpu_time_total / 1e6
        shapes = list(e.input_shapes or [])
        r["flops"] += matmul_flops(e.name, shapes)
        works = any(c.name not in VIEWS for c in e.cpu_children)
        moved = op_bytes(e.name, shapes, list(getattr(e, "concrete_inputs", None) or []), works)
        if moved is None:  # not estimated: the op counts at its measured time
            r["unestimated_s"] += e.self_cpu_time_total / 1e6
        else:
            r["bytes"] += moved
        r["calls"] += 1
    total = sum(r["self_s"] for r in per_op.values())
    rows = []
    for name, r in per_op.items():
        roof = max(r["flops"] / peak, r["bytes"] / bandwidth) + r["unestimated_s"]
        rows.append({"op": name, "self_s": r["self_s"], "share": r["self_s"] / total, "calls": r["calls"],
                     "gflop": r["flops"] / 1e9, "gbytes": r["bytes"] / 1e9,
                     "intensity": r["flops"] / r["bytes"] if r["bytes"] else None, "roofline_s": roof,
                     "efficiency": roof / r["self_s"] if r["self_s"] > 0 else None,
                     "estimated": r["unestimated_s"] == 0.0})
    rows.sort(key=lambda r: -r["self_s"])
    roofline_total = sum(r["roofline_s"] for r in rows)
    return {"profiled_s": total, "roofline_s": roofline_total, "model_flops": info["model_flops"],
            "mfu_profiled": info["model_flops"] / (total * peak),
            "mfu_at_roofline": info["model_flops"] / (roofline_total * peak),
            "matmul_share_of_roofline": sum(r["gflop"] * 1e9 / peak for r in rows) / roofline_total,
            "unestimated_s": sum(r["unestimated_s"] for r in per_op.values()),
            "ops": rows[:top] if top else rows}


def run(json_lines: bool = False, cfg=None, backends=None, configs=STEP_CONFIGS, top: int | None = TOP,
        peak_n: int = 4096, mib: int = 256) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    if cfg.backend.precision != "fp32" or (cfg.backend.device or "cpu") != "cpu":
        raise SystemExit("grf bench roofline: CPU fp32 only (its byte rules count 4-byte elements and it "
                         "reads CPU self times); drop --set backend.device / backend.precision")
    out = []
    for label, B in backends_for(cfg, ["torch"] if backends is None else backends):
        if not label.startswith("torch"):
            raise SystemExit(f"grf bench roofline: torch backends only, got {label!r}")
        peak, bandwidth = matmul_peak(B, n=peak_n), memory_bandwidth(B, mib=mib)
        for name in configs:
            step_cfg, batch = step_setup(name, cfg)
            r = {"bench": "roofline", "backend": label, "device": device_label(B), "config": name,
                 "peak_flops": peak, "bandwidth_bytes_s": bandwidth,
                 **roofline_step(B, step_cfg, batch, peak, bandwidth, top=top),
                 **machine()}
            out.append(r)
            if json_lines:
                print(json.dumps(r), flush=True)
                continue
            print(f"{name} on {r['device']}: peak {peak / 1e9:.1f} GFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s; "
                  f"profiled {r['profiled_s']:.3f} s, roofline {r['roofline_s']:.3f} s; MFU {r['mfu_profiled']:.1%} "
                  f"profiled, {r['mfu_at_roofline']:.1%} at the roofline", flush=True)
            for op in r["ops"]:
                emit({"config": name, **op}, False, COLUMNS)
    return out
