"""Typed run configuration: frozen dataclasses filled from a TOML file and ``--set`` overrides.

The schema lives here (typed, documented); TOML files hold values. Every value is checked when
the config is built, before anything runs: its type; keys with a fixed set of values are
``Literal`` types (the error lists them); numbers have declared ranges (``_range``; floats must
also be finite); ``validate`` checks the rules that join several keys. Errors name where the
value came from (the TOML file, ``--set key=value`` or a checkpoint's embedded config), the key,
and the fix; an unknown key suggests the nearest valid one.
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from .errors import ConfigError  # noqa: F401 (re-exported)


# ----------------------------------------------------------------------------- choices
# Keys with a fixed set of values, declared once; everything else (backends, the CLI) reads them
# from here. Names that plugins may add (backend.name, loss.name, data.dataset, ops.attention) are
# checked against their registries instead (``gr_functional.configure``).
Dtype = Literal["float32", "float64"]
Precision = Literal["fp32", "bf16", "fp16"]
Deterministic = Literal["auto", "on", "off"]
DistBackend = Literal["gloo", "nccl", "hccl"]
DistBalance = Literal["none", "kk", "lookahead"]
RankingSplit = Literal["windows", "temporal"]
Ties = Literal["file", "shuffle"]
NegativeSamplerName = Literal["uniform", "popularity"]
NegativesPrecision = Literal["fp32", "fp16", "bf16"]
EmbeddingKind = Literal["dense", "hash"]
EvictionPolicy = Literal["lru", "lfu"]
EmbeddingOptimizer = Literal["adamw", "lazy_adam", "rowwise_adagrad"]
HashInit = Literal["hashed", "dense"]
Sharding = Literal["replicated", "row"]
ExchangePrecision = Literal["fp32", "fp16", "bf16"]
Task = Literal["retrieval", "ranking"]


def choices(literal) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` type: ``choices(Precision) == ("fp32", "bf16", "fp16")``."""
    return typing.get_args(literal)


def _range(default, *, ge=None, gt=None, le=None, lt=None):
    """A numeric field with its allowed range (checked by ``build_config``; floats must also be
    finite). ``ge``/``gt``/``le``/``lt``: >=, >, <=, < bounds."""
    return field(default=default, metadata={"range": {"ge": ge, "gt": gt, "le": le, "lt": lt}})


_OPS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
        "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def _range_text(bounds: dict) -> str:
    return " and ".join(f"{_OPS[op][0]} {b:g}" for op, b in bounds.items() if b is not None)


def _check_range(value, bounds: dict, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number {_range_text(bounds)}, got {value!r}")
    for op, b in bounds.items():
        if b is not None and not _OPS[op][1](value, b):
            raise ConfigError(f"{where}: must be {_range_text(bounds)}, got {value!r}")


@dataclass(frozen=True)
class DataConfig:
    # A registered dataset (gr_functional/data/registry.py; checked in validate): "synthetic",
    # "ml-1m", "ml-20m", "kuairand", "csv" (your own file, keys csv_* below), or a plugin's.
    dataset: str = "synthetic"
    path: str = ""                  # data file or folder; "" = the dataset's default under GRF_DATA_DIR
    seed: int = _range(0, ge=0)     # synthetic generator seed
    synthetic_users: int = _range(2000, ge=1)
    synthetic_items: int = _range(3000, ge=1)
    synthetic_max_events: int = _range(400, ge=1)  # real KuaiRand-27K lengths, truncated here
    zipf_a: float = _range(1.05, ge=0.0)  # item popularity exponent of the synthetic generator
    # GR trains on all but each user's last item, so the validation target (second to last) is
    # also a training target; false trains on all but the last two (an unleaked validation split).
    valid_in_train: bool = True
    # Item ids remapped to 1..K (K distinct ids, in increasing order of the original id): for raw ids
    # that are hashes or sparse (a table of max_id + 1 rows would not fit).
    remap_items: bool = False
    # Order of a user's events that share a timestamp (docs/guides/data.md "Data: ties"): "file" keeps the file's
    # order (a stable sort); "shuffle" permutes each run of same-second events with a generator
    # seeded by ties_seed (GR sorts with pandas' unstable quicksort: its tie order is arbitrary,
    # and ML-1M's file order carries a signal: tied events tend to have increasing movie ids).
    ties: Ties = "file"
    ties_seed: int = _range(0, ge=0)
    # Your own interactions (dataset = "csv", path = the file; gr_functional/data/sources/
    # interactions.py): one event per line, with user, item and time columns; other columns are
    # ignored. Ids that are not all integers (strings, hashes) are mapped to dense ints.
    csv_sep: str = ""               # field separator; "" = by extension: .csv ",", .tsv/.tab "\t", else sniffed
    csv_header: bool = True         # the first line names the columns
    # Columns: header names, or 0-based indices written as strings ("0", "2") when csv_header = false
    csv_user: str = "user_id"
    csv_item: str = "item_id"
    csv_time: str = "timestamp"     # unix time in csv_time_unit, or ISO 8601 dates ("2022-04-08 12:30:00")
    csv_time_unit: Literal["s", "ms", "us", "ns"] = "s"  # numeric times are floored to integer seconds
    csv_rating: str = ""            # optional rating column ("" = none) ...
    csv_min_rating: float = _range(0.0)  # ... rows rated below this are dropped
    # How ranking samples are split (model.task = "ranking"; gr_functional/ranking/data.py).
    # "windows": per user, test = the last ranking.num_candidates (C) events, validation the C
    # before, training every earlier window of C after a history event (every user in every split;
    # a user needs 3 C + 1 events). "temporal", as KuaiRand papers split: events before valid_start
    # train (windows of C, each after a history event), validation = each user's events in
    # [valid_start, test_start), test = those in [test_start, test_end): candidates in chunks of up
    # to C, history everything before the window; a user without events in a window, or without
    # history before it, has no sample there.
    split: RankingSplit = "windows"
    # The cutoffs of "temporal": a date or time ("2022-05-01", "2022-05-01T00:00:00+08:00"; without
    # an offset it is UTC) or epoch milliseconds ("1651334400000"); test_end "" = to the end of the data
    valid_start: str = ""
    test_start: str = ""
    test_end: str = ""
    # kuairand-rank-log with split = "temporal": each user's pre-period video ids prepended to its
    # history (never candidates): a Parquet file with user_id, last_time_ms, watch_seq, like_seq and
    # long_watch_seq, as the data folder's KuaiRand-Pure user_sequences_pure_before_20220425.parquet,
    # which "kuairand-pure-before" names; "" = none (gr_functional/data/sources/kuairand_ranking.py
    # ``prefix_history``: what the prefix events carry and what they cannot)
    history_prefix: str = ""


@dataclass(frozen=True)
class ModelConfig:
    # "retrieval": GR's research HSTU (the keys below, [loss], [embedding]); "ranking": GR's
    # dlrm_v3 HSTU ranking model, configured in [ranking] (gr_functional/ranking/, docs/guides/ranking.md "Ranking").
    task: str = "retrieval"           # a registered task (gr_functional/task.py): "retrieval", "ranking", a plugin's
    # the retrieval model, a registered name (gr_functional/model.py register_model): "hstu" (GR's
    # research HSTU, the keys below), or a plugin's
    name: str = "hstu"
    num_items: int = _range(0, ge=0)  # item ids are 1..num_items (0 = padding); 0 = take from the data
    embed_dim: int = _range(50, ge=1)
    num_blocks: int = _range(2, ge=1)
    num_heads: int = _range(1, ge=1)
    dqk: int = _range(50, ge=1)     # per-head query/key width
    dv: int = _range(50, ge=1)      # per-head value width
    max_len: int = _range(200, ge=1)  # history truncated to the most recent max_len events
    max_output_len: int = _range(11, ge=0)  # GR: attention normaliser n = max_len + max_output_len (211 on ML)
    num_time_buckets: int = _range(128, ge=1)
    pos_bias: bool = True           # relative position attention bias
    time_bias: bool = True          # relative (log-bucketed) time attention bias
    input_dropout: float = _range(0.2, ge=0.0, lt=1.0)
    linear_dropout: float = _range(0.2, ge=0.0, lt=1.0)
    ln_eps: float = _range(1e-6, gt=0.0)   # 0: a constant row divides 0 by 0
    l2_eps: float = _range(1e-6, gt=0.0)
    # Chunk length of the jagged attention's tile plan (Jagged.with_tiles), built with every batch;
    # backends with hstu_kernel "jagged" (the torch/jax default) then skip all padding. Layout
    # only: results are the same for any value up to float rounding. 0 = no plan (padded
    # attention); -1 = auto (``tile``: ~8 chunks per full-length sequence, measured fastest on CPU).
    attention_tile: int = _range(-1, ge=-1)

    @property
    def norm_len(self) -> int:
        """The fixed attention normaliser n (GR: padded length max_len + max_output_len)."""
        return self.max_len + self.max_output_len

    @property
    def tile(self) -> int:
        """The resolved ``attention_tile``: auto is max_len / 8 rounded up to a power of two, in
        [32, 256] and at most max_len (ML-1M, max_len 200: 32; length 1024: 128)."""
        if self.attention_tile >= 0:
            return self.attention_tile
        return min(self.max_len, 256, max(32, 1 << max(0, (self.max_len - 1) // 8).bit_length()))

    @property
    def uvqk_splits(self) -> tuple[int, int, int, int]:
        h = self.num_heads
        return (h * self.dv, h * self.dv, h * self.dqk, h * self.dqk)


@dataclass(frozen=True)
class LossConfig:
    """The training loss (gr_functional/losses.py): ``name`` is a registered loss; the shipped
    ones are "sampled_softmax" (GR's: each position's target against num_negatives uniformly
    sampled items), "in_batch" (the batch's other targets as negatives, TurboGR's shared
    logits), "shared_pool" (one pool of sampled negatives per batch, shared logits, logQ),
    "mixed_pool" (that pool plus in-batch positives) and "full_softmax" (every item). Losses registered from a script (``@losses.register``, ``grf train --plugin``) read
    the same keys."""

    name: str = "sampled_softmax"
    # logits are cosine / temperature: 0 divides by zero (the loss is undefined)
    temperature: float = _range(0.05, gt=0.0)
    # sampled per supervised position (sampled_softmax); the shared pool's size (in_batch, shared_pool)
    num_negatives: int = _range(128, ge=1)
    # The shared pool's sampler (losses whose negatives are "pool", e.g. "shared_pool"): "uniform"
    # over 1..N, or "popularity" (q(id) proportional to training events ** popularity_alpha).
    # logq subtracts log(num_negatives * q(id)) from each pooled negative's logit (the sampled-
    # softmax correction: the pool then estimates the full softmax's denominator without bias).
    sampler: NegativeSamplerName = "uniform"
    popularity_alpha: float = _range(1.0, ge=0.0)
    logq: bool = True
    # "mixed_pool" only: this many targets of the batch (in-batch positives, drawn with
    # replacement) join the num_negatives sampled ones in the shared pool; logq then corrects each
    # id by its expected count under the mixture (Yang et al. 2020, mixed negative sampling).
    batch_negatives: int = _range(128, ge=1)
    # The negative item embeddings the loss reads, as 16-bit values with one fp32 scale per jagged
    # segment (TurboGR's jaggedness-aware FP16 negatives): "fp16" | "bf16" round each user
    # sequence's negative rows divided by that sequence's largest |value| (a shared pool is one
    # segment); gradients pass straight through to the fp32 table. "fp32" keeps them as they are.
    negatives_precision: NegativesPrecision = "fp32"


Schedule = Literal["constant", "cosine", "linear"]


@dataclass(frozen=True)
class OptimConfig:
    # The dense parameters' optimizer, a registered name (gr_functional/optimizers; checked by its
    # registry): "adamw" (decoupled weight decay), "adagrad", "sgd" (with momentum), "lion", or a
    # plugin's; on the JAX backend also "optax:NAME" (any optax optimizer taking learning_rate).
    name: str = "adamw"
    lr: float = _range(1e-3, ge=0.0)
    # Learning-rate schedule (gr_functional/optim.py learning_rate), a function of the update
    # count t = 1, 2, ... held in the optimizer state (so a resume continues it exactly): a linear
    # warmup from 0 to lr over warmup_steps updates (0 = none), then "constant" lr, or a "cosine"
    # or "linear" decay from lr to lr * end_lr_factor over decay_steps updates (then flat);
    # decay_steps = 0 decays until the run's last update (resolved from the data and recorded).
    schedule: Schedule = "constant"
    warmup_steps: int = _range(0, ge=0)
    decay_steps: int = _range(0, ge=0)
    end_lr_factor: float = _range(0.0, ge=0.0, le=1.0)
    beta1: float = _range(0.9, ge=0.0, lt=1.0)
    beta2: float = _range(0.98, ge=0.0, lt=1.0)
    eps: float = _range(1e-8, gt=0.0)
    weight_decay: float = _range(0.0, ge=0.0)
    momentum: float = _range(0.9, ge=0.0, lt=1.0)           # sgd: heavy-ball momentum (0 = plain SGD)
    nesterov: bool = False                                   # sgd: Nesterov momentum
    initial_accumulator: float = _range(0.1, ge=0.0)         # adagrad: the accumulator's start value


@dataclass(frozen=True)
class TrainConfig:
    seed: int = _range(42, ge=0)
    epochs: int = _range(101, ge=1)
    batch_size: int = _range(128, ge=1)  # sequences per step
    max_tokens: int = _range(0, ge=0)  # token budget per step instead of a fixed count (0 = off)
    max_steps: int = _range(0, ge=0)  # stop after this many steps (0 = no limit)
    eval_every: int = _range(1, ge=1)  # epochs between evaluations
    log_every: int = _range(10, ge=1)  # steps between metrics.jsonl lines
    # Seconds between the plain progress lines (step, steps/s, tokens/s, loss, ETA) printed when
    # stderr is not a terminal, where the progress bar does not show (0 = none).
    progress_every_s: float = _range(60.0, ge=0.0)
    # Checkpoints (docs/guides/reliability.md "Reliability"): one at the end of every epoch and of the run, plus one
    # every checkpoint_every optimizer steps (0 = epoch ends only). Each is an atomic, checksummed
    # OUT/checkpoints/step-NNNNNNNN.safetensors; the newest keep_checkpoints are kept (0 = all).
    checkpoint_every: int = _range(0, ge=0)
    keep_checkpoints: int = _range(3, ge=0)
    # Gradient accumulation: one optimizer step per `accumulate` consecutive loader batches, with
    # the loss normalised by the supervised tokens of all of them (a k-times larger batch).
    accumulate: int = _range(1, ge=1)
    # Batches built ahead of the step on a background thread (gr_functional/data/prefetch.py):
    # negatives, dropout masks and the rank split leave the step's critical path; the batches,
    # and so the run, are bitwise those of prefetch = 0 (synchronous).
    prefetch: int = _range(2, ge=0)
    # NaN/Inf guard: a step whose loss or gradient is not finite is skipped (params and optimizer
    # state unchanged) and logged; this many skipped steps in a row abort the run after saving
    # the last good state (0 = never abort).
    max_bad_steps: int = _range(5, ge=0)
    # Divergence guard on the parameters: a step whose update is not finite, or moves the
    # parameters by more than max_update_ratio times their norm (global L2 norms,
    # ||new - old|| / ||old||), is skipped like a non-finite one and counts towards
    # max_bad_steps, so a finite but exploding update (optim.lr far too high) never reaches the
    # parameters or a checkpoint. GR's ML-1M recipe moves them by <= 0.03 per step. 0 = off.
    max_update_ratio: float = _range(1.0, ge=0.0)
    # fp16 dynamic loss scaling (backend.precision = "fp16" only): the initial scale, halved on
    # every overflow, doubled after loss_scale_window overflow-free steps (torch GradScaler's rule).
    loss_scale: float = _range(65536.0, ge=1.0)
    loss_scale_window: int = _range(2000, ge=1)
    # Modules of one's own imported before the config is checked (gr_functional/plugins.py): .py
    # files (saved as absolute paths) or module names that register losses, datasets or attention
    # kernels. `grf train --plugin FILE` appends one; a resume and `grf eval` import them again.
    plugins: tuple[str, ...] = ()
    # TensorBoard scalars (train loss, tokens/s, every evaluation metric) in OUT/tensorboard, for
    # watching a run live; needs the optional tensorboard package. metrics.jsonl stays the record.
    tensorboard: bool = False
    # Hooks added by name (gr_functional/hooks.py register_hook, from a --plugin module): called
    # after the built-in ones at every step and epoch end, e.g. hooks = ["print_lr"].
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int = _range(256, ge=1)
    ks: tuple[int, ...] = (10, 50, 200)
    max_users: int = _range(0, ge=0)  # evaluate the first N users only (0 = all)


@dataclass(frozen=True)
class BackendConfig:
    # A backend of backends.BACKENDS: "torch", "jax", "npu", or one a plugin registers.
    name: str = "torch"
    device: str = ""                # "" = the backend's default (cpu, npu:0, ...)
    dtype: Dtype = "float32"
    # torch.compile the training loss (model forward; its backward through AOTAutograd): inductor's
    # C++/OpenMP kernels on CPU, Triton on CUDA; the chunked loss ops stay eager. torch only (JAX
    # always jit-compiles its step); the first steps of each new batch shape compile (~30-60 s on
    # 2 CPU cores). docs/results/speed.md "Speed" has the measured gain.
    compile: bool = False
    # Recompute the attention in backward instead of keeping it (activation checkpointing of
    # hstu_attention: torch.utils.checkpoint / jax.checkpoint): autograd keeps only q, k, v and the
    # bias parameters of each layer, not its score tiles or matrices; costs one more attention
    # forward per layer (docs/results/speed.md "Speed" has both figures).
    attention_recompute: bool = False
    # Compute precision of the forward/backward pass: "fp32" | "bf16" | "fp16". Master weights and
    # the optimizer state stay in `dtype`; bf16/fp16 cast them per step (LayerNorm, L2-norm and the
    # loss's logsumexp run in fp32). fp16 adds dynamic loss scaling (train.loss_scale).
    precision: Precision = "fp32"
    # Deterministic kernels (torch.use_deterministic_algorithms; JAX on CPU already is): a run and
    # its resumed twin then write identical metrics.jsonl files. "auto" (default): on for CPU
    # devices, where it is nearly free, off on accelerators, where torch's deterministic index
    # backward is many times slower (docs/guides/reliability.md "Determinism"); "on" | "off" (TOML true / false also
    # accepted) force it.
    deterministic: Deterministic = "auto"


@dataclass(frozen=True)
class OpsConfig:
    """Which implementation runs each fused op (backends/ops.py: every op's implementations sit
    beside its reference and declare the backends, dtypes, precisions, devices and model options
    they support; others are refused by name). "default" is the backend's own choice
    (``Backend.default_ops``); a plugin may register more (``backends.ops.register``)."""

    # HSTU attention (backends/kernels.py): "default" ("best" on torch and jax = "cpu_fused" on CPU
    # where it builds, else "jagged"; "auto" = mxrec or Triton on npu), "jagged" (no-padding tiles
    # where they save enough work), "tiled" (always), "reference" (padded), "cpu_fused" (fused C++
    # tiles on CPU: a torch extension, an XLA custom call on jax), "triton" (torch/npu), "pallas"
    # (jax), "mxrec" (npu).
    attention: str = "default"
    # The ranking model's target-aware attention: "reference" (padded).
    ranking_attention: str = "default"
    # The loss's sampled logits, fp32 or with 16-bit negatives (backends/loss_ops.py): "default"
    # ("best" on torch and jax: the fused C++ op on CPU where it builds, else "reference"), "cpu_fused",
    # "reference" (the backend's formulation; torch: row-chunked).
    sampled_logits: str = "default"
    # The shared negative pool's logsumexp (loss.name = "shared_pool" and "in_batch"): as sampled_logits.
    shared_logsumexp: str = "default"
    # Row-sparse embedding update (embedding.optimizer lazy_adam / rowwise_adagrad;
    # backends/row_kernels.py): "default" ("reference" on torch/jax, "auto" on npu), "reference",
    # "fbgemm" (fbgemm's fused TBE row-wise Adagrad: fbgemm-ascend on npu, fbgemm_gpu on CUDA,
    # fbgemm-gpu-cpu on CPU; rowwise_adagrad only), "auto" (npu: fbgemm where it applies, else reference).
    row_update: str = "default"


@dataclass(frozen=True)
class DistConfig:
    """Data-parallel training (docs/guides/distributed.md "Distributed training"): torch ranks are
    processes; JAX ranks are the devices of a mesh over one process or several.

    ``train.batch_size`` stays the GLOBAL batch: every rank builds the same global batch (same
    users, negatives and dropout masks as a single-process run) and trains the sequences the
    balancer gives it; gradients are SUM-all-reduced after each rank scales its loss by
    ``1 / (global supervised tokens)``, so N ranks compute the single-process update.
    """

    # torch's process-group backend: "gloo" (CPU; the one verified here), "nccl" (CUDA), "hccl"
    # (Ascend, needs torch_npu); JAX processes exchange through XLA (gloo on CPU). Devices:
    # nccl/hccl ranks use cuda:LOCAL_RANK / npu:LOCAL_RANK unless backend.device names one.
    backend: DistBackend = "gloo"
    # Processes on this host that `grf train` starts (through torch.distributed.run) when > 1.
    # Under torchrun the world size comes from WORLD_SIZE and is written back here.
    nproc: int = _range(1, ge=1)
    # JAX (backends/dist_jax.py): devices of each process that train as ranks of a 1-D mesh,
    # each its dist.balance share of every global batch (0 or 1: one device); the ranks are
    # dist.nproc x devices. On CPU, grf asks XLA for that many host devices. torch and npu run
    # one rank per process.
    devices: int = _range(0, ge=0)
    # Which sequences of a global batch each rank trains: "none" (contiguous equal-count
    # slices), "kk" (equal-count Karmarkar-Karp + exchange refinement on a*L^2 + b*L per
    # sequence; the global batches are the single-process ones), "lookahead" (balance.plan_epoch
    # over windows of `lookahead` global batches: sequences may move between nearby global
    # batches, so the schedule differs from a single-process run).
    balance: DistBalance = "kk"
    lookahead: int = _range(16, ge=1)  # global batches pooled per window (balance = "lookahead")
    # Cost per sequence of L input tokens: cost_a * L^2 + cost_b * L, fitted on this machine by
    # `grf bench calibrate --config ...`; both 0 = the FLOP count of one HSTU layer
    # (balance.flop_cost_coefficients) as a stand-in.
    cost_a: float = _range(0.0, ge=0.0)
    cost_b: float = _range(0.0, ge=0.0)
    rank_token_cap: int = _range(0, ge=0)  # max input tokens per rank per global batch (0 = no cap)
    # Failure detection (backends/dist_torch.py limits): T = timeout_s. A rank whose heartbeat
    # is silent for max(T, 5 s), or that makes no progress for max(T, 5 x its slowest step so far)
    # (10 T in warm-up: the first steps after start, resume, evaluation or a checkpoint), makes
    # every rank exit (code 4) naming it; collectives time out after 10 T + max(T, 5 s).
    timeout_s: float = _range(300.0, gt=0.0)
    bucket_mb: float = _range(25.0, gt=0.0)  # gradient all-reduce bucket size (launched during backward)


@dataclass(frozen=True)
class EmbeddingConfig:
    """The item embedding table (docs/guides/sparse-embeddings.md "Sparse embeddings"; gr_functional/embedding/).

    kind "dense": one row per item id 0..num_items (today's ``params["item_emb"]``). kind "hash":
    a dynamic table of ``capacity`` rows; raw ids of any value get a row on first sight (after
    ``min_count`` sightings), and when the table is full the ``policy`` picks the row to evict
    (re-initialised with its optimizer state). The id -> row mapping and the per-step dedup run on
    the host (numpy), so every backend sees the same rows.

    optimizer "adamw": the whole table is a dense parameter updated by AdamW at every step (the
    GR recipe; dense kind only). "lazy_adam" / "rowwise_adagrad": row-sparse updates of the rows a
    step looks up (embedding/rowopt.py: lazy Adam keeps per-row moments and a per-row step count;
    row-wise Adagrad one accumulator per row), with optim.lr / schedule / betas / eps /
    weight_decay unless overridden here. Dense parameters always keep AdamW.
    """

    kind: EmbeddingKind = "dense"
    capacity: int = _range(0, ge=0)      # hash rows (row 0 is reserved); 0 = model.num_items
    policy: EvictionPolicy = "lru"       # hash eviction: least recently / least frequently used
    min_count: int = _range(1, ge=1)     # hash admission: an id gets a row once seen in this many steps
    optimizer: EmbeddingOptimizer = "adamw"
    lr: float = _range(0.0, ge=0.0)      # row-sparse optimizers' base lr; 0 = optim.lr
    # Initial value of a hash row: "hashed" (truncated normal std 0.02 drawn from a counter-based
    # generator keyed by (train.seed, id): the same row for an id on every backend, rank and
    # resume); "dense" (the row the dense table would have for that id; ids must be 1..num_items:
    # for A/B comparisons of the table kind on a catalogue-sized id space).
    init: HashInit = "hashed"
    # Where the rows live in a data-parallel run: "replicated" (every rank holds the whole table
    # and maps the global batch's ids) or "row" (each rank holds the rows of the ids it owns,
    # embedding/sharding.py; lookups and gradients travel by all-to-all: torch ranks, or the
    # devices of one JAX process). One process on one device: replicated.
    sharding: Sharding = "replicated"
    node_size: int = _range(0, ge=0)  # ranks per node (hierarchical groups, intra/inter byte split); 0 = 1
    hierarchical: bool = False        # two-level all-to-all: inside the node first, then across nodes
    exchange: ExchangePrecision = "fp32"  # exchanged rows and gradients; 16-bit ones carry a scale per row
    # Semi-asynchronous sparse updates (docs/guides/negatives-and-overlap.md "Semi-asynchronous sparse updates"): the row update
    # of step i is applied at step i + staleness, so each step reads rows at most `staleness`
    # updates old; dense parameters stay synchronous. 0 = synchronous. Row-sparse optimizers only.
    staleness: int = _range(0, ge=0)


@dataclass(frozen=True)
class RankingConfig:
    """dlrm_v3's HSTU ranking model (``model.task = "ranking"``; gr_functional/ranking/, spec
    docs/design/dlrm_v3_ranking_spec.md). Defaults are GR HEAD db1bf8f's kuairand-1k
    (``dlrm_v3/configs.py``): 512-wide tables, 5 STU layers, max_seq_len 16384, the LayerNorm output
    norm (GR 2e81fab's: 256, 3, 2056 and the per-head GroupNorm; a run's own config.toml keeps what it
    trained with)."""

    embed_dim: int = _range(512, ge=1)        # embedding tables
    dim: int = _range(512, ge=1)              # model width
    num_layers: int = _range(5, ge=1)
    heads: int = _range(4, ge=1)
    dqk: int = _range(128, ge=1)
    dv: int = _range(128, ge=1)
    max_seq_len: int = _range(16384, ge=1)    # contextual + history + candidates
    num_candidates: int = _range(10, ge=1)
    video_table: int = _range(10_000_000, ge=1)
    context_tables: tuple[int, ...] = (10_000_000, 8, 9, 9, 8, 8)   # user_id and the 5 user features
    # The 7 id features (video_id, user_id, 5 user features) are all embed_dim wide: with
    # merge_tables they share one physical table (id spaces at row offsets), one gather per step
    # instead of one per feature (MTGRBoost's table merging; embedding/collection.py plans it).
    merge_tables: bool = True
    action_dim: int = _range(8, ge=1)
    action_weights: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    tower_hidden: int = _range(256, ge=1)     # content and action towers (GR: the constant 256)
    item_hidden: int = _range(512, ge=1)      # item tower's hidden width (GR: the constant 512, not the model width)
    task_hidden: int = _range(512, ge=1)      # multitask head's hidden width (GR: the constant 512)
    position_buckets: int = _range(8192, ge=1)
    time_buckets: int = _range(2048, ge=1)    # the time table has time_buckets + 1 rows
    time_bucket_cap: int = _range(-1, ge=-1)  # -1: GR's PyTorch kernel's cap, dim - 1
    input_dropout: float = _range(0.2, ge=0.0, lt=1.0)
    linear_dropout: float = _range(0.1, ge=0.0, lt=1.0)
    # The STU layers' output norm of the attention output (GR's hstu_group_norm): false = one
    # LayerNorm over each token's heads * dv values, weights [heads * dv] (GR HEAD db1bf8f's
    # kuairand-1k); true = a GroupNorm per head, weights [heads] (GR 2e81fab's). Run folders written
    # before this key read as true (config.migrate), so they resume unchanged.
    group_norm: bool = False
    # How much history a sample keeps (an ablation; no GR counterpart): -1 = GR's, the OLDEST
    # max_history events before the candidates (GR's maybe_truncate_seq); N >= 0 = the N MOST RECENT
    # (0: no history, the non-sequential model: user id and features, candidate video ids). The
    # candidates' query time stays the newest history event's either way.
    recent_history: int = _range(-1, ge=-1)

    @property
    def contextual(self) -> int:
        return len(self.context_tables)

    @property
    def max_history(self) -> int:
        return self.max_seq_len - self.num_candidates - self.contextual

    @property
    def cap(self) -> int:
        return self.dim - 1 if self.time_bucket_cap < 0 else self.time_bucket_cap

    def __post_init__(self):
        if self.max_history < 1:
            raise ConfigError(f"ranking.max_seq_len={self.max_seq_len} leaves no history: it must exceed "
                              f"num_candidates ({self.num_candidates}) + the {self.contextual} contextual tokens")
        if self.cap > self.time_buckets:
            raise ConfigError(f"ranking.time_buckets={self.time_buckets}: time buckets reach {self.cap} "
                              f"(time_bucket_cap, or dim - 1 = {self.dim - 1} as GR's PyTorch kernel caps them) but "
                              f"the time table has rows 0..time_buckets: raise time_buckets or set "
                              f"time_bucket_cap <= {self.time_buckets}")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)


# section name -> its dataclass (each field's default_factory is the class itself)
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _coerce(value: Any, typ, where: str, from_text: bool = False):
    """``value`` as ``typ``, or ConfigError. Strings become numbers or booleans only when they
    come from command-line text (``from_text``: ``--set`` bare words); in a TOML file ``"16"`` is
    a string, and a string where a number belongs is an error, not a guess."""
    origin = typing.get_origin(typ)
    text = (str,) if from_text else ()
    quoted = "" if from_text else " (a quoted string: drop the quotes)"
    if origin is Literal:
        allowed = typing.get_args(typ)
        if isinstance(value, bool) and "on" in allowed:  # switches with an "auto" default (backend.deterministic)
            value = "on" if value else "off"
        if value not in allowed:
            near = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}{hint}")
        return value
    if origin is tuple:
        (inner, *_rest) = typing.get_args(typ)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of {inner.__name__}, got {value!r}")
        return tuple(_coerce(v, inner, where, from_text) for v in value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, *text)):
            raise ConfigError(f"{where}: expected an integer, got {value!r}{quoted if isinstance(value, str) else ''}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, *text)):
            raise ConfigError(f"{where}: expected a number, got {value!r}{quoted if isinstance(value, str) else ''}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if typ is str:
        if from_text and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # --set data.csv_user=0: a column index typed bare on the command line
        if isinstance(value, (datetime.date, datetime.time)):
            return value.isoformat()  # a TOML date or time written bare (data.valid_start = 2022-05-01)
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {typ}")


def _hints(cls):
    return typing.get_type_hints(cls)


# Keys that moved: (old section, old key) -> (new section, new key). Configs written by a run
# (OUT/config.toml, checkpoints) are migrated on reading; a user's file or --set naming the old
# place is an error saying where the key lives now.
MOVED_KEYS = {("model", "temperature"): ("loss", "temperature"),
              ("model", "num_negatives"): ("loss", "num_negatives"),
              ("backend", "hstu_kernel"): ("ops", "attention"),
              ("backend", "row_kernel"): ("ops", "row_update")}
# Keys added with a default that is not what a run written before them computed: (section, key) ->
# (the value such a stored config (OUT/config.toml, a checkpoint's) means, the (section, key, value)
# that makes the key matter). Read only for stored configs; a user's file without the key gets the
# new default, and so does a stored config the key does not matter to (a retrieval run's [ranking]).
ADDED_KEYS = {("ranking", "group_norm"): (True, ("model", "task", "ranking"))}   # per-head GroupNorm until GR HEAD's LayerNorm
# backend.cpu_fused (a switch of every fused C++ CPU op) became one [ops] key per op: false meant
# these choices (attention "default"/"best" ran jagged then)
CPU_FUSED_OFF = {"sampled_logits": "reference", "shared_logsumexp": "reference"}


def unread_sections(task: str) -> tuple[str, ...]:
    """Config sections a run of ``task`` never reads: a change there (a moved default) changes
    nothing it computes, so resuming and the refactor fingerprints ignore them."""
    return () if task == "ranking" else ("ranking",)


def migrate(values: dict, source: str = "<config>", origins: dict | None = None, stored: bool = True) -> dict:
    """``values`` ({section: {key: value}}) with the keys of older versions in their place now
    (``MOVED_KEYS``, ``backend.cpu_fused``) and, if ``stored``, the keys a run written before them
    lacks at the value it computed with (``ADDED_KEYS``); a copy. ``stored``: written by a run, so
    migrated; else (a user's file or --set) a ConfigError naming where the key lives now."""
    origins = origins or {}
    values = {name: dict(body) if isinstance(body, dict) else body for name, body in values.items()}
    if stored:
        for (section, key), (value, (when_section, when_key, when_value)) in ADDED_KEYS.items():
            if isinstance(values.get(section), dict) and values.get(when_section, {}).get(when_key) == when_value:
                values[section].setdefault(key, value)
    for (old, key), (new, new_key) in MOVED_KEYS.items():
        if not isinstance(values.get(old), dict) or key not in values[old]:
            continue
        if not stored:
            where = origins.get((old, key), source)
            raise ConfigError(f"{where}: {old}.{key} moved to {new}.{new_key}: write `{new_key} = ...` under "
                              f"[{new}] (--set {new}.{new_key}=...)")
        value = values[old].pop(key)
        values.setdefault(new, {}).setdefault(new_key, value)
    backend = values.get("backend")
    if isinstance(backend, dict) and "cpu_fused" in backend:
        if not stored:
            where = origins.get(("backend", "cpu_fused"), source)
            raise ConfigError(f"{where}: backend.cpu_fused is now one [ops] key per op: false is ops.attention="
                              f"'jagged', ops.sampled_logits='reference', ops.shared_logsumexp='reference' "
                              f"(--set ops.attention=jagged ...); true is the default")
        if backend.pop("cpu_fused") is False:
            chosen = values.setdefault("ops", {})
            if chosen.get("attention", "default") in ("default", "best") and backend.get("name", "torch") == "torch":
                chosen["attention"] = "jagged"
            for op, name in CPU_FUSED_OFF.items():
                chosen.setdefault(op, name)
    return values


def build_config(values: dict, source: str = "<config>", origins: dict | None = None,
                 stored: bool = False) -> Config:
    """Config from a nested dict ``{section: {key: value}}``, every value checked (type, choices,
    range, then ``validate``). Errors name the value's origin: ``origins[(section, key)]`` (e.g.
    ``"--set model.num_blocks=4"``) when given, else ``source`` (the file).

    ``stored``: the config was written by a run (a checkpoint's or OUT/config.toml): keys of
    older versions are migrated (``MOVED_KEYS``). Registry names (dataset, loss, kernel) are not
    looked up here (``gr_functional.configure`` does, for a config a user wrote), so a checkpoint
    of a plugin's loss can be read without that plugin."""
    origins = origins or {}
    values = migrate(values, source, origins, stored)
    sections = {}
    for name, body in values.items():
        if name not in SECTIONS:
            where = origins.get((name, None), source)
            near = difflib.get_close_matches(name, list(SECTIONS), n=1)
            hint = f"; did you mean [{near[0]}]?" if near else ""
            raise ConfigError(f"{where}: unknown section [{name}]{hint} (valid sections: {', '.join(SECTIONS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of key = value")
        cls = SECTIONS[name]
        hints = _hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in body.items():
            where = origins.get((name, key), source)
            if key not in hints:
                near = difflib.get_close_matches(key, list(hints), n=1)
                hint = f"; did you mean {name}.{near[0]}?" if near else ""
                raise ConfigError(f"{where}: unknown key {name}.{key}{hint} (valid keys in [{name}]: "
                                  f"{', '.join(hints)})")
            full = f"{where}: {name}.{key}" if where == source else where
            kwargs[key] = _coerce(value, hints[key], full, from_text=(name, key) in origins)
            bounds = fields[key].metadata.get("range")
            if bounds is not None:
                _check_range(kwargs[key], bounds, full)
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    try:
        validate(cfg, source=source, origins=origins)
    except ConfigError as exc:
        raise ConfigError(_blame_overrides(str(exc), cfg, values, source, origins)) from None
    return cfg


def _blame_overrides(message: str, cfg: Config, values: dict, source: str, origins: dict) -> str:
    """A cross-key rule's ``message`` names the key it checks and that key's origin; when that
    key came from the file (or is a default) but an override made the rule fail (``--set
    embedding.kind=hash`` with the file's ``embedding.optimizer='adamw'``), the message leads with
    the override instead of blaming the file: ``--set embedding.kind=hash: conflicts with
    embedding.optimizer='adamw' (the default; FILE does not set it): ...``.

    An override is to blame when the same values without it (the file's value back, or the key
    unset) pass every rule. Each is judged alone, so two overrides that each complete a rule are
    both named; one whose removal only uncovers another failure is not named."""
    if not message.startswith(f"{source}: "):
        return message  # the failing key's own origin is an override already
    blamed = []
    for (section, key), label in origins.items():
        if not isinstance(label, SetOrigin) or key is None:
            continue
        without = {name: dict(body) if isinstance(body, dict) else body for name, body in values.items()}
        if label.replaced is _ABSENT:
            without.get(section, {}).pop(key, None)
        else:
            without[section][key] = label.replaced
        try:
            rebuilt = Config(**{name: SECTIONS[name](**{k: _coerce(v, _hints(SECTIONS[name])[k], "", True)
                                                        for k, v in body.items()})
                                for name, body in without.items()})
            validate(rebuilt, source=source)
        except (ConfigError, TypeError, ValueError):
            continue
        blamed.append(str(label))
    if not blamed:
        return message
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            prefix = f"{source}: {section.name}.{f.name}={value!r}: "
            if message.startswith(prefix):
                body = values.get(section.name)
                whence = (f"in {source}" if isinstance(body, dict) and f.name in body
                          else f"(the default; {source} does not set it)" if source != "<defaults>"
                          else "(the default)")
                return (f"{' and '.join(blamed)}: conflicts with {section.name}.{f.name}={value!r} {whence}: "
                        f"{message[len(prefix):]}")
    return f"{message} (set by {' and '.join(blamed)})"


def validate(cfg: Config, source: str = "<config>", origins: dict | None = None) -> None:
    """Rules joining several keys (single values were checked by ``build_config``); ``ConfigError``
    names the key, its origin and the fix. Names looked up in a registry (``loss.name``,
    ``data.dataset``, kernels, hooks, optimizers) are each registry's own check
    (``gr_functional.configure.check_registries``): this module imports nothing of the project."""
    origins = origins or {}

    def fail(section: str, key: str, message: str):
        raise ConfigError(problem_message(cfg, section, key, message, source, origins))

    b, e = cfg.backend, cfg.eval
    if b.compile and b.name != "torch":
        fail("backend", "compile", f"torch.compile is a torch-backend option: "
                                   f"{'JAX always jit-compiles its step' if b.name == 'jax' else 'on npu it goes through torchair / triton-ascend, not verified here'}; "
                                   f"set backend.compile=false")
    if cfg.model.task == "ranking":
        _validate_ranking(cfg, fail)
    if cfg.dist.devices > 1 or (b.name == "jax" and cfg.dist.nproc > 1):
        _validate_devices(cfg, fail)
    if b.precision == "fp16" and 1.0 / cfg.loss.temperature >= 65504.0:
        fail("loss", "temperature", "fp16 logits (cosine / temperature) overflow above 65504; raise it to >= "
                                     "1.6e-5 or use backend.precision=bf16/fp32")
    emb = cfg.embedding
    if emb.kind == "hash" and emb.optimizer == "adamw":
        fail("embedding", "optimizer", "AdamW updates every row of the table at every step; a hash table is "
                                       "updated by rows: use 'lazy_adam' (Adam semantics per row) or "
                                       "'rowwise_adagrad'")
    if emb.sharding == "row" and emb.optimizer == "adamw":
        fail("embedding", "sharding", "row-sharded tables are updated by rows: set embedding.optimizer to "
                                      "'lazy_adam' or 'rowwise_adagrad'")
    if emb.hierarchical and emb.node_size < 1:
        fail("embedding", "hierarchical", "a hierarchical exchange groups ranks by node: set embedding.node_size "
                                          "(ranks per node, dividing dist.nproc)")
    if emb.node_size and cfg.dist.nproc > 1 and cfg.dist.nproc % emb.node_size:
        fail("embedding", "node_size", f"must divide dist.nproc={cfg.dist.nproc}")
    if emb.staleness and emb.optimizer == "adamw":
        fail("embedding", "staleness", "delays the row-sparse updates of the table: set embedding.optimizer to "
                                       "'lazy_adam' or 'rowwise_adagrad'")
    if emb.kind == "dense" and emb.capacity:
        fail("embedding", "capacity", "a dense table has one row per item id (model.num_items + 1); capacity "
                                      "applies to embedding.kind = 'hash'")
    if cfg.model.task == "ranking":
        return  # eval.ks are retrieval cut-offs
    if not e.ks or any(k < 1 for k in e.ks):
        fail("eval", "ks", "must be a non-empty list of cut-offs >= 1, e.g. [10, 50, 200]")
    if 10 not in e.ks:
        fail("eval", "ks", "must contain 10: the epoch is selected by validation HR@10")


def cutoff_ms(text: str) -> int:
    """Epoch milliseconds of a cutoff (``data.valid_start`` ...): digits are milliseconds, else an
    ISO date or time, UTC unless it has an offset; ValueError naming the forms."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError('not a date, a time or epoch milliseconds (e.g. "2022-05-01", '
                         '"2022-05-01T00:00:00+08:00", "1651334400000")') from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp() * 1000)


def _validate_devices(cfg: Config, fail) -> None:
    """dist.devices > 1, or several JAX processes: the ranks are devices of a JAX mesh
    (backends/dist_jax.py)."""
    key = "devices" if cfg.dist.devices > 1 else "nproc"
    if cfg.dist.devices > 1 and cfg.backend.name != "jax":
        fail("dist", "devices", f"trains ranks as the devices of JAX processes; backend.name="
                                f"{cfg.backend.name!r} runs one rank per process: use --nproc N (dist.nproc), "
                                f"or --backend jax")
    if cfg.model.task != "retrieval":
        fail("dist", key, f"the JAX mesh trains model.task='retrieval'; {cfg.model.task!r} runs data-parallel as "
                          f"torch ranks (--backend torch --nproc N)")
    e = cfg.embedding
    if e.sharding == "row" and (e.exchange != "fp32" or e.staleness):
        fail("embedding", "exchange" if e.exchange != "fp32" else "staleness",
             f"on the JAX mesh (dist.devices={cfg.dist.devices}, dist.nproc={cfg.dist.nproc}) the row exchange is "
             f"fp32 and synchronous; the 16-bit and stale exchanges run on torch ranks (--backend torch --nproc N)")
    ranks = cfg.dist.nproc * max(1, cfg.dist.devices)
    if cfg.dist.devices > 1 and not cfg.train.max_tokens and ranks > cfg.train.batch_size:
        # checked before XLA is asked for the devices: --devices 100000 grew past 1.2 GB, silent
        fail("dist", "devices", f"{ranks} ranks (dist.nproc x dist.devices) share each global batch of "
                                f"train.batch_size={cfg.train.batch_size} sequences, so some would train nothing; "
                                f"lower --devices or raise train.batch_size")
    if e.sharding == "row" and e.node_size and ranks % e.node_size:
        fail("embedding", "node_size", f"must divide the ranks, dist.nproc x dist.devices = {ranks}")


def _validate_ranking(cfg: Config, fail) -> None:
    """The rules of ``model.task = "ranking"`` (gr_functional/ranking/task.py)."""
    d = cfg.data
    if d.split == "temporal":
        cut = {}
        for key in ("valid_start", "test_start", "test_end"):
            if getattr(d, key) == "" and key != "test_end":
                fail("data", key, 'data.split="temporal" needs it: the first time of the validation window '
                                  '(valid_start) or of the test window (test_start), e.g. "2022-05-01"')
            try:
                cut[key] = cutoff_ms(getattr(d, key)) if getattr(d, key) else None
            except ValueError as exc:
                fail("data", key, str(exc))
        if cut["valid_start"] >= cut["test_start"]:
            fail("data", "test_start", f"must come after data.valid_start={d.valid_start!r}: validation is "
                                       f"[valid_start, test_start)")
        if cut["test_end"] is not None and cut["test_end"] <= cut["test_start"]:
            fail("data", "test_end", f"must come after data.test_start={d.test_start!r} (or be \"\": to the end)")
    elif any(getattr(d, key) for key in ("valid_start", "test_start", "test_end")):
        key = next(k for k in ("valid_start", "test_start", "test_end") if getattr(d, k))
        fail("data", key, 'is a cutoff of data.split="temporal"; set data.split="temporal" or drop it')
    if d.history_prefix and (d.dataset != "kuairand-rank-log" or d.split != "temporal"):
        fail("data", "history_prefix", "prefixes an official KuaiRand log's users with their pre-period ids: it needs "
                                       "data.dataset='kuairand-rank-log' and data.split='temporal'")
    if cfg.dist.balance == "lookahead":
        fail("dist", "balance", "model.task='ranking' splits each global batch as it is (\"none\" or \"kk\"); "
                                "lookahead moves samples between batches, which ranking's loader does not plan")
    emb = cfg.embedding
    if emb.sharding == "row" and emb.kind != "hash":
        fail("embedding", "sharding", "model.task='ranking' row-shards its one merged hash table: set "
                                      "embedding.kind='hash' (the dense tables are replicated)")
    if emb.kind == "dense" and emb.optimizer != "adamw":
        fail("embedding", "optimizer", "model.task='ranking' updates dense tables with AdamW; the row-sparse "
                                       "optimizers come with embedding.kind='hash' (ranking/sparse.py)")
    if emb.kind == "hash" and not cfg.ranking.merge_tables:
        fail("ranking", "merge_tables", "embedding.kind='hash' keeps every id feature in one hash table: set "
                                        "ranking.merge_tables=true")
    if emb.kind == "hash" and emb.init == "dense":
        fail("embedding", "init", "model.task='ranking' starts hash rows from hashed_init: set embedding.init='hashed'")


def problem_message(cfg: Config, section: str, key: str, message: str, source: str = "<config>",
                    origins: dict | None = None) -> str:
    """``WHERE: section.key=VALUE: message``, WHERE the value's origin (``--set ...``, the file)."""
    where = (origins or {}).get((section, key), source)
    return f"{where}: {section}.{key}={getattr(getattr(cfg, section), key)!r}: {message}"


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"model.num_blocks=4"`` -> ("model", "num_blocks", 4); TOML value syntax, bare strings allowed."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set model.num_blocks=4")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as --set backend.name=jax
    return section, key, value


_ABSENT = object()  # SetOrigin.replaced of a key the file did not set


class SetOrigin(str):
    """The origin label of an override (``"--set embedding.kind=hash"``), a plain string to every
    reader, which also remembers the value it replaced (``replaced``: the file's, or ``_ABSENT``),
    so ``build_config`` can tell which override makes a cross-key rule fail."""

    replaced: Any

    def __new__(cls, label: str, replaced: Any = _ABSENT):
        self = super().__new__(cls, label)
        self.replaced = replaced
        return self


def read_values(path: str | Path | None = None, overrides: list = ()) -> tuple[dict, str, dict]:
    """``(values, source, origins)``: the TOML file ``path`` (None: defaults) with ``--set``
    overrides applied (``"section.key=value"`` strings, or ``(label, "section.key=value")`` pairs for
    a CLI flag that sets a key, so errors name the flag the user typed: ``--backend tpu9``).
    ``origins[(section, key)]`` names where each override came from. Nothing is checked yet."""
    values: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found (configs live in experiments/configs/)") from None
        except IsADirectoryError:
            raise ConfigError(f"--config {path} is a folder; pass a .toml file (configs live in "
                              f"experiments/configs/)") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML (UTF-8): {exc}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    origins: dict = {}
    for item in overrides:
        label, text = item if isinstance(item, tuple) else (f"--set {item}", item)
        section, key, value = parse_override(text)
        values.setdefault(section, {})
        if not isinstance(values[section], dict):
            raise ConfigError(f"--set {text}: [{section}] is not a table")
        earlier = origins.get((section, key))  # the same key set twice: what the file had
        replaced = earlier.replaced if isinstance(earlier, SetOrigin) else values[section].get(key, _ABSENT)
        values[section][key] = value
        origins[(section, key)] = SetOrigin(label, replaced)
        origins.setdefault((section, None), label)
    if is_run_record(path):
        values = migrate(values, source, origins, stored=True)  # a run's own record (grf train --config OUT/config.toml)
    return values, source, origins


def is_run_record(path) -> bool:
    """``path`` is a run's own config.toml (``grf train --config OUT/config.toml``)."""
    return path is not None and Path(path).name == "config.toml" and (Path(path).parent / "checkpoints").is_dir()


def replace(cfg: Config, **sections: dict) -> Config:
    """Copy of ``cfg`` with some keys changed: ``replace(cfg, model={"num_blocks": 4})``."""
    changes = {name: dataclasses.replace(getattr(cfg, name), **kv) for name, kv in sections.items()}
    return dataclasses.replace(cfg, **changes)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def config_to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML (written to ``OUT/config.toml``)."""
    lines = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        body = getattr(cfg, section.name)
        for f in dataclasses.fields(body):
            lines.append(f"{f.name} = {_toml_value(getattr(body, f.name))}")
        lines.append("")
    return "\n".join(lines)
