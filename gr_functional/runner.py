"""Experiment runner: data -> params -> training loop -> evaluation -> output files.

``train(cfg, out_dir)`` writes (README "Commands"):
  OUT/config.toml    resolved config
  OUT/metrics.jsonl  one JSON object per line, a deterministic function of (config, data, backend):
                     training steps {"kind": "train", "step", "epoch", "loss", "tokens"[, "loss_scale"]},
                     skipped non-finite steps {"kind": "skip", ...}, evaluations
                     {"kind": "eval", "split": "valid"|"test", ...} and an abort {"kind": "abort", ...}.
                     No wall-clock field: a run killed and resumed writes the identical file.
  OUT/timing.jsonl   the wall-clock side: tokens/s per logged step, seconds per epoch, and run
                     events (start, resume with the checkpoint used, checkpoints skipped as damaged)
  OUT/eval.json      test metrics (hr@10, ndcg@10, hr@50, ndcg@50, hr@200, ndcg@200, mrr) of the epoch
                     with the best validation HR@10, plus that epoch and the last epoch's test metrics
  OUT/curves.png     loss and HR@10 per epoch
  OUT/checkpoints/   step-NNNNNNNN.safetensors checkpoints (params, optimizer state, loader position,
                     run state, config; checksummed), manifest.json, last.safetensors
                     (gr_functional/checkpoint.py)

Resume (``resume="auto"``, the default of ``grf train``): when OUT/checkpoints holds a valid
checkpoint, training continues from the newest one: params, optimizer state (and fp16 loss scale),
the loader position (epoch, batch), the step, the per-epoch history and metrics.jsonl up to that
step. All randomness is numpy ``default_rng((train.seed, epoch[, step]))`` drawn by the loader,
so the position and the seed are the whole RNG state.

Data-parallel (README "Distributed training"): under torchrun (``WORLD_SIZE > 1``) every rank
runs ``train``; each trains its share of every global batch (``data.batching.RankSplit``) with
``train.make_dist_train_step`` over a ``backends.dist_torch.TorchCollective``. Rank 0 alone
reads and writes OUT (config, metrics, timing, checkpoints, eval.json, curves) and evaluates;
the resume decision and checkpoint state are broadcast from it, so OUT need only exist on rank
0's host. timing.jsonl then also records per-rank forward+backward seconds and their imbalance.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from backends import backend_class, get_backend

from . import model
from .checkpoint import (Checkpoint, CheckpointDir, CheckpointError, NonFiniteState, WriteError, check_finite,
                         fault_point, read_checkpoint, warn, write_error)
from .config import Config, ConfigError, build_config, config_to_toml, replace
from .config import validate as config_validate
from .configure import resolve as resolve_config
from .memory import check_fits, table_items
from .report import SELECT_METRIC, select_epoch
from .runlock import RunLock, RunLocked
from .hooks import (RESTART, Evaluation, LocalComm, Run, StepResult, TensorBoard, advice, bad_step, builtin_hooks,
                    last_healthy, make_steps, named_hooks)
from .embedding.lookup import make_host, table_params
from .embedding.sharding import assemble_table, make_sharded
from .train import dense_state, init_loss_scale, init_opt_state, make_scorer
from .tree import tree_items
from .errors import Diverged, DistributedError, TrainingAborted  # noqa: F401 (re-exported)

RESUME_MODES = ("auto", "must", "never")


DIST_TORCH_BACKENDS = ("torch", "npu")


# ----------------------------------------------------------------------------- data
def load_sequences(cfg: Config):
    """The dataset named by ``cfg.data`` as a SequenceData (ids 1..num_items, time-sorted)."""
    from .data.datasets import load_dataset

    return load_dataset(cfg.data)


def resolve(cfg: Config, data) -> Config:
    """Fill ``model.num_items`` from the data when the config leaves it 0."""
    if cfg.model.num_items == 0:
        cfg = replace(cfg, model={"num_items": int(data.num_items)})
    elif cfg.model.num_items < data.num_items:
        raise ConfigError(f"model.num_items={cfg.model.num_items} but the data ({data.name or 'dataset'}) has item ids "
                          f"up to {data.num_items}; set model.num_items = 0 (take it from the data) or >= "
                          f"{data.num_items}")
    if cfg.embedding.kind == "hash" and cfg.embedding.capacity == 0:
        cfg = replace(cfg, embedding={"capacity": cfg.model.num_items})  # one row per item: recorded
    return cfg


_INT32_MAX = int(np.iinfo(np.int32).max)
_LATEST_SECONDS = 10**11


def check_data(data, splits) -> None:
    """Reject data the training loop would only trip over later (after OUT was written to), with a
    ``DataError`` naming the dataset and the fix. The loaders already reject malformed lines,
    negative timestamps, ids < 1, ids beyond int32 and sparse raw ids (unless ``data.remap_items``)
    and count exact duplicate rows (kept; ``data.describe()`` reports them); per-user time order is
    restored by a stable sort. ``memory.check_fits`` (called next) checks the config against the
    data: ``loss.num_negatives`` against the items, the memory estimate against what is free."""
    from .errors import DataError

    name = data.source or data.name or "dataset"
    if data.num_events and int(data.times.max()) - int(data.times.min()) > _INT32_MAX:
        raise DataError(f"{name}: timestamps span {int(data.times.max()) - int(data.times.min())} units, more than "
                        f"int32 seconds hold (68 years); they look like milliseconds. Convert them to seconds")
    if data.num_events and int(data.times.max()) > _LATEST_SECONDS:
        # unix seconds reach 1e11 in the year 5138; milliseconds of any date since 1973 exceed it
        raise DataError(f"{name}: the largest timestamp, {int(data.times.max()):,}, is after the year 5000 in unix "
                        f"seconds; the timestamps look like milliseconds (or microseconds). Convert them to "
                        f"seconds (the time bias buckets log-seconds)")
    for split in ("valid", "test"):
        if len(getattr(splits, split)) == 0:
            need = 3 if split == "valid" else 2
            raise DataError(f"{name}: the {split} split is empty: no user has >= {need} events (leave-one-out "
                            f"holds out each user's {'second-to-last' if split == 'valid' else 'last'} event)")


def data_fingerprint(data) -> str:
    """sha256 of the packed sequences (items, times, offsets): resuming on changed data is refused."""
    import hashlib

    h = hashlib.sha256()
    for arr in (data.items, data.times, data.offsets):
        h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def validate(cfg: Config, source: str = "<config>") -> None:
    """Every value was checked when the config was built (``config.build_config``: types, choices,
    ranges, cross-key rules, registry names); this re-checks a Config made in code with
    ``dataclasses.replace``."""
    resolve_config({section.name: {f.name: getattr(getattr(cfg, section.name), f.name)
                                 for f in dataclasses.fields(getattr(cfg, section.name))}
                  for section in dataclasses.fields(cfg)}, source)


def make_backend(cfg: Config, device: str | None = None):
    """The backend of ``cfg.backend``; ``device`` overrides ``backend.device`` (a rank's device)."""
    options = {"device": device or cfg.backend.device or None, "dtype": cfg.backend.dtype}
    if cfg.backend.hstu_kernel != "default":
        options["hstu_kernel"] = cfg.backend.hstu_kernel
    if cfg.backend.row_kernel != "default":
        options["row_kernel"] = cfg.backend.row_kernel
    if cfg.backend.compile:
        options["compile"] = True
    if not cfg.backend.cpu_fused:
        options["cpu_fused"] = False
    backend_class(cfg.backend.name).prepare_process(attention_recompute=cfg.backend.attention_recompute)
    B = get_backend(cfg.backend.name, **options)
    if cfg.backend.attention_recompute:
        B = B.with_attention_recompute(True)
    B.set_deterministic(cfg.backend.deterministic)
    return B


# ----------------------------------------------------------------------------- evaluation
def evaluate(B, params, cfg: Config, examples, candidates=None, scorer=None, max_users: int = 0,
             on_batch=None, host=None) -> dict:
    """HR@K / NDCG@K / MRR on leave-one-out ``examples`` (split.test or split.valid): full-catalogue
    ranking of the held-out item among ``candidates`` (all ids when None) minus the user's history.
    ``on_batch()``, if given, is called before each batch (the distributed watchdog's progress).
    ``host``: a hash table's ``EmbeddingHost``: items are scored through their rows (ids without
    a row read the zero row in histories and rank last as targets)."""
    from .data import batching, metrics

    scorer = scorer or make_scorer(B, cfg)
    absent = None
    if host is not None and host.table is not None:
        rows = host.eval_rows(np.arange(cfg.model.num_items + 1))
        params = {**params, "item_emb": B.gather_rows(params["item_emb"], B.asarray(rows))}  # indexed by id
        absent = np.flatnonzero(rows[1:] == 0) + 1
    ranks = []
    for batch, targets, exclude in batching.iter_eval(examples, cfg.model, cfg.eval.batch_size,
                                                    max_users=max_users or cfg.eval.max_users):
        if on_batch is not None:
            on_batch()
        scores = B.to_numpy(scorer(params, B.asarray_tree(batch)))[: len(targets)]
        if not np.isfinite(scores).all():
            bad = int((~np.isfinite(scores)).any(axis=1).sum())
            raise Diverged(f"evaluation produced non-finite scores for {bad} of {len(targets)} users in a batch "
                           f"(NaN/Inf in the model's output: the parameters diverged or overflowed in "
                           f"backend.precision={cfg.backend.precision})")
        if absent is not None and absent.size:
            scores = np.array(scores)  # a JAX array's numpy view is read-only
            scores[:, absent] = -np.inf
        ranks.append(metrics.ranks_from_scores(scores, targets, exclude, candidates=candidates))
    return metrics.metrics_from_ranks(np.concatenate(ranks), cfg.eval.ks)


# ----------------------------------------------------------------------------- resume
# Keys that must equal the checkpoint's to resume: they decide which batches are drawn and what
# the parameters mean. Any other key may change on resume (backend.name: resume on another
# backend; train.epochs / max_steps: extend a run; eval, logging, checkpoint cadence); optim.*
# and backend precision/dtype changes are allowed with a warning.
_MATCH_SECTIONS = ("data", "model", "loss", "embedding", "ranking")
_MATCH_TRAIN = ("seed", "batch_size", "max_tokens", "accumulate")
_MATCH_OPTIM = ("name",)  # the optimizer state's layout is the optimizer's
# model.attention_tile only lays out the attention's work (same results up to float rounding)
_NOTE_KEYS = [("optim", f.name) for f in dataclasses.fields(Config().optim) if f.name not in _MATCH_OPTIM] + [("backend", "precision"),
                                                                                ("backend", "dtype"),
                                                                                ("model", "attention_tile"),
                                                                                ("embedding", "lr")]


def resume_differences(saved: Config, now: Config) -> tuple[list[str], list[str]]:
    """``(errors, notes)``: keys that forbid resuming ``saved`` under ``now``, and allowed changes."""
    errors, notes = [], []
    keys = [(s, f.name) for s in _MATCH_SECTIONS for f in dataclasses.fields(getattr(now, s))
            if (s, f.name) not in _NOTE_KEYS]
    keys += [("train", k) for k in _MATCH_TRAIN] + [("optim", k) for k in _MATCH_OPTIM]
    if saved.data.ties == now.data.ties == "file":
        keys.remove(("data", "ties_seed"))  # the seed of a rule not in use orders nothing
    for section, key in keys:
        a, b = getattr(getattr(saved, section), key), getattr(getattr(now, section), key)
        if a != b:
            errors.append(f"{section}.{key}: checkpoint {a!r}, now {b!r}")
    for section, key in _NOTE_KEYS:
        a, b = getattr(getattr(saved, section), key), getattr(getattr(now, section), key)
        if a != b:
            notes.append(f"{section}.{key} changed on resume: {a!r} -> {b!r}")
    return errors, notes


@dataclasses.dataclass
class RunState:
    """What the training loop carries besides params and optimizer state (saved in each checkpoint).

      step            optimizer steps taken, skipped (non-finite) ones included
      epoch_losses    losses of the current epoch's applied steps (its mean is the epoch's loss)
      history         one record per finished epoch: {epoch, step, loss[, valid, test]}
      bad_in_a_row    consecutive skipped steps that count towards train.max_bad_steps
      skipped_total   all skipped steps of the run
      metrics_lines   lines of metrics.jsonl written up to this state (resume truncates to it)
      epoch_end_pending  an epoch whose batches all ran but whose end (evaluation, history, its
                      checkpoint) did not: a run aborted on the epoch's last batch; a resume
                      finishes that epoch first (-1: none)
    """

    step: int = 0
    epoch_losses: list = dataclasses.field(default_factory=list)
    history: list = dataclasses.field(default_factory=list)
    bad_in_a_row: int = 0
    skipped_total: int = 0
    metrics_lines: int = 0
    epoch_end_pending: int = -1

    def to_meta(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> "RunState":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in known})


class JsonLog:
    """An append-only JSON-lines file that counts its lines; ``keep_lines`` resumes it: the file is
    cut (atomically) to its first ``keep_lines`` lines, the ones written before the checkpoint.
    ``append`` opens an existing file for appending without cutting it (timing.jsonl). Write
    failures raise ``checkpoint.WriteError`` naming the file; a partial last line is harmless
    (a resume cuts metrics.jsonl back to the checkpoint's line count)."""

    def __init__(self, path: Path, keep_lines: int | None = None, append: bool = False):
        from .checkpoint import atomic_write_bytes

        self.path = path
        self.lines = 0
        self.file = None
        try:
            if keep_lines is None:
                self.file = open(path, "a" if append else "w")
                return
            old = path.read_text().splitlines(keepends=True) if path.exists() else []
            if len(old) < keep_lines:
                warn(f"{path} has {len(old)} lines but the checkpoint was written after {keep_lines}; "
                     f"the missing lines are not recreated")
            kept = old[:keep_lines]
            atomic_write_bytes(path, "".join(kept).encode())
            self.lines = len(kept)
            self.file = open(path, "a")
        except OSError as exc:
            raise write_error(path, exc) from None

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self.lines += 1

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def sync(self) -> None:
        """Flush and fsync, so the lines a checkpoint counts are on disk before it is."""
        self.flush()
        try:
            os.fsync(self.file.fileno())
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def close(self) -> None:
        if self.file is None:
            return
        try:
            self.file.close()
        except OSError:  # a write error already raised (or will be): closing must not mask it
            pass


class _NullLog:
    """JsonLog's interface writing nothing: ranks other than 0 count lines (the run state they
    carry matches rank 0's) but own no files."""

    def __init__(self):
        self.lines = 0

    def write(self, record: dict) -> None:
        self.lines += 1

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fault_point(name: str, step: int) -> None:
    """``checkpoint.fault_point``, limited to rank ``GRF_FAULT_RANK`` when that is set (tests of a
    data-parallel run pause or kill one rank)."""
    only = os.environ.get("GRF_FAULT_RANK")
    if only is not None and only != os.environ.get("RANK", "0"):
        return
    fault_point(name, step)


def _say(message: str) -> None:
    print(f"grf: {message}", file=sys.stderr, flush=True)


def _missing_host(ck: Checkpoint):
    raise CheckpointError(f"checkpoint {ck.path} has no embedding table state (host.embedding.*) although its config "
                          f"uses embedding.optimizer={ck.config.embedding.optimizer!r}; the file is incomplete")


def _restore_opt_state(B, opt_np: dict, cfg: Config) -> dict:
    """The checkpoint's optimizer state on ``B``, with the fp16 loss scaler added or dropped to
    match ``backend.precision`` (a precision change on resume)."""
    opt_state = B.asarray_tree(opt_np)
    if cfg.backend.precision == "fp16" and "loss_scale" not in opt_state:
        opt_state["loss_scale"] = init_loss_scale(B, cfg)   # resumed from fp32/bf16: a fresh scaler
    elif cfg.backend.precision != "fp16":
        opt_state.pop("loss_scale", None)
    return opt_state


def write_curves(path: Path, epochs: list[dict], metric: str = "hr@10", label: str = "HR@10") -> None:
    """OUT/curves.png: the train loss and the valid / test ``metric`` per epoch (atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot([e["epoch"] for e in epochs], [np.nan if e["loss"] is None else e["loss"] for e in epochs], marker="o")
    ax1.set_xlabel("epoch"), ax1.set_ylabel("train loss")
    for split in ("valid", "test"):
        pts = [(e["epoch"], e[split][metric]) for e in epochs if split in e and e[split].get(metric) is not None]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=split)
    ax2.set_xlabel("epoch"), ax2.set_ylabel(label), ax2.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    try:  # atomic, like every other output: a failed rewrite leaves the previous plot
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _world_size() -> int:
    """``WORLD_SIZE`` from torchrun's environment (1 when not launched by it)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not an integer") from None


def check_param_shapes(ck: Checkpoint) -> None:
    """``CheckpointError`` when the checkpoint's params (and optimizer moments) do not have the shapes
    its own embedded config gives (``model.param_shapes``): an edited or mis-assembled file."""
    cfg = ck.config
    if cfg.model.task == "ranking":
        from .ranking.runner import param_shapes

        expected = param_shapes(cfg)
    else:
        expected = model.param_shapes(cfg.model, table_items(cfg))
    if "shards" in ((ck.host or {}).get("embedding") or {}):
        expected.pop("item_emb")  # a row-sharded table: its rows are in host.embedding.shards
    trees = [("params", ck.params, expected)]
    moments = {k: v for k, v in expected.items() if not (k == "item_emb" and cfg.embedding.optimizer != "adamw")}
    if ck.opt_state is not None:
        # every moment tree of the dense optimizer (AdamW's mu and nu, Adagrad's sum_of_squares, ...)
        trees += [(f"opt.{m}", tree, moments) for m, tree in dense_state(ck.opt_state).items()
                  if isinstance(tree, dict)]
    for name, tree, expected in trees:
        got = {k: tuple(np.shape(v)) for k, v in tree_items(tree)}
        if got != expected:
            diff = sorted(set(got) ^ set(expected))[:3] or [
                f"{k}: {got[k]} vs {expected[k]}" for k in sorted(expected) if got[k] != expected[k]][:3]
            raise CheckpointError(f"checkpoint {ck.path}: its {name} tensors do not match its own config "
                                  f"(model.* gives other shapes; first differences: {', '.join(map(str, diff))}); "
                                  f"the file was edited or assembled from another run")


def _find_resume(cfg: Config, ckdir: CheckpointDir, resume: str, train_loader, fingerprint: str):
    """``(restored checkpoint or None, events)``: the checkpoint to resume from, after every check
    (raises ConfigError / CheckpointError / DataError naming the file and the fix).

    The newest checkpoint that verifies, holds only finite numbers, matches its own config and
    was trained with a config this run may resume is taken; newer ones that fail are skipped with
    a warning naming each and why (a different-config checkpoint newer than valid ones is never a
    reason to refuse: the valid ones are this run's work)."""
    events: list[dict] = []
    restored: Checkpoint | None = None
    if resume == "never":
        return None, events
    other_config: list[tuple[Path, list[str]]] = []

    def accept(ck: Checkpoint) -> str | None:
        try:
            check_param_shapes(ck)
        except CheckpointError as exc:
            return str(exc)
        errors, _ = resume_differences(ck.config, cfg)
        if errors:
            other_config.append((ck.path, errors))
            return f"it was trained with a different config ({'; '.join(errors)})"
        return None

    restored, skipped = ckdir.latest_valid(accept=accept)
    out = ckdir.folder.parent
    if restored is None and other_config:
        path, errors = other_config[0]
        raise ConfigError(f"cannot resume from {path}: it was trained with a different config "
                          f"({'; '.join(errors)}) and no checkpoint in {ckdir.folder} has this run's config. "
                          f"Resume with the run's own config ({out / 'config.toml'}), use another --out, or "
                          f"pass --fresh to delete its checkpoints and start over")
    for path, reason in skipped:
        kind = "checkpoint" if any(p == path for p, _ in other_config) else "damaged checkpoint"
        warn(f"skipping {kind} {path}: {reason}")
        events.append({"kind": "skipped_checkpoint", "file": str(path), "reason": reason,
                       "other_config": any(p == path for p, _ in other_config)})
    if restored is None:
        if resume == "must":
            raise CheckpointError(f"--resume: no valid checkpoint in {ckdir.folder}"
                                  + (f" ({len(skipped)} damaged, see the warnings above)" if skipped else "")
                                  + "; run without --resume to start from step 0")
        if skipped:
            warn(f"no valid checkpoint left in {ckdir.folder}; starting from step 0")
        elif ckdir.last_path.exists():
            # written by a version without numbered checkpoints: not resumable, but a result
            raise CheckpointError(f"{ckdir.last_path} is from an earlier gr-functional version and cannot be "
                                  f"resumed; starting over would replace it. Pass --fresh to do that, or "
                                  f"use another --out")
        return None, events
    _, notes = resume_differences(restored.config, cfg)
    if restored.opt_state is None or "step" not in restored.opt_state:
        raise CheckpointError(f"checkpoint {restored.path} has no optimizer state; it can be evaluated "
                              f"but not resumed")
    if "loader" not in restored.meta or "run" not in restored.meta:
        raise CheckpointError(f"checkpoint {restored.path} holds no loader position (an older format); "
                              f"it can be evaluated but not resumed")
    saved = (restored.host or {}).get("embedding") or {}
    sharded, world = cfg.embedding.sharding == "row" and _world_size() > 1, _world_size()
    if ("shards" in saved) != sharded:  # checked before the run touches OUT
        raise CheckpointError(f"checkpoint {restored.path} holds a {'row-sharded' if 'shards' in saved else 'whole'} "
                              f"item table but this run {'shards' if sharded else 'does not shard'} it "
                              f"(embedding.sharding={cfg.embedding.sharding!r} with {world} process(es)); resume "
                              f"with more than one process (a row-sharded checkpoint) or one (a whole table), or "
                              f"start over with --fresh")
    saved_data = restored.meta.get("data", {}).get("sha256")
    if saved_data not in (None, fingerprint):
        raise ConfigError(f"cannot resume from {restored.path}: the training data changed since it was "
                          f"written (data fingerprint {saved_data[:12]}... now {fingerprint[:12]}...). "
                          f"Restore the data, pass --fresh to start over, or use another --out")
    for note in notes:
        warn(note)
    train_loader.load_state_dict(restored.meta["loader"])  # DataError if the data changed
    return restored, events


def _resume_on_all_ranks(comm, find):
    """Rank 0 runs ``find()`` (it alone reads OUT) and broadcasts the result, or its error, to
    every rank; a user error is raised on every rank with the same class and message."""
    from .errors import DataError

    user_errors = {cls.__name__: cls for cls in (ConfigError, CheckpointError, DataError, RunLocked)}
    decision = None
    if comm.is_main:
        try:
            decision = {"result": find()}
        except tuple(user_errors.values()) as exc:
            comm.broadcast({"error": (type(exc).__name__, str(exc))})
            raise
    decision = comm.broadcast(decision)
    if "error" in decision:
        name, message = decision["error"]
        raise user_errors[name](f"(reported by rank 0) {message}")
    return decision["result"]


# ----------------------------------------------------------------------------- training
def train(cfg: Config, out_dir: str | Path, progress: bool = True, resume: str = "auto", hooks=()) -> dict:
    """Train per ``cfg``, evaluate, write the output files; returns the eval.json dict.

    resume: "auto" continues from the newest valid checkpoint in OUT/checkpoints when there is one
    (damaged ones are skipped with a warning naming them), else starts fresh; "must" is the same
    but fails when there is none (``grf train --resume``); "never" deletes OUT/checkpoints and
    starts over (``grf train --fresh``). Nothing under OUT is written or deleted until the data,
    the config and the checkpoint have been checked, so a rejected run loses nothing.
    Raises ``TrainingAborted`` after ``train.max_bad_steps`` non-finite steps in a row.

    Under torchrun (``WORLD_SIZE > 1``) this is one rank of a data-parallel run (module
    docstring): ranks other than 0 return ``{"rank": r, "steps": ...}`` and write nothing.
    Raises ``DistributedError`` (naming the rank) when a rank dies or hangs.

    ``hooks``: extra ``hooks.Hook`` objects called after the built-in ones and those named by
    ``train.hooks``, at every step and epoch end (gr_functional/hooks.py).
    """
    from .data import batching, split as split_mod
    from .plugins import import_plugins, normalise

    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    # a Config built in code: its losses / datasets / kernels, recorded as absolute paths
    cfg = replace(cfg, train={"plugins": tuple(normalise(e) for e in cfg.train.plugins)})
    import_plugins(cfg.train.plugins)
    validate(cfg)
    world = _world_size()
    if cfg.model.task == "ranking":
        if world > 1:
            raise ConfigError("model.task='ranking' trains in one process so far (README \"Ranking\"); "
                              "run it without torchrun")
        from .ranking.runner import train_ranking

        return train_ranking(cfg, out_dir, progress=progress, resume=resume, hooks=hooks)
    if world > 1:
        if cfg.backend.name not in DIST_TORCH_BACKENDS:
            raise ConfigError(f"backend.name={cfg.backend.name!r}: multi-process training runs the torch backends "
                              f"({', '.join(DIST_TORCH_BACKENDS)}); the JAX reference of the data-parallel step is "
                              f"backends.jax.make_sharded_train_step (one process, several jax devices)")
        cfg = replace(cfg, dist={"nproc": world})  # the resolved config records the real world size
    out = Path(out_dir)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
    check_data(data, splits)
    check_fits(cfg, data)  # negatives vs items, estimated memory vs available: before any allocation
    fingerprint = data_fingerprint(data)
    train_loader = batching.TrainLoader.from_config(splits.train, cfg, world_size=world)
    ckdir = CheckpointDir(out / "checkpoints", keep=cfg.train.keep_checkpoints)

    comm, device = LocalComm(), None
    if world > 1:
        # joined after each rank loaded its data (a slow loader never trips a collective timeout)
        from backends import dist_torch

        device = dist_torch.device_for(cfg.dist.backend, cfg.backend.device)
        comm = dist_torch.init(cfg.dist, device)
    lock = RunLock(out)

    def find():
        # one writer per folder: the lock is taken before the resume decision, so no other run
        # can move the checkpoints between that decision and this run's first write
        stale = lock.acquire()
        if stale:
            warn(f"{lock.path}: taking over the lock of a run that is gone ({stale})")
        return _find_resume(cfg, ckdir, resume, train_loader, fingerprint)

    try:
        restored, events = _resume_on_all_ranks(comm, find)
        if restored is not None and not comm.is_main:
            train_loader.load_state_dict(restored.meta["loader"])
        B = make_backend(cfg, device)
        result = _train_loop(cfg, out, progress, resume, B, comm, data, splits, fingerprint, train_loader, ckdir,
                             restored, events, hooks)
    except TrainingAborted as exc:
        # every rank aborts at the same step (same gradients): leave together; rank 0 alone evaluates
        comm.fail(str(exc)) if isinstance(exc, Diverged) else comm.shutdown()
        raise
    except WriteError as exc:
        comm.fail(f"WriteError: {exc}")
        fix = ("raise the file-size limit (ulimit -f)" if exc.errno == errno.EFBIG
               else "free space or fix the folder's permissions")
        try:
            ck, _ = ckdir.latest_valid()
        except OSError:  # the folder itself may be what failed
            ck = None
        then = (f"The last intact checkpoint is {ck.describe()}; {fix}, then rerun the same command "
                f"to resume from it" if ck is not None else
                f"No checkpoint was written yet; {fix}, then rerun the same command")
        raise WriteError(exc.errno, f"{exc}. {then}") from None
    except BaseException as exc:
        if not isinstance(exc, DistributedError):
            comm.fail(f"{type(exc).__name__}: {exc}")  # peers stop now instead of at a timeout
        raise
    finally:
        lock.release()
    comm.shutdown()
    return result


def _train_loop(cfg: Config, out: Path, progress: bool, resume: str, B, comm, data, splits, fingerprint: str,
                train_loader, ckdir: CheckpointDir, restored: Checkpoint | None, events: list[dict],
                extra_hooks=()) -> dict:
    """The body of ``train`` once the data, config and checkpoint are checked: a loop over steps
    calling the hooks (gr_functional/hooks.py), the same for one process and for one rank."""
    from tqdm import tqdm

    from .checkpoint import atomic_write_bytes

    main = comm.is_main
    say = _say if main else (lambda message: None)
    # hooks that can fail to start (a named hook's factory, TensorBoard without its package) are
    # made before the run touches OUT, so such an error leaves the folder as it was (even --fresh)
    user_hooks = [*named_hooks(cfg.train.hooks), *extra_hooks]
    if cfg.train.tensorboard and main:
        TensorBoard.check()
    # ---- checks passed: from here on the run owns OUT (rank 0 only in a data-parallel run)
    say(f"data {data.describe()}")
    if main:
        if resume == "never":
            n = ckdir.clear()
            if n:
                say(f"--fresh: deleted {n} checkpoint(s) in {ckdir.folder}")
        for tmp in ckdir.stale_temp_files():
            tmp.unlink(missing_ok=True)  # a write a killed run never finished (never renamed: not a checkpoint)
        for ev in events:
            if ev.get("other_config") and Path(ev["file"]).exists():
                moved = ckdir.set_aside(Path(ev["file"]))
                say(f"moved {Path(ev['file']).name} (another config's checkpoint) to {moved}: this run's saves "
                    f"and retention would overwrite or delete it there")
                ev["moved_to"] = str(moved)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / "config.toml", config_to_toml(cfg).encode())
    sharded = cfg.embedding.sharding == "row" and comm.world_size > 1
    shard = None
    if restored is not None:
        params = B.asarray_tree(restored.params)
        opt_state = _restore_opt_state(B, restored.opt_state, cfg)
        host = make_host(cfg)
        saved = (restored.host or {}).get("embedding") or {}
        if sharded:
            shard = make_sharded(B, cfg, comm)
            shard.load(saved["shards"])
        elif host.sparse:
            host.load_state_dict(saved or _missing_host(restored))
        state = RunState.from_meta(restored.meta["run"])
        log = JsonLog(out / "metrics.jsonl", keep_lines=state.metrics_lines) if main else _NullLog()
        if not main:
            log.lines = state.metrics_lines
        timing = JsonLog(out / "timing.jsonl", append=True) if main else _NullLog()
        e, s = train_loader.position
        say(f"resuming {out} from {restored.path.name}: step {state.step}, epoch {e} batch {s} "
            f"(written by {restored.meta.get('backend')}/{restored.config.backend.precision}, now "
            f"{B.name}/{cfg.backend.precision}); pass --fresh to start over")
        events.append({"kind": "resume", "file": str(restored.path), "step": state.step, "backend": B.name})
    else:
        dense = model.init_params(cfg.model, seed=cfg.train.seed)
        host = make_host(cfg, dense["item_emb"])
        if sharded:  # the rows live in the shards; the params are the dense ones
            shard = make_sharded(B, cfg, comm, dense["item_emb"])
            dense = {k: v for k, v in dense.items() if k != "item_emb"}
        params = B.asarray_tree(table_params(dense, host) if not sharded else dense)
        opt_state = init_opt_state(B, params, cfg)
        state = RunState()
        log = JsonLog(out / "metrics.jsonl") if main else _NullLog()
        timing = JsonLog(out / "timing.jsonl") if main else _NullLog()
        events.append({"kind": "start", "backend": B.name, "precision": cfg.backend.precision})
    if comm.world_size > 1:
        events.append({"kind": "distributed", "world_size": comm.world_size, "backend": comm.backend,
                       "balance": cfg.dist.balance, "cost_a": train_loader.split.cost_a,
                       "cost_b": train_loader.split.cost_b, "rank_token_cap": cfg.dist.rank_token_cap})
    for ev in events:
        timing.write({**ev, "time": time.time()})

    tc = cfg.train
    steps = make_steps(B, cfg, train_loader, comm, host, shard)
    epoch, start = train_loader.position
    if state.epoch_end_pending >= 0:
        epoch, start = state.epoch_end_pending, None  # no batches left: only the epoch's end
    total = -(-train_loader.steps_per_epoch // tc.accumulate) * tc.epochs
    total = min(total, tc.max_steps) if tc.max_steps else total

    def save(reason: str, epoch_of: int) -> Path | None:
        log.sync()
        state.metrics_lines = log.lines
        shards = comm.gather(shard.export()) if shard is not None else None  # every rank takes part
        ended = bool(state.history) and state.history[-1]["epoch"] == epoch_of
        if (reason not in ("epoch", "final") and train_loader.position[0] > epoch_of and state.epoch_end_pending < 0
                and not ended):
            # written after the epoch's last batch but before its end ran (a hook's save): a resume
            # from it must still run that epoch's end (evaluation, history)
            state.epoch_end_pending = epoch_of
        if not main:
            return None  # rank 0 writes the (identical) state
        comm.progress("checkpoint")
        t0 = time.perf_counter()
        meta = {"epoch": epoch_of, "step": state.step, "backend": B.name, "precision": cfg.backend.precision,
                "reason": reason, "loader": train_loader.state_dict(), "run": state.to_meta(),
                "data": {"sha256": fingerprint, "users": len(data), "events": int(data.num_events)},
                # the whole RNG state: every draw is numpy default_rng((seed, epoch[, batch]))
                "rng": {"generator": "numpy default_rng((train.seed, epoch, batch))", "seed": tc.seed,
                        "position": list(train_loader.position)},
                "world_size": comm.world_size}
        try:
            saved_host = ({"embedding": {"shards": shards}} if shard is not None else
                          {"embedding": host.state_dict()} if host.sparse else None)
            path = ckdir.save(B.to_numpy_tree(run.params), B.to_numpy_tree(run.opt_state), cfg, meta, host=saved_host)
        except NonFiniteState as exc:  # the step guard should make this unreachable: never write it
            raise TrainingAborted(f"training aborted at step {state.step}: {exc}. {last_healthy(ckdir)}") from None
        timing.write({"kind": "checkpoint", "step": state.step, "file": path.name, "reason": reason,
                      "seconds": time.perf_counter() - t0})
        timing.flush()
        return path

    # disable=None: no bar when stderr is not a terminal (CI logs); epoch lines still print
    bar = tqdm(total=total, initial=min(state.step, total), disable=None if (progress and main) else True,
               unit="step", dynamic_ncols=True)
    run = Run(cfg=cfg, out=out, B=B, comm=comm, state=state, log=log, timing=timing, loader=train_loader,
              save=save, echo=bar.write if main else (lambda text: None), bar=bar, params=params,
              opt_state=opt_state, run_start=time.perf_counter(), batch_build=steps.prefetch_stats)
    if shard is not None:
        def view(run):  # the shards gathered to rank 0, as one table
            shards = comm.gather(shard.export())
            if not main:
                return None, None
            table, table_host = assemble_table(cfg, shards)
            return {**run.params, "item_emb": B.asarray(table)}, table_host

        evaluation = Evaluation(evaluate, splits, data.candidates, make_scorer(B, cfg), ckdir, view=view)
    else:
        evaluation = Evaluation(partial(evaluate, host=host), splits, data.candidates, make_scorer(B, cfg), ckdir)
    hooks = [*builtin_hooks(cfg, out, main, evaluation), *user_hooks]

    run_epochs(run, hooks, steps, epoch, start, resumed=restored is not None)

    if not main:
        comm.wait_for("files")
        return {"rank": comm.rank, "steps": state.step, "skipped_steps": state.skipped_total}
    comm.progress("files")
    history = state.history
    if not history:
        raise CheckpointError(f"{out}: no epoch has run, nothing to report (train.epochs={tc.epochs})")
    best = select_epoch(history)
    last = history[-1]
    result = {**best["test"], "epoch": best["epoch"], "selected_by": f"best valid {SELECT_METRIC}",
              "last_epoch": last["epoch"], "last_epoch_test": last.get("test"), "dataset": data.name,
              "backend": B.name, "precision": cfg.backend.precision, "steps": state.step,
              "skipped_steps": state.skipped_total, "wall_seconds": time.perf_counter() - run.run_start}
    if comm.world_size > 1:
        result["world_size"] = comm.world_size
    atomic_write_bytes(out / "eval.json", json.dumps(result, indent=1).encode())
    try:
        write_curves(out / "curves.png", history)
    except OSError as exc:
        raise write_error(out / "curves.png", exc) from None
    comm.post("files")
    return result


def run_epochs(run: Run, hooks: list, steps, epoch: int, start: int | None, resumed: bool) -> None:
    """The training loop proper, shared by every task: epochs from ``epoch`` (its batches from
    ``start``; None: only its end is left) calling the hooks at every step and epoch end, until
    ``train.epochs`` or ``train.max_steps``; closes the hooks, the bar and the logs however it ends."""
    cfg, state, tc = run.cfg, run.state, run.cfg.train

    def finished() -> bool:
        return epoch >= tc.epochs or run.stopping()

    if finished() and resumed and run.is_main:
        _say(f"{run.out} is already complete (step {state.step}, epoch {epoch} of {tc.epochs}"
             f"{f', max_steps {tc.max_steps}' if tc.max_steps else ''}): rewriting eval.json and curves.png from its "
             f"history. Raise train.epochs or train.max_steps to continue, or pass --fresh to retrain")
    try:
        while not finished():
            run.epoch = epoch
            for hook in hooks:
                hook.on_epoch_start(run)
            # at most the steps max_steps leaves (a prefetch worker exchanging ids stops where every rank does)
            limit = tc.max_steps - state.step if tc.max_steps else None
            for micro in (steps.batches(epoch, start, limit) if start is not None else ()):
                run.params, run.opt_state, step = steps.run(run.params, run.opt_state, micro, state.step + 1, epoch)
                state.step += 1
                _count_step(state, step, cfg)
                for hook in hooks:
                    hook.on_step(run, step)
                _fault_point("after-step", state.step)
                if run.stopping():
                    break
            # ---- end of the epoch (or of the run, when max_steps stopped it early)
            run.last_epoch = epoch == tc.epochs - 1 or run.stopping()
            losses = state.epoch_losses
            record = {"epoch": epoch, "step": state.step, "loss": float(np.mean(losses)) if losses else None}
            for hook in hooks:
                hook.on_epoch_end(run, record)
            epoch, start = epoch + 1, 0
    finally:
        for hook in hooks:
            try:
                hook.on_close(run)
            except Exception as exc:  # noqa: BLE001 - never mask the run's own error or skip the closes below
                warn(f"hook {type(hook).__name__}.on_close failed: {type(exc).__name__}: {exc}")
        run.bar.close()
        run.log.close()
        run.timing.close()


def _count_step(state: RunState, step: StepResult, cfg: Config) -> None:
    """The run state's step bookkeeping: an applied step's loss joins the epoch's, a skipped one
    counts towards ``train.max_bad_steps`` (fp16 overflows above loss scale 1 do not)."""
    if step.finite:
        state.epoch_losses.append(float(step.metrics["loss"]))
        state.bad_in_a_row = 0
    else:
        _, counts = bad_step(step.metrics, cfg)
        state.skipped_total += 1
        state.bad_in_a_row += int(counts)


def evaluate_checkpoint(path: str | Path, backend: str | None = None, split: str = "test") -> dict:
    """Evaluate a checkpoint (trained on any backend) on ``backend`` with the run's own config."""
    from .data import split as split_mod

    from .plugins import import_plugins

    ck = read_checkpoint(path)
    import_plugins(ck.config.train.plugins, where=f"{path} (embedded config) train.plugins")
    check_param_shapes(ck)
    try:
        check_finite(ck)
    except NonFiniteState as exc:  # a diverged run's state: evaluating it would only rank NaNs
        raise Diverged(f"{exc}; evaluate an earlier checkpoint of the run (OUT/checkpoints/step-*.safetensors)") from None
    params_np, cfg, meta = ck.params, ck.config, ck.meta
    if backend:
        from backends.kernels import valid_names

        kernel = cfg.backend.hstu_kernel if cfg.backend.hstu_kernel in valid_names(backend) else "default"
        cfg = replace(cfg, backend={"name": backend, "hstu_kernel": kernel})  # the run's kernel may not exist there
        # only what evaluation uses is checked: a plugin's loss need not be registered to evaluate
        build_config({"backend": {f.name: getattr(cfg.backend, f.name) for f in dataclasses.fields(cfg.backend)}},
                     source=f"--backend {backend}")
        config_validate(cfg, source=f"--backend {backend}")
        from backends.kernels import check_config

        problem = check_config(cfg)
        if problem:
            raise ConfigError(f"--backend {backend}: backend.hstu_kernel={cfg.backend.hstu_kernel!r}: {problem}")
    if cfg.model.task == "ranking":
        from .ranking.runner import evaluate_ranking_checkpoint

        return evaluate_ranking_checkpoint(params_np, cfg, meta, split, ck.host)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    B = make_backend(cfg)
    splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
    host = make_host(cfg)
    saved = (ck.host or {}).get("embedding") or {}
    if "shards" in saved:
        table, host = assemble_table(cfg, saved["shards"])
        params_np = {**params_np, "item_emb": table}
    elif host.sparse:
        host.load_state_dict(saved or _missing_host(ck))
    result = evaluate(B, B.asarray_tree(params_np), cfg, getattr(splits, split), data.candidates, host=host)
    return {**result, "split": split, "backend": B.name, "trained_on": meta.get("backend"),
            "epoch": meta.get("epoch"), "dataset": data.name}
