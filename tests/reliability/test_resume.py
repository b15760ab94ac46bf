"""Kill-and-resume: a run SIGKILLed mid-epoch (also mid-checkpoint-write) and resumed writes the same
metrics.jsonl as the uninterrupted run; resume across backends; resume refusals lose nothing."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from gr_functional.checkpoint import CheckpointDir, read_checkpoint
from gr_functional.tree import tree_items

from .common import ROOT, file_digests, grf_command, metrics, run_grf, subprocess_env, tiny_config

CKPT = ["train.checkpoint_every=3", "train.keep_checkpoints=0"]


def _run_until_fault(out, fault: str, *extra_sets: str, timeout=300, command: list | None = None) -> str:
    """Start ``grf train`` with ``GRF_FAULT=fault`` (the tiny quickstart run, or ``command``); when
    it reports the pause, SIGKILL it."""
    err = open(out.parent / f"{out.name}-{fault}.stderr", "w+")
    proc = subprocess.Popen(command or grf_command(out, *CKPT, *extra_sets), cwd=ROOT, env=subprocess_env(GRF_FAULT=fault),
                            stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            if line.startswith(f"GRF_FAULT paused at {fault}"):
                break
            assert time.monotonic() < deadline, "the run never reached the fault point"
        else:
            err.seek(0)
            pytest.fail(f"run ended (rc={proc.wait()}) before the fault point {fault}:\n{err.read()}")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    err.seek(0)
    return err.read()


def _final_params(out):
    ck = read_checkpoint(CheckpointDir(out / "checkpoints").steps()[0][1])
    return ck, dict(tree_items(ck.params)), dict(tree_items(ck.opt_state))


def _eval_json(out):
    result = json.loads((out / "eval.json").read_text())
    result.pop("wall_seconds")
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (torch, CPU, deterministic mode: the default)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = run_grf(out, *CKPT)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_sigkill_mid_epoch_and_mid_checkpoint_resume_identically(reference, tmp_path):
    out = tmp_path / "run"
    # 5 steps per epoch, checkpoints at steps 3, 5 (epoch end), 6, 9, 10 (epoch end), 12, 15 (final)
    _run_until_fault(out, "after-step@7")                # killed mid-epoch 1, one step after checkpoint 6
    assert CheckpointDir(out / "checkpoints").steps()[0][0] == 6
    assert metrics(out)[-1]["step"] == 7                 # step 7 was logged: resume must drop that line
    # resume, and kill it again while checkpoint 12 sits in its temp file (written, not renamed)
    stderr = _run_until_fault(out, "checkpoint-tmp@12")
    assert "resuming" in stderr and "step-00000006.safetensors" in stderr
    assert CheckpointDir(out / "checkpoints").steps()[0][0] == 10
    assert CheckpointDir(out / "checkpoints").stale_temp_files()  # the half-written checkpoint 12
    proc = run_grf(out, *CKPT)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr and "step-00000010.safetensors" in proc.stderr
    assert not CheckpointDir(out / "checkpoints").stale_temp_files()

    # the deterministic record is byte-identical; so are eval.json (minus wall time) and the final state
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    assert _eval_json(out) == _eval_json(reference)
    ck, params, opt = _final_params(out)
    ck_ref, params_ref, opt_ref = _final_params(reference)
    assert ck.step == ck_ref.step == 15 and ck.meta["run"] == ck_ref.meta["run"]
    for key in params_ref:
        assert np.array_equal(params[key], params_ref[key]), key
    for key in opt_ref:
        assert np.array_equal(opt[key], opt_ref[key]), key
    events = [json.loads(line)["kind"] for line in (out / "timing.jsonl").read_text().splitlines()]
    assert events.count("resume") == 2


@pytest.mark.slow
def test_damaged_latest_checkpoint_is_skipped_with_a_warning(reference, tmp_path):
    """Truncate the newest checkpoint and corrupt the one before: resume warns naming both and
    continues from the newest valid one, to the same result."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    d = CheckpointDir(out / "checkpoints")
    for step, path in d.steps():
        if step > 10:
            path.unlink()                               # as if killed after step 10's checkpoint ...
    (newest := d.path_for(10)).write_bytes(newest.read_bytes()[:-64])        # ... truncated
    data = bytearray((second := d.path_for(9)).read_bytes())
    data[-20] ^= 0xFF
    second.write_bytes(bytes(data))                     # ... and a flipped bit
    proc = run_grf(out, *CKPT)
    assert proc.returncode == 0, proc.stderr
    assert "skipping damaged checkpoint" in proc.stderr
    assert str(newest) in proc.stderr and str(second) in proc.stderr
    assert "from step-00000006.safetensors" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()


@pytest.mark.slow
def test_same_seed_same_backend_identical(reference, tmp_path):
    """Two fresh runs (separate processes) with the same seed: identical metrics and parameters."""
    out = tmp_path / "again"
    assert run_grf(out, *CKPT).returncode == 0
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    assert _final_params(out)[1].keys() == _final_params(reference)[1].keys()
    for key, value in _final_params(reference)[1].items():
        assert np.array_equal(_final_params(out)[1][key], value), key


@pytest.mark.slow
def test_synchronous_batch_building_is_bitwise_the_prefetched_run(reference, tmp_path):
    """train.prefetch=0 (batches built in the step's thread) vs the default (built ahead on a
    worker thread, which also ran the kill-and-resume test above): the same run, bit for bit."""
    out = tmp_path / "sync"
    assert run_grf(out, *CKPT, "train.prefetch=0").returncode == 0
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    assert _eval_json(out) == _eval_json(reference)
    for mine, ref in zip(_final_params(out)[1:], _final_params(reference)[1:]):
        assert mine.keys() == ref.keys() and all(np.array_equal(mine[k], ref[k]) for k in ref)
    epochs = [json.loads(line) for line in (reference / "timing.jsonl").read_text().splitlines()]
    build = [e["batch_build"] for e in epochs if e["kind"] == "epoch"]
    assert build and all(b["prefetch"] == 2 and b["items"] > 0 and b["build_s"] > 0 for b in build)


def test_refused_resume_changes_nothing(reference, tmp_path):
    """A config that may not resume this run (or --resume without checkpoints) exits 2 with the
    reason and leaves every file as it was."""
    from gr_functional.cli import main

    from .common import TINY, sets

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = file_digests(out)
    base = ["train", "--config", "quickstart", "--quiet", "--out", str(out)] + sets(TINY + CKPT)
    assert main(base + ["--set", "model.num_blocks=3"]) == 2
    assert main(base + ["--set", "train.seed=7"]) == 2
    assert main(base + ["--set", "data.seed=1"]) == 2
    assert file_digests(out) == before
    empty = tmp_path / "empty"
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(empty), "--resume"] + sets(TINY)) == 2
    assert not empty.exists()


@pytest.mark.slow
def test_resume_across_backends(reference, tmp_path):
    """torch steps 1-6 -> JAX steps 7-12 -> torch steps 13-15. Checkpoints are numpy, so the state
    moves bit-exactly; the trajectories then agree to the cross-backend tolerance."""
    from gr_functional.runner import train

    cfg = tiny_config(*CKPT)
    jax_out = tmp_path / "jax"
    shutil.copytree(reference, jax_out)
    for step, path in CheckpointDir(jax_out / "checkpoints").steps():
        if step > 6:
            path.unlink()
    from gr_functional.config import replace

    train(replace(cfg, backend={"name": "jax"}, train={"max_steps": 12}), jax_out, progress=False)
    ck = read_checkpoint(CheckpointDir(jax_out / "checkpoints").path_for(12))
    assert ck.meta["backend"] == "jax"

    torch_out = tmp_path / "torch"
    shutil.copytree(jax_out, torch_out)
    train(cfg, torch_out, progress=False)       # resumes the JAX checkpoint at step 12 on torch
    ref, got = metrics(reference), metrics(torch_out)
    train_ref = {m["step"]: m["loss"] for m in ref if m["kind"] == "train"}
    train_got = {m["step"]: m["loss"] for m in got if m["kind"] == "train"}
    assert train_got.keys() == train_ref.keys() == set(range(1, 16))
    for step in range(1, 7):
        assert train_got[step] == train_ref[step]               # replayed from the torch run itself
    for step in range(7, 16):
        assert abs(train_got[step] - train_ref[step]) <= 1e-4 * abs(train_ref[step]), step
    _, params, _ = _final_params(torch_out)
    _, params_ref, _ = _final_params(reference)
    for key, value in params_ref.items():
        assert np.abs(params[key] - value).max() <= 1e-4 * max(np.abs(value).max(), 1e-3), key
    last_ref = [m for m in ref if m["kind"] == "eval"][-1]
    last_got = [m for m in got if m["kind"] == "eval"][-1]
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert abs(last_got[key] - last_ref[key]) <= 1.0 / 80, key   # a float tie may flip one user


def test_state_moves_bit_exactly_between_backends(reference):
    """The restored tensors on either backend are the checkpoint's bits."""
    from backends import get_backend

    ck = read_checkpoint(CheckpointDir(reference / "checkpoints").path_for(6))
    for name in ("jax", "torch"):
        B = get_backend(name)
        for tree in (ck.params, ck.opt_state):
            back = dict(tree_items(B.to_numpy_tree(B.asarray_tree(tree))))
            for key, value in tree_items(tree):
                assert back[key].dtype == value.dtype and np.array_equal(back[key], value), (name, key)


def test_checkpoint_of_an_earlier_version_is_not_overwritten(tmp_path, capsys):
    """OUT/checkpoints/last.safetensors without numbered checkpoints (written before resume
    existed) cannot be resumed; starting over would replace it, so that needs --fresh."""
    from gr_functional.cli import main

    from .common import TINY, sets

    legacy = tmp_path / "checkpoints" / "last.safetensors"
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"an old result")
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path)] + sets(TINY + ["train.epochs=1"])
    assert main(args) == 2
    assert "earlier gr-functional version" in capsys.readouterr().err and legacy.read_bytes() == b"an old result"
    assert main(args + ["--fresh"]) == 0
    assert legacy.read_bytes() != b"an old result"


def test_precision_runs_get_their_own_default_folder(tmp_path, monkeypatch):
    from gr_functional import runner
    from gr_functional.cli import main

    seen = []
    monkeypatch.setattr(runner, "train", lambda cfg, out, **kw: seen.append((str(out), kw["resume"])) or
                        {k: 0.0 for k in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr")}
                        | {"epoch": 0})
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--quiet"]) == 0
    assert main(["train", "--quiet", "--set", "backend.precision=bf16", "--fresh"]) == 0
    assert main(["train", "--quiet", "--backend", "jax", "--set", "backend.precision=fp16", "--resume"]) == 0
    assert seen == [("runs/quickstart-torch", "auto"), ("runs/quickstart-torch-bf16", "never"),
                    ("runs/quickstart-jax-fp16", "must")]


def test_the_selected_epochs_checkpoint_is_kept_and_grf_eval_of_the_folder_reproduces_eval_json(tmp_path, capsys):
    """Round 4: only the newest checkpoints were kept, so the epoch eval.json reports was gone on long
    runs and grf eval of `last` did not reproduce it. Now checkpoints/best.safetensors is that
    epoch's (kept by retention), and `grf eval --checkpoint OUT` evaluates it: eval.json's numbers."""
    from gr_functional.cli import main

    from .common import TINY, sets

    out = tmp_path / "run"
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(out)]
    assert main(args + sets(TINY + ["train.epochs=4", "train.keep_checkpoints=1", "optim.lr=0.05"])) == 0
    result = json.loads((out / "eval.json").read_text())
    best = read_checkpoint(out / "checkpoints" / "best.safetensors")
    assert best.meta["epoch"] == result["epoch"]
    assert len(CheckpointDir(out / "checkpoints").steps()) == 1
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["epoch"] == result["epoch"]
    assert all(evaluated[k] == result[k] for k in ("hr@10", "ndcg@10", "hr@50", "mrr"))
