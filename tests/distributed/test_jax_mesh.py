"""``grf train --backend jax --devices N``: N ranks on the devices of one JAX process (a 1-D mesh;
backends/dist_jax.py), forced XLA host devices on CPU (grf asks for them itself).

- 2 and 4 devices give the parameters, every step's loss and token count of the one-device JAX
  run and of 2 torch gloo ranks after 20 steps (1e-5 relative, as test_equality.py; measured
  about 6e-7), with evaluation sharded over the devices and the same test metrics;
- a run resumes across device counts (1 device -> 4) and across backends (a torch checkpoint ->
  2 JAX devices) and lands where the uninterrupted run does;
- asking for what cannot run fails at once, naming the key and the fix.
XLA reads XLA_FLAGS once, when JAX starts, hence subprocesses."""
from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import data_parallel

from .common import (ROOT, STEPS, final_params, metrics, subprocess_env, tiny_config, train_command,
                     worst_param_error)

TOL = 1e-5


def _grf(out, *extra, args=(), **env):
    return subprocess.Popen(train_command(out, *extra, args=args), cwd=ROOT, env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc, timeout=300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def _train_records(out):
    return [r for r in metrics(out) if r["kind"] == "train"]


def _same_run(got, want, what: str) -> None:
    err, leaf = worst_param_error(final_params(got), final_params(want))
    assert err <= TOL, f"{what}: {leaf}: {err:.2e}"
    g, w = _train_records(got), _train_records(want)
    assert [r["step"] for r in g] == [r["step"] for r in w] == list(range(1, 21)), what
    assert [r["tokens"] for r in g] == [r["tokens"] for r in w], what
    for a, b in zip(g, w):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), f"{what}: step {a['step']}"


@pytest.mark.slow
def test_devices_equal_one_device_and_torch_ranks(tmp_path, single_jax, two_ranks):
    runs = {n: tmp_path / f"devices-{n}" for n in (2, 4)}
    procs = {n: _grf(out, *STEPS, args=["--backend", "jax", "--devices", str(n)]) for n, out in runs.items()}
    for n, out in runs.items():
        _done(procs[n])
        _same_run(out, single_jax, f"{n} devices vs 1 device")
        _same_run(out, two_ranks[0], f"{n} devices vs 2 torch ranks")
        result = json.loads((out / "eval.json").read_text())
        assert result["world_size"] == n
        one = json.loads((single_jax / "eval.json").read_text())
        for k in ("hr@10", "ndcg@10", "mrr"):  # sharded evaluation: the same ranks, so the same metrics
            assert abs(result[k] - one[k]) <= 1e-6, (n, k)
        assert f"devices = {n}" in (out / "config.toml").read_text()
        timing = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
        dist = [t for t in timing if t["kind"] == "distributed"]
        assert dist and dist[0]["world_size"] == n and dist[0]["backend"] == "jax-mesh"
        steps = [t for t in timing if t["kind"] == "train"]
        assert len(steps) == 20 and all(len(t["rank_tokens"]) == n for t in steps)
        timed = data_parallel.summarise(out)  # what grf bench data_parallel reads of each cell
        assert timed["steps"] == 10 and timed["tokens_per_s"] > 0


@pytest.mark.slow
def test_resume_across_device_counts_and_backends(tmp_path, single_jax, single_torch):
    from gr_functional.runner import train

    first = ["train.max_steps=8", *STEPS[1:]]  # the same run, stopped after 8 steps
    from_jax, from_torch = tmp_path / "from-1-device", tmp_path / "from-torch"
    _done(_grf(from_jax, *first, args=["--backend", "jax"]))
    train(tiny_config(*first), from_torch, progress=False, resume="never")  # torch, in this process
    resumed = {out: _grf(out, *STEPS, args=["--backend", "jax", "--devices", str(n), "--resume"])
               for out, n in ((from_jax, 4), (from_torch, 2))}
    for out, proc in resumed.items():
        _done(proc)
        timing = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
        assert any(t["kind"] == "resume" and t.get("step") == 8 for t in timing), out.name
    _same_run(from_jax, single_jax, "1 device for 8 steps, then 4 devices")
    _same_run(from_torch, single_torch, "torch for 8 steps, then 2 JAX devices")


@pytest.mark.slow
@pytest.mark.parametrize("args, sets, env, message", [
    (["--backend", "jax", "--devices", "4"], [], {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
     "JAX sees 2 cpu device(s)"),
    (["--backend", "torch", "--devices", "2"], [], {}, "use --nproc N"),
    (["--backend", "jax", "--devices", "2"], ["embedding.sharding=row", "embedding.optimizer=lazy_adam",
                                              "embedding.exchange=fp16"], {}, "the 16-bit and stale exchanges run on torch"),
], ids=["more-than-exist", "torch", "row-16-bit"])
def test_refused_at_once_naming_the_fix(tmp_path, args, sets, env, message):
    out = tmp_path / "run"
    r = subprocess.run(train_command(out, *sets, args=args), cwd=ROOT, env=subprocess_env(**env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "dist.devices" in r.stderr, r.stderr[-2000:]
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_hash_table_accumulation_and_idle_devices(tmp_path):
    """A hash table (the global step's ids mapped once, the same rows on every device), 2
    micro-batches of 3 sequences per step on 4 devices (a device holds none of a micro-batch: its
    share weighs 0): 4 devices equal 1 device, with the table full and ids left without a row."""
    sets = ["embedding.kind=hash", "embedding.optimizer=lazy_adam", "embedding.capacity=24", "train.accumulate=2",
            "train.batch_size=3", "train.max_steps=6", *STEPS[1:]]
    runs = {n: tmp_path / f"devices-{n}" for n in (1, 4)}
    procs = {n: _grf(out, *sets, args=["--backend", "jax", "--devices", str(n)]) for n, out in runs.items()}
    for proc in procs.values():
        _done(proc)
    err, leaf = worst_param_error(final_params(runs[4]), final_params(runs[1]))
    assert err <= TOL, f"{leaf}: {err:.2e}"
    one, two = _train_records(runs[1]), _train_records(runs[4])
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]) and a["embedding"] == b["embedding"], a["step"]
    table = two[-1]["embedding"]["table"]
    assert table["occupancy"] == table["capacity"] == 24 and table["overflow"] > 0


def test_an_uneven_mesh_is_refused_naming_each_process():
    """Processes asking for different device counts, or with fewer devices than asked, are refused
    on every process (``dist_jax.join`` gathers each process's count first)."""
    from backends.dist_jax import check_even
    from gr_functional.errors import ConfigError

    with pytest.raises(ConfigError, match="differs between the JAX processes \\(process 0: 2, process 1: 4\\)"):
        check_even({0: 2, 1: 4}, {0: 2, 1: 4})
    with pytest.raises(ConfigError, match="process\\(es\\) \\[1\\] have only \\[1\\] device"):
        check_even({0: 2, 1: 2}, {0: 2, 1: 1})
    check_even({0: 2, 1: 2}, {0: 8, 1: 8})  # a host with more devices trains on the first ones
