"""``grf``: train, eval, crosscheck and data commands.

    grf train --config experiments/configs/NAME.toml [--backend B] [--set key=value ...] [--out DIR]
              [--resume | --fresh]   (default: resume from DIR/checkpoints when it holds a valid one)
    grf eval --checkpoint PATH [--backend B] [--split test|valid]
    grf crosscheck --config FILE --backends jax,torch [--json] [--set key=value ...]
    grf data fetch ml-1m | grf data info
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # see npu_ops: torch_npu without CANN breaks torch

DEFAULT_CONFIG = "quickstart"


def _config_path(text: str | None) -> Path | None:
    """A config file path, or a bare name from the packaged experiments/configs/."""
    if text is None:
        return None
    path = Path(text)
    if path.exists() or path.suffix == ".toml":
        return path
    packaged = Path(__file__).resolve().parent.parent / "experiments" / "configs" / f"{text}.toml"
    return packaged if packaged.exists() else path


def _load(args):
    from .config import load_config

    overrides = list(args.set or [])
    if getattr(args, "backend", None):
        overrides.append(f"backend.name={args.backend}")
    return load_config(_config_path(args.config), overrides)


def cmd_train(args) -> int:
    from .runner import train

    cfg = _load(args)
    name = Path(args.config).stem if args.config else DEFAULT_CONFIG
    # bf16/fp16 runs get their own default folder, so they never resume an fp32 run by accident
    suffix = "" if cfg.backend.precision == "fp32" else f"-{cfg.backend.precision}"
    out = Path(args.out or f"runs/{name}-{cfg.backend.name}{suffix}")
    # default: continue from OUT/checkpoints when it holds a valid checkpoint (the runner says so)
    resume = "must" if args.resume else "never" if args.fresh else "auto"
    result = train(cfg, out, progress=not args.quiet, resume=resume)
    keys = ["hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr"]
    print(json.dumps({k: round(result[k], 4) for k in keys} | {"epoch": result["epoch"], "out": str(out)}))
    return 0


def cmd_eval(args) -> int:
    from .runner import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(args.checkpoint, args.backend, args.split), indent=1))
    return 0


def cmd_crosscheck(args) -> int:
    from backends import get_backend

    from . import model
    from .config import replace
    from .crosscheck import crosscheck, random_batch
    from .runner import load_sequences, resolve

    cfg = _load(args)
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if len(names) != 2:
        raise SystemExit("grf crosscheck: --backends takes two names, e.g. --backends jax,torch")
    backends = [get_backend(n, dtype=cfg.backend.dtype) for n in names]
    if cfg.model.num_items == 0 or cfg.data.dataset != "synthetic":
        from .data import loader, split

        data = load_sequences(cfg)
        cfg = resolve(cfg, data)
        cfg = replace(cfg, train={"batch_size": args.users, "max_tokens": 0})
        train_loader = loader.TrainLoader.from_config(split.leave_one_out(data).train, cfg)
        batch = next(iter(train_loader.epoch(0)))
    else:
        batch = random_batch(cfg, seed=cfg.train.seed, num_users=args.users)
    params = model.init_params(cfg.model, seed=cfg.train.seed)
    report = crosscheck(backends, params, batch, cfg)
    print(report.to_json() if args.json else report.to_table())
    return 0 if report.ok else 1


def cmd_data(args) -> int:
    from .data import fetch, paths

    if args.action == "fetch":
        path = fetch.fetch(args.name, args.dest)
        print(f"{args.name}: {path}")
    else:
        print(f"data dir: {paths.data_dir()}")
        for name in paths.dataset_names():
            try:
                print(f"  {name}: {paths.dataset_path(name)}")
            except Exception as exc:  # noqa: BLE001 - report, don't fail
                print(f"  {name}: missing ({exc})")
    return 0


BENCHMARKS = {"balance": "benchmarks.balance"}


def cmd_bench(args) -> int:
    import importlib

    if args.name not in BENCHMARKS:
        raise SystemExit(f"grf bench: unknown benchmark {args.name!r}; available: {', '.join(BENCHMARKS)}")
    importlib.import_module(BENCHMARKS[args.name]).run(json_lines=args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train and evaluate a model")
    t.add_argument("--config", help="TOML config file or packaged config name (default: quickstart)")
    t.add_argument("--backend", help="jax | torch | npu (overrides backend.name)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. model.num_blocks=4")
    t.add_argument("--out", help="output folder (default runs/CONFIG-BACKEND, plus -bf16/-fp16 for those precisions)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    r = t.add_mutually_exclusive_group()
    r.add_argument("--resume", action="store_true",
                   help="require resuming from OUT/checkpoints (error if it holds no valid checkpoint). "
                        "Without --resume or --fresh, a run resumes when it finds one and starts fresh otherwise")
    r.add_argument("--fresh", action="store_true",
                   help="delete OUT/checkpoints and train from step 0")
    t.set_defaults(fn=cmd_train, config=None)

    e = sub.add_parser("eval", help="evaluate a checkpoint on any backend")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--backend", help="backend to evaluate on (default: the one in the checkpoint's config)")
    e.add_argument("--split", default="test", choices=["test", "valid"])
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("crosscheck", help="compare two backends layer by layer on the same params and batch")
    c.add_argument("--config", required=True)
    c.add_argument("--backends", default="jax,torch", help="reference,other (default jax,torch)")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--users", type=int, default=32, help="sequences in the checked batch (default 32)")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(fn=cmd_crosscheck)

    d = sub.add_parser("data", help="fetch datasets or show where they are")
    d.add_argument("action", choices=["fetch", "info"])
    d.add_argument("name", nargs="?", default="ml-1m")
    d.add_argument("--dest", help="target data folder (default: GRF_DATA_DIR or the user cache)")
    d.set_defaults(fn=cmd_data)

    b = sub.add_parser("bench", help="run a benchmark (prints a table, or JSON lines with --json)")
    b.add_argument("name", help=f"one of: {', '.join(BENCHMARKS)}")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train" and args.config is None:
        args.config = DEFAULT_CONFIG
    from backends import BackendUnavailable

    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .jagged import JaggedError
    from .runner import TrainingAborted

    user_errors: tuple = (ConfigError, BackendUnavailable, JaggedError, FileNotFoundError, CheckpointError)
    try:
        from .data.loaders import DataError
        user_errors += (DataError,)
    except ImportError:
        pass
    try:
        return args.fn(args)
    except user_errors as exc:
        print(f"grf: error: {exc}", file=sys.stderr)
        return 2
    except TrainingAborted as exc:  # the run saved its last good state; exit 3 tells scripts apart
        print(f"grf: error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
