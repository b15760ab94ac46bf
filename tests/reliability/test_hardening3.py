"""[hardening3] regressions of the fault campaign (single process; the launcher's are in
tests/distributed/test_launcher_lifetime.py): a build lock left by a killed build of the fused CPU
ops, a --set value blamed on the config file, SIGTERM, ``grf eval --plugin``. Each test failed
before the change it guards (the campaign's reproduction is in each docstring).

Bounds are generous (a saturated 2-core machine): they only tell "finished" from "hung forever".
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gr_functional.cli import main

from .common import ROOT, TINY, grf_command, run_grf, sets, subprocess_env

HANG_S = 300  # a run of a few steps that has not ended after this long is hung (it takes ~5-30 s)


def _args(out, *extra):
    return ["train", "--config", "quickstart", "--quiet", "--out", str(out)] + sets(TINY + list(extra))


# ----------------------------------------------------------------------------- 1. stale build lock
def _fused_build_dir():
    """The cpu_fused ops' build folder under the default TORCH_EXTENSIONS_DIR, built (skip where
    they cannot be)."""
    from torch.utils import cpp_extension

    from backends import cpu_fused

    if not cpu_fused.available(warn=False):
        pytest.skip(f"the cpu_fused ops do not build here: {cpu_fused._BUILT.get('error')}")
    return cpp_extension._get_build_directory(cpu_fused._NAME, verbose=False)


def _extensions_copy(tmp_path) -> tuple[dict, str]:
    """A TORCH_EXTENSIONS_DIR holding a copy of the built ops (no rebuild: mtimes kept), and the
    copy's build folder."""
    root = tmp_path / "torch_extensions"
    build = root / os.path.basename(_fused_build_dir())
    shutil.copytree(_fused_build_dir(), build, ignore=shutil.ignore_patterns("lock", "lock.*"))
    return {"TORCH_EXTENSIONS_DIR": str(root)}, str(build)


@pytest.mark.slow
def test_a_build_lock_left_by_a_killed_build_does_not_hang_grf_train(tmp_path):
    """Before: `kill -9` during the first build (or any load) of backends/cpu_fused left torch's
    `lock` in the build folder, and every later torch-CPU `grf train` waited on it forever with no
    output. Now the lock's owner is known to be gone (nobody holds the build turn) and it is
    removed, naming it."""
    env, build = _extensions_copy(tmp_path)
    open(os.path.join(build, "lock"), "w").close()  # what the killed build left
    t0 = time.monotonic()
    try:
        r = run_grf(tmp_path / "run", "train.epochs=1", timeout=HANG_S, **env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"grf train still waits on {build}/lock after {HANG_S} s")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"removed {build}/lock" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(os.path.join(build, "lock"))
    print(f"grf train with a stale build lock: {time.monotonic() - t0:.1f} s")


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    build = sys.argv[1]
    f = open(os.path.join(build, "lock.owner"), "a+")
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0); f.truncate(); f.write(f"{os.getpid()}\\n"); f.flush()
    open(os.path.join(build, "lock"), "w").close()   # torch's FileBaton, taken inside load()
    print("holding", flush=True)
    time.sleep(600)
""")


def _holder(build):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, build], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_killed_builder_is_seen_as_gone_at_once(tmp_path, monkeypatch):
    """A process in the middle of load() (holding the turn and torch's lock) is killed: the next
    load takes the turn at once and removes the lock it left."""
    from torch.utils import cpp_extension

    from backends import cpu_fused

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = cpp_extension._get_build_directory(cpu_fused._NAME, verbose=False)
    proc = _holder(build)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="removed .*lock, left by a build or load of them whose process is gone"):
        with cpu_fused._BuildTurn(cpp_extension, wait_s=HANG_S):
            assert not os.path.exists(os.path.join(build, "lock"))
            assert open(os.path.join(build, "lock.owner")).read().strip() == str(os.getpid())
    assert time.monotonic() - t0 < 60


def test_a_live_builder_is_waited_for_a_bounded_time_then_named(tmp_path, monkeypatch):
    """A live process holding the turn (a build in progress, or one stopped forever) is waited
    for, at most the bound; then the error names its pid, the lock files and the way out, and
    its lock is left alone."""
    from torch.utils import cpp_extension

    from backends import cpu_fused
    from npu_ops import UnsupportedOnBackend

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = cpp_extension._get_build_directory(cpu_fused._NAME, verbose=False)
    proc = _holder(build)
    try:
        t0 = time.monotonic()
        with pytest.raises(UnsupportedOnBackend) as info:
            with cpu_fused._BuildTurn(cpp_extension, wait_s=1.0):
                pass
        assert time.monotonic() - t0 < 60
    finally:
        proc.kill()
        proc.wait()
    message = str(info.value)
    assert f"process pid {proc.pid}" in message and f"delete {build}/lock and {build}/lock.owner" in message
    assert os.path.exists(os.path.join(build, "lock"))


# ----------------------------------------------------------------------------- 4a. --set blamed
def test_a_cross_key_rule_broken_by_a_set_value_names_the_set(tmp_path, capsys):
    """Before: `--set embedding.kind=hash` (the file keeps the default optimizer adamw) reported
    `experiments/configs/quickstart.toml: embedding.optimizer='adamw': ...`, the file as the origin."""
    assert main(_args(tmp_path / "a", "embedding.kind=hash")) == 2
    err = capsys.readouterr().err
    assert err.startswith("grf: error: --set embedding.kind=hash: conflicts with embedding.optimizer='adamw' "
                          "(the default; "), err
    assert "use 'lazy_adam'" in err and not (tmp_path / "a").exists()


def test_the_blame_follows_where_each_value_came_from(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text((ROOT / "experiments" / "configs" / "quickstart.toml").read_text()
                      + '\n[embedding]\noptimizer = "adamw"\n')
    # the failing key set in the file, the rule triggered by --set: the --set leads, the file named
    args = ["train", "--config", str(config), "--out", str(tmp_path / "b"), "--set", "embedding.kind=hash"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--set embedding.kind=hash: conflicts with embedding.optimizer='adamw' in {config}: " in err, err
    # both from the file: the file, as before
    config.write_text(config.read_text().replace('optimizer = "adamw"', 'optimizer = "adamw"\nkind = "hash"'))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "b")]) == 2
    assert f"grf: error: {config}: embedding.optimizer='adamw': AdamW updates" in capsys.readouterr().err
    # the failing key itself from --set: that --set, as before
    assert main(args[:-2] + ["--set", "embedding.optimizer=adamw"]) == 2
    assert "grf: error: --set embedding.optimizer=adamw: embedding.optimizer='adamw'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 4b. SIGTERM
@pytest.mark.slow
def test_sigterm_says_where_it_stopped_and_exits_143_and_the_same_command_resumes(tmp_path):
    """Before: SIGTERM ended `grf train` with 143 and no word."""
    out = tmp_path / "run"
    cmd = grf_command(out, "train.epochs=400")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + HANG_S
    while not list((out / "checkpoints").glob("step-*.safetensors")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # some steps past that checkpoint
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"grf train still running {HANG_S} s after SIGTERM")
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("grf: stopped by SIGTERM at step "), err[-3000:]
    assert "the last checkpoint is " in last and "rerun the same command to resume from it" in last, last
    # the lock is free and the checkpoint named is where the same command (extended) resumes
    named = last.split("the last checkpoint is ", 1)[1].split(" (step", 1)[0]
    # one step past the checkpoint (an extension: a key lowered to a finished state would be refused)
    from gr_functional.checkpoint import CheckpointDir

    step = CheckpointDir(out / "checkpoints").steps()[0][0]
    r = subprocess.run(cmd + ["--set", f"train.max_steps={step + 1}"], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"grf: resuming {out} from {os.path.basename(named)}" in r.stderr, r.stderr[-3000:]


# ----------------------------------------------------------------------------- 4c. grf eval --plugin
KERNEL_PLUGIN = textwrap.dedent("""
    from backends.kernels import reference, register_kernel

    register_kernel("h3_plugin_kernel", reference, backends=("torch",), precisions=("fp32",))
""")


@pytest.mark.slow
def test_eval_imports_a_plugin_the_run_did_not_record(tmp_path):
    """Before: a run trained with a kernel registered by a script (not in train.plugins) could not
    be evaluated: `grf eval` had no --plugin and refused the kernel name."""
    plugin = tmp_path / "my_kernel.py"
    plugin.write_text(KERNEL_PLUGIN)
    out = tmp_path / "run"
    # registered by the training script itself, as an experiment script does: not recorded
    script = (f"import runpy, sys; runpy.run_path({str(plugin)!r}); from gr_functional.cli import main; "
              f"sys.exit(main(sys.argv[1:]))")
    args = _args(out, "train.epochs=1", "ops.attention=h3_plugin_kernel")
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                       text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = out / "checkpoints" / "last.safetensors"
    recorded = (out / "config.toml").read_text()
    assert "h3_plugin_kernel" in recorded and "my_kernel" not in recorded

    def grf_eval(*extra):
        return subprocess.run([sys.executable, "-m", "gr_functional.cli", "eval", "--checkpoint", str(ck), *extra],
                              cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=HANG_S)

    without = grf_eval()
    assert without.returncode == 2 and "h3_plugin_kernel" in without.stderr, without.stderr[-3000:]
    r = grf_eval("--plugin", str(plugin))
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"hr@10"' in r.stdout
    missing = grf_eval("--plugin", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "--plugin" in missing.stderr and "nope.py does not exist" in missing.stderr


# ----------------------------------------------------------------------------- 4e. the learning rate to blame
@pytest.mark.slow
def test_an_abort_from_a_large_embedding_lr_names_embedding_lr(tmp_path):
    """Before: a hash table with embedding.lr=1e6 aborted saying `optim.lr=0.001` and "Lower optim.lr"."""
    proc = run_grf(tmp_path / "run", "embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.lr=1e6",
                   "train.max_bad_steps=2", "train.epochs=1")
    assert proc.returncode == 3, proc.stderr
    assert "embedding.lr=1e+06" in proc.stderr and "Lower embedding.lr" in proc.stderr
    assert "--set embedding.lr=1e-4" in proc.stderr


# ----------------------------------------------------------------------------- 4b. the user's code fails
_FAILING_HOOK = '''
import os
import sys

from gr_functional.hooks import Hook, register_hook


@register_hook("fails_at_step_4")
class FailsAtStep4(Hook):
    def on_step(self, run, step):
        how = os.environ.get("GRF_TEST_HOOK", "")
        if step.step == 4 and how == "raise":
            raise RuntimeError("the hook's own bug")
        if step.step == 4 and how == "exit":
            sys.exit(3)
'''


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [("raise", "RuntimeError: the hook's own bug"), ("exit", "sys.exit(3)")])
def test_a_failing_plugin_hook_exits_6_naming_it_and_the_run_resumes(tmp_path, how, said):
    """Before: a plugin hook raising in on_step ended with a traceback and exit 1, and one calling
    sys.exit(3) exited with the "diverged" code."""
    plugin = tmp_path / "failing_hook.py"
    plugin.write_text(_FAILING_HOOK)
    out = tmp_path / "run"
    extra = ("train.checkpoint_every=3", 'train.hooks=["fails_at_step_4"]')
    proc = run_grf(out, *extra, args=("--plugin", str(plugin)), GRF_TEST_HOOK=how)
    assert proc.returncode == 6, proc.stderr
    assert "hook 'fails_at_step_4'" in proc.stderr and "failed in on_step at step 4" in proc.stderr
    assert said in proc.stderr and "step-00000003.safetensors" in proc.stderr and "Traceback" not in proc.stderr
    again = run_grf(out, *extra, args=("--plugin", str(plugin)))          # the cause fixed: it resumes
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr


# ----------------------------------------------------------------------------- 2. a run folder keeps its history
@pytest.mark.slow
def test_a_finished_run_refuses_a_changed_key_and_keeps_its_config(tmp_path):
    """Before: a rerun of a finished run with --set optim.lr=3e-3 trained nothing, exited 0 and left
    config.toml saying lr 3e-3 for a run trained at 1e-3."""
    out = tmp_path / "run"
    assert run_grf(out, "train.epochs=1").returncode == 0
    before = (out / "config.toml").read_bytes()
    proc = run_grf(out, "train.epochs=1", "optim.lr=3e-3")
    assert proc.returncode == 2
    assert "finished run" in proc.stderr and "optim.lr: trained with 0.001, now 0.003" in proc.stderr
    assert "--out" in proc.stderr and "--fresh" in proc.stderr
    assert (out / "config.toml").read_bytes() == before
    assert run_grf(out, "train.epochs=2", "train.log_every=2").returncode == 0     # extending it is no change


@pytest.mark.slow
def test_a_resume_with_changed_keys_records_them_with_their_step(tmp_path):
    import json

    from .test_resume import CKPT, _run_until_fault

    out = tmp_path / "run"
    _run_until_fault(out, "after-step@7")
    proc = run_grf(out, *CKPT, "optim.lr=3e-3")
    assert proc.returncode == 0, proc.stderr
    assert "changed on resume, from step 7: optim.lr 0.001 -> 0.003" in proc.stderr
    resumes = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "resume"]
    assert resumes[-1]["step"] == 6 and resumes[-1]["changed"] == {"optim.lr": [0.001, 0.003]}


def test_overrides_that_change_what_trains_get_their_own_default_folder(tmp_path, monkeypatch):
    """Before: `grf train --set optim.lr=3e-3` without --out landed in runs/quickstart-torch and
    resumed the run of the plain config there."""
    from gr_functional import runner

    seen = []
    monkeypatch.setattr(runner, "train", lambda cfg, out, **kw: seen.append(str(out)) or {"epoch": 0})
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--quiet"]) == 0
    assert main(["train", "--quiet", "--set", "train.epochs=3"]) == 0                  # extends: same folder
    assert main(["train", "--quiet", "--set", "optim.lr=3e-3"]) == 0
    assert main(["train", "--quiet", "--set", "optim.lr=3e-3", "--set", "train.log_every=5"]) == 0
    assert main(["train", "--quiet", "--set", "optim.lr=1e-2"]) == 0
    assert seen[0] == seen[1] == "runs/quickstart-torch"
    assert seen[2] == seen[3] and seen[2].startswith("runs/quickstart-torch-") and len(seen[2]) == 30
    assert len({seen[0], seen[2], seen[4]}) == 3
