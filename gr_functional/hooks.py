"""The training loop's seams: how a step runs (``LocalSteps`` / ``RankSteps``), the collective of a
one-process run (``LocalComm``), and the hooks called after every step and at every epoch end.

``runner.run_epochs`` is a short loop over steps; everything a step or an epoch end does beyond
the update itself (logging, timing, the bad-step policy, checkpoints, evaluation, distributed
sync, TensorBoard) is a ``Hook``. A hook of one's own subclasses ``Hook`` and is passed to
``runner.train(..., hooks=[...])``; it sees the ``Run`` (config, backend, state, logs) and each
``StepResult``. Hooks run in list order; the built-in ones come first, so the files they write
are the same with or without extra hooks.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import errors
from .config import Config
from .data.prefetch import PrefetchStats
from .registry import Registry
from .report import select_epoch


@dataclasses.dataclass
class StepResult:
    """One optimizer step as the hooks see it: ``metrics`` of ``step.train_step`` (loss, finite,
    ...), ``tokens`` (input tokens of the global step, as a one-process run counts them) and, in
    a data-parallel run, ``rank_tokens`` (per rank) and ``rank_compute_s`` (forward+backward
    seconds per rank) and, with row-sparse embeddings, ``embedding`` (this step's lookups before
    and after dedup and the table's cumulative counters, ``EmbeddingHost.counters``)."""

    step: int
    epoch: int
    metrics: dict
    tokens: int
    rank_tokens: list | None = None
    rank_compute_s: np.ndarray | None = None
    embedding: dict | None = None

    @property
    def finite(self) -> bool:
        return bool(self.metrics["finite"])


# ----------------------------------------------------------------------------- bad steps
RESTART = ("to restart from it, rerun the same grf train command (same --out) with the cause fixed (e.g. "
            "--set optim.lr=1e-4): it resumes from that checkpoint")


def lr_suspect(cfg: Config) -> str:
    """The learning-rate key to lower first: ``embedding.lr`` when a row-sparse table has its own,
    larger one, else ``optim.lr``."""
    e = cfg.embedding
    return "embedding.lr" if e.optimizer != "adamw" and e.lr > cfg.optim.lr else "optim.lr"


def lr_keys(cfg: Config) -> str:
    """``optim.lr=X`` (and ``embedding.lr=Y`` when set for a row-sparse table, the suspect first)."""
    keys = [f"optim.lr={cfg.optim.lr:g}"]
    if cfg.embedding.optimizer != "adamw" and cfg.embedding.lr > 0:
        keys.insert(0 if lr_suspect(cfg) == "embedding.lr" else 1, f"embedding.lr={cfg.embedding.lr:g}")
    return ", ".join(keys)


def restart(cfg: Config) -> str:
    """``RESTART`` with the suspect learning-rate key as its example."""
    return RESTART.replace("--set optim.lr=1e-4", f"--set {lr_suspect(cfg)}=1e-4")


def advice(reason: str, cfg: Config) -> str:
    """What to change after bad steps, by the last one's reason (``bad_step``) and the config."""
    ratio = cfg.train.max_update_ratio
    if reason.startswith("exploding update"):
        if ratio < 0.05:  # below what a healthy step moves (GR's ML-1M recipe: 0.006-0.03)
            return (f"train.max_update_ratio={ratio:g} is below the size of a normal step (about 0.01-0.03 of "
                    f"the parameters' norm): raise it (default 1.0; 0 = no limit)")
        return (f"Lower {lr_suspect(cfg)} (or raise train.max_update_ratio, 0 = no limit, if steps that large are "
                "intended)")
    suspects = [f"{lr_suspect(cfg)} (a smaller one)"]
    if cfg.loss.temperature < 1e-3:
        suspects.insert(0, f"loss.temperature={cfg.loss.temperature:g} (logits are cosine / temperature; "
                           f"GR uses 0.05)")
    return (f"Check {', '.join(suspects)}, the eps keys and the data, or try backend.precision=fp32")


def last_healthy(ckdir) -> str:
    """``"The last healthy checkpoint is X; to restart ..."``, or how to start over without one."""
    ck, _ = ckdir.latest_valid()
    if ck is None:
        return (f"No healthy checkpoint exists in {ckdir.folder}; fix the cause and rerun with --fresh to "
                f"start over")
    return f"The last healthy checkpoint is {ck.describe()}; {RESTART}"


def bad_step(m: dict, cfg: Config) -> tuple[str, bool]:
    """``(reason, counts towards max_bad_steps)`` of a skipped step.

    fp16 gradient overflows are the loss scaler's normal search for a scale (the step is skipped
    and the scale halved), so they count only once the scale is down to 1: then even unscaled
    gradients overflow and the model itself is blowing up."""
    if not bool(m["loss_finite"]):
        return "non-finite loss", True
    if not bool(m["grads_finite"]):
        if "loss_scale" in m:
            scale = float(m["loss_scale"])
            return f"fp16 gradient overflow at loss scale {scale:g}", scale <= 1.0
        return "non-finite gradient", True
    if not bool(m["update_finite"]):
        return f"non-finite update ({lr_keys(cfg)})", True
    return (f"exploding update: it would move the parameters by {float(m['update_ratio']):.3g} x their norm "
            f"(train.max_update_ratio={cfg.train.max_update_ratio:g}; {lr_keys(cfg)})"), True


# ----------------------------------------------------------------------------- step runners


@dataclasses.dataclass
class Run:
    """What hooks see of the running training: read it, do not replace its fields (the loop
    owns them). ``save(reason, epoch)`` writes a checkpoint of the current state (rank 0; None
    elsewhere); ``echo(text)`` prints beside the progress bar (rank 0)."""

    cfg: Config
    out: Path
    B: Any
    comm: Any
    state: Any               # resume.RunState
    log: Any                 # metrics.jsonl (outputs.JsonLog; counts lines on every rank)
    timing: Any              # timing.jsonl
    loader: Any              # data.batching.TrainLoader
    save: Callable
    echo: Callable
    bar: Any
    params: Any = None
    opt_state: Any = None
    epoch: int = 0
    # this epoch so far: input tokens, start time, per-rank compute sums (data-parallel)
    epoch_tokens: int = 0
    epoch_start: float = 0.0
    rank_sum: np.ndarray | None = None
    step_max: float = 0.0
    step_mean: float = 0.0
    run_start: float = 0.0
    last_epoch: bool = False  # the epoch ending is the run's last (train.epochs or max_steps)
    batch_build: PrefetchStats | None = None  # batch-building seconds of this epoch (train.prefetch)

    @property
    def is_main(self) -> bool:
        return self.comm.is_main

    @property
    def tokens_per_s(self) -> float:
        return self.epoch_tokens / max(time.perf_counter() - self.epoch_start, 1e-9)

    def stopping(self) -> bool:
        """The step limit (``train.max_steps``) is reached."""
        return bool(self.cfg.train.max_steps and self.state.step >= self.cfg.train.max_steps)


class Hook:
    """A training-loop extension; override what you need. ``on_epoch_start(run)`` before an
    epoch's first step, ``on_step(run, step)`` after each optimizer step, ``on_epoch_end(run,
    record)`` once per epoch (``record``: {"epoch", "step", "loss"[, "valid", "test"]}, filled
    by the hooks before), ``on_close(run)`` when the loop ends, normally or not (an error there
    is reported, never raised over the run's own). Hooks run on every rank: check
    ``run.is_main`` before writing files, and write your own files, not ``run.log`` (metrics.jsonl
    is the built-in hooks' record: a line added after an epoch's checkpoint is dropped on resume)."""

    def on_epoch_start(self, run: Run) -> None:
        pass

    def on_step(self, run: Run, step: StepResult) -> None:
        pass

    def on_epoch_end(self, run: Run, record: dict) -> None:
        pass

    def on_close(self, run: Run) -> None:
        pass


# ----------------------------------------------------------------------------- built-in hooks
class Throughput(Hook):
    """Counts the epoch's tokens and (data-parallel) per-rank compute: first, so the hooks after
    it read up-to-date ``run.tokens_per_s``."""

    def on_epoch_start(self, run: Run) -> None:
        run.epoch_tokens, run.epoch_start = 0, time.perf_counter()
        run.rank_sum, run.step_max, run.step_mean = None, 0.0, 0.0

    def on_step(self, run: Run, step: StepResult) -> None:
        run.epoch_tokens += step.tokens
        rc = step.rank_compute_s
        if rc is not None:
            run.rank_sum = rc if run.rank_sum is None else run.rank_sum + rc
            run.step_max, run.step_mean = run.step_max + float(rc.max()), run.step_mean + float(rc.mean())


class StepLog(Hook):
    """metrics.jsonl: a train line every ``train.log_every`` steps (its wall-clock side in
    timing.jsonl), a skip line for every skipped step."""

    def on_step(self, run: Run, step: StepResult) -> None:
        cfg, m, state = run.cfg, step.metrics, run.state
        fp16 = cfg.backend.precision == "fp16"
        if step.finite:
            if step.step % cfg.train.log_every:
                return
            record = {"kind": "train", "step": step.step, "epoch": step.epoch, "loss": float(m["loss"]),
                      "tokens": step.tokens}
            if fp16:
                record["loss_scale"] = float(m["loss_scale"])
            if step.embedding is not None:
                record["embedding"] = step.embedding
            run.log.write(record)
            run.log.flush()
            trec = {"kind": "train", "step": step.step, "tokens_per_s": run.tokens_per_s,
                    "elapsed_s": time.perf_counter() - run.run_start}
            if step.rank_tokens is not None:
                # per-rank times of processes (torch ranks); a JAX mesh's ranks share one program
                trec.update({k: m[k] for k in ("rank_compute_s", "rank_cpu_s", "wait_s", "rank_peak_rss_mb") if k in m},
                            rank_tokens=step.rank_tokens)
            run.timing.write(trec)
            return
        reason, _ = bad_step(m, cfg)
        record = {"kind": "skip", "step": step.step, "epoch": step.epoch, "reason": reason,
                  "bad_in_a_row": state.bad_in_a_row}
        if fp16:
            record["next_loss_scale"] = float(run.opt_state["loss_scale"]["scale"])
        run.log.write(record)
        run.log.flush()
        run.echo(f"step {step.step}: skipped ({reason}); {state.bad_in_a_row} bad in a row")


class BadStepPolicy(Hook):
    """``train.max_bad_steps`` skipped steps in a row abort the run: an abort line, a checkpoint
    of the last good state (the epoch's end left pending when it was its last batch), and
    ``TrainingAborted`` naming it and what to change."""

    def on_step(self, run: Run, step: StepResult) -> None:
        tc, state = run.cfg.train, run.state
        if step.finite or not tc.max_bad_steps or state.bad_in_a_row < tc.max_bad_steps:
            return
        reason, _ = bad_step(step.metrics, run.cfg)
        first = state.step - state.bad_in_a_row + 1
        run.log.write({"kind": "abort", "step": state.step, "epoch": step.epoch,
                       "reason": f"{state.bad_in_a_row} bad steps in a row", "last_good_step": first - 1})
        if run.loader.position[0] > step.epoch:
            state.epoch_end_pending = step.epoch  # its last batch: the resume ends the epoch
        path = run.save("abort", step.epoch)
        where = path if path is not None else f"{run.out / 'checkpoints'} (written by rank 0)"
        raise errors.TrainingAborted(
            f"training aborted at step {state.step}: {state.bad_in_a_row} steps in a row "
            f"(train.max_bad_steps={tc.max_bad_steps}) were skipped (last: {reason}); none was applied. The last "
            f"healthy checkpoint is {where}: params and optimizer state after step {first - 1}, data position "
            f"after the skipped batches. {advice(reason, run.cfg)}; {restart(run.cfg)}")


class ProgressBar(Hook):
    def on_step(self, run: Run, step: StepResult) -> None:
        if step.finite:
            run.bar.set_postfix(epoch=step.epoch, loss=f"{float(step.metrics['loss']):.4f}",
                                tok_s=f"{run.tokens_per_s:,.0f}")
        run.bar.update(1)


class ProgressLine(Hook):
    """Where no progress bar shows (stderr is not a terminal: a run logged to a file, CI), one plain
    line every ``every_s`` seconds: step of total, steps/s, tokens/s, the loss, the ETA."""

    def __init__(self, total: int, every_s: float = 60.0):
        self.total, self.every_s = total, every_s
        self.t0 = self.last = None
        self.first_step = 0

    def on_step(self, run: Run, step: StepResult) -> None:
        if not run.bar.disable or self.every_s <= 0:
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = self.last = now
            self.first_step = step.step - 1
            return
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = (step.step - self.first_step) / max(now - self.t0, 1e-9)
        left = max(self.total - step.step, 0) / max(rate, 1e-9)
        loss = f", loss {float(step.metrics['loss']):.4f}" if step.finite else ""
        share = f" ({100 * step.step / self.total:.1f} %)" if self.total else ""
        run.echo(f"step {step.step:,}/{self.total:,}{share}, epoch {step.epoch}: {rate:.2f} steps/s, "
                 f"{run.tokens_per_s:,.0f} tokens/s{loss}, ETA {_duration(left)}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class IntervalCheckpoint(Hook):
    """A checkpoint every ``train.checkpoint_every`` steps (not on an epoch's last step or the
    run's: the epoch-end / final checkpoint follows there)."""

    def on_step(self, run: Run, step: StepResult) -> None:
        every = run.cfg.train.checkpoint_every
        last_of_epoch = run.loader.position[0] > step.epoch
        if every and step.step % every == 0 and not last_of_epoch and not run.stopping():
            run.save("interval", step.epoch)


class Evaluation(Hook):
    """Valid and test metrics every ``train.eval_every`` epochs and after the last, on rank 0
    (the other ranks count its two metrics.jsonl lines); non-finite scores abort (``Diverged``)."""

    def __init__(self, evaluate: Callable, splits, candidates, scorer, ckdir, view: Callable | None = None):
        self.evaluate, self.splits, self.candidates, self.scorer, self.ckdir = (evaluate, splits, candidates,
                                                                                 scorer, ckdir)
        # view(run) -> (params, host) to evaluate, called on EVERY rank (a row-sharded table is
        # gathered to rank 0 there); default: the run's params and no host
        self.view = view

    def on_epoch_end(self, run: Run, record: dict) -> None:
        epoch, state = record["epoch"], run.state
        if not ((epoch + 1) % run.cfg.train.eval_every == 0 or run.last_epoch):
            return
        params, host = self.view(run) if self.view is not None else (run.params, None)
        if not run.is_main:
            run.log.lines += 2  # rank 0 writes the valid and test lines
            return
        for name in ("valid", "test"):
            try:
                record[name] = self.evaluate_split(run, params, host, name)
            except errors.Diverged as exc:
                run.log.write({"kind": "abort", "step": state.step, "epoch": epoch,
                               "reason": f"non-finite {name} scores"})
                run.log.sync()
                raise errors.Diverged(f"training aborted at the end of epoch {epoch} (step {state.step}): {exc}. "
                               f"{last_healthy(self.ckdir)}") from None
            run.log.write({"kind": "eval", "split": name, "epoch": epoch, "step": state.step, **record[name]})
        run.log.flush()
        loss_text = "n/a" if record["loss"] is None else f"{record['loss']:.4f}"
        run.echo(f"epoch {epoch}: loss {loss_text}  {self.summary(record)}")

    def evaluate_split(self, run: Run, params, host, name: str) -> dict:
        """The metrics of split ``name`` ("valid" | "test"); ``Diverged`` on non-finite scores."""
        extra = {"host": host} if host is not None else {}
        return self.evaluate(run.B, params, run.cfg, getattr(self.splits, name), self.candidates, self.scorer,
                             on_batch=lambda: run.comm.progress("eval"), **extra)

    def summary(self, record: dict) -> str:
        """The epoch line's metrics."""
        return (f"valid HR@10 {record['valid']['hr@10']:.4f}  test HR@10 {record['test']['hr@10']:.4f}  "
                f"NDCG@10 {record['test']['ndcg@10']:.4f}")


class EpochHistory(Hook):
    """The run state's epoch bookkeeping (saved in the checkpoint that follows)."""

    def on_epoch_end(self, run: Run, record: dict) -> None:
        run.state.history.append(record)
        run.state.epoch_losses = []
        run.state.epoch_end_pending = -1


class EpochTiming(Hook):
    """timing.jsonl: seconds and tokens/s of the epoch (evaluation included) and, data-parallel,
    each rank's compute and the imbalance ``sum_steps(max) / sum_steps(mean) - 1``."""

    def on_epoch_end(self, run: Run, record: dict) -> None:
        erec = {"kind": "epoch", "epoch": record["epoch"], "seconds": time.perf_counter() - run.epoch_start,
                "tokens_per_s": run.tokens_per_s}
        if run.rank_sum is not None:
            erec.update(rank_compute_s=[float(x) for x in run.rank_sum],
                        imbalance=run.step_max / max(run.step_mean, 1e-12) - 1.0)
        if run.batch_build is not None:
            # the worker's build seconds and the loop's wait for them: hidden = 1 - wait / build
            erec["batch_build"] = {**run.batch_build.as_dict(), "prefetch": run.cfg.train.prefetch}
            run.batch_build.reset()
        run.timing.write(erec)


class EpochCheckpoint(Hook):
    """The epoch's checkpoint; when the epoch is the best so far by validation ``select_metric``
    (the one eval.json will report), also ``checkpoints/best.safetensors``, which retention keeps."""

    def __init__(self, ckdir=None, select_metric: str | None = None):
        self.ckdir, self.select_metric = ckdir, select_metric

    def on_epoch_end(self, run: Run, record: dict) -> None:
        path = run.save("final" if run.last_epoch else "epoch", record["epoch"])
        if path is None or self.ckdir is None or self.select_metric is None or "valid" not in record:
            return
        if select_epoch(run.state.history, self.select_metric) is record:
            self.ckdir.mark_best(path)


class EpochSync(Hook):
    """Ranks leave an epoch together; they wait on the store, not in a collective, since rank 0's
    evaluation may take longer than ``dist.timeout_s`` (the watchdog still sees its progress)."""

    def on_epoch_end(self, run: Run, record: dict) -> None:
        tag = f"epoch-{record['epoch']}"
        run.comm.post(tag) if run.is_main else run.comm.wait_for(tag)


class TensorBoard(Hook):
    """``train.tensorboard = true``: the train loss, tokens/s and every evaluation metric as
    TensorBoard scalars in OUT/tensorboard (rank 0; needs the optional ``tensorboard`` package).
    metrics.jsonl stays the exact record; this is for watching a run live."""

    def __init__(self, out: Path):
        self.writer = self.check()(log_dir=str(out / "tensorboard"))

    @staticmethod
    def check():
        """torch's ``SummaryWriter``, or ConfigError naming the missing package (called before the
        run touches OUT)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise errors.ConfigError(f"train.tensorboard=true needs the tensorboard package ({exc}); pip install "
                              f"tensorboard, or set train.tensorboard=false (metrics.jsonl holds every value)") from None
        return SummaryWriter

    def on_step(self, run: Run, step: StepResult) -> None:
        if step.finite and step.step % run.cfg.train.log_every == 0:
            self.writer.add_scalar("train/loss", float(step.metrics["loss"]), step.step)
            self.writer.add_scalar("train/tokens_per_s", run.tokens_per_s, step.step)

    def on_epoch_end(self, run: Run, record: dict) -> None:
        for split in ("valid", "test"):
            for key, value in record.get(split, {}).items():
                self.writer.add_scalar(f"{split}/{key}", value, record["step"])
        self.writer.flush()

    def on_close(self, run: Run) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------- named hooks
# Hooks `grf train` can add by name (``train.hooks``), registered from a plugin module.
HOOKS: Registry[Callable[[], Hook]] = Registry(
    "hook", config_key="train.hooks",
    how="Register one with gr_functional.hooks.register_hook(NAME, cls) in a --plugin module")


def register_hook(name: str, factory: Callable[[], Hook] | None = None, *, replace: bool = False):
    """Make ``factory() -> Hook`` (a Hook subclass works) available as ``train.hooks = [name]``
    (``register_hook(name, cls)`` or ``@register_hook(name)`` on a class). A plugin module
    (``grf train --plugin FILE``) registers it; the name goes into config.toml. A taken name is
    refused unless ``replace=True`` (or it is the same definition imported again), as for losses."""
    def add(f):
        HOOKS.add(name, f, replace=replace)
        return f

    return add if factory is None else add(factory)


def hook_names() -> tuple[str, ...]:
    return HOOKS.names()


def named_hooks(names) -> list[Hook]:
    """One new hook per name of ``train.hooks`` (names were checked with the config)."""
    return [HOOKS.get(name)() for name in names]


# the project's own error classes: a hook raising one of them means it (TrainingAborted: stop here)
_PROJECT_ERRORS = tuple(v for v in vars(errors).values()
                        if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == errors.__name__)


class UserHook(Hook):
    """A hook of the user's (``train.hooks``, ``grf.fit(hooks=...)``) as the loop calls it: an
    exception or ``sys.exit`` inside it stops the run with ``PluginError`` naming the hook, the
    method and the step (``grf`` exits 6, not the code the plugin picked); the project's own
    errors (``TrainingAborted`` from a hook that stops a run on purpose, ...) pass as they are."""

    def __init__(self, hook: Hook, label: str, ckdir=None):
        self.hook, self.label, self.ckdir = hook, label, ckdir

    def _call(self, method: str, run: Run, *args) -> None:
        try:
            getattr(self.hook, method)(run, *args)
        except _PROJECT_ERRORS:
            raise
        except (Exception, SystemExit) as exc:
            what = f"sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
            where = f" (epoch {run.epoch})" if method != "on_close" else ""
            then = (f" {last_healthy(self.ckdir)}" if self.ckdir is not None and method != "on_close" else "")
            raise errors.PluginError(f"hook {self.label} failed in {method} at step {run.state.step}{where}: {what}."
                                     f"{then}") from exc

    def on_epoch_start(self, run: Run) -> None:
        self._call("on_epoch_start", run)

    def on_step(self, run: Run, step: StepResult) -> None:
        self._call("on_step", run, step)

    def on_epoch_end(self, run: Run, record: dict) -> None:
        self._call("on_epoch_end", run, record)

    def on_close(self, run: Run) -> None:
        self._call("on_close", run)


def user_hooks(names, extra=(), ckdir=None) -> list[Hook]:
    """The user's hooks of a run, each a ``UserHook``: ``train.hooks`` by name, then ``extra``."""
    named = [UserHook(hook, f"{name!r} ({_described(hook)})", ckdir) for name, hook in zip(names, named_hooks(names))]
    return named + [UserHook(hook, _described(hook), ckdir) for hook in extra]


def _described(hook) -> str:
    cls = type(hook)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_config(cfg: Config) -> list[tuple[str, str, str]]:
    """``train.hooks`` must name registered hooks."""
    unknown = [h for h in cfg.train.hooks if h not in HOOKS]
    return [("train", "hooks", HOOKS.unknown_message(unknown[0]))] if unknown else []


def builtin_hooks(run_cfg: Config, out: Path, is_main: bool, evaluation: Evaluation,
                  select_metric: str | None = None) -> list[Hook]:
    """The hooks every run has, in order (the files they write depend on it); ``select_metric``:
    the task's validation metric that picks the epoch eval.json reports (its checkpoint is kept)."""
    hooks = [Throughput(), StepLog(), BadStepPolicy(), ProgressBar(), IntervalCheckpoint(), evaluation,
             EpochHistory(), EpochTiming(), EpochCheckpoint(evaluation.ckdir, select_metric), EpochSync()]
    if run_cfg.train.tensorboard and is_main:
        hooks.append(TensorBoard(out))
    return hooks
