"""Experiment runner: data -> params -> training loop -> evaluation -> output files.

``train(cfg, out_dir)`` writes (DESIGN.md "CLI and files"):
  OUT/config.toml    resolved config
  OUT/metrics.jsonl  one JSON object per line: training steps {"kind": "train", ...} and
                     evaluations {"kind": "eval", "split": "valid"|"test", ...}
  OUT/eval.json      test metrics (hr@10, ndcg@10, hr@50, ndcg@50, hr@200, ndcg@200, mrr) of the epoch
                     with the best validation HR@10, plus that epoch and the last epoch's test metrics
  OUT/curves.png     loss and HR@10 per epoch
  OUT/checkpoints/   safetensors checkpoints (params + optimizer state + config)
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from backends import get_backend

from . import model
from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config, config_to_toml, replace
from .optim import adamw_init
from .train import make_scorer, make_train_step


# ----------------------------------------------------------------------------- data
def load_sequences(cfg: Config):
    """The dataset named by ``cfg.data`` as a SequenceData (ids 1..num_items, time-sorted)."""
    from .data.datasets import load_dataset

    return load_dataset(cfg.data)


def resolve(cfg: Config, data) -> Config:
    """Fill ``model.num_items`` from the data when the config leaves it 0."""
    if cfg.model.num_items == 0:
        cfg = replace(cfg, model={"num_items": int(data.num_items)})
    elif cfg.model.num_items < data.num_items:
        raise ValueError(f"model.num_items={cfg.model.num_items} < largest item id {data.num_items} in the data")
    return cfg


def make_backend(cfg: Config):
    options = {"device": cfg.backend.device or None, "dtype": cfg.backend.dtype}
    if cfg.backend.hstu_kernel != "default":
        options["hstu_kernel"] = cfg.backend.hstu_kernel
    return get_backend(cfg.backend.name, **options)


# ----------------------------------------------------------------------------- evaluation
def evaluate(B, params, cfg: Config, examples, candidates=None, scorer=None, max_users: int = 0) -> dict:
    """HR@K / NDCG@K / MRR on leave-one-out ``examples`` (split.test or split.valid): full-catalogue
    ranking of the held-out item among ``candidates`` (all ids when None) minus the user's history."""
    from .data import loader, metrics

    scorer = scorer or make_scorer(B, cfg)
    ranks = []
    for batch, targets, exclude in loader.iter_eval(examples, cfg.model, cfg.eval.batch_size,
                                                    max_users=max_users or cfg.eval.max_users):
        scores = B.to_numpy(scorer(params, B.asarray_tree(batch)))[: len(targets)]
        ranks.append(metrics.ranks_from_scores(scores, targets, exclude, candidates=candidates))
    return metrics.metrics_from_ranks(np.concatenate(ranks), cfg.eval.ks)


# ----------------------------------------------------------------------------- training
def _write_curves(path: Path, epochs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot([e["epoch"] for e in epochs], [e["loss"] for e in epochs], marker="o")
    ax1.set_xlabel("epoch"), ax1.set_ylabel("train loss")
    for split in ("valid", "test"):
        pts = [(e["epoch"], e[split]["hr@10"]) for e in epochs if split in e]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=split)
    ax2.set_xlabel("epoch"), ax2.set_ylabel("HR@10"), ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(cfg: Config, out_dir: str | Path, progress: bool = True) -> dict:
    """Train per ``cfg``, evaluate, write the output files; returns the eval.json dict."""
    from tqdm import tqdm

    from .data import loader, split as split_mod

    out = Path(out_dir)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    (out / "config.toml").write_text(config_to_toml(cfg))
    splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
    B = make_backend(cfg)
    params = B.asarray_tree(model.init_params(cfg.model, seed=cfg.train.seed))
    opt_state = adamw_init(B, params)
    step_fn, scorer = make_train_step(B, cfg), make_scorer(B, cfg)
    train_loader = loader.TrainLoader.from_config(splits.train, cfg)
    total_steps = train_loader.steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    log = open(out / "metrics.jsonl", "w")
    epochs, step, best = [], 0, None
    # disable=None: no bar when stderr is not a terminal (CI logs); epoch lines still print
    bar = tqdm(total=total_steps, disable=None if progress else True, unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    for epoch in range(cfg.train.epochs):
        losses, tokens, t_epoch = [], 0, time.perf_counter()
        for batch in train_loader.epoch(epoch):
            if step >= total_steps:
                break
            params, opt_state, m = step_fn(params, opt_state, B.asarray_tree(batch))
            step += 1
            n_tok = batch.layout.num_tokens()
            tokens += n_tok
            loss = float(m["loss"])
            losses.append(loss)
            tok_s = tokens / max(time.perf_counter() - t_epoch, 1e-9)
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)
            if step % cfg.train.log_every == 0:
                log.write(json.dumps({"kind": "train", "step": step, "epoch": epoch, "loss": loss,
                                      "tokens": n_tok, "tokens_per_s": tok_s}) + "\n")
                log.flush()
        if not losses:
            break
        record = {"epoch": epoch, "step": step, "loss": float(np.mean(losses)),
                  "epoch_seconds": time.perf_counter() - t_epoch}
        last_epoch = epoch == cfg.train.epochs - 1 or step >= total_steps
        if (epoch + 1) % cfg.train.eval_every == 0 or last_epoch:
            for name in ("valid", "test"):
                record[name] = evaluate(B, params, cfg, getattr(splits, name), data.candidates, scorer)
                log.write(json.dumps({"kind": "eval", "split": name, "epoch": epoch, "step": step,
                                      **record[name]}) + "\n")
            log.flush()
            if best is None or record["valid"]["hr@10"] > best["valid"]["hr@10"]:
                best = record
            bar.write(f"epoch {epoch}: loss {record['loss']:.4f}  valid HR@10 {record['valid']['hr@10']:.4f}"
                      f"  test HR@10 {record['test']['hr@10']:.4f}  NDCG@10 {record['test']['ndcg@10']:.4f}")
        epochs.append(record)
        save_checkpoint(out / "checkpoints" / "last.safetensors", B.to_numpy_tree(params),
                        B.to_numpy_tree(opt_state), cfg, {"epoch": epoch, "step": step, "backend": B.name})
        if last_epoch:
            break
    bar.close()
    log.close()
    last = epochs[-1]
    result = {**best["test"], "epoch": best["epoch"], "selected_by": "best valid hr@10",
              "last_epoch": last["epoch"], "last_epoch_test": last["test"], "dataset": data.name,
              "backend": B.name, "steps": step, "wall_seconds": time.perf_counter() - t_start}
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    _write_curves(out / "curves.png", epochs)
    return result


def evaluate_checkpoint(path: str | Path, backend: str | None = None, split: str = "test") -> dict:
    """Evaluate a checkpoint (trained on any backend) on ``backend`` with the run's own config."""
    from .data import split as split_mod

    params_np, _, cfg, meta = load_checkpoint(path)
    if backend:
        cfg = replace(cfg, backend={"name": backend})
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    B = make_backend(cfg)
    splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
    result = evaluate(B, B.asarray_tree(params_np), cfg, getattr(splits, split), data.candidates)
    return {**result, "split": split, "backend": B.name, "trained_on": meta.get("backend"),
            "epoch": meta.get("epoch"), "dataset": data.name}
