"""[hardening] regressions: poisoned checkpoints, divergence caught on the parameters and at
evaluation, one writer per run folder, write failures, damaged/foreign checkpoints, small CLI
fixes. Each test failed before the change it guards (see the issue's reproduction in each)."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest

from backends import get_backend
from gr_functional import model
from gr_functional.checkpoint import CheckpointDir, NonFiniteState, read_checkpoint, save_checkpoint
from gr_functional.cli import main
from gr_functional.config import Config, replace
from gr_functional.step import init_opt_state, train_step
from gr_functional.tree import tree_items, tree_map

from ..differential.test_model import CFG, make_train_batch
from .common import ROOT, TINY, file_digests, grf_command, metrics, run_grf, sets, subprocess_env


def _args(out, *extra):
    return ["train", "--config", "quickstart", "--quiet", "--out", str(out)] + sets(TINY + list(extra))


def _max_abs(tree) -> float:
    return max(float(np.abs(v).max()) for _, v in tree_items(tree))


# ----------------------------------------------------------------------------- 1. the guard sees the update
@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
@pytest.mark.parametrize("lr,reason", [(float("nan"), "update_finite"), (1e6, "update_ratio")])
def test_bad_update_is_skipped_although_loss_and_gradients_are_finite(name, lr, reason):
    """Before: the guard looked at the loss and gradients only, so lr=nan wrote NaN params and
    lr=1e6 moved every weight by ~1e6, both applied (and checkpointed)."""
    B = get_backend(name)
    cfg = Config(model=CFG)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr))  # past the parse-time check
    params = B.asarray_tree(model.init_params(CFG, seed=0))
    state = init_opt_state(B, params, cfg)
    new_params, new_state, m = B.jit(partial(train_step, B, cfg=cfg))(
        params, state, B.asarray_tree(make_train_batch("mixed")))
    assert bool(m["loss_finite"]) and bool(m["grads_finite"]) and not bool(m["finite"])
    if reason == "update_finite":
        assert not bool(m["update_finite"])
    else:
        assert bool(m["update_finite"]) and float(m["update_ratio"]) > 1e3
    for tree, new in ((params, new_params), (state, new_state)):
        for (key, a), (_, b) in zip(tree_items(B.to_numpy_tree(tree)), tree_items(B.to_numpy_tree(new))):
            assert np.array_equal(a, b), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_sane_update_ratio_is_small_and_identical_across_backends(name):
    cfg = Config(model=CFG)
    B = get_backend(name)
    params = B.asarray_tree(model.init_params(CFG, seed=0))
    _, _, m = B.jit(partial(train_step, B, cfg=cfg))(params, init_opt_state(B, params, cfg),
                                                     B.asarray_tree(make_train_batch("mixed")))
    assert bool(m["finite"]) and 0 < float(m["update_ratio"]) < 0.1


def test_exploding_lr_aborts_with_healthy_params_and_a_sane_rerun_finishes(tmp_path, capsys):
    """Issue reproduction: lr=1e6 exited 3 but saved params ~1e6 as "last good", and a rerun with a
    sane lr aborted again. Now the bad updates are never applied."""
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    good = CheckpointDir(tmp_path / "checkpoints").latest_valid()[0]
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=2", "optim.lr=1e6", "train.max_bad_steps=3")) == 3
    err = capsys.readouterr().err
    assert "exploding update" in err and "train.max_update_ratio=1" in err
    assert "The last healthy checkpoint is" in err and "step-00000008.safetensors" in err
    assert "rerun the same grf train command" in err and "--set optim.lr=" in err
    aborted = read_checkpoint(tmp_path / "checkpoints" / "step-00000008.safetensors")
    for (key, a), (_, b) in zip(tree_items(aborted.params), tree_items(good.params)):
        assert np.array_equal(a, b), key
    assert main(_args(tmp_path, "train.epochs=2")) == 0  # the original lr resumes and finishes
    final = CheckpointDir(tmp_path / "checkpoints").latest_valid()[0]
    assert final.meta["epoch"] == 1 and _max_abs(final.params) < 10


# ----------------------------------------------------------------------------- 1. checkpoints are finite
def test_a_non_finite_state_is_never_written(tmp_path):
    cfg = Config(model=replace(Config(), model={"num_items": 20}).model)
    params = model.init_params(cfg.model, seed=0)
    params["blocks"][0]["w_o"][0, 0] = np.nan
    d = CheckpointDir(tmp_path, keep=1)
    with pytest.raises(NonFiniteState, match=r"blocks.0.w_o holds NaN/Inf"):
        d.save(params, None, cfg, {"step": 1})
    assert not list(tmp_path.iterdir())


def test_poisoned_checkpoints_of_an_older_version_are_skipped_not_resumed(tmp_path, capsys):
    """The issue's folder after `--set optim.lr=nan`: the newest checkpoints hold NaN (an older
    version wrote them). Resume skips them, names them, and continues from the newest finite one."""
    assert main(_args(tmp_path, "train.epochs=2")) == 0
    ckdir = CheckpointDir(tmp_path / "checkpoints")
    good = ckdir.latest_valid()[0]
    for step in (11, 12):  # what the unguarded version wrote
        nan_params = tree_map(lambda a: np.full_like(a, np.nan), good.params)
        save_checkpoint(ckdir.path_for(step), nan_params, good.opt_state, good.config,
                        {**good.meta, "step": step})
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=3")) == 0
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and "step-00000012.safetensors" in err
    assert "holds non-finite numbers" in err and "from step-00000010.safetensors" in err
    # grf eval of a poisoned file: exit 3 (diverged), not a traceback
    assert main(["eval", "--checkpoint", str(ckdir.path_for(12))]) == 3
    assert "holds non-finite numbers" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 2. divergence at evaluation
def test_non_finite_evaluation_scores_exit_3_naming_the_last_healthy_checkpoint(tmp_path, capsys, monkeypatch):
    """Before: `ValueError: scores hold NaN`, exit 1."""
    from gr_functional.retrieval import task as retrieval

    real = retrieval.make_scorer

    def nan_scorer(B, cfg):
        score = real(B, cfg)
        return lambda params, batch: score(params, batch) * float("nan")

    assert main(_args(tmp_path, "train.epochs=1")) == 0
    monkeypatch.setattr(retrieval, "make_scorer", nan_scorer)
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=2")) == 3
    err = capsys.readouterr().err
    assert "non-finite scores" in err and "The last healthy checkpoint is" in err
    assert "step-00000005.safetensors" in err
    assert metrics(tmp_path)[-1] == {"kind": "abort", "step": 10, "epoch": 1, "reason": "non-finite valid scores"}


# ----------------------------------------------------------------------------- 3. one writer per folder
def _paused(out, *extra, fault="after-step@2"):
    proc = subprocess.Popen(grf_command(out, *extra), cwd=ROOT, env=subprocess_env(GRF_FAULT=fault),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("GRF_FAULT paused"):
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"never reached the fault point: {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_second_run_on_a_folder_exits_2_and_a_dead_holder_is_taken_over(tmp_path):
    """Before: two runs on one --out both exited 0 with interleaved metrics.jsonl lines."""
    out = tmp_path / "run"
    first = _paused(out)
    try:
        before = file_digests(out)
        second = run_grf(out)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"{out} is in use by another grf train (pid {first.pid} on host" in second.stderr
        assert "grf train" in second.stderr and "use another --out" in second.stderr
        assert file_digests(out) == before  # the second run touched nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = run_grf(out)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"taking over the lock of a run that is gone (pid {first.pid} on host" in third.stderr
    lines = metrics(out)  # every line parses: one writer
    assert lines[-1]["kind"] == "eval" and (out / ".grf.lock").read_text() == ""


def test_rejected_run_on_a_new_folder_leaves_nothing(tmp_path):
    out = tmp_path / "new"
    assert main(_args(out, "model.num_items=3", "data.synthetic_items=150")) == 2
    assert not out.exists()


# ----------------------------------------------------------------------------- 4. write failures
@pytest.mark.slow
def test_file_size_limit_is_a_one_line_error_and_resume_trusts_no_partial_file(tmp_path):
    """Before: SIGXFSZ killed the run (or a raw OSError traceback)."""
    out = tmp_path / "run"
    ok = run_grf(out, "train.epochs=1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    size = max(p.stat().st_size for p in (out / "checkpoints").glob("step-*.safetensors"))
    cmd = " ".join(f"'{c}'" for c in grf_command(out, "train.epochs=2"))
    # ulimit -f counts 1024-byte blocks: half a checkpoint, so the next checkpoint write fails
    failed = subprocess.run(["bash", "-c", f"ulimit -f {size // 2048} && exec {cmd}"], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert failed.returncode == 5, failed.stderr[-2000:]
    err = failed.stderr.strip().splitlines()[-1]
    assert err.startswith("grf: error: cannot write ") and "File too large" in err, failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    assert "The last intact checkpoint is" in err and "step-00000005.safetensors (step 5, epoch 0)" in err
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    resumed = run_grf(out, "train.epochs=2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "from step-00000005.safetensors" in resumed.stderr
    assert [m["step"] for m in metrics(out) if m["kind"] == "train"] == list(range(1, 11))


@pytest.mark.slow
@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_unwritable_checkpoint_folder_exits_5_naming_file_and_last_checkpoint(tmp_path, capsys, monkeypatch, code):
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    real_replace = os.replace

    def failing_replace(src, dst, *a, **k):
        if str(dst).endswith(".safetensors"):
            raise OSError(code, os.strerror(code))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", failing_replace)
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=2")) == 5
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grf: error:")]
    assert len(err) == 1 and "Traceback" not in err[0]
    err = err[0]
    assert f"cannot write {tmp_path / 'checkpoints' / 'step-00000010.safetensors'}: {os.strerror(code)}" in err
    assert "last intact checkpoint is" in err and "step-00000005.safetensors" in err
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


# ----------------------------------------------------------------------------- 8. small ones
def test_eval_writes_its_result_beside_the_checkpoint(tmp_path, capsys):
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    ck = tmp_path / "checkpoints" / "last.safetensors"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ck)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "checkpoints" / "last.eval-test-torch.json").read_text())
    assert written == printed and written["split"] == "test"
    assert main(["eval", "--checkpoint", str(ck), "--split", "valid", "--out", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["split"] == "valid"


@pytest.mark.slow
def test_report_into_a_closed_pipe_prints_no_traceback(tmp_path):
    assert main(_args(tmp_path / "a", "train.epochs=1", "train.max_steps=2")) == 0
    runs = " ".join([str(tmp_path / "a")] * 400)
    proc = subprocess.run(f"{sys.executable} -m gr_functional.cli report {runs} --curve hr@10 | head -1",
                          shell=True, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.stdout.count("\n") == 1
    assert "BrokenPipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_unknown_config_name_lists_the_packaged_configs(capsys):
    assert main(["train", "--config", "ml1m_hstuu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--config ml1m_hstuu: no such file" in err and "ml1m_hstu, ml1m_hstu_best, ml1m_hstu_bf16" in err


def test_checkpoint_whose_tensors_contradict_its_config_is_a_clear_error(tmp_path, capsys):
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    ck = read_checkpoint(tmp_path / "checkpoints" / "last.safetensors")
    params = dict(ck.params, item_emb=ck.params["item_emb"][:, :8])  # 16 wide in the config
    bad = tmp_path / "edited.safetensors"
    save_checkpoint(bad, params, None, ck.config, ck.meta)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "do not have the shapes its own config gives" in err and "item_emb" in err and "Traceback" not in err


def test_newer_checkpoint_of_another_config_is_skipped_not_a_refusal(tmp_path, capsys):
    """Before: resume refused and suggested --fresh, which would delete the valid checkpoints."""
    assert main(_args(tmp_path, "train.epochs=2")) == 0
    ckdir = CheckpointDir(tmp_path / "checkpoints")
    good = ckdir.latest_valid()[0]
    other = replace(good.config, train={"seed": 7})
    # at the very step this run will save next: it must be moved aside, not overwritten (campaign D16)
    foreign = ckdir.path_for(15)
    save_checkpoint(foreign, good.params, good.opt_state, other, {**good.meta, "step": 15})
    foreign_bytes = foreign.read_bytes()
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=3")) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step-00000015" in err and "train.seed: checkpoint 7, now 42" in err
    assert "from step-00000010.safetensors" in err and "other-config" in err
    assert (ckdir.folder / "other-config" / "step-00000015.safetensors").read_bytes() == foreign_bytes
    assert read_checkpoint(ckdir.path_for(15)).config.train.seed == 42
    # with no checkpoint of this config left, it is still a refusal naming the keys
    for step, path in ckdir.steps():
        path.unlink()
    save_checkpoint(ckdir.path_for(99), good.params, good.opt_state, other, {**good.meta, "step": 99})
    assert main(_args(tmp_path, "train.epochs=3")) == 2
    assert "trained with a different config (train.seed: checkpoint 7, now 42)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- campaign findings
def test_abort_on_an_epochs_last_batch_is_finished_by_the_restart(tmp_path, capsys):
    """Campaign P08: the abort's data position was the next epoch, so the advised restart said
    "already complete" and the epoch was never evaluated."""
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    # epoch 1 = steps 6..10; 5 bad steps in a row end exactly on its last batch
    assert main(_args(tmp_path, "train.epochs=2", "optim.lr=1e6", "train.max_bad_steps=5")) == 3
    assert main(_args(tmp_path, "train.epochs=2")) == 0
    evals = [m for m in metrics(tmp_path) if m["kind"] == "eval"]
    assert [(m["epoch"], m["split"]) for m in evals][-2:] == [(1, "valid"), (1, "test")]
    assert json.loads((tmp_path / "eval.json").read_text())["last_epoch"] == 1


def test_any_eval_ks_with_10_trains_and_reports(tmp_path, capsys):
    """Campaign C17/R04: eval.ks=[10] crashed the CLI's summary line and grf report."""
    assert main(_args(tmp_path / "a", "train.epochs=1", "eval.ks=[10]")) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "hr@10" in out and "hr@50" not in out
    assert main(_args(tmp_path / "b", "train.epochs=1")) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "hr@50" in table and table.count("| done |") == 2


def test_report_tells_aborted_and_stopped_runs_from_running_ones(tmp_path, capsys):
    assert main(_args(tmp_path / "aborted", "train.epochs=2", "optim.lr=1e6", "train.max_bad_steps=2")) == 3
    assert main(_args(tmp_path / "stopped", "train.epochs=2", "train.max_steps=3")) == 0
    (tmp_path / "stopped" / "eval.json").unlink()  # as a run killed before its end leaves it
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) == 0
    status = {json.loads(line)["run"]: json.loads(line)["status"] for line in capsys.readouterr().out.splitlines()}
    assert status["aborted"].startswith("aborted") and status["stopped"].startswith("stopped"), status


@pytest.mark.parametrize("case", ["out_is_a_file", "config_not_utf8", "config_is_a_folder", "eval_unknown_backend",
                                  "toml_string_number"])
def test_campaign_tracebacks_are_clear_errors(tmp_path, capsys, case):
    if case == "out_is_a_file":
        (tmp_path / "f").write_text("x")
        code, fragment = main(_args(tmp_path / "f")), "cannot use"
    elif case == "config_not_utf8":
        (tmp_path / "c.toml").write_bytes(b"[model]\nembed_dim = 8 # \xff\xfe\n")
        code, fragment = main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")]), "UTF-8"
    elif case == "config_is_a_folder":
        code, fragment = main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "o")]), "is a folder"
    elif case == "eval_unknown_backend":
        assert main(_args(tmp_path / "r", "train.epochs=1", "train.max_steps=1")) == 0
        capsys.readouterr()
        code = main(["eval", "--checkpoint", str(tmp_path / "r" / "checkpoints" / "last.safetensors"),
                     "--backend", "foo"])
        fragment = "--backend foo: backend.name='foo': no backend named 'foo' is registered"
    else:
        (tmp_path / "c.toml").write_text('[train]\nbatch_size = "16"\n')
        code = main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")])
        fragment = "train.batch_size: expected an integer, got '16' (a quoted string: drop the quotes)"
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err, err


def test_read_only_folder_is_a_write_failure_even_for_the_lock(tmp_path, capsys, monkeypatch):
    """Recheck W05: a finished run's folder made read-only failed at the lock file with exit 2."""
    assert main(_args(tmp_path, "train.epochs=1")) == 0
    real_open = os.open

    def read_only(path, flags, *a, **k):
        if str(path).endswith(".grf.lock") and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    capsys.readouterr()
    assert main(_args(tmp_path, "train.epochs=2")) == 5
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / '.grf.lock'}: Read-only file system" in err
    assert "The last intact checkpoint is" in err and "step-00000005.safetensors" in err


@pytest.mark.parametrize("extra,advice", [
    (["train.max_update_ratio=1e-12"], "train.max_update_ratio=1e-12 is below the size of a normal step"),
    (["loss.temperature=1e-30"], "Check loss.temperature=1e-30"),
])
def test_abort_advice_names_the_cause(tmp_path, capsys, extra, advice):
    assert main(_args(tmp_path, "train.epochs=1", "train.max_bad_steps=2", *extra)) == 3
    assert advice in capsys.readouterr().err
