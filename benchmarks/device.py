"""``grf bench device [--tiny] [--backend torch,jax] [--set backend.device=cuda] [--set
backend.precision=bf16] [--record]``: the whole device table in one command, for a lent GPU (or an
NPU: ``--backend torch_npu``).

Three sections, each the rows of an existing benchmark (their ``bench`` field names the section):

  attention  ``benchmarks.attention``: one HSTU layer forward + backward, padded vs the jagged
             kernels each backend has on the device (tiles; Triton and Pallas on a GPU), on real KuaiRand-27K
             lengths truncated at 256 / 1024 / 4096
  mfu        ``benchmarks.mfu``: the training step of ml1m_hstu, ml1m_hstu_large, kuairand_1k and
             NVIDIA's benchmark shape (``nvidia_hstu``, 32 x 4096, D = 1024), on every backend, in
             ``backend.precision`` (bf16 is the device table's), MFU by our FLOP model and by
             NVIDIA's formula over the matmul peak measured in the same run
  pipeline   ``benchmarks.pipeline``: how busy the ML-1M HSTU training loop keeps the device, with
             batches built in the step's thread and ahead on a worker

then one ``{"bench": "device", "section": "total"}`` row with the wall seconds of the whole
command (the goal on a GPU is under 8 minutes). ``--tiny`` runs the same code at toy sizes
(truncation 64, the ``tiny_`` step configs of ``benchmarks.step``, the quickstart loop for a few
steps): the command's check in CI, on a CPU, in seconds.
"""
from __future__ import annotations

import dataclasses
import time

from gr_functional.cli import _config_path
from gr_functional.configure import load_config

from . import attention, mfu, pipeline
from .common import emit

SIZES = {
    "full": {"truncations": attention.TRUNCATIONS, "token_budget": attention.TOKEN_BUDGET,
             "step_configs": ("ml1m_hstu", "ml1m_hstu_large", "kuairand_1k", "nvidia_hstu"),
             "pipeline_config": "ml1m_hstu", "pipeline_steps": 20, "pipeline_warmup": 3, "repeats": 3,
             "peak_n": 8192},
    "tiny": {"truncations": (64,), "token_budget": 256, "step_configs": ("tiny_kuairand", "tiny_nvidia"),
             "pipeline_config": "quickstart", "pipeline_steps": 2, "pipeline_warmup": 1, "repeats": 1,
             "peak_n": 256},
}


def run(json_lines: bool = False, cfg=None, backends=None, tiny: bool = False) -> list[dict]:
    size = SIZES["tiny" if tiny else "full"]
    cfg = cfg or load_config(None)
    start = time.perf_counter()
    rows = attention.run(json_lines, cfg, backends, truncations=size["truncations"],
                         token_budget=size["token_budget"], repeats=size["repeats"])
    rows += mfu.run(json_lines, cfg, backends, configs=size["step_configs"], repeats=size["repeats"],
                    peak_n=size["peak_n"])
    # the loop runs the packaged config's model and data on this command's backend settings
    loop_cfg = dataclasses.replace(load_config(_config_path(size["pipeline_config"])), backend=cfg.backend, ops=cfg.ops)
    rows += pipeline.run(json_lines, loop_cfg, backends, steps=size["pipeline_steps"],
                         warmup=size["pipeline_warmup"])
    total = {"bench": "device", "section": "total", "size": "tiny" if tiny else "full", "rows": len(rows),
             "wall_s": time.perf_counter() - start}
    emit(total, json_lines, ["bench", "section", "size", "rows", "wall_s"])
    return rows + [total]

