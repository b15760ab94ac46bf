"""Resuming a run: which checkpoint to continue from (every check before the run writes),
the run state a checkpoint carries, and the optimizer state restored on the backend.

Keys that must equal the checkpoint's to resume decide which batches are drawn and what the
parameters mean (``resume_differences``); a run's checkpoints that were trained with another
config, are damaged or hold non-finite numbers are skipped with a warning naming each.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint, CheckpointDir, CheckpointError, check_finite, read_checkpoint
from .log import warn
from .config import Config, ConfigError
from .errors import DataError
from .runlock import RunLocked
from .step import dense_state, init_loss_scale
from .task import unread_sections
from .tree import tree_items
from .contracts import Backend, Comm

RESUME_MODES = ("auto", "must", "never")


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



def _unread(saved: Config, now: Config) -> set[str]:
    """Sections neither config's task reads (``Task.unread_sections``): not compared."""
    return set(unread_sections(saved.model.task)) & set(unread_sections(now.model.task))


def resume_differences(saved: Config, now: Config) -> tuple[list[str], list[str]]:
    """``(errors, notes)``: keys that forbid resuming ``saved`` under ``now``, and allowed changes."""
    errors, notes = [], []
    unread = _unread(saved, now)
    keys = [(s, f.name) for s in _MATCH_SECTIONS if s not in unread for f in dataclasses.fields(getattr(now, s))
            if (s, f.name) not in _NOTE_KEYS]
    keys += [("train", k) for k in _MATCH_TRAIN] + [("optim", k) for k in _MATCH_OPTIM]
    if saved.data.ties == now.data.ties == "file":
        keys.remove(("data", "ties_seed"))  # the seed of a rule not in use orders nothing
    for section, key in keys:
        # a key an extension declared after the checkpoint was written: not set then
        a, b = getattr(getattr(saved, section), key, "(not set)"), getattr(getattr(now, section), key)
        if a != b:
            errors.append(f"{section}.{key}: checkpoint {a!r}, now {b!r}")
    for section, key in _NOTE_KEYS:
        a, b = getattr(getattr(saved, section), key), getattr(getattr(now, section), key)
        if a != b:
            notes.append(f"{section}.{key} changed on resume: {a!r} -> {b!r}")
    return errors, notes


def config_changes(saved: Config, now: Config) -> dict:
    """``{"section.key": [saved value, now]}`` of every key that differs (a resume records them)."""
    out = {}
    unread = _unread(saved, now)
    for section in dataclasses.fields(now):
        if section.name in unread:
            continue
        a, b = getattr(saved, section.name), getattr(now, section.name)
        for f in dataclasses.fields(b):
            old, new = getattr(a, f.name, None), getattr(b, f.name)
            if old != new:
                out[f"{section.name}.{f.name}"] = [list(old) if isinstance(old, tuple) else old,
                                                    list(new) if isinstance(new, tuple) else new]
    return out


def refuse_changes_to_a_finished_run(cfg: Config, restored: Checkpoint, loader) -> None:
    """ConfigError when ``restored`` is a finished run (nothing left to train under ``cfg``'s
    ``train.epochs`` / ``max_steps``) and ``cfg`` changes any key: nothing would train, and the
    folder's config.toml must keep describing what did."""
    state = RunState.from_meta(restored.meta["run"])
    tc = cfg.train
    done = state.epoch_end_pending < 0 and (loader.position[0] >= tc.epochs or bool(tc.max_steps and
                                                                                    state.step >= tc.max_steps))
    changed = config_changes(restored.config, cfg)
    if not done or not changed:
        return
    keys = "; ".join(f"{k}: trained with {a!r}, now {b!r}" for k, (a, b) in changed.items())
    raise ConfigError(f"{restored.path.parent.parent} holds a finished run (step {state.step}) and this command "
                      f"changes {keys}. A finished run trains nothing more, and its config.toml must keep "
                      f"describing what trained: train the variant in another folder (--out DIR), retrain this "
                      f"one from scratch (--fresh), or raise train.epochs / train.max_steps to continue it")


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


def missing_host(ck: Checkpoint):
    raise CheckpointError(f"checkpoint {ck.path} has no embedding table state (host.embedding.*) although its config "
                          f"uses embedding.optimizer={ck.config.embedding.optimizer!r}; the file is incomplete")


def restore_opt_state(B: Backend, opt_np: dict, cfg: Config) -> dict:
    """The checkpoint's optimizer state on ``B``, with the fp16 loss scaler added or dropped to
    match ``backend.precision`` (a precision change on resume)."""
    opt_state = B.asarray_tree(opt_np)
    if cfg.backend.precision == "fp16" and "loss_scale" not in opt_state:
        opt_state["loss_scale"] = init_loss_scale(B, cfg)   # resumed from fp32/bf16: a fresh scaler
    elif cfg.backend.precision != "fp16":
        opt_state.pop("loss_scale", None)
    return opt_state


def world_size() -> int:
    """``WORLD_SIZE`` from torchrun's environment (1 when not launched by it)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not an integer") from None


def _param_like(node, top: set) -> bool:
    """A dict whose keys are all top-level parameter names: a moment tree (AdamW's ``mu``, a
    subtree of optax's state such as ``optax.t0.nu``)."""
    return isinstance(node, dict) and bool(node) and set(node) <= top


def _moment_trees(tree, prefix: str, top: set):
    """``(name, subtree)`` of every parameter-shaped subtree of an optimizer state. Other nodes
    (step counts, optax's ``count``, schedules' state) are descended into, never compared: their
    layout is the optimizer's own (an optax chain's ``t0.mu``, a user transform's fields)."""
    if _param_like(tree, top):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from _moment_trees(tree[k], f"{prefix}.{k}", top)
    elif isinstance(tree, (list, tuple)):
        for i, x in enumerate(tree):
            yield from _moment_trees(x, f"{prefix}.{i}", top)


def check_param_shapes(ck: Checkpoint, expected: dict) -> None:
    """``CheckpointError`` when the checkpoint's params (and optimizer moments) do not have the shapes
    its own embedded config gives (``expected``, the task's ``param_shapes``).

    The params must match ``expected`` exactly. In the optimizer state, every parameter-shaped
    subtree (``_moment_trees``: AdamW's ``mu`` and ``nu``, an optax state's ``t0.mu``) must hold
    the shapes of the parameters it names; a subtree naming only some parameters (optax's
    ``masked``) is compared on those. A file that fails was written with other shapes than its own
    config gives: edited, assembled from two runs, or written by a model whose ``param_shapes``
    disagree with its ``init_params`` (refused when such a run starts)."""
    cfg = ck.config
    moments = {k: v for k, v in expected.items() if not (k == "item_emb" and cfg.embedding.optimizer != "adamw")}
    top = {k.split(".", 1)[0] for k in expected}
    trees = [("params", ck.params, expected, True)]
    if ck.opt_state is not None:
        for m, tree in dense_state(ck.opt_state).items():
            # a moment tree of the state's top level is whole (AdamW's mu); deeper ones may be masked
            trees += [(f"opt{name}", sub, moments, name == f".{m}") for name, sub in _moment_trees(tree, f".{m}", top)]
    for name, tree, want, whole in trees:
        got = {k: tuple(np.shape(v)) for k, v in tree_items(tree)}
        if not whole:
            want = {k: v for k, v in want.items() if k.split(".", 1)[0] in tree}
        if got != want:
            diff = sorted(set(got) ^ set(want))[:3] or [
                f"{k}: {got[k]} vs {want[k]}" for k in sorted(want) if got[k] != want[k]][:3]
            raise CheckpointError(f"checkpoint {ck.path}: its {name} tensors do not have the shapes its own config "
                                  f"gives (first differences: {', '.join(map(str, diff))}); it was written with "
                                  f"other parameter shapes than its model.* keys give, so it cannot be read "
                                  f"as this config's state")


def _resumable_last(ckdir: CheckpointDir, accept):
    """``last.safetensors`` as the checkpoint to resume when the folder has no numbered ones
    (deleted by hand, or copied without them): ``(checkpoint, [])`` when it reads, verifies and
    carries a run's position, else ``(None, [])`` (a file of a version before resume, kept)."""
    try:
        ck = read_checkpoint(ckdir.last_path)
        check_finite(ck)
    except CheckpointError:
        return None, []
    if "loader" not in ck.meta or "run" not in ck.meta:
        return None, []
    reason = accept(ck)
    return (ck, []) if reason is None else (None, [(ckdir.last_path, reason)])


def find_resume(cfg: Config, ckdir: CheckpointDir, resume: str, train_loader, fingerprint: str, shapes_of):
    """``(restored checkpoint or None, events)``: the checkpoint to resume from, after every check
    (raises ConfigError / CheckpointError / DataError naming the file and the fix).

    The newest checkpoint that verifies, holds only finite numbers, matches its own config and
    was trained with a config this run may resume is taken; newer ones that fail are skipped with
    a warning naming each and why (a different-config checkpoint newer than valid ones is never a
    reason to refuse: the valid ones are this run's work). ``shapes_of(ck)``: the parameter shapes
    the checkpoint's own config gives (the task's ``param_shapes``)."""
    events: list[dict] = []
    restored: Checkpoint | None = None
    if resume == "never":
        return None, events
    other_config: list[tuple[Path, list[str]]] = []

    def accept(ck: Checkpoint) -> str | None:
        try:
            check_param_shapes(ck, shapes_of(ck))
        except CheckpointError as exc:
            return str(exc)
        errors, _ = resume_differences(ck.config, cfg)
        if errors:
            other_config.append((ck.path, errors))
            return f"it was trained with a different config ({'; '.join(errors)})"
        return None

    restored, skipped = ckdir.latest_valid(accept=accept)
    if restored is None and not skipped and not ckdir.steps() and ckdir.last_path.exists():
        restored, skipped = _resumable_last(ckdir, accept)
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
            for path, reason in skipped:
                events.append({"kind": "no_usable_checkpoint", "file": str(path), "reason": reason})
            # Training from step 0 would overwrite the folder's results with a new run: the user decides.
            raise CheckpointError(f"no usable checkpoint in {ckdir.folder}: {len(skipped)} checkpoint(s) could not be "
                                  f"resumed (see the warnings above); nothing was written. Keep them and train "
                                  f"elsewhere with another --out, evaluate one with grf eval --checkpoint FILE, "
                                  f"or pass --fresh to delete them and start over")
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
    world = world_size() * max(1, cfg.dist.devices)  # ranks: processes x JAX devices of each
    sharded = cfg.embedding.sharding == "row" and world > 1
    if ("shards" in saved) != sharded:  # checked before the run touches OUT
        raise CheckpointError(f"checkpoint {restored.path} holds a {'row-sharded' if 'shards' in saved else 'whole'} "
                              f"item table but this run {'shards' if sharded else 'does not shard'} it "
                              f"(embedding.sharding={cfg.embedding.sharding!r} with {world} rank(s)); resume "
                              f"with more than one rank (a row-sharded checkpoint) or one (a whole table), or "
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


def resume_on_all_ranks(comm: Comm, find):
    """Rank 0 runs ``find()`` (it alone reads OUT) and broadcasts the result, or its error, to
    every rank; a user error is raised on every rank with the same class and message."""
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

