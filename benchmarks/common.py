"""Shared pieces of the speed benchmarks (attention, mfu, throughput): which backends to measure,
batches of given lengths, timing, and the matmul peak of the same run."""
from __future__ import annotations

import dataclasses
import json
import platform
import time

import numpy as np

from gr_functional.batch import make_batch


def machine() -> dict:
    """What the figures were measured on (goes into every JSON line)."""
    import os

    info = {"machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def rss() -> tuple[int, int]:
    """(current, peak) resident set of this process, bytes (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def backends_for(cfg, names=None) -> list:
    """``[(label, backend)]`` to measure: ``names`` (default torch and jax) as ``grf train`` would
    make them (``runner.make_backend``: ``backend.device``, ``ops``, ``deterministic``).
    With ``backend.compile``: torch only, as two rows, "torch" (eager) and "torch+compile".
    Raises ``ConfigError`` / ``BackendUnavailable`` with the reason, before anything is timed.
    (Precision is applied by whoever runs the step: ``train`` casts per ``backend.precision``.)"""
    from gr_functional.config import replace
    from gr_functional.runtime import make_backend
    from gr_functional.configure import validate

    validate(cfg)
    out = []
    for name in names or ["torch", "jax"]:
        if cfg.backend.compile and name != "torch":
            continue  # backend.compile is torch's (the config check says why)
        B = make_backend(replace(cfg, backend={"name": name}))
        if B.compile:  # the eager step, measured in the same run, is what compile is compared with
            out.append((name, B.with_compile(False)))
            out.append((f"{name}+compile", B))
        else:
            out.append((name, B))
    return out


def fused_available(B) -> bool:
    """The fused C++ CPU ops run the loss in ``B`` (``ops.sampled_logits`` "best" or "cpu_fused"
    on the CPU; torch's extension, or the XLA FFI library on jax) and are built here."""
    if B.op_names.get("sampled_logits") not in ("best", "cpu_fused") or B.device_kind != "cpu":
        return False
    from backends import cpu_fused

    return cpu_fused.available(warn=False, B=B)


def kernel_variant(B, kernel: str, fused_ops: bool = True):
    """A copy of backend ``B`` whose ``hstu_attention`` uses ``kernel`` (a registered attention
    kernel: "jagged" | "tiled" | "reference" | ...; ``Backend.with_ops``). ``fused_ops = False``
    also turns off the fused C++ CPU ops of the loss (``cpu_fused.OFF``), so the step is the
    array-API formulation both backends share."""
    from backends.cpu_fused import OFF

    chosen = {"attention": kernel}
    if not fused_ops:
        chosen.update({op: name for op, name in OFF.items() if op != "attention" and op in B.op_names})
    return B.with_ops(**chosen)


def device_label(B) -> str:
    dev = getattr(B, "torch_device", None)
    if dev is not None:
        return str(dev)
    import jax

    return str((B._device or jax.devices()[0]).platform)


def synthetic_batch(mc, lengths, seed: int = 0, *, padded: bool = False, train: bool = True, negatives=None):
    """A numpy training batch of sequences with these input lengths (random ids and times).
    ``negatives``: what the loss draws (``losses.negatives_for(cfg)``; default GR's 128 sampled).

    padded=True lays it out as a padded implementation would: every sequence owns ``max_len``
    rows (t_cap = B * max_len, so the linear layers run on padding too) and no tile plan (the
    attention is the padded dense one)."""
    rng = np.random.default_rng(seed)
    n_items = mc.num_items or 1000
    lengths = [int(x) for x in lengths]
    hist = [rng.integers(1, n_items + 1, L + 1) for L in lengths]
    times = [np.cumsum(rng.integers(1, 3600, L + 1)) for L in lengths]
    m = dataclasses.replace(mc, num_items=n_items, attention_tile=0 if padded else mc.attention_tile)
    t_cap = len(lengths) * mc.max_len if padded else None
    extra = {} if negatives is None else {"negatives": negatives}
    return make_batch(hist, times, m, rng=rng, num_items=n_items, train=train, t_cap=t_cap, b_cap=len(lengths),
                      **extra)


def timed_call(B, fn, *args) -> float:
    """Wall seconds of one ``fn(*args)`` until its outputs are computed (``B.block_until_ready``:
    no copy to the host)."""
    t0 = time.perf_counter()
    B.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def median_seconds(B, fn, *args, repeats: int = 3, warmup: int = 1) -> float:
    """Median ``timed_call`` of ``fn(*args)`` after ``warmup`` calls (JAX compiles in the first)."""
    for _ in range(warmup):
        B.block_until_ready(fn(*args))
    return float(np.median([timed_call(B, fn, *args) for _ in range(repeats)]))


COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def matmul_peak(B, precision: str = "fp32", n: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` product in the compute dtype of ``precision``: the peak MFU
    divides by."""
    rng = np.random.default_rng(0)
    dtype = COMPUTE_DTYPE[precision]
    a = B.cast(B.asarray(rng.standard_normal((n, n)).astype(np.float32)), dtype)
    b = B.cast(B.asarray(rng.standard_normal((n, n)).astype(np.float32)), dtype)
    mm = B.jit(lambda x, y: B.xp.matmul(x, y))
    seconds = median_seconds(B, mm, a, b, repeats=repeats, warmup=2)
    return 2 * n ** 3 / seconds


def kuairand_lengths(truncation: int) -> np.ndarray:
    """The 27,285 real KuaiRand-27K sequence lengths truncated at ``truncation``."""
    from benchmarks.balance import load_user_lengths

    return np.minimum(load_user_lengths(), truncation)


def emit(row: dict, json_lines: bool, columns: list[str]) -> None:
    if json_lines:
        print(json.dumps(row), flush=True)
        return
    cells = []
    for c in columns:
        v = row.get(c)
        cells.append(f"{c}={v:.4g}" if isinstance(v, float) else f"{c}={v}")
    print("  ".join(cells), flush=True)
