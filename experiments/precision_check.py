"""Speed and loss effect of backend.precision (bf16 / fp16 vs fp32), measured in one run.

    python experiments/precision_check.py --config quickstart [--backends torch,jax] [--steps 20]
        [--set key=value ...]

For each backend, the same initial params train for ``--steps`` steps on the same first batches
of epoch 0 in fp32, bf16 and fp16 (dynamic loss scaling, starting at train.loss_scale). Prints one
JSON object per (backend, precision): training tokens/s (timed from the third step, after one
warm-up step per batch capacity, so JAX compile time is excluded), its ratio to fp32 on the same
backend, the mean loss of the last 5 steps and its relative difference from fp32's, and the fp16
steps skipped by overflow (a skipped step shifts the trajectory, so fp16's loss difference then
compares different steps). HR@10 needs full runs: ``grf train --set backend.precision=bf16``
(see experiments/configs/ml1m_hstu_bf16.toml).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def main() -> None:
    from gr_functional import model
    from gr_functional.cli import _config_path
    from gr_functional.config import replace
    from gr_functional.configure import load_config
    from gr_functional.data import batching, split
    from gr_functional.retrieval.task import load_sequences, resolve
    from gr_functional.runtime import make_backend
    from gr_functional.step import init_opt_state, make_train_step

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--backends", default="torch,jax")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()

    cfg = load_config(_config_path(args.config), args.set)
    data = load_sequences(cfg)
    cfg = resolve(cfg, data)
    train_loader = batching.TrainLoader.from_config(split.leave_one_out(data).train, cfg)
    n = min(args.steps + 2, train_loader.steps_in_epoch(0))
    batches = [train_loader.batch(0, s) for s in range(n)]
    tokens = [b.layout.num_tokens() for b in batches]
    params0 = model.init_params(cfg.model, seed=cfg.train.seed)
    for name in args.backends.split(","):
        base = None
        for precision in ("fp32", "bf16", "fp16"):
            run_cfg = replace(cfg, backend={"name": name, "precision": precision})
            B = make_backend(run_cfg)
            step = make_train_step(B, run_cfg)
            params = B.asarray_tree(params0)
            state = init_opt_state(B, params, run_cfg)
            dev = [B.asarray_tree(b) for b in batches]
            # warm-up: one step per distinct capacity on throw-away state (JAX compiles here)
            seen = {}
            for b, d in zip(batches, dev):
                seen.setdefault((b.layout.t_cap, b.layout.b_cap), d)
            for d in seen.values():
                bool(step(params, state, d)[2]["finite"])
            losses, skipped = [], 0
            for i in range(n):
                if i == 2:
                    t0 = time.perf_counter()
                params, state, m = step(params, state, dev[i])
                ok = bool(m["finite"])  # forces the step to finish (host sync)
                skipped += int(not ok)
                if ok:
                    losses.append(float(m["loss"]))
            seconds = time.perf_counter() - t0
            row = {"backend": name, "precision": precision, "steps": n - 2,
                   "tokens_per_s": round(sum(tokens[2:]) / seconds, 1),
                   "last5_loss": round(sum(losses[-5:]) / len(losses[-5:]), 5), "skipped": skipped}
            if base is None:
                base = row
            row["speed_vs_fp32"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
            row["loss_rel_diff_vs_fp32"] = round(abs(row["last5_loss"] - base["last5_loss"]) / base["last5_loss"], 5)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
