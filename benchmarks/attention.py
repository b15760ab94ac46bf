"""``grf bench attention [--json] [--backend torch,jax] [--set backend.device=cuda]``: one HSTU
layer, forward + backward, jagged (no padding) vs padded, on the real KuaiRand-27K lengths.

Per truncation T in (256, 1024, 4096): ``budget // T`` sequences (budget = 16,384 padded tokens)
drawn with a fixed seed from the 27,285 real KuaiRand-27K lengths (``benchmarks.balance``),
truncated at T. The layer is ``model.hstu_block`` (D = 256, 4 heads of 64, both relative biases,
no dropout), differentiated with respect to its parameters and its input.

In fp32 (``backend.precision`` is not applied here). Variants (each backend):
  padded  every sequence laid out on T rows (t_cap = B T: the projections run on padding too)
          and the padded dense attention ``[B, H, T, T]`` (``hstu_attention_padded``): what a
          padded implementation computes;
  jagged  rows for real tokens only and the block-sparse tiled attention (auto tile: 32, 128, 256);
  jagged+recompute  the same under ``backend.attention_recompute``: autograd keeps the attention's
          inputs only and backward recomputes its tiles (torch's autograd-saved bytes then leave
          out the one layer's tiles that exist while its backward runs; XLA's temp buffers include
          them);
  fused   (torch on CPU only) jagged rows and the fused C++ tiles (``ops.attention =
          "cpu_fused"``, backends/cpu_fused: products on BLAS, the elementwise work in cache, the
          tiles recomputed in backward: autograd keeps q, k, v only);
  triton  (torch on CUDA only) jagged rows and the Triton kernel of npu_ops;
  pallas  (JAX on a GPU only) jagged rows and the Pallas kernel (backends/pallas_hstu.py).

Fields: seconds (median of 3 after a warm-up/compile), memory_bytes with memory_kind
(``Backend.memory_profile``: autograd-saved bytes on torch CPU, peak allocated on CUDA, XLA temp
buffers on JAX), the ideal ratios of ``flops.padded_over_jagged`` (``ideal_attention`` =
B T^2 / sum L^2, ``ideal_linear`` = B T / sum L, ``ideal_layer`` = padded layer FLOPs / jagged layer
FLOPs with those two), the achieved ``speedup`` = padded seconds / this variant's seconds and
``memory_ratio`` = padded memory / this variant's. Target (issue 4): speedup >= 0.8 ideal_layer at
T=1024. The tiled kernel also skips the upper triangle (it computes ``P tile^2`` score cells, about
sum L^2 / 2 plus a tile's width per sequence), so its speedup can exceed ``ideal_layer``;
``score_cells`` and ``work_ratio`` (padded cells / this variant's) say how much work it did.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gr_functional import flops, model
from gr_functional.config import ModelConfig

from .common import (backends_for, device_label, emit, fused_available, kernel_variant, kuairand_lengths, machine,
                     median_seconds, synthetic_batch)

TRUNCATIONS = (256, 1024, 4096)
TOKEN_BUDGET = 16384
LAYER = ModelConfig(embed_dim=256, num_heads=4, dqk=64, dv=64, num_blocks=1, input_dropout=0.0,
                    linear_dropout=0.0)
COLUMNS = ["backend", "device", "variant", "truncation", "sequences", "tokens", "seconds", "memory_bytes",
           "ideal_layer", "work_ratio", "speedup", "memory_ratio"]


def layer_grad_fn(B, mc):
    """``f((block_params, x), batch) -> (loss, grads)`` for one HSTU block (jitted on JAX)."""

    def objective(px, batch):
        y = model.hstu_block(B, px[0], px[1], batch, mc)
        return B.xp.sum(y * y)

    return B.jit(B.value_and_grad(objective))


def ideal_layer_ratio(mc, lengths, T: int) -> float:
    lengths = np.asarray(lengths, dtype=np.int64)
    B = len(lengths)

    def layer(tokens, cells):  # forward FLOPs of one block with `cells` score cells
        return sum(flops.block_forward_flops(mc, tokens, cells).values())

    return layer(B * T, B * T * T) / layer(int(lengths.sum()), int((lengths * lengths).sum()))


def measure(B, mc, lengths, variant: str, repeats: int = 3) -> dict:
    padded = variant == "padded"
    batch = synthetic_batch(mc, lengths, seed=1, padded=padded)
    rng = np.random.default_rng(2)
    params = model.init_params(dataclasses.replace(mc, num_items=16), seed=0)["blocks"][0]
    x = rng.standard_normal((batch.tokens.t_cap, mc.embed_dim)).astype(np.float32)
    args = (B.asarray_tree((params, x)), B.asarray_tree(batch))
    fn = layer_grad_fn(B, mc)
    seconds = median_seconds(B, fn, *args, repeats=repeats)
    memory, kind = B.memory_profile(fn, *args)
    plan = batch.tokens.tiles
    if padded or B.hstu_kernel not in ("tiled", "cpu_fused") or plan is None:
        cells = batch.tokens.b_cap * mc.max_len ** 2
    else:
        cells = plan.num_pairs() * plan.tile ** 2
    return {"seconds": seconds, "memory_bytes": memory, "memory_kind": kind, "score_cells": int(cells)}


def variants(label, B):
    yield "padded", kernel_variant(B, "reference")
    yield "jagged", kernel_variant(B, "tiled")
    yield "jagged+recompute", kernel_variant(B, "tiled").with_attention_recompute(True)
    if label == "torch" and B.device_kind == "cpu" and fused_available(B):
        yield "fused", kernel_variant(B, "cpu_fused")
    if label == "torch" and str(getattr(B, "torch_device", "cpu")).startswith("cuda"):
        from backends import get_backend

        yield "triton", get_backend("torch", device=str(B.torch_device), ops={"attention": "triton"})
    if label == "jax" and B.device_kind == "gpu":  # on a CPU the Pallas kernel is interpreted: a test, not a speed
        yield "pallas", kernel_variant(B, "pallas")


def run(json_lines: bool = False, cfg=None, backends=None, truncations=TRUNCATIONS,
        token_budget: int = TOKEN_BUDGET, repeats: int = 3) -> list[dict]:
    from gr_functional.configure import load_config

    cfg = cfg or load_config(None)
    rows = []
    host = machine()
    for T in truncations:
        all_lengths = kuairand_lengths(T)
        n = max(1, token_budget // T)
        lengths = np.random.default_rng(T).choice(all_lengths, size=n, replace=False)
        mc = dataclasses.replace(LAYER, max_len=int(T))
        ideal = flops.padded_over_jagged(lengths, T)
        for label, B in backends_for(cfg, backends):
            base = None
            for variant, BV in variants(label, B):
                r = measure(BV, mc, lengths, variant, repeats=repeats)
                if variant == "padded":
                    base = r
                row = {"bench": "attention", "backend": label, "device": device_label(B), "variant": variant,
                       "precision": "fp32", "truncation": int(T), "sequences": int(n),
                       "tokens": int(lengths.sum()), **r,
                       "ideal_attention": ideal["attention_sq"], "ideal_attention_causal": ideal["attention_causal"],
                       "ideal_linear": ideal["linear"], "ideal_layer": ideal_layer_ratio(mc, lengths, T),
                       "work_ratio": base["score_cells"] / r["score_cells"],
                       "speedup": base["seconds"] / r["seconds"],
                       "memory_ratio": (base["memory_bytes"] / r["memory_bytes"]
                                        if base["memory_bytes"] and r["memory_bytes"] else None),
                       **host}
                rows.append(row)
                emit(row, json_lines, COLUMNS)
    return rows
