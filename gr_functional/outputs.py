"""A run's output files: metrics.jsonl / timing.jsonl (``JsonLog``), curves.png, eval.json.

metrics.jsonl is a deterministic function of (config, data, backend): a run killed and resumed
writes the identical file (a resume cuts it back to the lines its checkpoint counted);
timing.jsonl is its wall-clock side. Every write failure raises ``WriteError`` naming the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .checkpoint import atomic_write_bytes, write_error
from .log import warn


class JsonLog:
    """An append-only JSON-lines file that counts its lines; ``keep_lines`` resumes it: the file is
    cut (atomically) to its first ``keep_lines`` lines, the ones written before the checkpoint.
    ``append`` opens an existing file for appending without cutting it (timing.jsonl). Write
    failures raise ``checkpoint.WriteError`` naming the file; a partial last line is harmless
    (a resume cuts metrics.jsonl back to the checkpoint's line count)."""

    def __init__(self, path: Path, keep_lines: int | None = None, append: bool = False):
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


class NullLog:
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


def write_result(out: Path, result: dict, history: list, metric: str, label: str) -> None:
    """eval.json (``result``) and curves.png (``history``'s loss and ``metric``), atomically."""
    atomic_write_bytes(out / "eval.json", json.dumps(result, indent=1).encode())
    try:
        write_curves(out / "curves.png", history, metric=metric, label=label)
    except OSError as exc:
        raise write_error(out / "curves.png", exc) from None
