"""Shared setup of the reliability tests: a tiny synthetic run that trains in a few seconds."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 80 synthetic users -> 80 training users; batch 16 -> 5 steps per epoch.
TINY = ["data.synthetic_users=80", "data.synthetic_items=150", "data.synthetic_max_events=30",
        "model.max_len=16", "model.embed_dim=16", "model.dqk=8", "model.dv=8", "loss.num_negatives=8",
        "train.epochs=3", "train.batch_size=16", "train.log_every=1", "eval.batch_size=64"]


def sets(items) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def tiny_config(*extra: str):
    from gr_functional.configure import load_config

    return load_config(ROOT / "experiments" / "configs" / "quickstart.toml", TINY + list(extra))


def grf_command(out, *extra_sets: str, args=()) -> list[str]:
    return [sys.executable, "-m", "gr_functional.cli", "train", "--config", "quickstart", "--quiet",
            "--out", str(out), *sets(TINY + list(extra_sets)), *args]


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("GRF_FAULT", None)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_grf(out, *extra_sets: str, args=(), timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(grf_command(out, *extra_sets, args=args), cwd=ROOT, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def file_digests(folder: Path) -> dict[str, str]:
    """name -> sha256 of every file under ``folder`` (to prove a failed command changed nothing)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
