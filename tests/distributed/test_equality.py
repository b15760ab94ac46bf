"""Data-parallel == single process: 2 gloo ranks (separate processes, CPU) given the same global
batches give the parameters of a single-process run and of the JAX reference after 20 steps.

Tolerance 1e-5 relative (each parameter leaf, relative to its max, as the differential suite);
measured on CPU: 3e-7 against single-process torch, 6e-7 against JAX (float summation order:
the gradient is a sum of two ranks' partial sums instead of one sum)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from .common import ROOT, final_params, metrics, spawn_ranks, tiny_config, wait_all, worst_param_error

PARAM_TOL = 1e-5
LOSS_TOL = 1e-5


def _train_records(out):
    return [r for r in metrics(out) if r["kind"] == "train"]


@pytest.mark.slow
def test_two_gloo_ranks_equal_single_process(single_torch, two_ranks):
    out, results = two_ranks
    err, leaf = worst_param_error(final_params(out), final_params(single_torch))
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"
    # the logged global loss and token count of every step match too
    got, want = _train_records(out), _train_records(single_torch)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 21))
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"]), g["step"]


def test_outputs_written_once_by_rank_0(two_ranks):
    out, results = two_ranks
    (rc0, stdout0, _), (rc1, stdout1, _) = results
    assert json.loads(stdout0.strip().splitlines()[-1])["out"] == str(out)
    assert stdout1.strip() == ""        # rank 1 prints no result and writes no files
    assert "nproc = 2" in (out / "config.toml").read_text()
    assert json.loads((out / "eval.json").read_text())["world_size"] == 2
    timing = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    steps = [t for t in timing if t["kind"] == "train"]
    assert len(steps) == 20 and all(len(t["rank_compute_s"]) == 2 and len(t["rank_tokens"]) == 2 for t in steps)
    assert all("imbalance" in t for t in timing if t["kind"] == "epoch")
    assert [t for t in timing if t["kind"] == "distributed"][0]["world_size"] == 2


@pytest.mark.slow
def test_two_gloo_ranks_equal_jax_reference(two_ranks, single_jax):
    err, leaf = worst_param_error(final_params(two_ranks[0]), final_params(single_jax))
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_accumulation_with_contiguous_split(tmp_path, dtype):
    """dist.balance = none (equal-count contiguous slices) and train.accumulate = 2: the global
    token count of both micro-batches normalises every rank's loss, as in one process.

    In float64: after 4 Adam steps a float32 run differs from one process by Adam's normalised
    step on parameters whose gradient is float32 summation noise (read 4e-6 to 1.6e-5 of the
    leaf's max across kernel versions against float32's 1e-5 tolerance); in float64 it reads 1.2e-14,
    so the comparison tests the normalisation, not rounding, at a 1e-10 tolerance. In float32 (what
    runs train) the per-step losses, which the sign flips do not amplify, are compared instead."""
    sets = ["train.max_steps=4", "train.epochs=2", "train.eval_every=100", "train.accumulate=2",
            f"backend.dtype={dtype}"]
    from gr_functional.runner import train

    train(tiny_config(*sets), tmp_path / "single", progress=False, resume="never")
    results = wait_all(spawn_ranks(tmp_path / "dist", *sets, "dist.balance=none"), timeout=120)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    got, want = _train_records(tmp_path / "dist"), _train_records(tmp_path / "single")
    assert len(got) == 4 and [g["tokens"] for g in got] == [w["tokens"] for w in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"]), g["step"]
    if dtype == "float64":
        err, leaf = worst_param_error(final_params(tmp_path / "dist"), final_params(tmp_path / "single"))
        assert err <= 1e-10, f"{leaf}: {err:.2e}"


@pytest.mark.slow
def test_two_ranks_resume_a_single_process_checkpoint(tmp_path, single_torch):
    """Rank 0 reads OUT/checkpoints and broadcasts the state; with dist.balance = kk the global
    batches are the single-process ones, so 8 single-process steps + 12 on 2 ranks = 20 steps."""
    from gr_functional.runner import train

    out = tmp_path / "run"
    train(tiny_config("train.max_steps=8", "train.epochs=10", "train.eval_every=100"), out, progress=False)
    results = wait_all(spawn_ranks(out, "train.max_steps=20", "train.epochs=10", "train.eval_every=100"), 120)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    assert "resuming" in results[0][2] and "resuming" not in results[1][2]   # rank 0 speaks for the run
    err, leaf = worst_param_error(final_params(out), final_params(single_torch))
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"
    assert [r["step"] for r in _train_records(out)] == list(range(1, 21))


def _two_ranks_equal_one_process(tmp_path, sets, steps: int):
    """Train ``sets`` in one process and on 2 gloo ranks; assert equal params and per-step losses;
    return both runs' train records."""
    from gr_functional.runner import train

    train(tiny_config(*sets), tmp_path / "single", progress=False, resume="never")
    results = wait_all(spawn_ranks(tmp_path / "dist", *sets), timeout=120)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    err, leaf = worst_param_error(final_params(tmp_path / "dist"), final_params(tmp_path / "single"))
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"
    got, want = _train_records(tmp_path / "dist"), _train_records(tmp_path / "single")
    assert len(got) == steps and all(abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"])
                                     for g, w in zip(got, want))
    return got, want


@pytest.mark.slow
def test_in_batch_loss_two_ranks_equal_single_process(tmp_path):
    """loss.name = in_batch: the shared negatives are drawn from the GLOBAL batch's targets, so
    each rank scores its sequences against the same ones as one process does."""
    _two_ranks_equal_one_process(tmp_path, ["train.max_steps=4", "train.epochs=2", "train.eval_every=100",
                                            "loss.name=in_batch", "loss.num_negatives=32"], steps=4)


@pytest.mark.slow
def test_hash_table_two_ranks_equal_single_process(tmp_path):
    """embedding.kind = hash below the catalogue (evictions) with lazy Adam: every rank maps the
    ids of the whole global batch, so the replicated tables take the same rows and updates as one
    process, and the logged table counters match."""
    got, want = _two_ranks_equal_one_process(
        tmp_path, ["train.max_steps=6", "train.epochs=3", "train.eval_every=100", "embedding.kind=hash",
                   "embedding.optimizer=lazy_adam", "embedding.capacity=90", "train.accumulate=2",
                   "loss.num_negatives=1"], steps=6)
    assert [g["embedding"] for g in got] == [w["embedding"] for w in want]
    assert got[-1]["embedding"]["table"]["evictions"] > 0


ROW_SHARDED = ["train.max_steps=6", "train.epochs=3", "train.eval_every=100", "embedding.kind=hash",
               "embedding.optimizer=lazy_adam", "embedding.capacity=240", "loss.num_negatives=4"]


def _table_by_id(out) -> dict:
    """id -> row of the item table in OUT's last checkpoint (whole or row-sharded)."""
    from gr_functional.checkpoint import read_checkpoint
    from gr_functional.embedding.hashtable import HashTable

    ck = read_checkpoint(out / "checkpoints" / "last.safetensors")
    saved = ck.host["embedding"]
    if "shards" in saved:
        return {int(i): v for s in saved["shards"] for i, v in zip(s["ids"], s["values"])}
    table = HashTable(ck.config.embedding.capacity, seed=ck.config.train.seed)
    table.load_state_dict(saved["table"])
    return {int(i): ck.params["item_emb"][r] for r, i in zip(table.live_rows(), table.row_ids()[table.live_rows()])}


def _launch(out, *sets, world=2, env=None):
    results = wait_all(spawn_ranks(out, *sets, world=world, rank_extra_env=env), timeout=180)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"


@pytest.fixture(scope="module")
def row_sharded(tmp_path_factory):
    """A 2-rank row-sharded run of ROW_SHARDED and its one-process (whole-table) twin."""
    from gr_functional.runner import train

    root = tmp_path_factory.mktemp("row_sharded")
    train(tiny_config(*ROW_SHARDED), root / "single", progress=False, resume="never")
    # checkpoints at steps 3 and 6 (and the epoch end, 5): the resume test below starts from step 3
    _launch(root / "dist", *ROW_SHARDED, "embedding.sharding=row", "train.checkpoint_every=3",
            "train.keep_checkpoints=0")
    return root


@pytest.mark.slow
def test_row_sharded_table_two_ranks_equal_single_process(row_sharded):
    """embedding.sharding = row: each rank holds the rows it owns and looks up its own ids by
    all-to-all; params, losses, the table (by id) and the evaluation equal one process's."""
    tmp_path = row_sharded
    got_params, want_params = final_params(tmp_path / "dist"), final_params(tmp_path / "single")
    want_params.pop("item_emb")
    err, leaf = worst_param_error(got_params, want_params)
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"
    got, want = _train_records(tmp_path / "dist"), _train_records(tmp_path / "single")
    assert len(got) == 6 and all(abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"]) for g, w in zip(got, want))
    rows, ref = _table_by_id(tmp_path / "dist"), _table_by_id(tmp_path / "single")
    assert set(rows) == set(ref)
    assert max(float(abs(rows[i] - ref[i]).max()) for i in ref) <= 1e-6
    assert got[-1]["embedding"]["exchange"]["ids_inter"] > 0
    a = json.loads((tmp_path / "dist" / "eval.json").read_text())
    b = json.loads((tmp_path / "single" / "eval.json").read_text())
    assert abs(a["hr@10"] - b["hr@10"]) <= 1e-6 and abs(a["ndcg@10"] - b["ndcg@10"]) <= 1e-5


@pytest.mark.slow
def test_row_sharded_resume_is_exact_and_reshards_to_four_ranks(row_sharded, tmp_path):
    """A 2-rank row-sharded run stopped at step 3 and resumed on 2 ranks logs what the
    uninterrupted run logs; resumed on 4 ranks instead (re-sharded by id), the same losses to
    float rounding; its checkpoint evaluates on one process on both backends."""
    import shutil

    from gr_functional.runner import evaluate_checkpoint

    from gr_functional.checkpoint import CheckpointDir

    sets = [*ROW_SHARDED, "embedding.sharding=row"]
    for name in ("same", "four"):  # the 2-rank run as if stopped after step 3
        shutil.copytree(row_sharded / "dist", tmp_path / name)
        for step, path in CheckpointDir(tmp_path / name / "checkpoints").steps():
            if step > 3:
                path.unlink()
    _launch(tmp_path / "same", *sets)
    _launch(tmp_path / "four", *sets, world=4)
    whole, same, four = (_train_records(p) for p in (row_sharded / "dist", tmp_path / "same", tmp_path / "four"))
    assert same == whole
    assert [r["step"] for r in four] == list(range(1, 7))
    assert all(abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]) for a, b in zip(four, whole))
    rows, ref = _table_by_id(tmp_path / "four"), _table_by_id(row_sharded / "dist")
    assert set(rows) == set(ref) and max(float(abs(rows[i] - ref[i]).max()) for i in ref) <= 1e-5
    last = row_sharded / "dist" / "checkpoints" / "last.safetensors"
    t, j = evaluate_checkpoint(last, "torch"), evaluate_checkpoint(last, "jax")
    final = json.loads((row_sharded / "dist" / "eval.json").read_text())["last_epoch_test"]
    assert abs(t["hr@10"] - final["hr@10"]) <= 1e-6 and abs(t["hr@10"] - j["hr@10"]) <= 1e-3


@pytest.mark.slow
def test_row_sharded_on_jax_devices_equals_torch_ranks_and_resumes_across(row_sharded, tmp_path):
    """The same row-sharded run on 2 JAX devices of one process (backends/dist_jax.py MeshTable:
    the owners' rows on the devices, rows and gradients by jax.lax.all_to_all): the 2 torch
    ranks' params, losses, table records (ids, dedup, hash counters, exchanged bytes: equal) and
    rows by id. The torch run's step-3 checkpoint resumes on 4 JAX devices (re-sharded by id) to
    the same losses; on 4 devices as 2 nodes of 2 (the two-level exchange over a "node" x
    "local" mesh) the same losses and rows; the JAX run's checkpoint evaluates on one process."""
    import shutil
    import subprocess

    from gr_functional.checkpoint import CheckpointDir
    from gr_functional.runner import evaluate_checkpoint

    from .common import subprocess_env, train_command

    sets = [*ROW_SHARDED, "embedding.sharding=row", "train.checkpoint_every=3", "train.keep_checkpoints=0"]
    jax_out, four = tmp_path / "jax-2", tmp_path / "jax-4-from-torch"
    shutil.copytree(row_sharded / "dist", four)
    for step, path in CheckpointDir(four / "checkpoints").steps():
        if step > 3:
            path.unlink()
    two_level = tmp_path / "jax-4-hierarchical"
    procs = [subprocess.Popen(train_command(out, *sets, *extra, args=["--backend", "jax", "--devices", str(n)]),
                              cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for out, n, extra in ((jax_out, 2, []), (four, 4, []),
                                   (two_level, 4, ["embedding.node_size=2", "embedding.hierarchical=true"]))]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    torch_run = row_sharded / "dist"
    err, leaf = worst_param_error(final_params(jax_out), final_params(torch_run))
    assert err <= PARAM_TOL, f"{leaf}: {err:.2e}"
    got, want = _train_records(jax_out), _train_records(torch_run)
    assert [r["step"] for r in got] == list(range(1, 7))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"]) and g["embedding"] == w["embedding"], g["step"]
    rows, ref = _table_by_id(jax_out), _table_by_id(torch_run)
    assert set(rows) == set(ref) and max(float(abs(rows[i] - ref[i]).max()) for i in ref) <= 1e-5
    for out in (four, two_level):
        runs = _train_records(out)
        assert [r["step"] for r in runs] == list(range(1, 7)), out.name
        assert all(abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]) for a, b in zip(runs, want)), out.name
    rows = _table_by_id(two_level)
    assert set(rows) == set(ref) and max(float(abs(rows[i] - ref[i]).max()) for i in ref) <= 1e-5
    assert _train_records(two_level)[-1]["embedding"]["exchange"]["ids_intra"] > 0  # the first hop stays in the node
    a = json.loads((jax_out / "eval.json").read_text())["last_epoch_test"]
    t = evaluate_checkpoint(jax_out / "checkpoints" / "last.safetensors", "torch")
    assert abs(a["hr@10"] - t["hr@10"]) <= 1e-6


def test_row_sharded_checkpoint_is_not_resumed_by_one_process(row_sharded, tmp_path):
    """One process cannot continue a row-sharded checkpoint (its rows are spread over shards):
    a clear CheckpointError before the run touches the folder."""
    import shutil

    from gr_functional.errors import CheckpointError
    from gr_functional.runner import train

    from ..reliability.common import file_digests

    out = tmp_path / "copy"
    shutil.copytree(row_sharded / "dist", out)
    before = file_digests(out)
    with pytest.raises(CheckpointError, match="row-sharded item table but this run does not shard it"):
        train(tiny_config(*ROW_SHARDED, "embedding.sharding=row", "train.max_steps=8"), out, progress=False)
    assert file_digests(out) == before


@pytest.mark.slow
def test_row_sharded_prefetched_id_exchange_is_the_synchronous_run(tmp_path):
    """train.prefetch = 2 with a row-sharded table: each step's ids are deduplicated, localised
    and exchanged with their owners (both hops of a hierarchical exchange) on the prefetch
    worker, on a process group of its own, ahead of the step. The run is bitwise the synchronous
    one (train.prefetch = 0): the same metrics.jsonl (losses, exchanged bytes, table counters
    through evictions) and the same table. accumulate = 2 groups micro-batches where they are
    built; max_steps = 5 stops mid-epoch, where every rank's worker stops routing."""
    sets = [*ROW_SHARDED, "embedding.sharding=row", "embedding.capacity=90", "loss.num_negatives=1", "train.accumulate=2",
            "train.max_steps=5", "embedding.node_size=1", "embedding.hierarchical=true"]
    _launch(tmp_path / "sync", *sets, "train.prefetch=0")
    _launch(tmp_path / "ahead", *sets, "train.prefetch=2")
    sync, ahead = _train_records(tmp_path / "sync"), _train_records(tmp_path / "ahead")
    assert [r["step"] for r in ahead] == [1, 2, 3, 4, 5]
    assert ahead == sync
    assert ahead[-1]["embedding"]["table"]["evictions"] > 0 and ahead[-1]["embedding"]["exchange"]["ids_inter"] > 0
    rows, ref = _table_by_id(tmp_path / "ahead"), _table_by_id(tmp_path / "sync")
    assert set(rows) == set(ref) and all((rows[i] == ref[i]).all() for i in ref)


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


# sitecustomize for the ranks of a test: rank 0's loss is NaN at the listed (1-based) calls, i.e.
# steps with train.accumulate = 1, so the guard skips them on every rank (the loss is all-reduced)
_NAN_STEPS = """
import os
import gr_functional.step as t
_real, _calls, _bad = t._loss, [0], {int(x) for x in os.environ["GRF_TEST_NAN_CALLS"].split(",")}
def _loss(*args, **kwargs):
    _calls[0] += 1
    loss, aux = _real(*args, **kwargs)
    return (loss * float("nan") if _calls[0] in _bad else loss), aux
t._loss = _loss
"""


@pytest.mark.slow
@pytest.mark.parametrize("k,extra", [(1, ["embedding.node_size=1", "embedding.hierarchical=true", "train.accumulate=2",
                                         "embedding.policy=lfu", "embedding.min_count=2"]),
                                     (2, ["loss.num_negatives=8", "train.max_bad_steps=0"])])
def test_row_sharded_stale_lookup_ahead_is_the_synchronous_run(tmp_path, k, extra):
    """embedding.staleness = k >= 1 with train.prefetch: while step i computes, a worker lands the
    update due at step i and looks up step i+1's rows (evicting, inserting) on its own process
    group. The run is bitwise the synchronous one (train.prefetch = 0): metrics.jsonl, and every
    checkpoint's shards (values, optimizer state, queued updates by id, hash statistics, sketch,
    counters), one after every step, so most were written while the next step's lookup had
    already run. With k = 2, steps 3 and 4 are skipped (rank 0's loss made NaN by a sitecustomize
    shim): step 3 drops the update of step 1 that the worker had already landed, so the pipeline
    takes it back and reads step 4's rows again. Resumed from the step-2 checkpoint: the same
    metrics.jsonl."""
    import shutil

    from gr_functional.checkpoint import CheckpointDir, read_checkpoint

    sets = [*ROW_SHARDED, "embedding.sharding=row", "embedding.capacity=90", "loss.num_negatives=1",
            "train.max_steps=5", f"embedding.staleness={k}", "train.checkpoint_every=1",
            "train.keep_checkpoints=0", *extra]
    env = None
    if "train.max_bad_steps=0" in extra:  # steps 3 and 4 skipped: step 3 drops step 1's update
        (tmp_path / "shim").mkdir()
        (tmp_path / "shim" / "sitecustomize.py").write_text(_NAN_STEPS)
        env = {0: {"GRF_TEST_NAN_CALLS": "3,4", "PYTHONPATH": f"{tmp_path / 'shim'}{os.pathsep}{ROOT}"}}
    _launch(tmp_path / "sync", *sets, "train.prefetch=0", env=env)
    _launch(tmp_path / "ahead", *sets, "train.prefetch=2", env=env)
    sync, ahead = metrics(tmp_path / "sync"), metrics(tmp_path / "ahead")
    assert [r["step"] for r in ahead if r["kind"] in ("train", "skip")] == [1, 2, 3, 4, 5]
    if env:  # the rows read again after a skipped step are real traffic, counted
        for a, b in zip(ahead, sync):
            if "embedding" in a:
                assert a["embedding"]["exchange"].pop("rows_inter") >= b["embedding"]["exchange"].pop("rows_inter")
    assert ahead == sync
    if env:
        assert [r["step"] for r in ahead if r["kind"] == "skip"] == [3, 4]
    saved = dict(CheckpointDir(tmp_path / "ahead" / "checkpoints").steps())
    reference = dict(CheckpointDir(tmp_path / "sync" / "checkpoints").steps())
    assert set(saved) == set(reference) == {1, 2, 3, 4, 5}
    skips = "train.max_bad_steps=0" in extra
    for step, path in saved.items():
        a, b = read_checkpoint(path), read_checkpoint(reference[step])
        if skips:  # the rows a skipped step makes the pipeline read again are real traffic, counted
            for x, y in zip(a.host["embedding"]["shards"], b.host["embedding"]["shards"]):
                assert (x.pop("bytes") >= y.pop("bytes")).all()
        assert _same_tree(a.host, b.host) and _same_tree(a.params, b.params) and _same_tree(a.opt_state, b.opt_state), step
    shutil.copytree(tmp_path / "ahead", tmp_path / "resumed")
    for step, path in CheckpointDir(tmp_path / "resumed" / "checkpoints").steps():
        if step > 2:
            path.unlink()
    if env:  # the resumed ranks count loss calls from step 3
        env[0]["GRF_TEST_NAN_CALLS"] = "1,2"
    _launch(tmp_path / "resumed", *sets, "train.prefetch=2", env=env)
    assert _train_records(tmp_path / "resumed") == _train_records(tmp_path / "ahead")


@pytest.fixture(scope="module")
def row_sharded_stale(tmp_path_factory):
    """ROW_SHARDED with embedding.staleness = 2 on 2 ranks, checkpoints at steps 3 and 6, and its
    one-process (replicated) twin. The capacity holds every id (as in ``row_sharded``): below it,
    each shard evicts within its own rows and the tables legitimately differ from one table's."""
    from gr_functional.runner import train

    root = tmp_path_factory.mktemp("row_sharded_stale")
    sets = [*ROW_SHARDED, "embedding.staleness=2"]
    train(tiny_config(*sets), root / "single", progress=False, resume="never")
    _launch(root / "dist", *sets, "embedding.sharding=row", "train.checkpoint_every=3", "train.keep_checkpoints=0")
    return root, sets


@pytest.mark.slow
def test_row_sharded_staleness_equals_one_process_and_resumes_exactly(row_sharded_stale, tmp_path):
    """embedding.staleness = 2 on a row-sharded table: each owner queues its rows' summed
    gradients and applies them 2 steps late, as the replicated table of one process does (losses,
    the table by id, new rows every step). Stopped at step 3 (two updates pending, in the shards'
    checkpoint) and resumed on 2 ranks: the same metrics.jsonl; on 4 ranks (the queue re-sharded
    by id): the same losses to float rounding."""
    import shutil

    from gr_functional.checkpoint import CheckpointDir

    root, sets = row_sharded_stale
    got, want = _train_records(root / "dist"), _train_records(root / "single")
    assert len(got) == 6 and all(abs(g["loss"] - w["loss"]) <= LOSS_TOL * abs(w["loss"]) for g, w in zip(got, want))
    rows, ref = _table_by_id(root / "dist"), _table_by_id(root / "single")
    assert set(rows) == set(ref) and max(float(abs(rows[i] - ref[i]).max()) for i in ref) <= 1e-6
    for name in ("same", "four"):
        shutil.copytree(root / "dist", tmp_path / name)
        for step, path in CheckpointDir(tmp_path / name / "checkpoints").steps():
            if step > 3:
                path.unlink()
    _launch(tmp_path / "same", *sets, "embedding.sharding=row")
    _launch(tmp_path / "four", *sets, "embedding.sharding=row", world=4)
    whole, same, four = (_train_records(p) for p in (root / "dist", tmp_path / "same", tmp_path / "four"))
    assert same == whole
    assert [r["step"] for r in four] == list(range(1, 7))
    assert all(abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]) for a, b in zip(four, whole))
