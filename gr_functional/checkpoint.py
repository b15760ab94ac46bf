"""Backend-neutral checkpoints in safetensors: params, optimizer state, run position, the config.

One file per checkpoint, ``OUT/checkpoints/step-NNNNNNNN.safetensors`` (NNNNNNNN = optimizer steps
taken). Tensor keys are tree paths (``params.blocks.0.w_uvqk``, ``opt.mu.item_emb``, ``opt.step``,
``opt.loss_scale.scale``), all numpy (float32 master weights), so a checkpoint written on torch
loads on JAX and vice versa. The safetensors metadata holds:

  format     "gr-functional/2" ("gr-functional/1" files, without checksums, still load)
  config     the resolved config as TOML
  meta       JSON: step, epoch, backend, precision, loader position, run state (docs/guides/reliability.md "Reliability")
  checksums  JSON manifest: sha256 of every tensor's bytes and of the config + meta strings

so every file validates itself: a truncated file fails to parse and a flipped bit fails a
checksum. ``OUT/checkpoints/manifest.json`` indexes the folder (file, step, epoch, bytes and the
sha256 of the whole file, for ``sha256sum``-style checks by other tools); ``last.safetensors`` is a
hard link to (or a copy of) the newest checkpoint, for ``grf eval``.

Writes are atomic: temp file in the same folder, fsync, rename, fsync of the folder. A run killed
at any instant leaves either the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import tomllib
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .config import Config, build_config, config_to_toml
from .tree import tree_from_items, tree_items
from .errors import CheckpointError, NonFiniteState, WriteError  # noqa: F401 (re-exported)

FORMAT = "gr-functional/2"
READABLE_FORMATS = ("gr-functional/1", FORMAT)
INDEX_FORMAT = "gr-functional/checkpoints/1"
_STEP_FILE = re.compile(r"^step-(\d+)\.safetensors$")


def first_non_finite(tree: dict | None, prefix: str = "") -> str | None:
    """The path of the first leaf of a numpy tree holding NaN/Inf, or None when all are finite."""
    if tree is None:
        return None
    for key, leaf in tree_items(tree):
        arr = np.asarray(leaf)
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            return prefix + key
    return None


# ----------------------------------------------------------------------------- fault injection
def fault_point(name: str, step: int) -> None:
    """Test hook for crash tests: with ``GRF_FAULT=NAME@STEP`` in the environment, print
    ``GRF_FAULT paused at NAME@STEP pid=PID`` on stdout and sleep until killed (the test sends
    SIGKILL). Points: ``after-step`` (after optimizer step STEP and its checkpoint, if any),
    ``checkpoint-tmp`` (checkpoint STEP written to its temp file, not yet renamed). Unset: no-op."""
    spec = os.environ.get("GRF_FAULT")
    if not spec or spec != f"{name}@{step}":
        return
    print(f"GRF_FAULT paused at {spec} pid={os.getpid()}", flush=True)
    deadline = time.monotonic() + 600  # never hang CI forever if the test dies first
    while time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(99)


# ----------------------------------------------------------------------------- atomic writes
def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows): rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_mode() -> int:
    """0o666 minus the umask: what ``open(path, "w")`` would give (mkstemp makes 0o600 files)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _file_mode()


def atomic_write_bytes(path: Path, data: bytes, *, fault_step: int | None = None) -> None:
    """Write ``data`` to ``path`` via a hidden temp file in the same folder, fsync, rename."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, _MODE) if hasattr(os, "fchmod") else None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if fault_step is not None:
            fault_point("checkpoint-tmp", fault_step)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise write_error(path, exc) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            try:
                os.remove(tmp)  # never renamed: not a checkpoint, whatever it holds
            except OSError:
                pass


def write_error(path: Path, exc: OSError) -> WriteError:
    """``exc`` as a ``WriteError`` naming ``path`` and the OS's reason (errno text)."""
    if isinstance(exc, WriteError):
        return exc
    reason = exc.strerror or str(exc)
    return WriteError(exc.errno, f"cannot write {path}: {reason}" + (f" [errno {exc.errno}]" if exc.errno else ""))


def _sha256(buf) -> str:
    return hashlib.sha256(buf).hexdigest()


def _array_sha256(arr: np.ndarray) -> str:
    return _sha256(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)


# ----------------------------------------------------------------------------- one file
def serialize_checkpoint(params_np: dict, opt_state_np: dict | None, cfg: Config, meta: dict | None = None,
                         host: dict | None = None) -> bytes:
    """The safetensors bytes of a checkpoint (numpy trees -> tensors, metadata with checksums).
    ``host``: host-side state that is not a parameter (a hash table's id map and counters:
    ``embedding.lookup.EmbeddingHost.state_dict``), tensors ``host.*`` kept in their own dtypes."""
    tensors = {f"params.{k}": np.array(v, order="C") for k, v in tree_items(params_np)}
    if opt_state_np is not None:
        tensors.update({f"opt.{k}": np.array(v, order="C") for k, v in tree_items(opt_state_np)})
    if host:
        tensors.update({f"host.{k}": np.array(v, order="C") for k, v in tree_items(host)})
    config_text = config_to_toml(cfg)
    meta_text = json.dumps(meta or {}, sort_keys=True)
    checksums = {"tensors": {k: _array_sha256(v) for k, v in tensors.items()},
                 "config+meta": _sha256((config_text + "\0" + meta_text).encode())}
    metadata = {"format": FORMAT, "config": config_text, "meta": meta_text,
                "checksums": json.dumps(checksums, sort_keys=True)}
    return st_save(tensors, metadata=metadata)


def save_checkpoint(path: str | Path, params_np: dict, opt_state_np: dict | None, cfg: Config,
                    meta: dict | None = None) -> Path:
    """Write numpy trees to ``path`` atomically. ``meta`` (JSON-able) holds step, epoch, backend..."""
    path = Path(path)
    atomic_write_bytes(path, serialize_checkpoint(params_np, opt_state_np, cfg, meta))
    return path


@dataclasses.dataclass
class Checkpoint:
    """A loaded, verified checkpoint: numpy trees, the embedded config, its meta and the file."""

    params: dict
    opt_state: dict | None
    config: Config
    meta: dict
    path: Path
    host: dict | None = None  # host-side state (``serialize_checkpoint``), None when the run had none

    @property
    def step(self) -> int:
        return int(self.meta.get("step", 0))

    def describe(self) -> str:
        """``"PATH (step N, epoch E)"``: for messages that tell the user where their work is."""
        return f"{self.path} (step {self.step}, epoch {self.meta.get('epoch')})"


def _header(path: Path, data: bytes) -> dict:
    """The safetensors JSON header (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise CheckpointError(f"checkpoint {path} is truncated ({len(data)} bytes, not even a header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > 1 << 30 or data[8:9] != b"{":  # safetensors headers are JSON objects of modest size
        raise CheckpointError(f"{path} is not a checkpoint (no safetensors header); pass a "
                              f"OUT/checkpoints/*.safetensors file")
    if n > len(data) - 8:
        raise CheckpointError(f"checkpoint {path} is truncated: the header claims {n} bytes, "
                              f"the file has {len(data)}")
    try:
        return json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupted: unreadable header ({exc})") from None


def read_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Load and (``verify``) check a checkpoint file; raises ``CheckpointError`` naming the file and
    what is wrong (missing, truncated, corrupted, not a gr-functional checkpoint)."""
    path = Path(path)
    if path.is_dir():
        inside = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        raise CheckpointError(f"checkpoint {path} is a folder; pass a checkpoint file, e.g. "
                              f"{inside / 'last.safetensors'}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    metadata = _header(path, data).get("__metadata__") or {}
    fmt = metadata.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(f"{path} is not a gr-functional checkpoint (metadata format={fmt!r})")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupted?): {exc}") from None
    config_text, meta_text = metadata.get("config", ""), metadata.get("meta", "{}")
    if verify and fmt != "gr-functional/1":
        try:
            checksums = json.loads(metadata["checksums"])
        except (KeyError, json.JSONDecodeError):
            raise CheckpointError(f"checkpoint {path} is corrupted: its checksum manifest is missing or unreadable") from None
        if _sha256((config_text + "\0" + meta_text).encode()) != checksums.get("config+meta"):
            raise CheckpointError(f"checkpoint {path} is corrupted: config/meta checksum mismatch")
        expected = checksums.get("tensors", {})
        if set(expected) != set(tensors):
            missing = sorted(set(expected) ^ set(tensors))[:3]
            raise CheckpointError(f"checkpoint {path} is corrupted: tensor set differs from its manifest ({missing})")
        for name, arr in tensors.items():
            if _array_sha256(arr) != expected[name]:
                raise CheckpointError(f"checkpoint {path} is corrupted: checksum mismatch in tensor {name}")
    try:
        cfg = build_config(tomllib.loads(config_text), source=f"{path} (embedded config)", stored=True)
        meta = json.loads(meta_text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable config or meta: {exc}") from None
    params = tree_from_items({k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")})
    opt_items = {k[len("opt."):]: v for k, v in tensors.items() if k.startswith("opt.")}
    opt_state = tree_from_items(opt_items) if opt_items else None
    if opt_state is not None and "step" in opt_state:
        opt_state["step"] = np.asarray(opt_state["step"])
    host_items = {k[len("host."):]: v for k, v in tensors.items() if k.startswith("host.")}
    return Checkpoint(params, opt_state, cfg, meta, path, tree_from_items(host_items) if host_items else None)


def check_finite(ck: Checkpoint) -> Checkpoint:
    """``ck``, or ``NonFiniteState`` naming the file and the first NaN/Inf tensor (a diverged run
    written by a version without the parameter guard)."""
    bad = first_non_finite(ck.params, "params.") or first_non_finite(ck.opt_state, "opt.")
    if bad is not None:
        raise NonFiniteState(f"checkpoint {ck.path} holds non-finite numbers ({bad}): a diverged state")
    return ck


def load_checkpoint(path: str | Path) -> tuple[dict, dict | None, Config, dict]:
    """``(params, opt_state or None, config, meta)`` as numpy trees, checksums verified."""
    ck = read_checkpoint(path)
    return ck.params, ck.opt_state, ck.config, ck.meta


# ----------------------------------------------------------------------------- the folder
class CheckpointDir:
    """``OUT/checkpoints``: numbered checkpoints, their index, ``last.safetensors``, retention.

    ``save`` writes ``step-NNNNNNNN.safetensors`` atomically, then the index and the ``last`` link,
    then deletes all but the newest ``keep`` checkpoints (0 keeps all) among those at or before
    the new step: files from a later step (left by an earlier, longer run) are never touched.
    ``latest_valid`` returns the newest checkpoint that verifies, and the skipped ones with reasons.
    """

    def __init__(self, folder: str | Path, keep: int = 3):
        self.folder = Path(folder)
        self.keep = int(keep)

    @property
    def index_path(self) -> Path:
        return self.folder / "manifest.json"

    @property
    def last_path(self) -> Path:
        return self.folder / "last.safetensors"

    @property
    def best_path(self) -> Path:
        """The checkpoint of the epoch eval.json reports (the best validation epoch): kept however
        many numbered ones retention deletes, and what ``grf eval --checkpoint OUT`` evaluates."""
        return self.folder / "best.safetensors"

    def mark_best(self, path: Path) -> None:
        """Make ``best.safetensors`` the checkpoint ``path`` (a hard link, else an atomic copy)."""
        self._link(path, self.best_path)

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{int(step):08d}.safetensors"

    def steps(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every numbered checkpoint file, newest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _STEP_FILE.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def stale_temp_files(self) -> list[Path]:
        """Temp files of writes a killed run never finished (safe to delete: never renamed)."""
        if not self.folder.is_dir():
            return []
        ours = (".step-", ".manifest.json.", ".last.safetensors.", ".best.safetensors.")  # atomic_write_bytes / _link names
        return sorted(p for p in self.folder.iterdir() if p.name.startswith(ours) and p.name.endswith(".tmp"))

    def set_aside(self, path: Path) -> Path:
        """Move a checkpoint of another config out of the way (``checkpoints/other-config/``), so
        this run's saves and retention never overwrite or delete it; returns the new path."""
        aside = self.folder / "other-config"
        aside.mkdir(exist_ok=True)
        target, n = aside / path.name, 1
        while target.exists():
            target, n = aside / f"{path.stem}.{n}{path.suffix}", n + 1
        os.replace(path, target)
        return target

    def read_index(self) -> dict:
        try:
            index = json.loads(self.index_path.read_text())
            if index.get("format") == INDEX_FORMAT and isinstance(index.get("checkpoints"), list):
                return index
        except (OSError, ValueError):
            pass
        return {"format": INDEX_FORMAT, "checkpoints": []}

    def save(self, params_np: dict, opt_state_np: dict | None, cfg: Config, meta: dict, host: dict | None = None) -> Path:
        """Write checkpoint ``meta["step"]``; raises ``NonFiniteState`` (writing nothing) when the
        params or optimizer state hold NaN/Inf, so every checkpoint in the folder is finite and
        retention, which keeps the newest ones, never deletes the newest finite one."""
        step = int(meta["step"])
        path = self.path_for(step)
        bad = first_non_finite(params_np, "params.") or first_non_finite(opt_state_np, "opt.")
        if bad is not None:
            raise NonFiniteState(f"refusing to write checkpoint {path}: {bad} holds NaN/Inf")
        data = serialize_checkpoint(params_np, opt_state_np, cfg, meta, host)
        atomic_write_bytes(path, data, fault_step=step)
        try:
            self._link_last(path, data)
            removed = self._prune(step)
        except OSError as exc:  # the checkpoint itself is written and valid; say what failed after it
            raise write_error(self.last_path, exc) from None
        entries = [e for e in self.read_index()["checkpoints"]
                   if e.get("file") != path.name and (self.folder / str(e.get("file"))).is_file()
                   and e.get("file") not in removed]
        entries.append({"file": path.name, "step": step, "epoch": meta.get("epoch"), "reason": meta.get("reason"),
                        "bytes": len(data), "sha256": _sha256(data), "finite": True})
        entries.sort(key=lambda e: e["step"])
        index = {"format": INDEX_FORMAT, "latest": path.name, "checkpoints": entries}
        atomic_write_bytes(self.index_path, (json.dumps(index, indent=1) + "\n").encode())
        return path

    def _link_last(self, path: Path, data: bytes) -> None:
        self._link(path, self.last_path, data)

    def _link(self, path: Path, target: Path, data: bytes | None = None) -> None:
        tmp = self.folder / f".{target.name}.link.tmp"
        try:
            if tmp.exists():
                tmp.unlink()
            os.link(path, tmp)  # a hard link: no copy, and pruning the step file keeps it alive
            os.replace(tmp, target)
            _fsync_dir(self.folder)
        except OSError:  # filesystems without hard links: write a copy (also atomic)
            if tmp.exists():
                tmp.unlink()
            atomic_write_bytes(target, path.read_bytes() if data is None else data)

    def _prune(self, newest: int) -> set[str]:
        if self.keep <= 0:
            return set()
        older = [(s, p) for s, p in self.steps() if s <= newest]
        removed = set()
        for _, p in older[self.keep:]:
            p.unlink(missing_ok=True)
            removed.add(p.name)
        return removed

    def latest_valid(self, accept=None) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
        """The newest checkpoint that loads, verifies and holds only finite numbers, and
        ``[(path, reason)]`` of the newer ones skipped (truncated, corrupted, unreadable,
        non-finite). ``accept(checkpoint)``, if given, returns None to take a checkpoint or a
        reason to skip it (a checkpoint of another config)."""
        skipped = []
        for _, path in self.steps():
            try:
                ck = read_checkpoint(path)
                check_finite(ck)
            except CheckpointError as exc:
                skipped.append((path, str(exc)))
                continue
            reason = accept(ck) if accept is not None else None
            if reason is None:
                return ck, skipped
            skipped.append((path, reason))
        return None, skipped


    def clear(self) -> int:
        """Delete every checkpoint, the index, ``last``, ``best`` and temp files (``grf train --fresh``);
        returns the number of checkpoint files deleted."""
        n = 0
        for _, p in self.steps():
            p.unlink(missing_ok=True)
            n += 1
        n += int(self.last_path.exists())
        for p in (self.index_path, self.last_path, self.best_path, *self.stale_temp_files()):
            p.unlink(missing_ok=True)
        return n


def checkpoint_of(path: str | Path) -> Path:
    """The checkpoint file ``grf eval --checkpoint PATH`` means: a file as it is; a run folder (or
    its ``checkpoints/``) gives ``best.safetensors``, the epoch its eval.json reports, else
    ``last.safetensors``. ``CheckpointError`` naming what was looked for when neither exists."""
    path = Path(path)
    if not path.is_dir():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    ckdir = CheckpointDir(folder)
    for candidate in (ckdir.best_path, ckdir.last_path):
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"{path} is a folder without {ckdir.best_path.name} or {ckdir.last_path.name} (looked in "
                          f"{folder}); pass a checkpoint file, or a run folder (grf train --out)")
