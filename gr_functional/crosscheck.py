"""Cross-backend check: same params, same batch, two backends, a per-layer error table; or the same
N-step training on both (``trajectory``: losses and parameters), or one trained checkpoint evaluated
on both (``checkpoint_evaluations``).

Rows come in the order a bug propagates: forward activations (input, each block's uvqk,
attention, norm_mul and output, the final output, the loss), then parameter gradients in
backprop order (last block first). The first failing row names the first diverging layer.
Error measures (per tensor): ``max_abs = max|a - ref|`` and ``rel = max_abs / max|ref|``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from backends import ops

from . import model
from .batch import HSTUBatch, make_batch
from .checkpoint import read_checkpoint
from .config import Config, replace
from .configure import validate
from .data import batching, split
from .losses import negatives_for
from .retrieval.task import load_sequences, resolve
from .runner import evaluate_checkpoint, for_evaluation, train
from .runtime import make_backend
from .tree import tree_items
from .contracts import Backend

FWD_TOL = 1e-6
GRAD_TOL = 1e-5
TRAJ_TOL = 1e-4    # losses and parameters after N float32 steps (tests/differential: 50 steps)
METRIC_TOL = 1e-3  # a checkpoint's ranking metrics on two backends


@dataclasses.dataclass
class Row:
    kind: str        # "activation" | "gradient" | "loss" | "param" | "metric"
    name: str
    max_abs: float
    rel: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.rel) and self.rel <= self.tol)


@dataclasses.dataclass
class Report:
    backends: tuple[str, str]
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_failure(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)

    def records(self) -> list[dict]:
        """One dict per row: ``{"reference", "other", "kind", "name", "max_abs", "rel", "tol", "ok"}``."""
        ref, other = self.backends
        return [dict(reference=ref, other=other, **dataclasses.asdict(r), ok=r.ok) for r in self.rows]

    def to_json(self) -> str:
        first = self.first_failure
        return json.dumps({
            "backends": list(self.backends), "ok": self.ok,
            "first_diverging": None if first is None else first.name,
            "rows": [dict(dataclasses.asdict(r), ok=r.ok) for r in self.rows],
        }, indent=1)

    def to_table(self) -> str:
        ref, other = self.backends
        lines = [f"crosscheck {other} against {ref} (reference)",
                 f"{'kind':<10} {'layer':<28} {'max_abs_err':>12} {'rel_err':>10} {'tol':>8}  result"]
        for r in self.rows:
            lines.append(f"{r.kind:<10} {r.name:<28} {r.max_abs:>12.3e} {r.rel:>10.3e} {r.tol:>8.0e}  "
                         f"{'pass' if r.ok else 'FAIL'}")
        first = self.first_failure
        lines.append("all layers agree" if first is None else
                     f"FAILED: first diverging layer: {first.name} ({first.kind}, rel err {first.rel:.3e} "
                     f"> {first.tol:.0e})")
        return "\n".join(lines)


def _run(B: Backend, params_np: dict, batch_np: HSTUBatch, cfg: Config):
    params = B.asarray_tree(params_np)
    batch = B.asarray_tree(batch_np)

    def traced_loss(p, b):
        trace: dict = {}
        loss = model.loss_fn(B, p, b, cfg.model, trace, loss=cfg.loss)
        return loss, trace

    (loss, trace), grads = B.value_and_grad(traced_loss, has_aux=True)(params, batch)
    acts = {name: B.to_numpy(x) for name, x in trace.items()}
    grads = {path: B.to_numpy(g) for path, g in tree_items(grads)}
    return acts, grads


def _compare(a: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    a64, r64 = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    diff = float(np.abs(a64 - r64).max(initial=0.0))
    if not np.isfinite(a64).all():
        return float("inf"), float("inf")
    scale = float(np.abs(r64).max(initial=0.0))
    return diff, (diff / scale if scale > 0 else diff)


def _grad_order(path: str) -> tuple:
    """Backprop order: last block first, then position and item embeddings."""
    parts = path.split(".")
    if parts[0] == "blocks":
        return (0, -int(parts[1]), path)
    return (1, 0 if parts[0] == "pos_emb" else 1, path)


def crosscheck(backends, params_np: dict, batch_np: HSTUBatch, cfg: Config,
               fwd_tol: float = FWD_TOL, grad_tol: float = GRAD_TOL) -> Report:
    """Compare ``backends[1]`` against ``backends[0]`` (the reference) layer by layer.

    ``backends`` are two Backend instances; params and batch are numpy trees.
    """
    ref_b, other_b = backends
    ref_acts, ref_grads = _run(ref_b, params_np, batch_np, cfg)
    acts, grads = _run(other_b, params_np, batch_np, cfg)
    rows = []
    for name in model.trace_names(cfg.model):
        rows.append(Row("activation", name, *_compare(acts[name], ref_acts[name]), fwd_tol))
    for path in sorted(ref_grads, key=_grad_order):
        rows.append(Row("gradient", path, *_compare(grads[path], ref_grads[path]), grad_tol))
    return Report((ref_b.name, other_b.name), rows)


def random_batch(cfg: Config, seed: int = 0, num_users: int = 16) -> HSTUBatch:
    """A training batch of random histories (lengths 2..max_len+1, one of each extreme) for checks
    that need no dataset."""
    rng = np.random.default_rng(seed)
    m = cfg.model
    lengths = rng.integers(2, m.max_len + 2, num_users)
    lengths[0], lengths[-1] = 2, m.max_len + 1
    histories = [rng.integers(1, m.num_items + 1, n) for n in lengths]
    times = [np.cumsum(rng.integers(1, 10**5, n)) + 10**9 for n in lengths]
    # a popularity sampler draws from these histories' own item counts
    popularity = np.bincount(np.concatenate(histories), minlength=m.num_items + 1)
    return make_batch(histories, times, m, rng=rng, num_items=m.num_items,
                      negatives=negatives_for(cfg, popularity))


def config_as_trained(cfg: Config, name: str, *, trains: bool = True) -> Config:
    """``cfg`` as ``grf train --backend name`` would run it: the config's ops, device and
    determinism where they run on ``name`` (the config's own backend gets them all; the other side
    keeps what it supports, else its default), checked as train checks them, so a wrong kernel or
    device is refused or compared, not skipped. ``trains=False`` (evaluating a checkpoint): the
    run's optimizer is not used, so one that runs on JAX only (optax) does not refuse another side."""
    if name == cfg.backend.name:
        side = cfg
    else:
        side = replace(cfg, backend={"name": name, "device": "", "compile": False},
                       ops={**ops.portable(ops.choices(cfg), name), "row_update": "default"})
        if not trains:
            side = for_evaluation(side)
    validate(side, source=f"--backends {name}")
    return side


def backend_as_trained(cfg: Config, name: str):
    """The backend ``grf train --backend name`` would build from ``cfg`` (``config_as_trained``)."""
    return make_backend(config_as_trained(cfg, name, trains=False))


def trajectory(cfg: Config, names, steps: int, out: Path, tol: float = TRAJ_TOL) -> Report:
    """Train ``steps`` steps of ``cfg`` on each of ``names`` (reference first) exactly as ``grf
    train`` runs them (``runner.train`` into ``out/NAME``: the same seed, batches, negatives and
    optimizer), then compare the losses step by step and every parameter after the last step.
    Losses and parameters drift apart slowly under float32 noise: ``tol`` is relative."""
    losses, params = [], []
    for name in names:
        side = replace(config_as_trained(cfg, name),
                       train={"max_steps": steps, "log_every": 1, "checkpoint_every": 0})
        folder = Path(out) / name
        with contextlib.redirect_stdout(sys.stderr):  # the epoch lines: stdout is the report
            train(side, folder, progress=False, resume="never")
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if r.get("kind") == "train"])
        params.append(dict(tree_items(read_checkpoint(folder / "checkpoints" / "last.safetensors").params)))
    (ref_loss, loss), (ref_params, got) = losses, params
    rows = [Row("loss", f"step {i + 1}", *_compare(np.float64(b), np.float64(a)), tol)
            for i, (a, b) in enumerate(zip(ref_loss, loss))]
    if len(ref_loss) != len(loss):
        rows.append(Row("loss", f"steps run: {len(ref_loss)} vs {len(loss)}", float("inf"), float("inf"), tol))
    for path in sorted(ref_params, key=_grad_order):
        rows.append(Row("param", path, *(_compare(got[path], ref_params[path]) if path in got
                                         else (float("inf"), float("inf"))), tol))
    return Report(tuple(names), rows)


def checkpoint_evaluations(path: str | Path, names, split: str = "test", tol: float = METRIC_TOL,
                           users: int = 32) -> Report:
    """One trained checkpoint on each of ``names``: its evaluation (``runner.evaluate_checkpoint``:
    the run's own config, its ops where they run there), every metric compared (ranking metrics move
    only when float noise swaps two scores: ``tol``, relative, is looser than a layer's); and, for a
    dense retrieval model, its trained parameters layer by layer on a batch of ``users`` sequences
    of its training data (``crosscheck``), where a kernel that barely moves a metric shows."""
    results = [evaluate_checkpoint(path, backend=name, split=split) for name in names]
    ref, got = results
    rows = [Row("metric", key, *_compare(np.float64(got[key]), np.float64(value)), tol)
            for key, value in ref.items()
            if isinstance(value, float) and key in got]
    ck = read_checkpoint(path)
    cfg = ck.config
    if cfg.model.task == "retrieval" and cfg.embedding.kind == "dense":
        backends = [backend_as_trained(cfg, name) for name in names]
        data_cfg, batch = first_batch(cfg, users)
        rows += crosscheck(backends, ck.params, batch, data_cfg).rows
    return Report(tuple(names), rows)


def first_batch(cfg: Config, users: int) -> tuple[Config, HSTUBatch]:
    """``(cfg resolved against its data, a training batch of users sequences)``: the first batch of
    the config's data (its own split and loader), or random histories for a synthetic config with a
    catalogue size (``random_batch``)."""
    if cfg.model.num_items == 0 or cfg.data.dataset != "synthetic":
        data = load_sequences(cfg)
        cfg = replace(resolve(cfg, data), train={"batch_size": users, "max_tokens": 0})
        train_loader = batching.TrainLoader.from_config(split.leave_one_out(data).train, cfg)
        return cfg, next(iter(train_loader.epoch(0)))
    return cfg, random_batch(cfg, seed=cfg.train.seed, num_users=users)
