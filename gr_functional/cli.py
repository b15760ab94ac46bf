"""``grf``: train, eval, crosscheck, data, bench and report commands.

    grf train --config experiments/configs/NAME.toml [--backend B] [--set key=value ...] [--out DIR]
              [--plugin my_loss.py ...]   (import first: registers losses, datasets, kernels)
              [--resume | --fresh]   (default: resume from DIR/checkpoints when it holds a valid one)
              [--nproc N]            (N > 1: data-parallel on this host through torch.distributed.run)
    grf eval --checkpoint PATH [--backend B] [--split test|valid] [--plugin my_loss.py ...]
    grf crosscheck --config FILE --backends jax,torch [--steps N [--out DIR]] [--json] [--set key=value ...]
    grf crosscheck --checkpoint OUT/checkpoints/last.safetensors --backends jax,torch [--split valid]
    grf data fetch ml-1m | grf data info
    grf bench attention|mfu|throughput|compile|recompute|profile|roofline|balance|calibrate|dist_imbalance|data_parallel|embedding|pipeline|pipeline_sharded|negatives|ranking|device [--json] [--tiny] ...
    grf report RUN_DIR [RUN_DIR ...] [--group-seeds] [--metrics hr@10,ndcg@10] [--curve hr@10] [--json]

Exit codes: 0 done, 2 user error (nothing written; also: the run folder is in use by another run),
3 the model diverged (NaN/Inf or exploding steps, or non-finite evaluation scores; the last
healthy checkpoint is named), 4 a data-parallel rank died or hung (the message names it), 5 a
file could not be written (read-only folder, full disk, file-size limit; the last intact
checkpoint is named), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (both: the same command
resumes). Under torchrun every rank prints its own errors prefixed with its rank; only rank 0
prints the result.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
from pathlib import Path

from . import log, results
from .checkpoint import atomic_write_bytes, checkpoint_of, write_error
from .errors import ConfigError
from .registry import did_you_mean
from .plugins import import_plugins, normalise, plugin_failure

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # see npu_ops: torch_npu without CANN breaks torch

DEFAULT_CONFIG = "quickstart"


from .config import PACKAGED_CONFIGS, config_path as _config_path  # noqa: E402,F401 (re-exported)


def _load(args):
    from .configure import load_config

    overrides = list(args.set or [])
    if getattr(args, "backend", None):
        overrides.append((f"--backend {args.backend}", f"backend.name={args.backend}"))
    if getattr(args, "devices", None) is not None:
        overrides.append((f"--devices {args.devices}", f"dist.devices={args.devices}"))
    return load_config(_config_path(args.config), overrides, plugins=getattr(args, "plugin", None) or [])


def _launched_rank() -> int | None:
    """This process's rank when torchrun started it (WORLD_SIZE > 1), else None."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return int(os.environ.get("RANK", "0"))
    return None


def _launch(args, cfg, out: Path, nproc: int) -> int:
    """``grf train --nproc N``: run this same command as N ranks on this host under
    ``torch.distributed.run`` (torchrun) with a free local port. Each rank records its exit code
    (``gr_functional.rank``), since torchrun only says 1 whatever failed; returns
    ``dist_torch.job_exit_code``: 0, or 2 (a rank's user error), 3 (diverged), a rank's other
    code (1: an unexpected error, 5: a write failure), 4 (a rank died, was killed or hung). Each
    rank's own message names it."""
    import shutil
    import subprocess

    from backends import backend_class, dist_torch, multi_process_backends

    from .config import ConfigError, parse_override, replace, validate as config_rules
    from .configure import validate

    validate(cfg)  # user errors once, before N processes start
    if not backend_class(cfg.backend.name).multi_process:
        raise ConfigError(f"--nproc {nproc}: multi-process training runs the backends "
                          f"{', '.join(multi_process_backends())}, not backend.name={cfg.backend.name!r}")
    # what a launched rank would refuse with dist.nproc = N (embedding.node_size must divide it):
    # refused here, in one line, before torchrun starts (the config read above had the file's nproc)
    origins = {parse_override(item)[:2]: f"--set {item}" for item in args.set or []}
    config_rules(replace(cfg, dist={"nproc": nproc}), source=str(_config_path(args.config) or "<defaults>"),
                 origins={**origins, ("dist", "nproc"): f"--nproc {nproc}"})
    argv = ["train", "--out", str(out)]
    if args.config:
        argv += ["--config", str(args.config)]
    if args.backend:
        argv += ["--backend", args.backend]
    if args.devices is not None:
        argv += ["--devices", str(args.devices)]
    for item in args.set or []:
        argv += ["--set", item]
    for plugin in args.plugin or []:
        argv += ["--plugin", plugin]
    argv += ["--set", f"dist.nproc={nproc}"]
    argv += ["--quiet"] if args.quiet else []
    argv += ["--resume"] if args.resume else ["--fresh"] if args.fresh else []
    # gr_functional.rank runs gr_functional.cli's main and records the rank's exit code
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "gr_functional.rank", *argv]
    backend_class(cfg.backend.name).prepare_launch(cfg)  # once here, not in each rank's warm-up
    log.say(f"launching {nproc} ranks: {' '.join(cmd[1:])}")
    dist_torch.reap_exit_dirs()  # temp folders of launchers that were killed
    exit_dir = dist_torch.make_exit_dir()
    env = {**os.environ, dist_torch.EXIT_DIR_ENV: exit_dir, dist_torch.LAUNCHER_PID_ENV: str(os.getpid()),
           **backend_class(cfg.backend.name).launch_env()}
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_torchrun_preexec())
        try:
            code = dist_torch.supervise(proc, exit_dir, nproc)
        except BaseException as exc:  # Ctrl-C, SIGTERM (_Terminated): stop the job, bounded, then report
            sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
            dist_torch.stop_job(proc, exit_dir, nproc, sig)
            raise
        dist_torch.stop_ranks(exit_dir, nproc)  # a rank torchrun left behind (torchrun itself was killed)
        job, why = dist_torch.job_exit_code(code, exit_dir, nproc)
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)
    if code != 0:
        log.error(f"the {nproc}-rank run failed (torchrun exit {code}; {why}): exit {job}; the messages above name "
                  f"the failing rank")
    return job


def _torchrun_preexec():
    """torchrun's ``preexec_fn``: its own process group, so a terminal's Ctrl-C reaches the launcher
    alone, which passes it on once (``dist_torch.stop_job``); and, on Linux, SIGTERM when the
    launcher dies (``prctl(PR_SET_PDEATHSIG)``), on which torchrun stops the ranks: a ``kill -9``
    of ``grf train --nproc N`` leaves nothing running (the ranks also watch the launcher
    themselves: ``dist_torch.watch_launcher``). libc's ``prctl`` is looked up here, in the parent:
    the child only calls it."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            prctl.restype = ctypes.c_int
        except (OSError, AttributeError):
            prctl = None

    def preexec():
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the launcher died before the line above
                os._exit(1)

    return preexec


def cmd_train(args) -> int:
    from . import checkpoint, hooks, runner

    cfg = _load(args)
    out = Path(args.out or default_out(args, cfg))
    nproc = args.nproc if args.nproc is not None else cfg.dist.nproc
    if nproc < 1:
        from .config import ConfigError

        raise ConfigError(f"--nproc (or dist.nproc) must be >= 1, got {nproc}")
    rank = _launched_rank()
    _STOPPED.update(checkpoints=checkpoint.CheckpointDir(out / "checkpoints"), step=None, epoch=None)
    if rank is None and nproc > 1:
        return _launch(args, cfg, out, nproc)
    # default: continue from OUT/checkpoints when it holds a valid checkpoint (the runner says so)
    resume = "must" if args.resume else "never" if args.fresh else "auto"
    result = runner.train(cfg, out, progress=not args.quiet, resume=resume, hooks=[_last_step_hook(hooks.Hook)])
    if rank:  # ranks other than 0 write nothing and print nothing
        return 0
    print(json.dumps(summary_line(result) | {"epoch": result["epoch"], "out": str(out)}))
    return 0


# --set keys that extend or observe a run without changing what it trains: a run given one of them
# stays in (and resumes) the folder of its variant
_FOLDER_NEUTRAL = ("train.epochs", "train.max_steps", "train.log_every", "train.checkpoint_every", "train.eval_every",
                   "train.keep_checkpoints", "train.prefetch", "train.tensorboard", "backend.precision", "backend.name",
                   "dist.devices")  # N JAX devices train the one-device update


def default_out(args, cfg) -> str:
    """``runs/CONFIG-BACKEND[-PRECISION][-VARIANT]``: bf16/fp16 runs, and runs whose ``--set``
    overrides change what trains (VARIANT: 8 hex digits of the sorted overrides), get their own
    default folder, so that they never land in, or resume, the folder of another variant."""
    import hashlib

    name = Path(args.config).stem if args.config else DEFAULT_CONFIG
    suffix = "" if cfg.backend.precision == "fp32" else f"-{cfg.backend.precision}"
    changes = sorted(s.strip() for s in (args.set or []) if not isinstance(s, tuple)
                     and not s.split("=", 1)[0].strip().startswith(("eval.", *_FOLDER_NEUTRAL)))
    changes += sorted(str(p) for p in (getattr(args, "plugin", None) or []))
    if changes:
        suffix += "-" + hashlib.sha256("\n".join(changes).encode()).hexdigest()[:8]
    return f"runs/{name}-{cfg.backend.name}{suffix}"


def _last_step_hook(Hook):
    """A hook noting the last step taken, for the line ``grf train`` prints when stopped (SIGTERM)."""

    class LastStep(Hook):
        def on_step(self, run, step) -> None:
            _STOPPED.update(step=step.step, epoch=step.epoch)

    return LastStep()


def summary_line(result: dict) -> dict:
    """The selected epoch's test metrics of an eval.json ``result``, rounded: retrieval's HR/NDCG@k
    and MRR (eval.ks decides which), a ranking run's AUCs, GAUCs and NEs; what the last line of
    ``grf train`` prints."""
    return {k: round(v, 4) for k, v in result.items()
            if isinstance(v, float) and k not in _NOT_METRICS and math.isfinite(v)}


_NOT_METRICS = {"wall_seconds"}


def cmd_eval(args) -> int:
    from .runner import evaluate_checkpoint

    # before the checkpoint is read: a kernel, loss or dataset its config names may be a plugin's
    # that the run did not record in train.plugins (registered by hand, or a renamed file)
    plugins = [normalise(p) for p in args.plugin or []]
    import_plugins(plugins, where=f"--plugin {' --plugin '.join(args.plugin or [])}")
    ck = checkpoint_of(args.checkpoint)  # a run folder: its best epoch's checkpoint (eval.json's), else last
    if ck != Path(args.checkpoint):
        log.say(f"evaluating {ck}")
    result = evaluate_checkpoint(ck, args.backend, args.split)
    text = json.dumps(result, indent=1)
    out = Path(args.out) if args.out else ck.with_name(f"{ck.stem}.eval-{args.split}-{result['backend']}.json")
    atomic_write_bytes(out, (text + "\n").encode())
    print(text)
    log.say(f"wrote {out}")
    return 0


def cmd_crosscheck(args) -> int:

    names = _crosscheck_usage(args)  # flag errors: exit 2 before anything is imported, loaded or built
    if args.record:
        _check_record(args.record, "crosscheck.jsonl")
    from . import model
    from .crosscheck import (backend_as_trained, checkpoint_evaluations, config_as_trained, crosscheck, first_batch,
                             trajectory)

    if args.checkpoint:
        report = checkpoint_evaluations(args.checkpoint, names, split=args.split, users=args.users, **_tol(args))
        return _crosscheck_result(report, args)
    cfg = _load(args)
    if not args.steps and cfg.model.task != "retrieval":
        # before any backend is built: the layer trace (model.trace_names) is the retrieval model's;
        # the training trajectory and a checkpoint's metrics compare any task
        raise ConfigError(f"--config {args.config}: the layer-by-layer check (no --steps) runs the retrieval model "
                          f"only, and this config has model.task={cfg.model.task!r}; use --steps N (trains N steps "
                          f"on both backends and compares the losses and parameters) or --checkpoint PATH (a trained "
                          f"run's metrics on both)")
    if args.steps:
        for name in names:
            config_as_trained(cfg, name)  # refused before either side trains
        if args.out:
            report = trajectory(cfg, names, args.steps, Path(args.out), **_tol(args))
        else:
            with tempfile.TemporaryDirectory(prefix="grf-crosscheck-") as tmp:
                report = trajectory(cfg, names, args.steps, Path(tmp), **_tol(args))
        return _crosscheck_result(report, args)
    backends = [backend_as_trained(cfg, n) for n in names]
    cfg, batch = first_batch(cfg, args.users)
    params = model.model_of(cfg.model).init_params(cfg.model, seed=cfg.train.seed)
    return _crosscheck_result(crosscheck(backends, params, batch, cfg, **_tol(args, "fwd_tol", "grad_tol")), args)


def _crosscheck_usage(args) -> list[str]:
    """The two ``--backends`` names, after refusing (ConfigError: exit 2, ``grf: error: ...``) flags
    that cannot work together or values no check can use: a wrong flag costs nothing, not a
    training run or a compile followed by a "divergence" (exit 1)."""
    import math


    names = [b.strip() for b in args.backends.split(",")]
    if len(names) != 2 or not all(names):
        raise ConfigError(f"--backends {args.backends}: crosscheck compares two backends, comma-separated, the "
                          f"reference first: e.g. --backends jax,torch")
    if args.steps < 0:  # 0 (the default) is the one-batch check
        raise ConfigError(f"--steps must be >= 1 (training steps to compare on both backends), got {args.steps}; "
                          f"leave --steps out for the one-batch layer-by-layer check")
    if args.users < 1:
        raise ConfigError(f"--users must be >= 1 (sequences in the checked batch, default 32), got {args.users}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol >= 0):
        # a negative tolerance fails every row, NaN fails them all too: not a divergence, a typo
        raise ConfigError(f"--tol must be a finite relative tolerance >= 0 (e.g. --tol 1e-5), got {args.tol:g}")
    if args.checkpoint:
        ignored = [flag for flag, given in (("--config", args.config), ("--steps", args.steps), ("--set", args.set),
                                            ("--out", args.out)) if given]
        if ignored:
            raise ConfigError(f"--checkpoint evaluates a trained run with the config it was trained with: drop "
                              f"{', '.join(ignored)} (or drop --checkpoint to check --config FILE)")
    elif not args.config:
        raise ConfigError("give --config FILE (one batch layer by layer, or --steps N of training) or "
                          "--checkpoint PATH (a trained run's metrics)")
    elif args.out and not args.steps:
        raise ConfigError("--out keeps the two runs that --steps N trains; add --steps N or drop --out")
    return names


def _tol(args, *keys: str) -> dict:
    """``--tol`` for the given keyword(s) of the check (each check's default otherwise)."""
    return {} if args.tol is None else {key: args.tol for key in (keys or ("tol",))}


def _crosscheck_result(report, args) -> int:
    print(report.to_json() if args.json else report.to_table())
    if args.record:  # one record per compared row: the data a results page shows
        written = _write_record(args.record, args.command_line, report.records())
        log.say(f"{len(report.rows)} records written to {written}")
    return 0 if report.ok else 1


def cmd_data(args) -> int:
    from .data import fetch, paths

    if args.action == "fetch":
        path = fetch.fetch(args.name, args.dest)
        print(f"{args.name}: {path}")
    else:
        from .data import registry

        print(f"data dir: {paths.data_dir()}")
        print(f"datasets (data.dataset): {', '.join(registry.names('retrieval'))}")
        print(f"ranking datasets (with model.task = \"ranking\"): {', '.join(registry.names('ranking'))}; files:")
        for name in paths.dataset_names():
            try:
                print(f"  {name}: {paths.dataset_path(name)}")
            except Exception as exc:  # noqa: BLE001 - report, don't fail
                print(f"  {name}: missing ({exc})")
        print("downloads (grf data fetch NAME):")
        for line in fetch.listing():
            print(f"  {line}")
    return 0


BENCHMARKS = {"attention": "benchmarks.attention", "mfu": "benchmarks.mfu", "throughput": "benchmarks.throughput",
              "profile": "benchmarks.profile",
              "balance": "benchmarks.balance", "calibrate": "benchmarks.calibrate",
              "dist_imbalance": "benchmarks.dist_imbalance", "embedding": "benchmarks.embedding",
              "pipeline": "benchmarks.pipeline", "negatives": "benchmarks.negatives", "stream": "benchmarks.stream",
              "scaling": "benchmarks.scaling", "compile": "benchmarks.compile", "roofline": "benchmarks.roofline",
              "recompute": "benchmarks.recompute", "pipeline_sharded": "benchmarks.pipeline_sharded",
              "ranking": "benchmarks.ranking", "ranking_baselines": "benchmarks.ranking_baselines",
              "ranking_scale": "benchmarks.ranking_scale", "data_parallel": "benchmarks.data_parallel",
              "device": "benchmarks.device"}


def cmd_bench(args) -> int:
    import importlib
    import inspect


    # usage errors first (exit 2), before the benchmark's module (torch, jax: seconds) is imported
    if args.name not in BENCHMARKS:
        raise ConfigError(f"grf bench {args.name}: no benchmark named {args.name!r}"
                          f"{did_you_mean(args.name, BENCHMARKS)}; available: {', '.join(BENCHMARKS)}")
    _bench_usage(args.name, _bench_params(args.name), args)
    record = None
    if args.record is not None:  # checked now: a bad path found after the run would lose its measurements
        record = _check_record(args.record or str(results.RESULTS / "bench" / f"{args.name}.jsonl"),
                               f"{args.name}.jsonl")
    module = importlib.import_module(BENCHMARKS[args.name])
    run = module.run
    params = inspect.signature(run).parameters
    _bench_usage(args.name, set(params), args)  # the same checks on the imported run() (one the source hides)
    if not args.config and getattr(module, "DEFAULT_CONFIG", None):  # a benchmark with its own preset
        args.config = module.DEFAULT_CONFIG
    kwargs = {"json_lines": args.json}
    if "backends" in params:  # speed benchmarks: --backend torch,jax picks backends; --set backend.device=cuda
        backends = args.backend.split(",") if args.backend else None
        args.backend = None
        kwargs.update(cfg=_load(args), backends=backends)
    elif "sets" in params:  # benchmarks that launch `grf train` themselves (dist_imbalance)
        kwargs.update(sets=list(args.set or []), config=args.config or DEFAULT_CONFIG)
    elif "cfg" in params:  # benchmarks of a model config (calibrate)
        kwargs["cfg"] = _load(args)
    if "tiny" in params:
        kwargs["tiny"] = args.tiny
    if record is None:
        run(**kwargs)
        return 0
    return _recorded(lambda: run(**{**kwargs, "json_lines": True}), str(record), args.command_line)


def _bench_params(name: str) -> set[str] | None:
    """The parameter names of benchmark ``name``'s ``run()``, read from its source without importing
    it (its imports take seconds, a usage error must not); None where the source does not tell
    (no plain ``def run``, or one taking ``**kwargs``)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec(BENCHMARKS[name])
        tree = ast.parse(Path(spec.origin).read_text())
    except (ImportError, AttributeError, TypeError, ValueError, OSError, SyntaxError):
        return None
    runs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run"]
    if not runs or runs[-1].args.kwarg is not None:
        return None
    a = runs[-1].args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def _bench_usage(name: str, params: set[str] | None, args) -> None:
    """Refuse (exit 2) the flags benchmark ``name`` does not take (``params``: its ``run()``'s
    parameters; None: unknown, checked once it is imported)."""

    if params is None:
        return
    if args.tiny and "tiny" not in params:
        tiny = [n for n in BENCHMARKS if "tiny" in (_bench_params(n) or ())]
        raise ConfigError(f"grf bench {name}: takes no --tiny; drop it (benchmarks that take --tiny: "
                          f"{', '.join(tiny) or 'none'})")
    given = [flag for flag, value in (("--config", args.config), ("--set", args.set), ("--backend", args.backend))
             if value]
    if given and not params & {"backends", "sets", "cfg"}:
        raise ConfigError(f"grf bench {name}: takes no --config, --set or --backend (it measures its own fixed "
                          f"setup); drop {', '.join(given)}")


def _recorded(command, path: str, command_line: str) -> int:
    """Run ``command`` (which prints JSON lines) and write what it printed to ``path`` as a results
    file (gr_functional/results.py), stamped with this command line, the date, commit and machine."""
    capture = results.JsonLines(sys.stdout)
    with contextlib.redirect_stdout(capture):
        command()
    written = _write_record(path, command_line, capture.records)
    log.say(f"{len(capture.records)} records written to {written}")
    return 0


def _check_record(text: str, example: str) -> Path:
    """``--record FILE`` checked before anything is measured, as ``grf train`` checks ``--out``: a
    folder, or a path through a file, is a usage error (ConfigError, exit 2: --record takes a FILE,
    per its help); a folder that cannot be written to is a write failure (WriteError, exit 5, with
    the OS's reason). Nothing is left behind: the probe file is an unnamed temporary one."""

    path = Path(text)
    try:
        if path.is_dir():
            raise ConfigError(f"--record {text}: is a folder; --record takes the results FILE to write, e.g. "
                              f"--record {path / example}")
        folder = path.parent
        while not folder.exists():  # results.write creates the missing folders: probe the nearest existing one
            folder = folder.parent
        if not folder.is_dir():
            raise ConfigError(f"--record {text}: {folder} is a file, not a folder; give a FILE in a folder")
        if path.exists():
            open(path, "ab").close()  # writable, and left as it is
        else:
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise write_error(path, exc) from None
    return path


def _write_record(path, command_line: str, records: list[dict]) -> Path:
    """``results.write``; where it still fails (the disk filled during the run...), the file's lines
    are printed on stdout instead, so the measurements are not lost, and WriteError (exit 5) says so."""

    try:
        return results.write(path, command_line, records)
    except OSError as exc:
        for record in [results.stamp(command_line), *records]:
            print(json.dumps(record))
        sys.stdout.flush()
        err = write_error(Path(path), exc)
        raise type(err)(err.errno, f"{err}; nothing is lost: the file's {len(records) + 1} lines (a stamp, then "
                                   f"the records) are printed on stdout above: save them, or rerun with --record "
                                   f"FILE in a writable folder") from None


def cmd_report(args) -> int:
    from . import report

    runs = report.find_runs(args.runs)
    metrics = ([m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics
               else report.default_metrics(runs))
    if args.record:
        args.record, path = None, args.record
        args.json = True
        return _recorded(lambda: cmd_report(args), path, args.command_line)
    if args.json:
        if args.curve:
            for run in runs:
                print(json.dumps({"run": str(run.path), "evals": run.evals}))
        else:
            _, rows = report.summary_rows(runs, metrics, args.group_seeds)
            for row in rows:
                print(json.dumps(row))
    elif args.curve:
        print(report.curve_table(runs, args.curve, args.split))
    else:
        print(report.summary_table(runs, metrics, args.group_seeds))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train and evaluate a model")
    t.add_argument("--config", help="TOML config file or packaged config name (default: quickstart)")
    t.add_argument("--backend", help="jax | torch | npu (overrides backend.name)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. model.num_blocks=4")
    t.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="a .py file or module to import first: it may register losses, datasets or attention kernels "
                        "(appended to train.plugins; repeatable)")
    t.add_argument("--out", help="output folder (default runs/CONFIG-BACKEND, plus -bf16/-fp16 for those precisions "
                                 "and 8 hex digits of the --set overrides that change what trains)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    r = t.add_mutually_exclusive_group()
    r.add_argument("--resume", action="store_true",
                   help="require resuming from OUT/checkpoints (error if it holds no valid checkpoint). "
                        "Without --resume or --fresh, a run resumes when it finds one and starts fresh otherwise")
    r.add_argument("--fresh", action="store_true",
                   help="delete OUT/checkpoints and train from step 0")
    t.add_argument("--nproc", type=int, default=None,
                   help="data-parallel processes on this host (default dist.nproc, 1); > 1 starts them through "
                        "torch.distributed.run (torchrun); JAX processes join one mesh (jax.distributed). For "
                        "several hosts see docs/guides/distributed.md")
    t.add_argument("--devices", type=int, default=None,
                   help="JAX: train data-parallel on N devices of each process, one rank each (dist.devices; on "
                        "CPU, N XLA host devices)")
    t.set_defaults(fn=cmd_train, config=None)

    e = sub.add_parser("eval", help="evaluate a checkpoint on any backend")
    e.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint file, or a run folder: its best.safetensors (the epoch eval.json reports), "
                        "else last.safetensors")
    e.add_argument("--backend", help="backend to evaluate on (default: the one in the checkpoint's config)")
    e.add_argument("--split", default="test", choices=["test", "valid"])
    e.add_argument("--out", help="JSON file for the result (default: beside the checkpoint, "
                                 "CHECKPOINT.eval-SPLIT-BACKEND.json)")
    e.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="a .py file or module to import before the checkpoint is read: it may register the "
                        "losses, datasets or kernels the run used (besides its train.plugins; repeatable)")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("crosscheck", help="compare two backends: layer by layer on one batch, over N training "
                                          "steps (--steps), or on a trained checkpoint's evaluation (--checkpoint)")
    c.add_argument("--config", help="the run's config (one batch, or --steps N of training)")
    c.add_argument("--steps", type=int, default=0,
                   help="train N steps on each backend as grf train would and compare the losses step by step and "
                        "the parameters after the last (default 0: one batch, layer by layer)")
    c.add_argument("--out", help="with --steps: keep the two runs in OUT/REFERENCE and OUT/OTHER (default: a "
                                 "temporary folder)")
    c.add_argument("--checkpoint", help="evaluate this trained checkpoint on both backends and compare every metric")
    c.add_argument("--split", default="test", choices=("test", "valid"), help="split for --checkpoint (default test)")
    c.add_argument("--tol", type=float, help="relative tolerance (defaults: 1e-6 activations, 1e-5 gradients, 1e-4 "
                                             "after --steps, 1e-3 for --checkpoint metrics)")
    c.add_argument("--backends", default="jax,torch", help="reference,other (default jax,torch)")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="a .py file or module to import first: it may register losses, datasets or attention kernels "
                        "(appended to train.plugins; repeatable)")
    c.add_argument("--users", type=int, default=32, help="sequences in the checked batch (default 32)")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.add_argument("--record", metavar="FILE", help="also write one JSON row per compared layer, step or metric, "
                                                   "stamped with the command, date, commit and machine, to FILE "
                                                   "(e.g. results/quality/ml1m-crosscheck.jsonl)")
    c.set_defaults(fn=cmd_crosscheck)

    d = sub.add_parser("data", help="fetch datasets or show where they are")
    d.add_argument("action", choices=["fetch", "info"])
    d.add_argument("name", nargs="?", default="ml-1m",
                   help="fetch: a download (ml-1m, ml-20m, kuairand-pure, kuairand-1k, kuairand-27k-lengths; "
                        "grf data info lists their sizes and licences)")
    d.add_argument("--dest", help="target data folder (default: GRF_DATA_DIR or the user cache)")
    d.set_defaults(fn=cmd_data)

    b = sub.add_parser("bench", help="run a benchmark (prints a table, or JSON lines with --json)")
    b.add_argument("name", help=f"one of: {', '.join(BENCHMARKS)}")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.add_argument("--record", nargs="?", const="", metavar="FILE",
                   help="also write the JSON lines, stamped with the command, date, commit and machine, to FILE "
                        "(default results/bench/NAME.jsonl): the data the docs' result pages are generated from")
    b.add_argument("--config", help="model config (calibrate; default quickstart)")
    b.add_argument("--backend", help="backend to measure on (calibrate; default backend.name); attention, mfu, "
                                      "throughput: comma-separated list (default torch,jax)")
    b.add_argument("--set", action="append", metavar="KEY=VALUE")
    b.add_argument("--tiny", action="store_true", help="device: the whole command at toy sizes (its CI check)")
    b.set_defaults(fn=cmd_bench)

    r = sub.add_parser("report", help="compare runs: test metrics of each run's selected epoch, or a metric per epoch")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (grf train --out), or folders of them")
    r.add_argument("--metrics", help="comma-separated test metrics (default hr@10,ndcg@10,hr@50,ndcg@50,hr@200,ndcg@200,mrr)")
    r.add_argument("--group-seeds", action="store_true",
                   help="one row per config: mean +- sample std over runs that differ only in train.seed "
                        "(or in determinism, attention kernel/tile, device)")
    r.add_argument("--curve", metavar="METRIC", help="print METRIC at every evaluated epoch, one column per run")
    # validation by default: the split a run selects its epoch on (reading test curves to choose is a leak)
    r.add_argument("--split", default="valid", choices=("test", "valid"), help="split for --curve (default valid)")
    r.add_argument("--json", action="store_true", help="one JSON object per row (per run with --curve)")
    r.add_argument("--record", metavar="FILE", help="also write the JSON rows, stamped with the command, date, commit "
                                                    "and machine, to FILE (e.g. results/quality/ml1m.jsonl)")
    r.set_defaults(fn=cmd_report)
    return p


_INTERRUPTED = ("interrupted; nothing is lost: rerun the same command to resume from the last checkpoint "
                "(OUT/checkpoints)")
_STOPPED: dict = {"checkpoints": None, "step": None, "epoch": None}  # grf train's, for _stopped()


class _Terminated(KeyboardInterrupt):
    """SIGTERM during ``grf train``, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so
    the run stops the same way (its lock released, its peers told); ``grf`` prints where it
    stopped and exits 143, what a process killed by SIGTERM reports."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise _Terminated()


def _stopped() -> str:
    """``stopped by SIGTERM at step N (epoch E); the last checkpoint is PATH (step S, epoch E);
    rerun the same command to resume from it`` (the step where the process saw it; a launcher
    of ranks knows only the checkpoint)."""
    ckdir, step = _STOPPED["checkpoints"], _STOPPED["step"]
    at = f" at step {step} (epoch {_STOPPED['epoch']})" if step is not None else ""
    last = ""
    if ckdir is not None:
        try:
            ck, _ = ckdir.latest_valid()
            last = (f"; the last checkpoint is {ck.describe()}" if ck is not None
                    else f"; no checkpoint was written in {ckdir.folder} yet")
        except Exception:  # noqa: BLE001 - the line itself must not fail
            last = ""
    then = " from it" if last.startswith("; the last") else ""
    return f"stopped by SIGTERM{at}{last}; rerun the same command to resume{then}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except _Terminated:  # past _main's own handler (its last lines)
        log.say(_stopped())
        return 143
    except KeyboardInterrupt:  # also during the imports before _main's own handler
        log.say(_INTERRUPTED)
        return 130


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["grf", *(sys.argv[1:] if argv is None else argv)])  # what --record stamps
    if args.command in ("train", "bench") and args.config is None and (args.command == "train"
                                                                      or args.name == "calibrate"):
        args.config = DEFAULT_CONFIG
    from backends import BackendUnavailable

    from .errors import (CheckpointError, ConfigError, DataError, DistributedError, JaggedError, PluginError,
                         ReportError, RunLocked, TrainingAborted, WriteError)

    user_errors: tuple = (ConfigError, BackendUnavailable, JaggedError, FileNotFoundError, CheckpointError,
                          ReportError, RunLocked, DataError)
    rank = _launched_rank()
    who = "" if rank is None else f"rank {rank}: "  # every rank of a torchrun job prints its own errors
    if hasattr(signal, "SIGXFSZ"):
        # past a file-size limit (ulimit -f) a write then fails with EFBIG, which the writers
        # report (exit 5, naming the file), instead of the signal killing the process mid-write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = None
    if args.command == "train" and rank is None and threading.current_thread() is threading.main_thread():
        # a stopped run says where it stopped. Not in a launched rank: torchrun stops a rank with
        # SIGTERM when another failed, and the rank must go at once (it may be inside a collective)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return code
    except _Terminated:
        log.say(_stopped())
        return 143
    except KeyboardInterrupt:
        log.say(f"{who}{_INTERRUPTED}")
        return 130
    except BrokenPipeError:
        # `grf report ... | head`: the reader left; not an error. Point stdout at devnull so
        # the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except WriteError as exc:  # before user_errors: a WriteError is an OSError, not a user error
        log.error(f"{who}{exc}")
        return 5
    except user_errors as exc:
        log.error(f"{who}{exc}")
        return 2
    except TrainingAborted as exc:  # the run saved its last good state; exit 3 tells scripts apart
        log.error(f"{who}{exc}")
        return 3
    except DistributedError as exc:  # the message starts with "rank R:" already
        log.error(f"{exc}")
        return 4
    except PluginError as exc:  # the user's code failed, not the run: its checkpoints resume
        log.error(f"{who}{exc}")
        return 6
    except (Exception, SystemExit) as exc:  # raised inside a plugin's code (its traceback says): as a hook's
        failure = plugin_failure(exc, resumes=args.command == "train")
        if failure is None:  # the project's own: its traceback, exit 1 (or the SystemExit's code)
            raise
        log.error(f"{who}{failure}")
        return 6
    finally:
        if previous is not None:  # main() called in-process (tests, scripts): their handler back
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
