"""Cross-backend check: same params, same batch, two backends, a per-layer error table.

Rows come in the order a bug propagates: forward activations (input, each block's uvqk,
attention, norm_mul and output, the final output, the loss), then parameter gradients in
backprop order (last block first). The first failing row names the first diverging layer.
Error measures (per tensor): ``max_abs = max|a - ref|`` and ``rel = max_abs / max|ref|``.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from backends import ops

from . import model
from .batch import HSTUBatch
from .config import Config, replace
from .configure import validate
from .runtime import make_backend
from .tree import tree_items

FWD_TOL = 1e-6
GRAD_TOL = 1e-5


@dataclasses.dataclass
class Row:
    kind: str        # "activation" | "gradient"
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


def _run(B, params_np: dict, batch_np: HSTUBatch, cfg: Config):
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
    from .batch import make_batch
    from .losses import negatives_for

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


def backend_as_trained(cfg: Config, name: str):
    """Backend ``name`` built exactly as ``grf train --backend name`` would build it from ``cfg``:
    the config's kernel, row kernel, device and determinism where they run on ``name`` (the
    config's own backend gets them all; the other side keeps what it supports, else its default),
    checked as train checks them, so a wrong kernel or device is refused or compared, not skipped."""
    if name == cfg.backend.name:
        side = cfg
    else:
        side = replace(cfg, backend={"name": name, "device": "", "compile": False},
                       ops={**ops.portable(ops.choices(cfg), name), "row_update": "default"})
    validate(side, source=f"--backends {name}")
    return make_backend(side)
