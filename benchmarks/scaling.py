"""``grf bench scaling [--config kuairand27k_02b] [--set ...] [--json]``: a weak-scaling cost model
of the row-sharded stream training (``grf bench stream`` with ``embedding.sharding = "row"``),
validated on this machine's 1, 2 and 4 local ranks, then a **projection** to 8-64 accelerators.

Measured here, per rank and step, at a fixed per-rank batch (``train.batch_size`` is per rank in
this benchmark; the global batch grows with R): forward + backward seconds, the host's id-to-row
work (``lookup_s`` at R = 1: hashing, assignment, dedup), the rest of the step, the distinct ids a
rank looks up (U) and the all-to-all bytes; and the loopback link between the ranks (latency and
bandwidth of a gloo all-to-all).

The model, per rank and step, R ranks, ``node`` ranks per node, uniform id ownership:
  all-to-all bytes   U (R-1)/R (8 + 2 x 4 D)   ids out, fp32 rows back, fp32 row gradients out
                     (halved rows/grads with embedding.exchange = fp16/bf16: 2 D + 4 per row)
  all-to-all time    max(intra bytes / bw_intra, inter bytes / bw_inter), a rank's remote traffic
                     split (node-1)/(R-1) inside its node, (R-node)/(R-1) across
  all-reduce time    2 (R-1)/R x 4 P_dense / bw(R)
  latency            C alpha(R), C the blocking collectives of a step (measured: counts, ids,
                     rows, gradients, the loss, the dense buckets) x ceil(log2 R) for the
                     reductions' tree (taken for all, an upper bound)
  step               compute + host + all-to-all + all-reduce (serial), or max(compute, host,
                     all-to-all + all-reduce) (overlapped: the pipeline and bounded staleness of
                     docs/guides/negatives-and-overlap.md "Negatives and overlap"); "device" efficiencies leave the host out
  efficiency(R)      step(1) / step(R): per-accelerator throughput kept at R (weak scaling)

On this machine ranks share 2 cores, so compute, host and the rest of the step are scaled by
max(1, R / cores) in the validation. In the projection the per-rank batch is ``project_tokens``
(an accelerator's, not a CPU core's), compute is its model FLOPs over an accelerator's peak at an
assumed MFU, and the host work is this CPU's measured id-map time per token (hash tables live on
the host) scaled to that batch.
Hardware presets state their sources; latencies are assumptions. Nothing here ran on a cluster.
"""
from __future__ import annotations

import dataclasses
import math
import os

from .common import emit

DEFAULT_CONFIG = "kuairand27k_02b"
RANKS = (1, 2, 4)
PROJECT = (8, 16, 32, 64)
HARDWARE = {
    # DeepEP V1 (deepseek-ai/DeepEP docs/legacy.md): H800, ~160 GB/s NVLink, CX7 400 Gb/s IB (~50 GB/s);
    # measured all-to-all bottleneck bandwidth 153 GB/s intranode (EP 8), 43-58 GB/s internode (EP 16-64)
    "h800_ib": {"label": "H800 x 8 per node (NVLink), CX7 IB 400 Gb/s", "node": 8, "bw_intra": 153e9, "bw_inter": 43e9,
                "alpha_intra": 10e-6, "alpha_inter": 30e-6, "peak_flops": 989e12,
                "source": "bandwidths: DeepEP docs/legacy.md (measured all-to-all); peak: H100/H800 SXM bf16 dense "
                          "datasheet; latencies assumed"},
    # DeepEP-Ascend (sgl-project/sgl-kernel-npu README): A3 SuperPoD, pure HCCS, measured all-to-all
    # bottleneck bandwidth 102 GB/s intranode (EP 8), 87 GB/s across nodes (EP 16)
    "ascend_a3_hccs": {"label": "Ascend A3 x 8 per node, HCCS across nodes", "node": 8, "bw_intra": 102e9,
                       "bw_inter": 87e9, "alpha_intra": 10e-6, "alpha_inter": 20e-6, "peak_flops": 376e12,
                       "source": "bandwidths: sgl-kernel-npu README (DeepEP-Ascend, measured); peak: assumed 376 "
                                 "TFLOP/s fp16 per NPU (not verified here); latencies assumed"},
}
ASSUMED_MFU = 0.5   # TurboGR reports 54.71 % on Ascend
PROJECT_TOKENS = 32768  # per accelerator and step in the projection: 128 windows of 256 events


@dataclasses.dataclass
class Measured:
    """One R's measured per-rank, per-step figures (``grf bench stream`` sharded rows)."""

    ranks: int
    step_s: float
    compute_s: float
    lookup_s: float
    unique: float
    collectives: float
    alltoall_bytes: float     # per rank
    tokens: float             # per rank
    flops: float              # model FLOPs per rank


def alltoall_bytes(unique: float, R: int, dim: int, exchange: str = "fp32") -> float:
    """Bytes one rank sends to the others per step (ids, rows back, row gradients)."""
    row = 4 * dim if exchange == "fp32" else 2 * dim + 4
    return unique * (R - 1) / R * (8 + 2 * row)


def comm_seconds(bytes_a2a: float, dense_bytes: float, R: int, hw: dict, collectives: float) -> float:
    """All-to-all and dense all-reduce seconds per step on ``hw`` (module docstring)."""
    if R == 1:
        return 0.0
    node = hw["node"]
    inside = min(node, R)
    intra = bytes_a2a * (inside - 1) / (R - 1)
    inter = bytes_a2a - intra
    alpha = hw["alpha_intra"] if R <= node else hw["alpha_inter"]
    a2a = max(intra / hw["bw_intra"], inter / hw["bw_inter"] if inter else 0.0)
    bw = hw["bw_intra"] if R <= node else hw["bw_inter"]
    allreduce = 2 * (R - 1) / R * dense_bytes / bw
    return a2a + allreduce + collectives * math.ceil(math.log2(R)) * alpha


def _measure(cfg, R: int, steps: int) -> tuple[Measured, dict]:
    from gr_functional.config import replace
    from gr_functional.flops import train_step_flops

    from .stream import run_sharded

    # prefetch off: with a spare core a rank's batch building runs beside its step, which the
    # validation could not tell from scaling (ranks = cores leaves none spare)
    rcfg = replace(cfg, dist={"nproc": R}, train={"batch_size": cfg.train.batch_size * R,
                                                  "log_every": max(1, steps // 2), "prefetch": 0})
    row = run_sharded(rcfg, json_lines=False, steps=steps, quiet=True)[-1]   # the second half: warm
    tokens = row["tokens_per_rank"]
    flops = train_step_flops(cfg.model, [cfg.model.max_len] * round(tokens / cfg.model.max_len),
                             num_negatives=cfg.loss.num_negatives)["total"]
    return Measured(R, row["step_s"], row["compute_s"], row["lookup_s"], row["unique_per_rank"],
                    row["collectives_per_step"], row["alltoall_mb_per_step"] * 2**20 / R, tokens, flops), row


def run(json_lines: bool = False, cfg=None, steps: int = 8, ranks=RANKS, project=PROJECT,
        project_tokens: int = PROJECT_TOKENS) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(f"experiments/configs/{DEFAULT_CONFIG}.toml")
    D, ex = cfg.model.embed_dim, cfg.embedding.exchange
    cores = os.cpu_count() or 1
    measured, raw = {}, {}
    for R in ranks:
        measured[R], raw[R] = _measure(cfg, R, steps)
    base = measured[ranks[0]]
    dense_bytes = raw[ranks[0]]["allreduce_mb_per_step"] * 2**20
    link = next((raw[R]["link"] for R in ranks if R > 1), {"latency_s": 0.0, "bandwidth_Bps": float("inf")})
    local = {"node": max(ranks), "bw_intra": link["bandwidth_Bps"], "bw_inter": link["bandwidth_Bps"],
             "alpha_intra": link["latency_s"], "alpha_inter": link["latency_s"]}
    rest = max(base.step_s - base.compute_s - base.lookup_s, 0.0)
    rows = []
    for R in ranks:
        m = measured[R]
        share = max(1.0, R / cores)                      # local ranks share the cores
        predicted_bytes = alltoall_bytes(m.unique, R, D, ex)
        predicted = (base.compute_s + base.lookup_s + rest) * share + comm_seconds(predicted_bytes, dense_bytes, R, local,
                                                                                  m.collectives)
        row = {"bench": "scaling", "section": "validation", "ranks": R, "measured_step_s": m.step_s,
               "predicted_step_s": predicted, "step_error": predicted / m.step_s - 1.0,
               "measured_alltoall_bytes": m.alltoall_bytes, "predicted_alltoall_bytes": predicted_bytes,
               "bytes_error": predicted_bytes / m.alltoall_bytes - 1.0 if m.alltoall_bytes else 0.0,
               "unique_per_rank": m.unique, "collectives_per_step": m.collectives, "measured_efficiency": base.step_s * share / m.step_s,
               "cores": cores, "link": link}
        emit(row, json_lines, ["ranks", "measured_step_s", "predicted_step_s", "step_error", "measured_alltoall_bytes",
                               "predicted_alltoall_bytes", "bytes_error", "measured_efficiency"])
        rows.append(row)
    collectives = max(m.collectives for m in measured.values())
    # an accelerator runs a larger per-rank batch than one CPU core: FLOPs, host work and distinct
    # ids are scaled linearly from the measured batch (linear ids: an upper bound, dedup grows with
    # the batch, so the bytes and the communication time are over-estimated)
    scale = project_tokens / base.tokens
    for name, hw in HARDWARE.items():
        compute = scale * base.flops / (hw["peak_flops"] * ASSUMED_MFU)
        host = scale * base.lookup_s
        for R in (1, *project):
            b = alltoall_bytes(scale * base.unique, R, D, ex)
            comm = comm_seconds(b, dense_bytes, R, hw, collectives)
            row = {"bench": "scaling", "section": "projection", "hardware": name, "ranks": R,
                   "tokens_per_rank": project_tokens, "compute_s": compute, "host_s": host, "comm_s": comm,
                   "alltoall_bytes": b,
                   # the device alone (the host's id map hidden or on the device), then with the host
                   "efficiency_device_serial": compute / (compute + comm),
                   "efficiency_device_overlapped": compute / max(compute, comm),
                   "efficiency_host_serial": (compute + host) / (compute + host + comm),
                   "efficiency_host_overlapped": max(compute, host) / max(compute, host, comm),
                   "assumed_mfu": ASSUMED_MFU, "label": hw["label"], "source": hw["source"]}
            emit(row, json_lines, ["hardware", "ranks", "tokens_per_rank", "compute_s", "host_s", "comm_s",
                                   "efficiency_device_serial", "efficiency_device_overlapped",
                                   "efficiency_host_serial", "efficiency_host_overlapped"])
            rows.append(row)
    return rows
