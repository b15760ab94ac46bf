"""Typed run configuration: frozen dataclasses filled from a TOML file and ``--set`` overrides.

The schema lives here (typed, documented); TOML files hold values. Unknown sections or keys
and values of the wrong type are errors that name the file and key and list the valid keys.
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and how to fix it."""


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "synthetic"      # synthetic | ml-1m | ml-20m | kuairand
    path: str = ""                  # data file or folder; "" = the dataset's default under GRF_DATA_DIR
    seed: int = 0                   # synthetic generator seed
    synthetic_users: int = 2000
    synthetic_items: int = 3000
    synthetic_max_events: int = 400  # real KuaiRand-27K lengths, truncated here
    zipf_a: float = 1.05             # item popularity exponent of the synthetic generator
    # GR trains on all but each user's last item, so the validation target (second to last) is
    # also a training target; false trains on all but the last two (an unleaked validation split).
    valid_in_train: bool = True


@dataclass(frozen=True)
class ModelConfig:
    num_items: int = 0              # item ids are 1..num_items (0 = padding); 0 = take from the data
    embed_dim: int = 50
    num_blocks: int = 2
    num_heads: int = 1
    dqk: int = 50                   # per-head query/key width
    dv: int = 50                    # per-head value width
    max_len: int = 200              # history truncated to the most recent max_len events
    max_output_len: int = 11        # GR: attention normaliser n = max_len + max_output_len (211 on ML)
    num_time_buckets: int = 128
    pos_bias: bool = True           # relative position attention bias
    time_bias: bool = True          # relative (log-bucketed) time attention bias
    input_dropout: float = 0.2
    linear_dropout: float = 0.2
    temperature: float = 0.05
    num_negatives: int = 128
    ln_eps: float = 1e-6
    l2_eps: float = 1e-6
    # Chunk length of the jagged attention's tile plan (Jagged.with_tiles), built with every batch;
    # backends with hstu_kernel "jagged" (the torch/jax default) then skip all padding. Layout
    # only: results are the same for any value up to float rounding. 0 = no plan (padded
    # attention); -1 = auto (``tile``: ~8 chunks per full-length sequence, measured fastest on CPU).
    attention_tile: int = -1

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
class OptimConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 42
    epochs: int = 101
    batch_size: int = 128           # sequences per step
    max_tokens: int = 0             # token budget per step instead of a fixed count (0 = off)
    max_steps: int = 0              # stop after this many steps (0 = no limit)
    eval_every: int = 1             # epochs between evaluations
    log_every: int = 10             # steps between metrics.jsonl lines
    # Checkpoints (README "Reliability"): one at the end of every epoch and of the run, plus one
    # every checkpoint_every optimizer steps (0 = epoch ends only). Each is an atomic, checksummed
    # OUT/checkpoints/step-NNNNNNNN.safetensors; the newest keep_checkpoints are kept (0 = all).
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    # Gradient accumulation: one optimizer step per `accumulate` consecutive loader batches, with
    # the loss normalised by the supervised tokens of all of them (a k-times larger batch).
    accumulate: int = 1
    # NaN/Inf guard: a step whose loss or gradient is not finite is skipped (params and optimizer
    # state unchanged) and logged; this many skipped steps in a row abort the run after saving
    # the last good state (0 = never abort).
    max_bad_steps: int = 5
    # fp16 dynamic loss scaling (backend.precision = "fp16" only): the initial scale, halved on
    # every overflow, doubled after loss_scale_window overflow-free steps (torch GradScaler's rule).
    loss_scale: float = 65536.0
    loss_scale_window: int = 2000


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int = 256
    ks: tuple[int, ...] = (10, 50, 200)
    max_users: int = 0              # evaluate the first N users only (0 = all)


@dataclass(frozen=True)
class BackendConfig:
    name: str = "torch"             # jax | torch | npu
    device: str = ""                # "" = the backend's default (cpu, npu:0, ...)
    dtype: str = "float32"
    # HSTU attention kernel: "default" (the backend's own choice: "jagged" on torch/jax, mxrec or
    # Triton on npu), or a backend-specific name (torch: "jagged" | "tiled" | "reference" |
    # "triton"; jax: "jagged" | "tiled" | "reference"; npu: "auto" | "mxrec" | "triton" |
    # "reference"). "jagged" runs the no-padding tiles where they save enough work, "tiled" always.
    hstu_kernel: str = "default"
    # Compute precision of the forward/backward pass: "fp32" | "bf16" | "fp16". Master weights and
    # the optimizer state stay in `dtype`; bf16/fp16 cast them per step (LayerNorm, L2-norm and the
    # loss's logsumexp run in fp32). fp16 adds dynamic loss scaling (train.loss_scale).
    precision: str = "fp32"
    # Deterministic kernels (torch.use_deterministic_algorithms; JAX on CPU already is): a run and
    # its resumed twin then write identical metrics.jsonl files. "auto" (default): on for CPU
    # devices, where it is nearly free, off on accelerators, where torch's deterministic index
    # backward made an ML-1M step 24x slower on an H100 (1341 vs 56 ms, profiled); "on" | "off"
    # (TOML true / false also accepted) force it.
    deterministic: str = "auto"


@dataclass(frozen=True)
class DistConfig:
    """Multi-process data-parallel training (README "Distributed training"; torch backends only).

    ``train.batch_size`` stays the GLOBAL batch: every rank builds the same global batch (same
    users, negatives and dropout masks as a single-process run) and trains the sequences the
    balancer gives it; gradients are SUM-all-reduced after each rank scales its loss by
    ``1 / (global supervised tokens)``, so N ranks compute the single-process update.
    """

    # Process-group backend: "gloo" (CPU; the one verified here), "nccl" (CUDA), "hccl" (Ascend,
    # needs torch_npu). Devices: nccl/hccl ranks use cuda:LOCAL_RANK / npu:LOCAL_RANK unless
    # backend.device names one.
    backend: str = "gloo"
    # Processes on this host that `grf train` starts (through torch.distributed.run) when > 1.
    # Under torchrun the world size comes from WORLD_SIZE and is written back here.
    nproc: int = 1
    # Which sequences of a global batch each rank trains: "none" (contiguous equal-count
    # slices), "kk" (equal-count Karmarkar-Karp + exchange refinement on a*L^2 + b*L per
    # sequence; the global batches are the single-process ones), "lookahead" (balance.plan_epoch
    # over windows of `lookahead` global batches: sequences may move between nearby global
    # batches, so the schedule differs from a single-process run).
    balance: str = "kk"
    lookahead: int = 16             # global batches pooled per window (balance = "lookahead")
    # Cost per sequence of L input tokens: cost_a * L^2 + cost_b * L, fitted on this machine by
    # `grf bench calibrate --config ...`; both 0 = the FLOP count of one HSTU layer
    # (balance.flop_cost_coefficients) as a stand-in.
    cost_a: float = 0.0
    cost_b: float = 0.0
    rank_token_cap: int = 0         # max input tokens per rank per global batch (0 = no cap)
    # Failure detection: a rank whose heartbeat stops, or that makes no progress while others
    # wait for it, for timeout_s seconds makes every rank exit (code 4) naming it; collectives
    # time out after the same time. Rank 0 evaluates while the others wait without a timeout
    # (they watch its heartbeat instead), so long evaluations are fine.
    timeout_s: float = 300.0
    bucket_mb: float = 25.0         # gradient all-reduce bucket size (launched during backward)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# section name -> its dataclass (each field's default_factory is the class itself)
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _coerce(value: Any, typ, where: str):
    origin = typing.get_origin(typ)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(typ)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of {inner.__name__}, got {value!r}")
        return tuple(_coerce(v, inner, where) for v in value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, bool):  # switches with an "auto" default (backend.deterministic)
            return "on" if value else "off"
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {typ}")


def _hints(cls):
    return typing.get_type_hints(cls)


def build_config(values: dict, source: str = "<config>") -> Config:
    """Config from a nested dict ``{section: {key: value}}``; errors name ``source``."""
    sections = {}
    for name, body in values.items():
        if name not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{name}]; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of key = value")
        cls = SECTIONS[name]
        hints = _hints(cls)
        kwargs = {}
        for key, value in body.items():
            if key not in hints:
                raise ConfigError(f"{source}: unknown key {name}.{key}; valid keys in [{name}]: "
                                  f"{', '.join(hints)}")
            kwargs[key] = _coerce(value, hints[key], f"{source}: {name}.{key}")
        sections[name] = cls(**kwargs)
    return Config(**sections)


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


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML config (or defaults when ``path`` is None) and apply ``--set`` overrides."""
    values: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found (configs live in experiments/configs/)") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        values.setdefault(section, {})
        if not isinstance(values[section], dict):
            raise ConfigError(f"--set {text}: [{section}] is not a table")
        values[section][key] = value
    return build_config(values, source)


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
