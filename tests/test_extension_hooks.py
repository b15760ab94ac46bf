"""Extension point: a training-loop hook written outside the package sees every step and epoch
end without changing what the run writes; the optional TensorBoard writer."""
from __future__ import annotations

import json

import pytest

from gr_functional import runner
from gr_functional.comm import LocalComm
from gr_functional.hooks import Hook

from .reliability.common import tiny_config


class Recorder(Hook):
    def __init__(self):
        self.events = []

    def on_epoch_start(self, run):
        self.events.append(("start", run.epoch))

    def on_step(self, run, step):
        self.events.append(("step", step.step, step.epoch, step.finite, step.tokens))

    def on_epoch_end(self, run, record):
        self.events.append(("end", record["epoch"], "valid" in record, run.last_epoch))

    def on_close(self, run):
        self.events.append(("close", run.state.step))


def test_a_hook_sees_every_step_and_epoch_and_changes_no_output(tmp_path):
    cfg = tiny_config("train.epochs=2")
    plain = runner.train(cfg, tmp_path / "plain", progress=False)
    recorder = Recorder()
    hooked = runner.train(cfg, tmp_path / "hooked", progress=False, hooks=[recorder])
    steps = [e for e in recorder.events if e[0] == "step"]
    assert [s[1] for s in steps] == list(range(1, plain["steps"] + 1))
    assert all(s[3] and s[4] > 0 for s in steps)
    assert recorder.events[0] == ("start", 0) and recorder.events[-1] == ("close", plain["steps"])
    assert [e for e in recorder.events if e[0] == "end"] == [("end", 0, True, False), ("end", 1, True, True)]
    for name in ("metrics.jsonl", "config.toml"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "hooked" / name).read_bytes()
    assert {k: v for k, v in plain.items() if k != "wall_seconds"} == \
        {k: v for k, v in hooked.items() if k != "wall_seconds"}


def test_a_hook_that_raises_stops_the_run_and_leaves_a_resumable_checkpoint(tmp_path):
    class Stop(Hook):
        def on_epoch_end(self, run, record):
            raise KeyboardInterrupt

    cfg = tiny_config("train.epochs=2")
    with pytest.raises(KeyboardInterrupt):
        runner.train(cfg, tmp_path / "run", progress=False, hooks=[Stop()])
    result = runner.train(cfg, tmp_path / "run", progress=False)
    assert result["last_epoch"] == 1


def test_local_comm_is_the_identity():
    comm = LocalComm()
    assert (comm.world_size, comm.rank, comm.is_main) == (1, 0, True)
    assert comm.broadcast({"a": 1}) == {"a": 1}
    comm.progress("step"), comm.post("x"), comm.wait_for("x"), comm.fail("m"), comm.shutdown()


def test_tensorboard_writer_records_loss_and_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config("train.epochs=2", "train.tensorboard=true")
    runner.train(cfg, tmp_path, progress=False)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "valid/hr@10", "test/ndcg@10"} <= tags
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert [e.step for e in acc.Scalars("train/loss")] == [x["step"] for x in train]
    assert [round(e.value, 5) for e in acc.Scalars("train/loss")] == [round(x["loss"], 5) for x in train]


def test_grf_train_adds_a_hook_registered_by_a_plugin(tmp_path, capsys):
    from gr_functional.cli import main

    from .reliability.common import TINY, sets

    plugin = tmp_path / "my_hooks.py"
    plugin.write_text(
        "import json\n"
        "from gr_functional.hooks import Hook, register_hook\n\n"
        "@register_hook('epoch_losses')\n"
        "class EpochLosses(Hook):\n"
        "    def on_epoch_end(self, run, record):\n"
        "        with open(run.out / 'epoch_losses.jsonl', 'a') as f:\n"
        "            f.write(json.dumps({'epoch': record['epoch'], 'loss': record['loss']}) + '\\n')\n")
    out = tmp_path / "run"
    code = main(["train", "--config", "quickstart", "--quiet", "--plugin", str(plugin), "--out", str(out),
                 *sets(TINY + ["train.epochs=2", 'train.hooks=["epoch_losses"]'])])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "epoch_losses.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1] and all(r["loss"] > 0 for r in rows)
    assert 'hooks = ["epoch_losses"]' in (out / "config.toml").read_text()
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "other"),
                 *sets(TINY + ['train.hooks=["nope"]'])]) == 2
    assert "no hook named 'nope' is registered" in capsys.readouterr().err
