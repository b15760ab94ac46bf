"""Fingerprints of training runs: what a refactor must leave unchanged.

A fingerprint is the content of a run folder that behaviour decides: every metrics.jsonl record,
eval.json, and every checkpoint tensor (sha256 of its bytes, plus float64 sum and norm so that a
different CPU can be compared within a tolerance), with wall-clock fields removed. It is recorded
before a refactor and checked after it: on the machine that recorded it the bytes must be equal; on
another CPU (another instruction set picks other matmul kernels) values must agree to a tolerance.

    python tools/fingerprints.py record [--size ci|full|legacy] [--only NAME ...] [--runs DIR]
    python tools/fingerprints.py check  [--size ci|full|legacy] [--only NAME ...] [--runs DIR]

``ci`` runs each scenario for a few steps (tests/test_fingerprints.py checks them in CI); ``full`` is
the issue's list at its real size (quickstart, 2 ML-1M epochs on torch and JAX, the ranking preset for
60 steps, a hash table with evictions, a 2-rank row-sharded run), checked by hand around a refactor.
``legacy`` keeps run folders stopped mid-run at the recording commit; ``check`` resumes them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gr_functional.config import migrate  # noqa: E402 - recorded configs are read as stored configs are
from gr_functional.task import unread_sections  # noqa: E402

STORE = ROOT / "tests" / "fingerprints"

# Fields that measure time, not behaviour.
VOLATILE = {"wall_seconds", "seconds", "time", "elapsed_s", "tokens_per_s", "out", "build_s", "wait_s", "hidden"}

_QUICK_SMALL = ["data.synthetic_users=400", "train.epochs=2", "train.checkpoint_every=3", "train.log_every=1"]
_HASH = ["embedding.kind=hash", "embedding.optimizer=lazy_adam"]
# few negatives and small batches, so that a table below the catalogue evicts rather than overflows
_EVICT = _HASH + ["train.batch_size=32", "loss.num_negatives=1", "embedding.capacity=1200"]
# the ranking scenarios were recorded before ranking.group_norm (per-head GroupNorm then; GR HEAD's
# LayerNorm is the default now): they pin what they recorded
_RANK_RECORDED_NORM = "ranking.group_norm=true"
_RANK_TINY = ["data.synthetic_users=24", "data.synthetic_items=300", "data.synthetic_max_events=60",
              "ranking.embed_dim=8", "ranking.dim=16", "ranking.num_layers=1", "ranking.heads=2", "ranking.dqk=4",
              "ranking.dv=4", "ranking.max_seq_len=40", "ranking.video_table=300",
              "ranking.context_tables=[24, 8, 9, 9, 8, 8]", "ranking.tower_hidden=8", "ranking.item_hidden=8",
              "ranking.task_hidden=8", "ranking.position_buckets=64", "ranking.time_buckets=16", "train.epochs=2",
              "train.batch_size=16", "train.log_every=1", "eval.batch_size=8", "train.checkpoint_every=3",
              _RANK_RECORDED_NORM]
_ML1M_CI = ["train.epochs=1", "train.max_steps=6", "train.log_every=1", "eval.max_users=300"]

# name -> size -> (config, backend, nproc, --set items)
SCENARIOS: dict[str, dict[str, tuple[str, str, int, list[str]]]] = {
    "quickstart": {
        "ci": ("quickstart", "torch", 1, _QUICK_SMALL),
        "full": ("quickstart", "torch", 1, ["train.checkpoint_every=100"]),
    },
    "ml1m_torch": {
        "ci": ("ml1m_hstu", "torch", 1, _ML1M_CI),
        "full": ("ml1m_hstu", "torch", 1, ["train.epochs=2"]),
    },
    "ml1m_jax": {
        "ci": ("ml1m_hstu", "jax", 1, _ML1M_CI),
        "full": ("ml1m_hstu", "jax", 1, ["train.epochs=2"]),
    },
    "ranking": {
        "ci": ("kuairand_rank", "torch", 1, _RANK_TINY),
        "full": ("kuairand_rank", "torch", 1, ["train.max_steps=60", "train.log_every=10", "train.checkpoint_every=30",
                                                    _RANK_RECORDED_NORM]),
    },
    "hash_evict": {
        "ci": ("quickstart", "torch", 1, _QUICK_SMALL + _EVICT),
        "full": ("quickstart", "torch", 1, _EVICT + ["loss.num_negatives=4", "embedding.capacity=2000",
                                                     "train.epochs=3", "train.checkpoint_every=100"]),
    },
    "row_sharded_2": {
        "ci": ("quickstart", "torch", 2, _QUICK_SMALL + _EVICT + ["embedding.sharding=row", "train.max_steps=8"]),
        "full": ("quickstart", "torch", 2, _EVICT + ["embedding.sharding=row", "loss.num_negatives=4",
                                                     "embedding.capacity=2000", "train.epochs=2",
                                                     "train.checkpoint_every=100"]),
    },
}


# Runs stopped by SIGKILL after step 6 at the commit the fingerprints were recorded at, kept with the
# fingerprint of the same run uninterrupted: a checkpoint written before a change must resume after it.
_TINY = ["data.synthetic_users=80", "data.synthetic_items=150", "data.synthetic_max_events=30", "model.max_len=16",
         "model.embed_dim=16", "model.dqk=8", "model.dv=8", "loss.num_negatives=8", "train.epochs=3",
         "train.batch_size=16", "train.log_every=1", "eval.batch_size=64", "train.checkpoint_every=3",
         "train.keep_checkpoints=0"]
LEGACY: dict[str, tuple[str, str, int, list[str]]] = {
    "dense": ("quickstart", "torch", 1, _TINY),
    "hash": ("quickstart", "torch", 1, _TINY + _HASH + ["embedding.capacity=60"]),
    "ranking": ("kuairand_rank", "torch", 1, _RANK_TINY + ["train.keep_checkpoints=0"]),
}
LEGACY_STOP = "after-step@6"


def machine() -> dict:
    """What decides float bytes on a CPU: the processor and its vector extensions, and the libraries."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    isa = sorted(f for f in flags.split() if f.startswith(("avx", "amx", "fma", "sse4")))
    model = platform.processor()
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import jax
    import torch

    return {"cpu": model, "isa": isa, "torch": torch.__version__, "jax": jax.__version__,
            "threads": int(os.environ.get("GRF_FINGERPRINT_THREADS", "1"))}


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _tensor_print(arr) -> dict:
    import numpy as np

    a = np.ascontiguousarray(arr)
    f = a.astype(np.float64) if a.dtype.kind in "fiub" else None
    return {"sha256": hashlib.sha256(a.tobytes()).hexdigest(), "dtype": str(a.dtype), "shape": list(a.shape),
            "sum": float(f.sum()) if f is not None else None,
            "norm": float(np.sqrt((f * f).sum())) if f is not None else None}


def _checkpoint_print(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: _tensor_print(f.get_tensor(k)) for k in sorted(f.keys())}
    config = tomllib.loads(meta.pop("config", "")) if "config" in meta else {}
    meta.pop("checksums", None)                       # sha256 of config text and tensors: covered above
    meta = {k: (_clean(json.loads(v)) if v[:1] in "{[" else v) for k, v in meta.items()}
    return {"tensors": tensors, "meta": meta, "config": config}


def fingerprint(run: Path) -> dict:
    """The behaviour-decided content of the run folder ``run``."""
    out: dict = {"metrics": [_clean(json.loads(ln)) for ln in (run / "metrics.jsonl").read_text().splitlines()
                             if ln.strip()]}
    if (run / "eval.json").exists():
        out["eval"] = _clean(json.loads((run / "eval.json").read_text()))
    out["config"] = tomllib.loads((run / "config.toml").read_text())
    ckpts: dict = {}
    for p in sorted((run / "checkpoints").rglob("*")):
        if not p.is_file() or p.is_symlink() or p.name == "last.safetensors":
            continue
        rel = str(p.relative_to(run / "checkpoints"))
        if p.suffix == ".safetensors":
            ckpts[rel] = _checkpoint_print(p)
        elif p.name == "manifest.json":
            m = json.loads(p.read_text())
            ckpts[rel] = [{k: c.get(k) for k in ("file", "step", "epoch", "reason", "finite")}
                          for c in m.get("checkpoints", [])]
        else:
            ckpts[rel] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    out["checkpoints"] = ckpts
    return out


def command(name: str, size: str, out: Path) -> list[str]:
    config, backend, nproc, items = LEGACY[name] if size == "legacy" else SCENARIOS[name][size]
    cmd = [sys.executable, "-m", "gr_functional.cli", "train", "--config", config, "--backend", backend,
           "--quiet", "--out", str(out)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    for item in items:
        cmd += ["--set", item]
    return cmd


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    threads = env.setdefault("GRF_FINGERPRINT_THREADS", "1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = threads
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    env.pop("GRF_FAULT", None)
    return env


def run_scenario(name: str, size: str, out: Path, timeout: float = 3600, fresh: bool = True) -> Path:
    """Train scenario ``name`` into ``out`` (from scratch where ``fresh``, else resuming what is there)."""
    if fresh and out.exists():
        shutil.rmtree(out)
    proc = subprocess.run(command(name, size, out), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"scenario {name} ({size}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return out


def _close(a, b, path: str, rtol: float, errors: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if k == "sha256":
                continue
            if k not in a or k not in b:
                errors.append(f"{path}.{k}: only in {'recorded' if k in a else 'now'}")
            else:
                _close(a[k], b[k], f"{path}.{k}", rtol, errors)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            errors.append(f"{path}: {len(a)} entries recorded, {len(b)} now")
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]", rtol, errors)
    elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if not (math.isclose(a, b, rel_tol=rtol, abs_tol=rtol) or (math.isnan(a) and math.isnan(b))):
            errors.append(f"{path}: {a!r} recorded, {b!r} now")
    elif a != b:
        errors.append(f"{path}: {a!r} recorded, {b!r} now")


def _config_errors(recorded: dict, now: dict, path: str, errors: list[str]) -> None:
    """Every recorded key keeps its value (keys of older versions where ``config.migrate`` moves
    them); keys added since (a new option at its default) are allowed."""
    for k, v in recorded.items():
        if k not in now:
            errors.append(f"{path}.{k}: removed")
        elif isinstance(v, dict):
            _config_errors(v, now[k], f"{path}.{k}", errors)
        elif v != now[k]:
            errors.append(f"{path}.{k}: {v!r} recorded, {now[k]!r} now")


def _behaviour(config: dict) -> dict:
    """``config`` (a stored config, migrated) without the sections its task never reads: a retrieval
    run's ``[ranking]`` (its defaults may move with GR's kuairand-1k without changing that run)."""
    unread = unread_sections(config.get("model", {}).get("task", "retrieval"))
    return {k: v for k, v in config.items() if k not in unread}


def compare(recorded: dict, now: dict, exact: bool, rtol: float = 2e-3) -> list[str]:
    """Differences between two fingerprints: bytes where ``exact``, else values within ``rtol``."""
    errors: list[str] = []
    _config_errors(_behaviour(migrate(recorded["config"])), now["config"], "config.toml", errors)
    for rel, ck in recorded["checkpoints"].items():
        if rel not in now["checkpoints"]:
            errors.append(f"checkpoints/{rel}: missing")
            continue
        other = now["checkpoints"][rel]
        if isinstance(ck, dict) and "config" in ck:
            _config_errors(_behaviour(migrate(ck["config"])), other.get("config", {}), f"checkpoints/{rel}:config",
                           errors)
            ck, other = {k: v for k, v in ck.items() if k != "config"}, {k: v for k, v in other.items() if k != "config"}
        if exact:
            if ck != other:
                errors.append(f"checkpoints/{rel}: differs")
        else:
            _close(ck, other, f"checkpoints/{rel}", rtol, errors)
    extra = set(now["checkpoints"]) - set(recorded["checkpoints"])
    # best.safetensors, new since the recordings ([fresh]): a link to the selected epoch's numbered
    # checkpoint (which retention may since have deleted), not a behaviour of the recorded runs
    extra.discard("best.safetensors")
    errors += [f"checkpoints/{rel}: not recorded" for rel in sorted(extra)]
    for key in ("metrics", "eval"):
        if exact:
            if recorded.get(key) != now.get(key):
                errors.append(f"{key}: differs")
        else:
            _close(recorded.get(key), now.get(key), key, rtol, errors)
    return errors


def _stop_after(name: str, out: Path, timeout: float = 600) -> None:
    """Run legacy scenario ``name`` until LEGACY_STOP, then SIGKILL it (as a crash would)."""
    import signal
    import time

    if out.exists():
        shutil.rmtree(out)
    env = _env()
    env["GRF_FAULT"] = LEGACY_STOP
    proc = subprocess.Popen(command(name, "legacy", out), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("GRF_FAULT paused") or time.monotonic() > deadline:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    (out / ".grf.lock").unlink(missing_ok=True)


def record_legacy(runs: Path) -> None:
    for name in LEGACY:
        whole = fingerprint(run_scenario(name, "legacy", runs / f"legacy-{name}-whole"))
        folder = STORE / "legacy" / name
        _stop_after(name, folder)
        record = {"scenario": name, "command": command(name, "legacy", Path("OUT"))[2:], "stopped": LEGACY_STOP,
                  "machine": machine(), "fingerprint": whole}
        (STORE / "legacy" / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"legacy {name}: recorded ({sum(p.stat().st_size for p in folder.rglob('*') if p.is_file())} bytes)")


def check_legacy(name: str, runs: Path) -> tuple[bool, list[str]]:
    """Resume the stored stopped run ``name`` with today's code; compare with the uninterrupted run."""
    stored = json.loads((STORE / "legacy" / f"{name}.json").read_text())
    out = runs / f"legacy-{name}-resumed"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(STORE / "legacy" / name, out)
    now = fingerprint(run_scenario(name, "legacy", out, fresh=False))
    exact = stored["machine"] == machine()
    want = stored["fingerprint"]
    # The resumed folder keeps the checkpoints written before the stop; compare what both runs wrote last.
    last = max(k for k in want["checkpoints"] if k.endswith(".safetensors"))
    want = dict(want, checkpoints={last: want["checkpoints"][last]})
    now = dict(now, checkpoints={last: now["checkpoints"].get(last)} if last in now["checkpoints"] else {})
    return exact, compare(want, now, exact)


def check(name: str, size: str, runs: Path) -> tuple[bool, list[str]]:
    """``(exact, errors)`` of scenario ``name`` run now against its stored fingerprint."""
    stored = json.loads((STORE / size / f"{name}.json").read_text())
    now = fingerprint(run_scenario(name, size, runs / f"{size}-{name}"))
    exact = stored["machine"] == machine()
    return exact, compare(stored["fingerprint"], now, exact)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["record", "check"])
    ap.add_argument("--size", choices=["ci", "full", "legacy"], default="ci")
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    ap.add_argument("--runs", type=Path, default=Path("/tmp/grf-fingerprints"), help="where the runs are written")
    args = ap.parse_args(argv)
    names = args.only or list(LEGACY if args.size == "legacy" else SCENARIOS)
    failed = 0
    if args.size == "legacy" and args.action == "record":
        record_legacy(args.runs)
        return 0
    for name in names:
        if args.action == "record":
            fp = fingerprint(run_scenario(name, args.size, args.runs / f"{args.size}-{name}"))
            (STORE / args.size).mkdir(parents=True, exist_ok=True)
            config, backend, nproc, items = SCENARIOS[name][args.size]
            record = {"scenario": name, "size": args.size, "command": command(name, args.size, Path("OUT"))[2:],
                      "machine": machine(), "fingerprint": fp}
            (STORE / args.size / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            print(f"{name}: recorded ({len(fp['metrics'])} metrics records, {len(fp['checkpoints'])} checkpoint files)")
        else:
            exact, errors = (check_legacy(name, args.runs) if args.size == "legacy"
                             else check(name, args.size, args.runs))
            failed += bool(errors)
            how = "bytes" if exact else "values (another machine)"
            print(f"{name}: {'same ' + how if not errors else 'DIFFERENT ' + how}")
            for e in errors[:20]:
                print("   ", e)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
