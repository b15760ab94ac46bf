"""Backend-neutral checkpoints in safetensors: params, optimizer state, step and the config.

Keys are tree paths (``params.blocks.0.w_uvqk``, ``opt.mu.item_emb``, ``opt.step``); the
resolved config TOML and run position ride in the safetensors metadata. Writes are atomic
(temp file, fsync, rename) so a killed run never leaves a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from .config import Config, build_config, config_to_toml
from .tree import tree_from_items, tree_items

import tomllib


def save_checkpoint(path: str | Path, params_np: dict, opt_state_np: dict | None, cfg: Config,
                    meta: dict | None = None) -> Path:
    """Write numpy trees to ``path`` atomically. ``meta`` (JSON-able) holds step, epoch, backend..."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"params.{k}": np.array(v, order="C") for k, v in tree_items(params_np)}
    if opt_state_np is not None:
        tensors.update({f"opt.{k}": np.array(v, order="C") for k, v in tree_items(opt_state_np)})
    metadata = {"config": config_to_toml(cfg), "meta": json.dumps(meta or {}), "format": "gr-functional/1"}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def load_checkpoint(path: str | Path) -> tuple[dict, dict | None, Config, dict]:
    """``(params, opt_state or None, config, meta)`` as numpy trees."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupted?): {exc}") from exc
    if metadata.get("format") != "gr-functional/1":
        raise ValueError(f"{path} is not a gr-functional checkpoint (metadata format={metadata.get('format')!r})")
    cfg = build_config(tomllib.loads(metadata["config"]), source=f"{path} (embedded config)")
    params = tree_from_items({k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")})
    opt_items = {k[len("opt."):]: v for k, v in tensors.items() if k.startswith("opt.")}
    opt_state = tree_from_items(opt_items) if opt_items else None
    if opt_state is not None and "step" in opt_state:
        opt_state["step"] = np.asarray(opt_state["step"])
    return params, opt_state, cfg, json.loads(metadata.get("meta", "{}"))
