"""How much memory a run will need, checked before anything is allocated or written.

``estimate(cfg, data)`` lists the largest allocations of a run as ``Item``s (name, bytes, the
config key that scales it, its formula). ``check_fits(cfg, data)`` first rejects
``model.num_negatives`` above the catalogue, then compares the estimated peak with the memory
available and raises ``ConfigError`` naming the biggest item and the key to change. Both are
arithmetic on config values and the data's per-user lengths: nothing is allocated.

Why: a fault campaign found ``model.num_negatives=100000`` on a 3,000-item catalogue growing to
15 GB before the kernel killed it, and one stray item id 1e9 asking for a 238 GiB table (the
data pipeline now refuses such sparse ids itself; a dense but huge catalogue lands here).

The estimate is an upper bound meant to be right within a small factor, not a prediction; the
formulas (bytes; ``f`` = 4 for float32, 8 for float64; ``T`` = token capacity of the largest
possible training batch, ``B`` = train.batch_size, ``L`` = model.max_len, ``R`` =
model.num_negatives, ``N`` = model.num_items, ``D`` = model.embed_dim, ``H`` = model.num_heads,
``nb`` = model.num_blocks, ``P`` = parameter count, ``Be`` = eval.batch_size):

  runtime        fixed: torch/npu 0.4 GB, jax 0.6 GB (libraries, allocator slack, compiled
                 programs; importing torch alone is 0.23 GB, torch + jax 0.41 GB)
  state          P x f x 4: params, gradients, AdamW mu and nu (persistent)
  optimizer      P x f x 3 + (N+1) x D x f x 2: the update builds new mu, nu and params before
                 the old ones are freed; the loss L2-normalises the whole item table (copy + its
                 gradient)
  negatives      T x R x 32 B: the [T, R] int32 ids (host and device), torch's int64 copy, and
                 the fp32 logits, mask, concat, logsumexp and gradient buffers of that shape
                 (measured: peak RSS grows 27-28 B per cell on torch and JAX, quickstart, T=6,144,
                 R = 2,000 -> 8,000)
  logits         rows x (N+1) x f x 3 when N+1 <= 64 R and the negatives are fp32 (the dense
                 ``user @ items^T`` form), else rows x R x D x f x 4 (gathered rows, product,
                 gradients; measured 3.5x on JAX; with 16-bit negatives the estimate is 1.6x the
                 growth measured on torch and 2.3x on JAX, quickstart, R = 2,000);
                 rows = T on JAX, 1,024 on torch (backends.torch.SAMPLED_LOGITS_CHUNK_ROWS)
  attention      nb x B x H x L x L x f x 4: the padded kernel's scores, bias, SiLU and their
                 gradient kept per block (the jagged kernel keeps less: an upper bound)
  activations    nb x T x (4 D + 2 W + 6 H dv) x f x 2 + T x (D + nb H dv) x f x 2, with
                 W = 2 H (dv + dqk): per-block tensors kept for backward and their gradients,
                 plus the dropout masks on host and device
  eval scores    Be x (N+1) x 13 B: scores on the device, their host copy, the masked copy and
                 the comparison mask of ``metrics.ranks_from_scores``
  eval activ.    Te x (4 D + 2 W + 6 H dv) x f + Be x H x L x L x f x 2: one block's forward
                 tensors (no gradients kept) for Te = the token capacity of eval.batch_size users

Peak = the sum of all items: the allocators keep memory the training steps freed, so evaluation
comes on top of it rather than reusing it (measured on ML-1M, torch). A run on an accelerator (``backend.device`` cuda/npu/gpu, the
npu backend, JAX on a GPU) checks only the host side (runtime, host batch, eval host copies)
against host memory: device memory is not checked here (the frameworks raise a clean
out-of-memory error there; the host OOM killer is what this guards against). Data-parallel
ranks on one host (``LOCAL_WORLD_SIZE``) each need their own share: the peak is multiplied.

How close the estimate comes to measured peaks: docs/guides/reliability.md "Reliability", "Memory estimate".

Available memory: ``GRF_MEMORY_LIMIT_BYTES`` when set (tests, or to leave room for other jobs),
else the smaller of ``MemAvailable`` in /proc/meminfo and the cgroup's limit minus its usage;
unknown (no /proc) means no check.
"""
from __future__ import annotations

import math
import os
import resource
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import ConfigError
from .jagged import round_up_capacity
from .losses import get as get_loss

# backends.base.Backend.DENSE_LOGITS_MAX_RATIO and backends.torch.SAMPLED_LOGITS_CHUNK_ROWS
# (copied, not imported: importing the backends loads torch/JAX; a test keeps them equal)
DENSE_LOGITS_MAX_RATIO = 64
TORCH_LOGITS_CHUNK_ROWS = 1024
RUNTIME_BYTES = {"torch": 400 << 20, "npu": 400 << 20, "jax": 600 << 20}
NEGATIVE_CELL_BYTES = 32
EVAL_CELL_BYTES = 13
ENV_LIMIT = "GRF_MEMORY_LIMIT_BYTES"


class Item(NamedTuple):
    """One estimated allocation. ``key``: the config key that drives it (named with its value in
    errors); ``fix``: what to change; ``phase``: "runtime" | "state" | "step" | "eval"; ``host``:
    False for what lives in an accelerator's own memory (not checked against host memory)."""

    name: str
    nbytes: int
    key: str
    detail: str     # the formula with this run's numbers
    fix: str
    phase: str
    host: bool = True


def param_count(cfg) -> int:
    """Parameters of the run (``model.param_shapes``; a hash table has ``embedding.capacity``
    rows), without allocating them."""
    from .model import model_of

    return sum(math.prod(shape) for shape in model_of(cfg.model).param_shapes(cfg.model, table_items(cfg)).values())


def table_items(cfg) -> int | None:
    """Rows of the item table minus the padding row when it is not ``model.num_items``: a hash
    table's capacity (None for a dense table)."""
    e = cfg.embedding
    return (e.capacity or cfg.model.num_items) if e.kind == "hash" else None


def token_capacity(cfg, data, batch_size: int | None = None) -> int:
    """``T``: the token capacity of the largest training batch the loader can build (or, with
    ``batch_size``, of an evaluation batch of that many users). Each user gives
    ``min(L_u - 1, max_len)`` input tokens (full histories: an upper bound on every split's), a
    batch holds at most ``train.batch_size`` users and ``train.max_tokens`` tokens (training, when
    set), rounded up the ``round_up_capacity`` ladder as the loader does."""
    tokens = np.minimum(np.maximum(data.lengths() - 1, 0), cfg.model.max_len)
    b = min(cfg.train.batch_size if batch_size is None else batch_size, len(tokens))
    top = int(np.partition(tokens, len(tokens) - b)[len(tokens) - b:].sum()) if b else 0
    if batch_size is None and cfg.train.max_tokens:
        top = min(top, cfg.train.max_tokens)
    return round_up_capacity(max(top, 1))


def _on_host(cfg) -> bool:
    """Whether the model runs in host memory (CPU), so every item counts against host RAM."""
    b = cfg.backend
    if b.name == "npu":
        return False
    device = (b.device or "").lower()
    if device:
        return device.startswith("cpu")
    if b.name == "jax":
        try:
            import jax

            return jax.default_backend() == "cpu"
        except Exception:  # noqa: BLE001 - a broken jax install fails later with its own message
            return True
    return True  # torch's default device is the CPU


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 0.95e9 else f"{n / 1e6:,.0f} MB"


def estimate(cfg, data) -> list[Item]:
    """The largest allocations of training and evaluating ``cfg`` on ``data`` (SequenceData), in
    bytes (formulas in the module docstring). ``cfg.model.num_items`` must be resolved (> 0)."""
    m, t = cfg.model, cfg.train
    f = 8 if cfg.backend.dtype == "float64" else 4
    N, D, R, H, L, nb = m.num_items, m.embed_dim, cfg.loss.num_negatives, m.num_heads, m.max_len, m.num_blocks
    kind = get_loss(cfg.loss.name).negatives
    if kind == "catalogue":  # every item is a negative; loss.num_negatives is not read
        R = N
    elif kind == "mixed":
        R += cfg.loss.batch_negatives
    B, Be = t.batch_size, cfg.eval.batch_size
    T = token_capacity(cfg, data)
    P = param_count(cfg)
    hv = H * m.dv
    W = 2 * H * (m.dv + m.dqk)
    # On an accelerator only the host side counts: device items get host=False, and of the
    # negatives and eval scores only the host arrays ([T, R] int32 ids; scores' host copy, masked
    # copy and comparison mask) stay.
    dev = _on_host(cfg)
    neg_cell = NEGATIVE_CELL_BYTES if dev else 4
    eval_cell = EVAL_CELL_BYTES if dev else EVAL_CELL_BYTES - 4
    name = cfg.backend.name

    negs = "lower loss.num_negatives or train.batch_size (or set train.max_tokens)"
    table = "lower model.embed_dim, or set data.remap_items=true if the item ids are sparse"
    shape = "lower train.batch_size or model.max_len (or set train.max_tokens)"
    items = [Item("framework runtime", RUNTIME_BYTES.get(name, RUNTIME_BYTES["jax"]), "backend.name",
                  f"fixed for {name}", "-", "runtime")]
    grad_copies = 4 + (1 if t.accumulate > 1 else 0)  # accumulation keeps a running gradient sum
    e = cfg.embedding
    if e.optimizer == "adamw":
        items.append(Item("parameters, gradients and AdamW state", P * f * grad_copies, "model.num_items",
                          f"{P:,} params x {f} B x {grad_copies}; item table [{N + 1:,}, {D}]", table, "state", dev))
        items.append(Item("optimizer update and normalised item table", P * f * 3 + (N + 1) * D * f * 2,
                          "model.num_items", f"{P:,} params x {f} B x 3 + [{N + 1:,}, {D}] x {f} B x 2", table,
                          "step", dev))
    else:  # row-sparse: the table and its per-row state, dense AdamW on the rest, the step's rows only
        rows_all = (table_items(cfg) or N) + 1
        ranks = cfg.dist.nproc * max(1, cfg.dist.devices)  # torch processes, or JAX devices of each
        world = ranks if e.sharding == "row" and ranks > 1 else 1
        rows_here = -(-rows_all // world)
        per_row = D * (3 if e.optimizer == "lazy_adam" else 1) + 1  # + lazy Adam's t or Adagrad's acc
        dense_p = P - rows_all * D
        U = min(rows_all, T * (R + 2) if kind == "sampled" else T * 2 + R)
        where = f" (1/{world} of it on each rank)" if world > 1 else ""
        key = "embedding.capacity" if e.kind == "hash" else "model.num_items"
        items.append(Item(f"item table and its {e.optimizer} state", rows_here * per_row * f, key,
                          f"[{rows_all:,}, {D}] table + state, {per_row} x {f} B per row{where}",
                          "lower embedding.capacity or shard the table (embedding.sharding='row')", "state", dev))
        items.append(Item("dense parameters, gradients and AdamW state", dense_p * f * (grad_copies + 3),
                          "model.embed_dim", f"{dense_p:,} params x {f} B x {grad_copies + 3}", table, "state", dev))
        items.append(Item("the step's looked-up rows (values, gradients, update, normalised)", U * D * f * 6,
                          "train.batch_size", f"<= {U:,} distinct rows x D={D} x {f} B x 6", shape, "step", dev))
    rows = min(T, TORCH_LOGITS_CHUNK_ROWS) if name in ("torch", "npu") else T
    if kind == "sampled":
        items.append(Item("sampled-softmax negatives", T * R * neg_cell, "loss.num_negatives",
                          f"per batch: T={T:,} tokens x {R:,} negatives x {neg_cell} B", negs, "step"))
        if N + 1 <= DENSE_LOGITS_MAX_RATIO * R and cfg.loss.negatives_precision == "fp32":
            items.append(Item("sampled-softmax logits (dense form)", rows * (N + 1) * f * 3, "loss.num_negatives",
                              f"{rows:,} rows x {N + 1:,} items x {f} B x 3", negs, "step", dev))
        else:
            items.append(Item("sampled-softmax logits (gathered rows)", rows * R * D * f * 4, "loss.num_negatives",
                              f"{rows:,} rows x {R:,} negatives x D={D} x {f} B x 4", negs, "step", dev))
    elif kind in ("in_batch", "pool", "mixed", "catalogue"):  # one [T, R] logit matrix (forward, its gradient, the mask)
        items.append(Item("shared-negative logits", T * R * f * 3, "loss.num_negatives",
                          f"T={T:,} tokens x {R:,} shared negatives x {f} B x 3", negs, "step", dev))
    items.append(Item("attention scores", nb * B * H * L * L * f * 4, "train.batch_size",
                      f"{nb} blocks x B={B} x H={H} x L={L} x L x {f} B x 4", shape, "step", dev))
    items.append(Item("activations and dropout masks",
                      nb * T * (4 * D + 2 * W + 6 * hv) * f * 2 + T * (D + nb * hv) * f * 2, "train.batch_size",
                      f"T={T:,} tokens x {nb} blocks x {4 * D + 2 * W + 6 * hv} x {f} B x 2", shape, "step", dev))
    items.append(Item("evaluation scores", Be * (N + 1) * eval_cell, "eval.batch_size",
                      f"{Be} users x {N + 1:,} items x {eval_cell} B",
                      "lower eval.batch_size (each user scores all model.num_items items)", "eval"))
    Te = token_capacity(cfg, data, Be)
    items.append(Item("evaluation activations", Te * (4 * D + 2 * W + 6 * hv) * f + Be * H * L * L * f * 2,
                      "eval.batch_size", f"T={Te:,} tokens x {4 * D + 2 * W + 6 * hv} x {f} B + B={Be} x H={H} x "
                      f"L={L} x L x {f} B x 2", "lower eval.batch_size", "eval", dev))
    return items


def peak(items: list[Item], host_only: bool = True) -> int:
    """The sum of the items that live in host memory (``host_only``). Summed, not the larger of
    step and evaluation: the allocators keep what the training steps freed (ML-1M on torch: RSS
    stays at its training level, 1.05 GB, and evaluation adds 0.3 GB on top)."""
    return sum(it.nbytes for it in items if it.host or not host_only)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def available_bytes() -> tuple[int | None, str]:
    """``(bytes, where it came from)``: ``GRF_MEMORY_LIMIT_BYTES``, else min(MemAvailable, the
    cgroup's limit minus usage); ``(None, ...)`` when unknown (no check)."""
    env = os.environ.get(ENV_LIMIT, "").strip()
    if env:
        try:
            return int(float(env)), ENV_LIMIT
        except ValueError:
            raise ConfigError(f"{ENV_LIMIT}={env!r} is not a number of bytes (e.g. 8e9); unset it to use "
                              f"MemAvailable") from None
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    # A container's cgroup limit can be far below the host's MemAvailable. Its usage counts page
    # cache too; the inactive file pages are reclaimable, so they are subtracted (as kubelet does).
    for base, limit, usage, inactive in (("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                                         ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                                          "total_inactive_file")):
        lim, use = _read_int(f"{base}/{limit}"), _read_int(f"{base}/{usage}")
        if lim is None or use is None or lim >= (1 << 60):  # absent, "max" or huge: no limit
            continue
        cache = 0
        try:
            for line in Path(f"{base}/memory.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == inactive and value.strip().isdigit():
                    cache = int(value)
        except OSError:
            pass
        found.append((lim - max(use - cache, 0), f"the cgroup limit in {base}/{limit}"))
    if not found:
        return None, "unknown"
    return min(found)


def check_negatives(cfg) -> None:
    """``loss.num_negatives`` must not exceed the items negatives are drawn from (ids
    1..``model.num_items``): more only repeats items, and the [T, R] buffers grow without bound."""
    R, N = cfg.loss.num_negatives, cfg.model.num_items
    if N > 0 and R > N and get_loss(cfg.loss.name).negatives not in ("none", "catalogue"):
        raise ConfigError(f"loss.num_negatives={R} is more than the {N:,} items negatives are sampled from "
                          f"(model.num_items={N}: ids 1..{N:,}); sampling more negatives than the catalogue "
                          f"holds only repeats items. Set loss.num_negatives <= {N:,} (GR uses 128)")


def check_fits(cfg, data) -> list[Item]:
    """Reject, with a ``ConfigError`` naming the biggest allocation and the key to change, a run
    whose estimated peak exceeds the available memory; also ``check_negatives``. Cheap (no
    allocation); call it after ``model.num_items`` is resolved and before OUT is written.
    Returns the estimate."""
    check_negatives(cfg)
    items = estimate(cfg, data)
    avail, source = available_bytes()
    if avail is None:
        return items
    procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    need = peak(items) * procs
    if need <= avail:
        return items
    counted = [it for it in items if it.host and it.phase != "runtime"]
    big = max(counted, key=lambda it: it.nbytes)
    state = [it for it in counted if it.phase == "state"]
    if state and sum(it.nbytes for it in state) + sum(it.nbytes for it in items if it.phase == "runtime") > avail:
        big = max(state, key=lambda it: it.nbytes)  # no batch size helps: name the table's key
    top = sorted(counted, key=lambda it: -it.nbytes)[:3]
    runtime = sum(it.nbytes for it in items if it.phase == "runtime")
    section, key = big.key.split(".", 1)
    value = getattr(getattr(cfg, section), key)
    where = "" if _on_host(cfg) else " (host side only: the model runs on an accelerator)"
    per = f" x {procs} processes on this host" if procs > 1 else ""
    raise ConfigError(
        f"{big.key}={value}: the {big.name} need ~{_gb(big.nbytes)} ({big.detail}); the run's estimated peak is "
        f"~{_gb(need)}{per}{where}, framework runtime {_gb(runtime)} included, but {_gb(avail)} is available "
        f"({source}); {big.fix}. Largest items: "
        + ", ".join(f"{it.name} {_gb(it.nbytes)}" for it in top)
        + f" (estimate: gr_functional/memory.py; {ENV_LIMIT} overrides the available figure)")


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (bytes; ``getrusage``'s ru_maxrss, KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
