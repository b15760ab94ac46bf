"""The full training step measured for ``grf bench mfu`` and ``grf bench throughput``.

Configs (``STEP_CONFIGS``):
  ml1m_hstu, ml1m_hstu_large  the shipped configs on a real ML-1M batch (the first batch of
                              epoch 0 of the training loader: 128 users, real lengths <= 200);
                              needs the ML-1M data (GRF_DATA_DIR)
  kuairand_1k                 a larger model (D = 256, 4 blocks, 4 heads of 64, max_len 1024,
                              128 negatives, 50,000 items) on 16 sequences drawn from the real
                              KuaiRand-27K lengths truncated at 1024 (~15.6k tokens)
  nvidia_hstu_512             NVIDIA recsys-examples' benchmark widths (D = 1024, 8 blocks, 4 heads
                              of 256) on 4 fixed-length sequences of 512 (``SYNTHETIC``; the
                              full shape, 32 x 4096, is "nvidia_hstu", for a GPU)

What is timed: ``step.make_train_step`` (forward, backward, AdamW update; jitted on JAX), the
median of ``repeats`` steps after one warm-up (JAX compiles in it), each step fed the same batch
and the previous step's parameters, outputs fetched to the host. Model FLOPs come from
``gr_functional.flops.train_step_flops`` (causal attention cells, supervised tokens, 3x forward
for forward + backward, AdamW); the peak is ``common.matmul_peak`` of the same backend, in the
same dtype, measured in the same run.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gr_functional import flops, model
from gr_functional.config import ModelConfig
from gr_functional.configure import load_config
from gr_functional.tree import tree_leaves
from gr_functional.step import init_opt_state, make_train_step

from .common import kuairand_lengths, median_seconds, synthetic_batch, timed_call

KUAIRAND_1K = ModelConfig(num_items=50_000, embed_dim=256, num_blocks=4, num_heads=4, dqk=64, dv=64,
                          max_len=1024)
# NVIDIA recsys-examples' HSTU benchmark shape (examples/hstu/training/configs/benchmark_ranking.gin
# at a00a749): 8 layers, 4 heads of kv_channels 256, hidden 1024, 32 sequences of a fixed 4096 tokens
# (is_jagged False). As our retrieval HSTU: embed_dim = hidden (their item embedding is 128, then
# projected; ours is the hidden width), GR's 128 sampled negatives, 50,000 items. Their ranking head
# and contextual features are left out. "nvidia_hstu" is the shape itself (a GPU's: 57 TFLOPs per
# step by their formula); "nvidia_hstu_512" the same widths on 4 sequences of 512 (0.47 TFLOPs),
# which a CPU steps in seconds.
NVIDIA_HSTU = ModelConfig(num_items=50_000, embed_dim=1024, num_blocks=8, num_heads=4, dqk=256, dv=256,
                          max_len=4096)
# name -> (model, sequences, fixed_length): a synthetic batch of that many sequences, of length
# max_len (fixed_length, as NVIDIA's benchmark feeds them) or drawn from the real KuaiRand-27K
# lengths truncated at max_len. The "tiny_" ones are the same kinds at toy widths, for
# ``grf bench device --tiny`` (the whole device command checked in CI in seconds).
TINY = ModelConfig(num_items=500, embed_dim=32, num_blocks=2, num_heads=2, dqk=16, dv=16, max_len=64)
SYNTHETIC = {"kuairand_1k": (KUAIRAND_1K, 16, False),
             "nvidia_hstu": (NVIDIA_HSTU, 32, True),
             "nvidia_hstu_512": (dataclasses.replace(NVIDIA_HSTU, max_len=512), 4, True),
             "tiny_kuairand": (TINY, 4, False),
             "tiny_nvidia": (dataclasses.replace(TINY, num_heads=1, dqk=32, dv=32, max_len=32), 2, True)}
STEP_CONFIGS = ("ml1m_hstu", "ml1m_hstu_large", "kuairand_1k", "nvidia_hstu_512")


def step_setup(name: str, base_cfg):
    """``(cfg, numpy batch)`` of a benchmark config; backend settings come from ``base_cfg``."""
    from gr_functional.losses import negatives_for

    if name in SYNTHETIC:
        shape, sequences, fixed = SYNTHETIC[name]
        cfg = dataclasses.replace(base_cfg, model=shape)
        if fixed:
            lengths = [shape.max_len] * sequences
        else:
            lengths = np.random.default_rng(0).choice(kuairand_lengths(shape.max_len), size=sequences, replace=False)
        return cfg, synthetic_batch(cfg.model, lengths, seed=0, negatives=negatives_for(cfg))
    from gr_functional.data import batching, split as split_mod
    from gr_functional.retrieval.task import load_sequences, resolve

    from gr_functional.cli import _config_path

    cfg = load_config(_config_path(name))
    cfg = dataclasses.replace(cfg, backend=base_cfg.backend)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
    return cfg, batching.TrainLoader.from_config(splits.train, cfg).batch(0, 0)


def prepare_step(B, cfg, batch_np):
    """``(one, info)``: ``one()`` runs one training step on ``B`` (each step fed the previous one's
    parameters) and returns its outputs; ``info`` the step's model FLOPs, tokens, sequences and
    parameter count."""
    params = B.asarray_tree(model.init_params(cfg.model, seed=0))
    opt = init_opt_state(B, params, cfg)
    batch = B.asarray_tree(batch_np)
    step = make_train_step(B, cfg)
    state = {"params": params, "opt": opt}

    def one():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        return metrics

    lengths = np.asarray(batch_np.tokens.lengths)
    lengths = lengths[lengths > 0]
    supervised = int(np.asarray(batch_np.weights).sum())
    n_params = sum(int(np.prod(np.shape(x))) for x in tree_leaves(params))
    fl = flops.train_step_flops(cfg.model, lengths, supervised=supervised, num_params=n_params,
                                 num_negatives=cfg.loss.num_negatives)
    return one, {"tokens": int(lengths.sum()), "sequences": int(len(lengths)), "model_flops": int(fl["total"]),
                 "flops_parts": {k: int(v) for k, v in fl.items() if k != "total"}, "params": n_params,
                 "nvidia_flops": flops.nvidia_step_flops(cfg.model, lengths)}


def measure_step(B, cfg, batch_np, repeats: int = 3) -> dict:
    """Seconds per training step (median of ``repeats`` after a warm-up) and the step's ``info``."""
    one, info = prepare_step(B, cfg, batch_np)
    return {"seconds": median_seconds(B, one, repeats=repeats), **info}


def alternate_steps(variants: dict, cfg, batch_np, repeats: int = 3) -> dict:
    """``{label: measure_step-like dict}`` of ``variants`` (``{label: backend}``) on one batch, their
    steps ALTERNATING (after one warm-up step each, in which JAX compiles): every variant sees the
    same machine load, so their ratios hold on a shared machine where timing one after the other
    would mix the load's drift into them."""
    prepared = {label: prepare_step(B, cfg, batch_np) for label, B in variants.items()}
    first = {label: timed_call(variants[label], one) for label, (one, _) in prepared.items()}
    times = {label: [] for label in variants}
    for _ in range(repeats):
        for label, (one, _) in prepared.items():
            times[label].append(timed_call(variants[label], one))
    return {label: {"seconds": float(np.median(times[label])), "first_s": first[label], **prepared[label][1]}
            for label in variants}
