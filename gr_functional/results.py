"""Results as data: what a command measured, written once by that command, stamped with where and
when it ran, so that the documentation's result pages are generated from it (tools/gen_docs.py)
instead of typed.

A results file is JSON lines: first a stamp, then the command's own records::

    {"kind": "stamp", "command": "grf bench attention --json", "date": "2026-11-27T12:00:00+00:00",
     "commit": "2c3385c...", "dirty": false, "machine": {"cpu": "...", "cpus": 2, ...}}
    {"backend": "torch", "L": 256, "ms": 1.9, ...}

``grf bench NAME --record [FILE]`` and ``grf report RUNS --record FILE`` write them (default
``results/bench/NAME.jsonl``); ``read`` returns ``(stamp, records)``.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from .errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("results")  # where --record writes by default (relative to the working directory)


def commit() -> tuple[str, bool]:
    """``(commit, dirty)`` of the checkout this code runs from ("" where it is not a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "", False
    return (head.stdout.strip(), bool(status.stdout.strip())) if head.returncode == 0 else ("", False)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a result was measured on: CPU model and count, architecture, libraries, GPU."""
    info = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "arch": platform.machine(),
            "python": platform.python_version()}
    for name in ("torch", "jax", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            continue
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def stamp(command: str) -> dict:
    code, dirty = commit()
    return {"kind": "stamp", "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "commit": code, "dirty": dirty, "machine": machine()}


def write(path: str | Path, command: str, records: list[dict]) -> Path:
    """Write ``records`` under a stamp to ``path`` (replacing it: the file is the latest measurement;
    git keeps the earlier ones)."""
    if not records:
        raise ConfigError(f"{command}: produced no records to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(stamp(command))] + [json.dumps(r, sort_keys=False) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: str | Path) -> tuple[dict, list[dict]]:
    """``(stamp, records)`` of a results file; ConfigError naming the file when it has no stamp."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or rows[0].get("kind") != "stamp":
        raise ConfigError(f"{path}: a results file starts with a stamp line (gr_functional/results.py)")
    return rows[0], rows[1:]




class JsonLines:
    """A stdout stand-in that passes everything through and keeps each line that is a JSON object
    (what ``--json`` commands print)."""

    def __init__(self, out):
        self.out, self.records, self._partial = out, [], ""

    def write(self, text: str) -> int:
        self.out.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            line = line.strip()
            if line.startswith("{"):
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return len(text)

    def flush(self) -> None:
        self.out.flush()


__all__ = ["RESULTS", "JsonLines", "commit", "machine", "read", "stamp", "write"]
