"""Checkpoint files: atomic, checksummed, self-validating, retention of the last K, damage detection."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gr_functional.checkpoint import (CheckpointDir, CheckpointError, load_checkpoint, read_checkpoint,
                                      save_checkpoint)
from gr_functional.config import Config

CFG = Config()


def _trees(seed=0):
    rng = np.random.default_rng(seed)
    params = {"item_emb": rng.standard_normal((7, 4)).astype(np.float32),
              "blocks": [{"w": rng.standard_normal((4, 4)).astype(np.float32)}]}
    opt = {"step": np.asarray(3.0, np.float32), "mu": {k: np.zeros_like(v) for k, v in [("item_emb", params["item_emb"])]},
           "nu": {"item_emb": np.ones_like(params["item_emb"])}, "loss_scale": {"scale": np.float32(1024.0)}}
    return params, opt


def _save_steps(folder, steps, keep=0):
    d = CheckpointDir(folder, keep=keep)
    for s in steps:
        params, opt = _trees(s)
        d.save(params, opt, CFG, {"step": s, "epoch": 0})
    return d


def test_roundtrip_is_bitwise_and_keeps_structure(tmp_path):
    params, opt = _trees()
    save_checkpoint(tmp_path / "a.safetensors", params, opt, CFG, {"step": 3})
    p2, o2, cfg, meta = load_checkpoint(tmp_path / "a.safetensors")
    assert cfg == CFG and meta == {"step": 3}
    assert np.array_equal(p2["item_emb"], params["item_emb"]) and np.array_equal(p2["blocks"][0]["w"], params["blocks"][0]["w"])
    assert float(o2["step"]) == 3.0 and float(o2["loss_scale"]["scale"]) == 1024.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no temp file left


def test_keep_last_k_and_manifest(tmp_path):
    d = _save_steps(tmp_path, [2, 4, 6, 8], keep=2)
    assert [s for s, _ in d.steps()] == [8, 6]
    index = json.loads((tmp_path / "manifest.json").read_text())
    assert [e["file"] for e in index["checkpoints"]] == ["step-00000006.safetensors", "step-00000008.safetensors"]
    assert index["latest"] == "step-00000008.safetensors"
    import hashlib
    for e in index["checkpoints"]:
        data = (tmp_path / e["file"]).read_bytes()
        assert e["bytes"] == len(data) and e["sha256"] == hashlib.sha256(data).hexdigest()
    # last.safetensors is the newest checkpoint
    assert (tmp_path / "last.safetensors").read_bytes() == (tmp_path / "step-00000008.safetensors").read_bytes()


def test_pruning_never_touches_later_steps(tmp_path):
    """Files from a later step (an older, longer run) are not the K newest of this run: left alone."""
    _save_steps(tmp_path, [50])
    d = _save_steps(tmp_path, [2, 4, 6], keep=1)
    assert [s for s, _ in d.steps()] == [50, 6]


def _flip_byte(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "truncate_header", "flip_tensor", "flip_meta", "empty", "garbage"])
def test_damaged_checkpoint_is_detected_and_skipped(tmp_path, damage):
    d = _save_steps(tmp_path, [3, 6])
    newest = d.path_for(6)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) - 100])
    elif damage == "truncate_header":
        newest.write_bytes(data[:50])
    elif damage == "flip_tensor":
        _flip_byte(newest, 10)          # inside the last tensor's bytes
    elif damage == "flip_meta":
        text = data.replace(b'"step\\": 6', b'"step\\": 7')  # header JSON escapes the meta string
        assert text != data
        newest.write_bytes(text)
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        newest.write_bytes(b"\x00" * 8 + b"not a checkpoint")
    with pytest.raises(CheckpointError, match="step-00000006"):
        read_checkpoint(newest)
    ck, skipped = d.latest_valid()
    assert ck.step == 3 and ck.path == d.path_for(3)
    assert [p for p, _ in skipped] == [newest]


def test_temp_file_of_a_killed_write_is_not_a_checkpoint(tmp_path):
    d = _save_steps(tmp_path, [3])
    (tmp_path / ".step-00000006.safetensors.abc123.tmp").write_bytes(b"half a checkpoint")
    ck, skipped = d.latest_valid()
    assert ck.step == 3 and not skipped
    assert d.stale_temp_files() == [tmp_path / ".step-00000006.safetensors.abc123.tmp"]


def test_backend_neutral_loading(tmp_path):
    """A checkpoint is numpy: it loads bit-identically into either backend."""
    from backends import get_backend

    params, opt = _trees()
    save_checkpoint(tmp_path / "a.safetensors", params, opt, CFG, {"step": 3})
    p2, *_ = load_checkpoint(tmp_path / "a.safetensors")
    for name in ("jax", "torch"):
        B = get_backend(name)
        back = B.to_numpy_tree(B.asarray_tree(p2))
        assert np.array_equal(back["item_emb"], params["item_emb"]), name


def test_format_1_checkpoints_still_load(tmp_path):
    """Checkpoints of the first format (no checksums) stay readable for ``grf eval``."""
    from safetensors.numpy import save_file

    from gr_functional.config import config_to_toml

    params, _ = _trees()
    save_file({"params.item_emb": params["item_emb"]}, str(tmp_path / "old.safetensors"),
              metadata={"format": "gr-functional/1", "config": config_to_toml(CFG), "meta": json.dumps({"epoch": 1})})
    p2, opt, cfg, meta = load_checkpoint(tmp_path / "old.safetensors")
    assert np.array_equal(p2["item_emb"], params["item_emb"]) and opt is None and meta == {"epoch": 1}


def test_the_shape_check_reads_optimizer_states_of_any_layout():
    """Round 4: every optax checkpoint was called damaged ("opt.optax tensors do not match"): the
    check compared optax's whole state tree with the parameters. It now compares each
    parameter-shaped subtree (AdamW's mu, optax's t0.mu, a masked subset) and nothing else."""
    from types import SimpleNamespace

    from gr_functional.checkpoint import CheckpointError
    from gr_functional.config import Config
    from gr_functional.resume import check_param_shapes

    expected = {"item_emb": (5, 4), "blocks.0.w_o": (4, 4)}
    params = {"item_emb": np.zeros((5, 4)), "blocks": [{"w_o": np.zeros((4, 4))}]}

    def ck(opt):
        return SimpleNamespace(config=Config(), params=params, opt_state=opt, path="ck")

    optax_state = {"step": np.int32(3), "optax": {"t0": {"count": np.int32(3), "mu": params, "nu": params},
                                                  "t1": {"mu": {"item_emb": np.zeros((5, 4))}}}}  # masked
    check_param_shapes(ck(optax_state), expected)
    check_param_shapes(ck({"step": np.int32(1), "mu": params, "nu": params}), expected)
    bad = {"step": np.int32(3), "optax": {"t0": {"mu": {**params, "item_emb": np.zeros((5, 3))}}}}
    with pytest.raises(CheckpointError, match=r"opt.optax.t0.mu tensors do not have the shapes.*item_emb: \(5, 3\)"):
        check_param_shapes(ck(bad), expected)
    with pytest.raises(CheckpointError, match="opt.mu tensors"):  # a top-level moment tree is whole
        check_param_shapes(ck({"step": np.int32(1), "mu": {"item_emb": np.zeros((5, 4))}}), expected)
