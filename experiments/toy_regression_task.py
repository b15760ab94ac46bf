"""A third task, written outside the package as a user would: linear regression on generated data,
trained by grf train's own loop (run folder, checkpoints, exact resume, grf eval, grf report).

    grf train --config quickstart --plugin experiments/toy_regression_task.py \
        --set model.task=toy_regression --set data.dataset=toy-regression --out runs/toy

One module, two registrations (the task and its dataset), no edit of gr_functional. The step is
the shared one (``step.make_train_step`` on this task's ``Objective``), so ``optim.*``, the NaN
guard, ``backend.precision`` and ``step.accumulate`` apply unchanged. tests/test_task_plugin.py
trains, kills, resumes, evaluates and reports it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any

import numpy as np

from gr_functional.data.prefetch import PrefetchStats
from gr_functional.data.registry import DatasetSpec, get_dataset, register_dataset
from gr_functional.hooks import Evaluation, StepResult
from gr_functional.task import ModelState, Prepared, Task, register_task
from gr_functional.step import Objective, make_train_step

DIM = 8


@dataclasses.dataclass
class Regression:
    """``x[N, DIM]`` float32 features, ``y[N]`` float32 targets, split 80/10/10 by row."""

    x: np.ndarray
    y: np.ndarray

    def split(self, name: str) -> "Regression":
        n = len(self.y)
        a, b = {"train": (0, int(0.8 * n)), "valid": (int(0.8 * n), int(0.9 * n)), "test": (int(0.9 * n), n)}[name]
        return Regression(self.x[a:b], self.y[a:b])


def load_regression(cfg, path) -> Regression:
    """``data.synthetic_users`` rows from ``data.seed``: y = x . w* + 0.5 + noise."""
    rng = np.random.default_rng(cfg.data.seed)
    x = rng.normal(size=(cfg.data.synthetic_users, DIM)).astype(np.float32)
    w = rng.normal(size=DIM).astype(np.float32)
    y = (x @ w + 0.5 + 0.1 * rng.normal(size=len(x))).astype(np.float32)
    return Regression(x, y)


@dataclasses.dataclass
class Batch:
    x: Any
    y: Any
    lookup: Any = None  # the shared step reads it: None, this task has no sparse table


class Loader:
    """Shuffled batches of the training rows with a resumable position ``(epoch, batch)``: the
    position names the next batch and moves as each is handed out."""

    def __init__(self, data: Regression, batch_size: int, seed: int):
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.steps_per_epoch = -(-len(data.y) // batch_size)
        self.position = (0, 0)

    def epoch(self, epoch: int, start: int):
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.data.y))
        for i in range(start, self.steps_per_epoch):
            rows = order[i * self.batch_size:(i + 1) * self.batch_size]
            self.position = (epoch, i + 1) if i + 1 < self.steps_per_epoch else (epoch + 1, 0)
            yield Batch(self.data.x[rows], self.data.y[rows])

    def state_dict(self) -> dict:
        return {"epoch": self.position[0], "step": self.position[1]}

    def load_state_dict(self, state: dict) -> None:
        self.position = (int(state["epoch"]), int(state["step"]))


def _mse(xp, params, x, y):
    pred = x @ params["w"] + params["b"]
    return xp.mean((pred - y) * (pred - y))


class Steps:
    """One loader batch per step through the shared step (``make_train_step``)."""

    def __init__(self, B, cfg, loader: Loader):
        self.B, self.loader, self.prefetch_stats = B, loader, PrefetchStats()
        objective = Objective(loss=lambda P, params, batch: _mse(P.xp, params, batch.x, batch.y),
                              tokens=lambda B, batch: B.xp.sum(B.xp.ones_like(batch.y)),
                              cast_batch=lambda B, batch, dtype: batch)
        self.fn = make_train_step(B, cfg, objective)

    def batches(self, epoch: int, start: int, limit: int | None = None):
        return itertools.islice(([b] for b in self.loader.epoch(epoch, start)), limit)

    def run(self, params, opt_state, micro, step: int, epoch: int):
        params, opt_state, m = self.fn(params, opt_state, self.B.asarray_tree(micro[0]))
        return params, opt_state, StepResult(step, epoch, m, len(micro[0].y))


def metrics(B, params, data: Regression) -> dict:
    params = B.to_numpy_tree(params)
    pred = data.x @ params["w"] + params["b"]
    mse = float(np.mean((pred - data.y) ** 2))
    return {"r2": 1.0 - mse / float(np.var(data.y)), "mse": mse}


class RegressionEvaluation(Evaluation):
    def __init__(self, data: Regression, ckdir):
        super().__init__(None, None, None, None, ckdir)
        self.data = data

    def evaluate_split(self, run, params, host, name: str) -> dict:
        return metrics(run.B, params, self.data.split(name))

    def summary(self, record: dict) -> str:
        return f"valid R^2 {record['valid']['r2']:.4f}  test R^2 {record['test']['r2']:.4f}"


class RegressionTask(Task):
    select_metric, curve_label = "r2", "R^2"
    rng_generator = "numpy default_rng((train.seed, epoch))"
    result_fields = {"task": "toy_regression"}

    def prepare(self, cfg, world_size: int) -> Prepared:
        data = get_dataset(cfg.data.dataset).load(cfg, None)
        loader = Loader(data.split("train"), cfg.train.batch_size, cfg.train.seed)
        fingerprint = hashlib.sha256(data.x.tobytes() + data.y.tobytes()).hexdigest()
        return Prepared(cfg, loader, fingerprint, {"sha256": fingerprint, "users": len(data.y), "events": len(data.y)},
                        describe=f"data: {len(data.y)} regression rows of {DIM} features", label="toy regression",
                        payload=data)

    def fresh(self, B, prepared: Prepared, comm) -> ModelState:
        rng = np.random.default_rng(prepared.cfg.train.seed)
        return ModelState(B.asarray_tree({"w": 0.1 * rng.normal(size=DIM).astype(np.float32),
                                          "b": np.zeros((), np.float32)}))

    def restore(self, B, prepared: Prepared, comm, checkpoint) -> ModelState:
        return ModelState(B.asarray_tree(checkpoint.params))

    def steps(self, B, prepared: Prepared, comm, state: ModelState):
        return Steps(B, prepared.cfg, prepared.loader)

    def evaluation(self, B, prepared: Prepared, comm, state: ModelState, ckdir):
        return RegressionEvaluation(prepared.payload, ckdir)

    def param_shapes(self, cfg, host_state) -> dict:
        return {"w": (DIM,), "b": ()}

    def evaluate_checkpoint(self, B, cfg, checkpoint, split: str) -> dict:
        data = load_regression(cfg, None).split(split)
        return {**metrics(B, B.asarray_tree(checkpoint.params), data), "task": "toy_regression"}


register_dataset(DatasetSpec("toy-regression", "toy regression", load_regression, needs_file=False,
                             task="toy_regression"))
register_task("toy_regression", RegressionTask())
