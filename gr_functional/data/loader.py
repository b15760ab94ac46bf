"""Batching: jagged training batches with a resumable position, and evaluation batches.

Every random draw is a pure function of ``(seed, epoch)`` (user order) and ``(seed, epoch, step)``
(negatives, dropout masks), so a run resumed from ``state_dict()`` sees exactly the batches an
uninterrupted run would have seen, on any backend. Nothing is padded to ``max_len``: a batch holds
``sum(min(L_u - 1, max_len))`` real tokens, rounded up to a capacity of the short
``round_up_capacity`` ladder so JAX compiles one program per capacity.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..batch import HSTUBatch, make_batch
from ..config import ModelConfig
from ..jagged import round_up_capacity
from .loaders import DataError
from .sequences import SequenceData
from .split import EvalSet


class TrainLoader:
    """Epochs of training batches over the users of ``data`` (use ``leave_one_out(...).train``).

    Each epoch visits every user exactly once in the order ``default_rng((seed, epoch)).permutation``.
    A step holds ``batch_size`` users (the last batch of an epoch may hold fewer), or, when
    ``max_tokens > 0``, as many users in that order as fit ``max_tokens`` input tokens (and at most
    ``batch_size``). Batches are ``make_batch(train=True)`` with ``b_cap=batch_size`` and
    ``t_cap=round_up_capacity(tokens)``.

    The position (``epoch``, ``step``) names the next batch to produce; iterating advances it
    before each batch is handed out, so a checkpoint written after a train step stores the right
    place to resume from.
    """

    def __init__(self, data: SequenceData, model_cfg: ModelConfig, batch_size: int, seed: int,
                 num_items: int | None = None, *, max_tokens: int = 0):
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (numpy seeds with (seed, epoch, step)), got {seed}")
        lengths = data.lengths()
        if len(lengths) == 0:
            raise DataError(f"{data.name or 'training data'}: no users to train on")
        short = np.flatnonzero(lengths < 2)
        if short.size:
            raise DataError(f"{data.name or 'training data'}: user row {short[0]} (id {data.user_ids[short[0]]}) has "
                            f"{lengths[short[0]]} event(s); training needs >= 2. Pass leave_one_out(data).train, "
                            f"which drops such users")
        self.data = data
        self.model_cfg = model_cfg
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_items = int(num_items or model_cfg.num_items or data.num_items)
        self.max_tokens = int(max_tokens)
        # Input tokens per user: make_batch feeds s[:-1], truncated to the most recent max_len.
        self.tokens = np.minimum(lengths - 1, model_cfg.max_len).astype(np.int64)
        if self.max_tokens and self.max_tokens < int(self.tokens.max()):
            raise DataError(f"max_tokens={self.max_tokens} is smaller than one user's {int(self.tokens.max())} "
                            f"training tokens; use max_tokens >= model.max_len={model_cfg.max_len} or 0 (off)")
        self._epoch = 0
        self._step = 0
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None

    @classmethod
    def from_config(cls, data: SequenceData, cfg) -> "TrainLoader":
        """From a full ``Config``: ``model``, ``train.batch_size``, ``train.seed`` and ``train.max_tokens``."""
        return cls(data, cfg.model, cfg.train.batch_size, cfg.train.seed, cfg.model.num_items or data.num_items,
                   max_tokens=cfg.train.max_tokens)

    # ------------------------------------------------------------------ schedule
    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def num_users(self) -> int:
        return len(self.tokens)

    def plan(self, epoch: int) -> list[np.ndarray]:
        """User rows of each step of ``epoch`` (``[B_s] int64`` arrays that partition all users)."""
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        order = np.random.default_rng((self.seed, epoch)).permutation(self.num_users)
        if not self.max_tokens:
            steps = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        else:
            steps, start, total = [], 0, 0
            tokens = self.tokens[order].tolist()
            for i, t in enumerate(tokens):
                if i > start and (total + t > self.max_tokens or i - start >= self.batch_size):
                    steps.append(order[start:i])
                    start, total = i, 0
                total += t
            steps.append(order[start:])
        self._plan_cache = (epoch, steps)
        return steps

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.plan(epoch))

    @property
    def steps_per_epoch(self) -> int:
        """Steps of the current epoch (the same for every epoch unless ``max_tokens`` is on)."""
        return self.steps_in_epoch(self._epoch)

    # ------------------------------------------------------------------ batches
    def batch(self, epoch: int, step: int) -> HSTUBatch:
        """Batch ``step`` of ``epoch`` (random access; does not move the position)."""
        plan = self.plan(epoch)
        if not 0 <= step < len(plan):
            raise IndexError(f"epoch {epoch} has {len(plan)} steps, asked for step {step}")
        users = plan[step]
        histories, times = self.data.sequences(users)
        return make_batch(histories, times, self.model_cfg, rng=np.random.default_rng((self.seed, epoch, step)),
                          num_items=self.num_items, train=True, b_cap=self.batch_size,
                          t_cap=round_up_capacity(int(self.tokens[users].sum())))

    def epoch(self, e: int, start_step: int = 0) -> Iterator[HSTUBatch]:
        """Batches of epoch ``e`` from ``start_step`` on; moves the position as it goes."""
        n = self.steps_in_epoch(e)
        for s in range(start_step, n):
            batch = self.batch(e, s)
            self._epoch, self._step = (e, s + 1) if s + 1 < n else (e + 1, 0)
            yield batch
        if start_step >= n:
            self._epoch, self._step = e + 1, 0

    def __iter__(self) -> Iterator[HSTUBatch]:
        """The rest of the current epoch, from the saved position."""
        return self.epoch(self._epoch, self._step)

    # ------------------------------------------------------------------ resume
    @property
    def position(self) -> tuple[int, int]:
        return self._epoch, self._step

    def state_dict(self) -> dict:
        """``{"epoch", "step"}`` of the next batch, plus what must match on resume."""
        return {"epoch": self._epoch, "step": self._step, "seed": self.seed, "batch_size": self.batch_size,
                "max_tokens": self.max_tokens, "num_users": self.num_users}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "max_tokens", "num_users"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(f"loader state has {key}={state[key]} but this loader has {key}={getattr(self, key)}; "
                                f"resuming would replay different batches. Resume with the run's original config")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or step < 0:
            raise DataError(f"loader state has a negative position epoch={epoch} step={step}")
        self._epoch, self._step = epoch, step


def eval_batches(histories, times, targets, target_times, model_cfg: ModelConfig, batch_size: int, *,
                 num_items: int | None = None) -> Iterator[tuple[HSTUBatch, np.ndarray, list[np.ndarray]]]:
    """Evaluation batches of ``batch_size`` users (the last may hold fewer).

    histories/times: U arrays (item ids int, unix seconds), each history >= 1 event;
    targets[U], target_times[U]: the held-out item and its time.
    Yields ``(batch, targets[B] int32, exclude)``: ``batch`` is ``make_batch(train=False)``
    scoring the last history position at ``query_times = target_times``; ``exclude`` holds the
    history ids the model saw (the most recent ``max_len``), the ids GR removes before ranking.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    n = len(histories)
    if not (len(times) == len(targets) == len(target_times) == n):
        raise DataError(f"eval_batches: {n} histories, {len(times)} time arrays, {len(targets)} targets, "
                        f"{len(target_times)} target times; they must match")
    targets = np.asarray(targets)
    target_times = np.asarray(target_times, dtype=np.int64)
    max_len = model_cfg.max_len
    for start in range(0, n, batch_size):
        end = min(start + batch_size, n)
        hs, ts = list(histories[start:end]), list(times[start:end])
        tokens = sum(min(len(h), max_len) for h in hs)
        batch = make_batch(hs, ts, model_cfg, query_times=target_times[start:end], num_items=num_items,
                           train=False, b_cap=batch_size, t_cap=round_up_capacity(tokens))
        yield batch, targets[start:end].astype(np.int32), [np.asarray(h[-max_len:]) for h in hs]


def iter_eval(split: EvalSet, model_cfg: ModelConfig, batch_size: int, *, num_items: int | None = None,
              max_users: int = 0) -> Iterator[tuple[HSTUBatch, np.ndarray, list[np.ndarray]]]:
    """``eval_batches`` over an ``EvalSet`` (``Split.valid`` or ``Split.test``); ``max_users > 0``
    keeps the first users only."""
    split = split.head(max_users)
    histories, times = split.history.sequences()
    return eval_batches(histories, times, split.targets, split.target_times, model_cfg, batch_size,
                        num_items=num_items)
