"""The run loop: one for every task (gr_functional/task.py), one process or many.

``train(cfg, out_dir)`` checks the config, the task's data and any checkpoint to resume, then
runs the task's steps, calling the hooks (gr_functional/hooks.py) at every step and epoch end,
and writes (docs/cli.md "Commands"):
  OUT/config.toml    resolved config
  OUT/metrics.jsonl  one JSON object per line, a deterministic function of (config, data, backend):
                     training steps {"kind": "train", "step", "epoch", "loss", "tokens"[, "loss_scale"]},
                     skipped non-finite steps {"kind": "skip", ...}, evaluations
                     {"kind": "eval", "split": "valid"|"test", ...} and an abort {"kind": "abort", ...}.
                     No wall-clock field: a run killed and resumed writes the identical file.
  OUT/timing.jsonl   the wall-clock side: tokens/s per logged step, seconds per epoch, and run
                     events (start, resume with the checkpoint used, checkpoints skipped as damaged)
  OUT/eval.json      test metrics of the epoch with the best validation ``task.select_metric``
                     (retrieval: hr@10, ndcg@10, hr@50, ndcg@50, hr@200, ndcg@200, mrr), plus that
                     epoch and the last epoch's test metrics
  OUT/curves.png     loss and the selecting metric per epoch
  OUT/checkpoints/   step-NNNNNNNN.safetensors checkpoints (params, optimizer state, loader position,
                     run state, config; checksummed), manifest.json, last.safetensors
                     (gr_functional/checkpoint.py)

Resume (``resume="auto"``, the default of ``grf train``): when OUT/checkpoints holds a valid
checkpoint, training continues from the newest one (gr_functional/resume.py): params, optimizer
state (and fp16 loss scale), the loader position (epoch, batch), the step, the per-epoch history
and metrics.jsonl up to that step. All randomness is numpy ``default_rng((train.seed, epoch[,
step]))`` drawn by the loader, so the position and the seed are the whole RNG state.

Data-parallel (docs/guides/distributed.md "Distributed training"): with ``dist.devices = N`` on
JAX, this process trains N ranks, one per device of a mesh (backends/dist_jax.py); under torchrun
(``WORLD_SIZE > 1``) every rank runs ``train``; the task's step runner trains the rank's share of every global batch over a
``backends.dist_torch.TorchCollective``. Rank 0 alone reads and writes OUT (config, metrics,
timing, checkpoints, eval.json, curves) and evaluates; the resume decision and checkpoint state
are broadcast from it, so OUT need only exist on rank 0's host. timing.jsonl then also records
per-rank forward+backward seconds and their imbalance.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import time
from pathlib import Path

import numpy as np

from backends import backend_class, multi_process_backends, ops

from . import results
from .checkpoint import (Checkpoint, CheckpointDir, CheckpointError, NonFiniteState, WriteError, atomic_write_bytes,
                         check_finite, fault_point, read_checkpoint)
from .config import Config, ConfigError, build_config, config_to_toml, problem_message, replace
from .config import validate as config_validate
from .configure import execution_problems, plugins_in_use, validate
from .errors import Diverged, DistributedError, PluginError, TrainingAborted  # noqa: F401 (re-exported)
from .comm import LocalComm
from .hooks import (ProgressLine, Run, StepResult, TensorBoard, bad_step, builtin_hooks, last_healthy,
                    user_hooks)
from .log import say, warn
from .optim import resolve_schedule, run_updates
from .optimizers import check_config as check_optimizer
from .outputs import JsonLog, NullLog, write_result
from .plugins import import_plugins, normalise
from .report import select_epoch
from .resume import (RESUME_MODES, RunState, check_param_shapes, config_changes, find_resume,
                     refuse_changes_to_a_finished_run, restore_opt_state, resume_on_all_ranks, world_size)
from .runlock import RunLock
from .runtime import make_backend, prepare_process
from .task import Task, get_task
from .step import init_opt_state
from .contracts import Comm

def _fault_point(name: str, step: int) -> None:
    """``checkpoint.fault_point``, limited to rank ``GRF_FAULT_RANK`` when that is set (tests of a
    data-parallel run pause or kill one rank)."""
    only = os.environ.get("GRF_FAULT_RANK")
    if only is not None and only != os.environ.get("RANK", "0"):
        return
    fault_point(name, step)


def _code_version() -> dict:
    """The commit the code that trains is at (and whether it has uncommitted changes), for
    timing.jsonl: ``grf report`` shows it beside the run's metrics (results.commit; {} outside git)."""
    code, dirty = results.commit()
    return {"commit": code, "dirty": dirty} if code else {}


def train(cfg: Config, out_dir: str | Path, progress: bool = True, resume: str = "auto", hooks=()) -> dict:
    """Train per ``cfg`` (the task ``model.task``), evaluate, write the output files (``grf.fit``).

    Nothing under OUT is written or deleted until the data, the config and the checkpoint have been
    checked, so a rejected run loses nothing. Under torchrun (``WORLD_SIZE > 1``) this is one rank of
    a data-parallel run (module docstring): ranks other than 0 write nothing.

    Args:
      cfg: the run's config (``load_config``, or a ``Config`` made in code: checked as a file is).
      out_dir: the run folder (config.toml, metrics.jsonl, eval.json, checkpoints/).
      progress: print the per-epoch lines and the progress bar or line.
      resume: "auto" continues from the newest valid checkpoint in OUT/checkpoints when there is one
        (damaged ones are skipped with a warning naming them), else starts fresh; "must" is the same
        but fails when there is none (``grf train --resume``); "never" deletes OUT/checkpoints and
        starts over (``grf train --fresh``).
      hooks: extra ``hooks.Hook`` objects called after the built-in ones and those named by
        ``train.hooks``, at every step and epoch end (gr_functional/hooks.py).
    Returns:
      the eval.json dict (rank 0); ``{"rank": r, "steps": ...}`` on the other ranks.
    Raises:
      ConfigError / DataError / CheckpointError: what was refused before anything was written.
      TrainingAborted: after ``train.max_bad_steps`` non-finite steps in a row.
      DistributedError: a rank died or hung (naming it).
    """
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    # a Config built in code: its losses / datasets / kernels, recorded as absolute paths
    cfg = replace(cfg, train={"plugins": tuple(normalise(e) for e in cfg.train.plugins)})
    import_plugins(cfg.train.plugins)
    processes = world_size()
    if processes > 1:
        if not backend_class(cfg.backend.name).multi_process:
            raise ConfigError(f"backend.name={cfg.backend.name!r}: multi-process training runs the backends "
                              f"{', '.join(multi_process_backends())}")
        cfg = replace(cfg, dist={"nproc": processes})  # the resolved config records the real world size
    validate(cfg)
    # what the script calling grf.fit registered itself: recorded, so a resume or grf eval finds it
    cfg = replace(cfg, train={"plugins": cfg.train.plugins + plugins_in_use(cfg)})
    prepare_process(cfg)  # before anything asks the array library about its devices (memory.check_fits)
    task = get_task(cfg.model.task)
    world = processes * max(1, cfg.dist.devices)  # data-parallel ranks: processes x devices of each
    task.check(cfg, world)
    out = Path(out_dir)
    prepared = task.prepare(cfg, world)
    # optim.decay_steps = 0 ends the decay with the run: concrete before anything records the config
    prepared = dataclasses.replace(prepared, cfg=resolve_schedule(prepared.cfg, prepared.loader.steps_per_epoch))
    cfg = prepared.cfg
    ckdir = CheckpointDir(out / "checkpoints", keep=cfg.train.keep_checkpoints)

    comm, device = LocalComm(), None
    if world > 1:
        # joined after each rank loaded its data (a slow loader never trips a collective timeout)
        comm, device = backend_class(cfg.backend.name).join(cfg)
    lock = RunLock(out)

    def find():
        # one writer per folder: the lock is taken before the resume decision, so no other run
        # can move the checkpoints between that decision and this run's first write
        stale = lock.acquire()
        if stale:
            warn(f"{lock.path}: taking over the lock of a run that is gone ({stale})")
        restored, events = find_resume(cfg, ckdir, resume, prepared.loader, prepared.fingerprint,
                                       lambda ck: task.param_shapes(ck.config, ck.host))
        if restored is not None:
            refuse_changes_to_a_finished_run(cfg, restored, prepared.loader)
        return restored, events

    try:
        restored, events = resume_on_all_ranks(comm, find)
        if restored is not None and not comm.is_main:
            prepared.loader.load_state_dict(restored.meta["loader"])
        B = make_backend(cfg, device)
        result = _train_loop(task, prepared, out, progress, resume, B, comm, ckdir, restored, events, hooks)
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


def _train_loop(task: Task, prepared, out: Path, progress: bool, resume: str, B, comm: Comm, ckdir: CheckpointDir,
                restored: Checkpoint | None, events: list[dict], extra_hooks=()) -> dict:
    """The body of ``train`` once the data, config and checkpoint are checked: a loop over steps
    calling the hooks (gr_functional/hooks.py), the same for every task, one process or one rank."""
    from tqdm import tqdm

    cfg, loader = prepared.cfg, prepared.loader
    main = comm.is_main
    say_main = say if main else (lambda message: None)
    # hooks that can fail to start (a named hook's factory, TensorBoard without its package) are
    # made before the run touches OUT, so such an error leaves the folder as it was (even --fresh)
    mine = user_hooks(cfg.train.hooks, extra_hooks, ckdir)
    if cfg.train.tensorboard and main:
        TensorBoard.check()
    # ---- checks passed: from here on the run owns OUT (rank 0 only in a data-parallel run)
    say_main(prepared.describe)
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
        for name, text in task.run_files(prepared).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(out / name, text.encode())
    if restored is not None:
        model_state = task.restore(B, prepared, comm, restored)
        opt_state = restore_opt_state(B, restored.opt_state, cfg)   # fp16's scaler follows the precision
        state = RunState.from_meta(restored.meta["run"])
        log = JsonLog(out / "metrics.jsonl", keep_lines=state.metrics_lines) if main else NullLog()
        if not main:
            log.lines = state.metrics_lines
        timing = JsonLog(out / "timing.jsonl", append=True) if main else NullLog()
        e, s = loader.position
        say_main(f"resuming {out} from {restored.path.name}: step {state.step}, epoch {e} batch {s} "
                 f"(written by {restored.meta.get('backend')}/{restored.config.backend.precision}, now "
                 f"{B.name}/{cfg.backend.precision}); pass --fresh to start over")
        resumed = {"kind": "resume", "file": str(restored.path), "step": state.step, "backend": B.name,
                   **_code_version()}
        changed = config_changes(restored.config, cfg)
        if changed:  # config.toml now says the new values: the history of what trained is here
            resumed["changed"] = changed
            say_main(f"changed on resume, from step {state.step + 1}: "
                     + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        events.append(resumed)
    else:
        model_state = task.fresh(B, prepared, comm)
        opt_state = init_opt_state(B, model_state.params, cfg)
        state = RunState()
        log = JsonLog(out / "metrics.jsonl") if main else NullLog()
        timing = JsonLog(out / "timing.jsonl") if main else NullLog()
        events.append({"kind": "start", "backend": B.name, "precision": cfg.backend.precision, **_code_version()})
    if comm.world_size > 1:
        events.append({"kind": "distributed", "world_size": comm.world_size, "backend": comm.backend,
                       "balance": cfg.dist.balance, "cost_a": loader.split.cost_a,
                       "cost_b": loader.split.cost_b, "rank_token_cap": cfg.dist.rank_token_cap})
    for ev in events:
        timing.write({**ev, "time": time.time()})

    tc = cfg.train
    steps = task.steps(B, prepared, comm, model_state)
    epoch, start = loader.position
    if state.epoch_end_pending >= 0:
        epoch, start = state.epoch_end_pending, None  # no batches left: only the epoch's end
    total = run_updates(loader.steps_per_epoch, cfg)

    def save(reason: str, epoch_of: int) -> Path | None:
        log.sync()
        state.metrics_lines = log.lines
        host = task.host_state(model_state, comm)  # every rank takes part (a row-sharded table gathers)
        ended = bool(state.history) and state.history[-1]["epoch"] == epoch_of
        if (reason not in ("epoch", "final") and loader.position[0] > epoch_of and state.epoch_end_pending < 0
                and not ended):
            # written after the epoch's last batch but before its end ran (a hook's save): a resume
            # from it must still run that epoch's end (evaluation, history)
            state.epoch_end_pending = epoch_of
        if not main:
            return None  # rank 0 writes the (identical) state
        comm.progress("checkpoint")
        t0 = time.perf_counter()
        meta = {"epoch": epoch_of, "step": state.step, "backend": B.name, "precision": cfg.backend.precision,
                "reason": reason, "loader": loader.state_dict(), "run": state.to_meta(), "data": prepared.meta,
                # the whole RNG state: every draw is numpy default_rng((seed, epoch[, batch]))
                "rng": {"generator": task.rng_generator, "seed": tc.seed, "position": list(loader.position)},
                "world_size": comm.world_size}
        try:
            path = ckdir.save(B.to_numpy_tree(run.params), B.to_numpy_tree(run.opt_state), cfg, meta, host=host)
        except NonFiniteState as exc:  # the step guard should make this unreachable: never write it
            raise TrainingAborted(f"training aborted at step {state.step}: {exc}. {last_healthy(ckdir)}") from None
        timing.write({"kind": "checkpoint", "step": state.step, "file": path.name, "reason": reason,
                      "seconds": time.perf_counter() - t0})
        timing.flush()
        return path

    # disable=None: no bar when stderr is not a terminal (CI logs); epoch lines still print
    bar = tqdm(total=total, initial=min(state.step, total), disable=None if (progress and main) else True,
               unit="step", dynamic_ncols=True)
    run = Run(cfg=cfg, out=out, B=B, comm=comm, state=state, log=log, timing=timing, loader=loader,
              save=save, echo=bar.write if main else (lambda text: None), bar=bar, params=model_state.params,
              opt_state=opt_state, run_start=time.perf_counter(), batch_build=steps.prefetch_stats)
    evaluation = task.evaluation(B, prepared, comm, model_state, ckdir)
    hooks = [*builtin_hooks(cfg, out, main, evaluation, task.select_metric), *mine]
    if progress and main:  # a plain line where the bar does not show (a run logged to a file)
        hooks.append(ProgressLine(total, cfg.train.progress_every_s))

    run_epochs(run, hooks, steps, epoch, start, resumed=restored is not None)

    if not main:
        comm.wait_for("files")
        return {"rank": comm.rank, "steps": state.step, "skipped_steps": state.skipped_total}
    comm.progress("files")
    history = state.history
    if not history:
        raise CheckpointError(f"{out}: no epoch has run, nothing to report (train.epochs={tc.epochs})")
    select = task.select_metric
    best = select_epoch(history, select) or history[-1]
    last = history[-1]
    result = {**best.get("test", {}), "epoch": best["epoch"], "selected_by": f"best valid {select}",
              "last_epoch": last["epoch"], "last_epoch_test": last.get("test"), "dataset": prepared.label,
              **task.result_fields, "backend": B.name, "precision": cfg.backend.precision, "steps": state.step,
              "skipped_steps": state.skipped_total, "wall_seconds": time.perf_counter() - run.run_start}
    if comm.world_size > 1:
        result["world_size"] = comm.world_size
    write_result(out, result, history, metric=select, label=task.curve_label)
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
        say(f"{run.out} is already complete (step {state.step}, epoch {epoch} of {tc.epochs}"
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
                warn(str(exc) if isinstance(exc, PluginError) else
                     f"hook {type(hook).__name__}.on_close failed: {type(exc).__name__}: {exc}")
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


def for_evaluation(cfg: Config) -> Config:
    """``cfg`` with the default optimizer when its own cannot be built on ``cfg.backend.name`` (an
    optax run evaluated on torch): evaluation builds no optimizer, so the run's must not refuse it."""
    if check_optimizer(cfg) is None:
        return cfg
    return replace(cfg, optim={"name": Config().optim.name})


def evaluate_checkpoint(path: str | Path, backend: str | None = None, split: str = "test") -> dict:
    """Evaluate a checkpoint (trained on any backend) with the run's own config (``grf eval``).

    Args:
      path: a checkpoint file (OUT/checkpoints/*.safetensors).
      backend: evaluate on this backend ("torch", "jax", ...; None: the run's); kernels the run chose
        that this backend lacks take its default.
      split: "test" or "valid".
    Returns:
      the metrics dict (``hr@10``, ``ndcg@10``, ... or the ranking task's AUCs) with ``split``,
      ``backend``, ``trained_on`` and ``epoch``.
    Raises:
      CheckpointError: the file is damaged or does not match its config; Diverged: it holds
      non-finite numbers; ConfigError: ``backend`` cannot run the run's config.
    """
    ck = read_checkpoint(path)
    import_plugins(ck.config.train.plugins, where=f"{path} (embedded config) train.plugins")
    # one process on one device: how the run was spread (torch ranks, JAX devices) is not evaluation's
    cfg = replace(ck.config, dist={"nproc": 1, "devices": 0})
    task = get_task(cfg.model.task)
    check_param_shapes(ck, task.param_shapes(cfg, ck.host))
    try:
        check_finite(ck)
    except NonFiniteState as exc:  # a diverged run's state: evaluating it would only rank NaNs
        raise Diverged(f"{exc}; evaluate an earlier checkpoint of the run (OUT/checkpoints/step-*.safetensors)") from None
    if backend:
        # the run's kernels may not exist there: those take that backend's default
        cfg = for_evaluation(replace(cfg, backend={"name": backend}, ops=ops.portable(ops.choices(cfg), backend)))
        # only what evaluation uses is checked: a plugin's loss need not be registered to evaluate
        build_config({"backend": {f.name: getattr(cfg.backend, f.name) for f in dataclasses.fields(cfg.backend)}},
                     source=f"--backend {backend}")
        config_validate(cfg, source=f"--backend {backend}")
        for section, key, message in execution_problems(cfg):
            raise ConfigError(problem_message(cfg, section, key, message, source=f"--backend {backend}"))
    B = make_backend(cfg)
    result = task.evaluate_checkpoint(B, cfg, ck, split)
    extra = {k: result.pop(k) for k in ("dataset", "task") if k in result}
    return {**result, "split": split, "backend": B.name, "trained_on": ck.meta.get("backend"),
            "epoch": ck.meta.get("epoch"), **extra}
