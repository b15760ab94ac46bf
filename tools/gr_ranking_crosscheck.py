#!/usr/bin/env python
"""Developer cross-check: gr_functional.ranking against generative-recommenders' own dlrm_v3
``DlrmHSTU`` (not part of the package, not run in CI).

It needs GR's source tree (github.com/facebookresearch/generative-recommenders, now meta-recsys/;
checked at HEAD db1bf8f, and still at 2e81fab: the differences are detected from GR's signatures
and attributes, not its commit) and a Python that imports both it and this project. On a CPU
machine with this project installed (torch 2.13.0 CPU; pip must not replace it)::

    python3 -m venv --system-site-packages grvenv
    grvenv/bin/pip install --no-deps fbgemm-gpu-cpu==1.8.0
    grvenv/bin/pip install --no-deps torchrec==1.9.2       # its metadata would pull CUDA builds
    grvenv/bin/pip install gin-config pandas tensordict iopath torchmetrics pyre-extensions
    export TORCH_DEVICE_BACKEND_AUTOLOAD=0 GRF_DATA_DIR=...
    GR_SRC=path/to/generative-recommenders grvenv/bin/python tools/gr_ranking_crosscheck.py --group-norm false
    GR_SRC=path/to/generative-recommenders grvenv/bin/python tools/gr_ranking_crosscheck.py --group-norm true
    # variable candidates per user and per-candidate query times (batch built by hand, below):
    GR_SRC=... grvenv/bin/python tools/gr_ranking_crosscheck.py --num-targets 5,2,4,1 --own-query-times

What it does, on the 4 users of the KuaiRand log sample, with a shrunken KuaiRand config:

1. GR's model: ``dlrm_v3.configs.get_hstu_configs("kuairand-1k")`` and
   ``get_embedding_table_config("kuairand-1k")`` with small dims, no dropout, fp32 tables, and
   ``hstu_group_norm`` from ``--group-norm`` (false: one LayerNorm over H*dv of the attention
   output, weights [H*dv]; true: per-head GroupNorm, weights [H]; default: configs.py's value,
   false at HEAD, true at 2e81fab); our ``ranking.group_norm`` follows GR's, and our tower width
   GR HEAD's ``hstu_preprocessor_hidden_dim``. The ``DlrmHSTU`` built as
   ``dlrm_v3.train.utils.make_model`` builds it, plus ``bf16_training=False`` where that argument
   exists (GR HEAD; its default casts the history embeddings to bfloat16), every Hammer kernel
   set to ``HammerKernel.PYTORCH``, its ``meta``-device ``EmbeddingCollection`` swapped for a CPU one.
2. Our parameters (``init_ranking_params``) are copied into GR's modules, every GR parameter
   mapped (the script fails if one is left unmapped) except GR HEAD's ``_additional_embedding_mlp``
   tower, which KuaiRand never runs (``unused_gr_parameters``; checked to get no gradient).
3. GR's batch comes from GR's own loader: ``kuairand_ranking.write_gr_processed`` writes a
   ``processed_seqs.csv``, ``DLRMv3KuaiRandDataset`` reads and hashes it, ``load_item`` builds the
   per-user KJTs and ``datasets.dataset.collate_fn`` batches them. That loader always gives
   ``max_num_candidates`` candidates per user, all at the newest history event's time; with
   ``--num-targets`` each user's KJTs come from ``load_item(row, num_targets[i])`` instead, and
   with ``--own-query-times`` the candidates' query-time values are replaced by their own event
   times (GR's model takes both). Ours: ``make_ranking_batch`` (``rng=None``: no dropout; with
   ``num_targets`` / ``own_query_times`` in those cases).
4. GR's forward in training mode (the mode that returns losses) and backward of the sum of the
   task losses (as ``train_loop`` does); ours with the torch backend in float32 and float64. It
   prints the worst relative error (``max|a - b| / max|b|``, b = GR) of the logits, predictions,
   per-task losses and every parameter's gradient, and exits 1 if one exceeds ``--tol``.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent

# GR parameter name -> (our parameter path, transpose?). {i} is an STU layer number; the towers
# are torch.nn.Sequential(Linear, SwishLayerNorm, Linear, LayerNorm), their Linear weights stored
# [out, in] where ours are [in, out].
_TOWER = {"0.weight": ("w1", True), "0.bias": ("b1", False), "1.weight": ("sw_w", False), "1.bias": ("sw_b", False),
          "2.weight": ("w2", True), "2.bias": ("b2", False), "3.weight": ("ln_w", False), "3.bias": ("ln_b", False)}
_STU = {"_uvqk_weight": "w_uvqk", "_uvqk_beta": "b_uvqk", "_input_norm_weight": "ln_w", "_input_norm_bias": "ln_b",
        "_output_weight": "w_out", "_output_norm_weight": "gn_w", "_output_norm_bias": "gn_b"}
_CONTEXT_TABLES = ("user_id", "user_active_degree", "follow_user_num_range", "fans_user_num_range",
                   "friend_user_num_range", "register_days_range")


def parameter_map(num_layers: int) -> dict[str, tuple[str, bool]]:
    """Every parameter of GR's ``DlrmHSTU`` (KuaiRand) -> (our path, transpose)."""
    m = {"_embedding_collection.embeddings.video_id.weight": ("video", False)}
    for s, name in enumerate(_CONTEXT_TABLES):
        m[f"_embedding_collection.embeddings.{name}.weight"] = (f"context.t{s}", False)
    pre = "_hstu_transducer._input_preprocessor."
    m[pre + "_batched_contextual_linear_weights"] = ("wc", False)
    m[pre + "_batched_contextual_linear_bias"] = ("bc", False)
    for gr, ours in (("_content_embedding_mlp", "content"), ("_action_embedding_mlp", "action")):
        for k, (name, t) in _TOWER.items():
            m[f"{pre}{gr}.{k}"] = (f"{ours}.{name}", t)
    m[pre + "_action_encoder._action_embedding_table"] = ("action_table", False)
    m[pre + "_action_encoder._target_action_embedding_table"] = ("action_target", False)
    pe = "_hstu_transducer._positional_encoder."
    m[pe + "_position_embeddings_weight"] = ("position", False)
    m[pe + "_timestamp_embeddings_weight"] = ("time", False)
    for i in range(num_layers):
        for gr, ours in _STU.items():
            m[f"_hstu_transducer._stu_module._stu_layers.{i}.{gr}"] = (f"stu.layer{i}.{ours}", False)
    post = "_hstu_transducer._output_postprocessor."
    m[post + "_time_feature_combiner.weight"] = ("post.w", True)
    m[post + "_time_feature_combiner.bias"] = ("post.b", False)
    m[post + "_layer_norm.weight"] = ("post.ln_w", False)
    m[post + "_layer_norm.bias"] = ("post.ln_b", False)
    for k, (name, t) in _TOWER.items():
        m[f"_item_embedding_mlp.{k}"] = (f"item.{name}", t)
    task = "_multitask_module._prediction_module."
    for k, (name, t) in {"0.weight": ("w1", True), "0.bias": ("b1", False), "1.weight": ("sw_w", False),
                         "1.bias": ("sw_b", False), "2.weight": ("w2", True), "2.bias": ("b2", False)}.items():
        m[task + k] = (f"task.{name}", t)
    return m


def with_feature_tables(tree: dict, cfg) -> dict:
    """``tree`` (our params or gradients) plus per-feature views of its (possibly merged) id
    tables under ``video`` and ``context.t0..t5``, the paths the parameter map names."""
    from gr_functional.ranking.model import feature_tables

    return {**tree, **feature_tables(tree["tables"], cfg)}


def get_path(tree, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max(initial=0.0)
    diff = np.abs(a - b).max(initial=0.0)
    return float(diff / scale) if scale > 0 else float(diff)


def small_gr_configs(args):
    """GR's KuaiRand config and tables (its own ``configs.py``), shrunk, dropout off, fp32 tables."""
    from generative_recommenders.dlrm_v3.configs import get_embedding_table_config, get_hstu_configs
    from torchrec.modules.embedding_configs import DataType

    hc = get_hstu_configs("kuairand-1k")
    hc.hstu_num_heads = args.heads
    hc.hstu_attn_linear_dim = args.dv
    hc.hstu_attn_qk_dim = args.dqk
    hc.hstu_attn_num_layers = args.layers
    hc.hstu_embedding_table_dim = args.embed_dim
    hc.hstu_transducer_embedding_dim = args.dim
    hc.hstu_input_dropout_ratio = 0.0
    hc.hstu_linear_dropout_rate = 0.0
    hc.max_seq_len = args.max_seq_len
    hc.max_num_candidates = args.candidates
    if args.group_norm is not None:                                           # else configs.py's own choice
        hc.hstu_group_norm = args.group_norm == "true"
    sizes = {"video_id": args.id_table, "user_id": args.id_table}             # the 5 user features keep GR's 8/9/9/8/8
    tables = {name: dataclasses.replace(t, embedding_dim=args.embed_dim, data_type=DataType.FP32,
                                        num_embeddings=sizes.get(name, t.num_embeddings))
              for name, t in get_embedding_table_config("kuairand-1k").items()}
    return hc, tables


def build_gr_model(hc, tables):
    """``make_model``'s construction (``dlrm_v3/train/utils.py``), on CPU."""
    import torch
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.modules.dlrm_hstu import DlrmHSTU
    from torchrec.modules.embedding_modules import EmbeddingCollection

    kwargs = {}
    if "bf16_training" in inspect.signature(DlrmHSTU.__init__).parameters:
        # GR HEAD: the default (True) casts the history embeddings to bfloat16 before the transducer
        # (and autocasts on CUDA); the comparison is of float32 models
        kwargs["bf16_training"] = False
    model = DlrmHSTU(hstu_configs=hc, embedding_tables=tables, is_inference=False, **kwargs)
    # GR creates the collection on `meta` for DistributedModelParallel to materialise; here a CPU one
    model._embedding_collection = EmbeddingCollection(tables=list(tables.values()), need_indices=False,
                                                      device=torch.device("cpu"))
    model.recursive_setattr("_hammer_kernel", HammerKernel.PYTORCH)
    return model


def gr_batch(seqs, users, hc, tables, workdir: Path, num_targets=None, own_query_times: bool = False):
    """GR's batch of ``users``, through GR's own loader from a processed_seqs.csv we write.

    ``num_targets`` / ``own_query_times`` (the variable-candidate case): GR's KuaiRand loader gives
    every user exactly ``max_num_candidates`` candidates, all at one query time (the newest kept
    history event's), though its model takes any per-sample count and per-candidate times. So each
    user's KJTs come from the loader's ``load_item(row, num_targets[i])`` (its split of the last
    num_targets[i] events), and with ``own_query_times`` the candidate KJT's query-time values are
    replaced by the candidates' own event times (GR's ``separate_uih_candidates`` of ``time_ms``)."""
    import torch
    from generative_recommenders.dlrm_v3.datasets.dataset import collate_fn
    from generative_recommenders.dlrm_v3.datasets.kuairand import DLRMv3KuaiRandDataset
    from generative_recommenders.dlrm_v3.datasets.utils import separate_uih_candidates
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gr_functional.data.sources.kuairand_ranking import write_gr_processed

    path = workdir / "processed_seqs.csv"
    write_gr_processed(seqs, path)
    ds = DLRMv3KuaiRandDataset(hstu_config=hc, embedding_config=tables, seq_logs_file=str(path), is_inference=False)
    if num_targets is None and not own_query_times:
        ds.load_query_samples(list(users))
        samples = [ds.get_sample(u) for u in users]
        ds.unload_query_samples(list(users))
        return collate_fn(samples)
    samples = []
    for i, u in enumerate(users):
        row = ds.seq_logs_frame.iloc[u]
        c = hc.max_num_candidates if num_targets is None else int(num_targets[i])
        uih, cand = ds.load_item(row, c)
        if own_query_times:
            keys, lengths, values = cand.keys(), cand.lengths(), cand.values().clone()
            k = keys.index(hc.candidates_querytime_feature_name)
            start = int(lengths[:k].sum())
            _, times = separate_uih_candidates(row.time_ms, candidates_max_seq_len=c)
            values[start:start + int(lengths[k])] = torch.tensor(times, dtype=values.dtype)
            cand = KeyedJaggedTensor(keys=keys, lengths=lengths, values=values)
        samples.append((uih, cand))
    return collate_fn(samples)


def gr_describe(gr_src: str) -> str:
    """GR's source tree and, where it is a git work tree, its commit (for the printout only)."""
    import subprocess

    try:
        rev = subprocess.run(["git", "-C", gr_src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{gr_src}" + (f" at {rev}" if rev else "")


def unused_gr_parameters(model) -> set[str]:
    """GR parameters that cannot take part in the KuaiRand forward, left out of the map.

    GR HEAD's ``ContextualPreprocessor`` always builds ``_additional_embedding_mlp`` (a tower on the
    concatenated embeddings of the "additional" features: ``merge_uih_candidate_feature_mapping``
    pairs whose both sides are embedding features, other than the post id), and runs it only when
    that list is non-empty. KuaiRand's only such pair is video_id/item_video_id, the post id, so
    the list is empty: the tower (first Linear ``[hidden, 0]``) is never called and has no
    counterpart in our model. Exactly those parameters are excluded, and only while the list is
    empty; ``run_gr`` checks that they get no gradient."""
    pre = model._hstu_transducer._input_preprocessor
    if getattr(pre, "_additional_embedding_features", None) or not hasattr(pre, "_additional_embedding_mlp"):
        return set()
    prefix = "_hstu_transducer._input_preprocessor._additional_embedding_mlp."
    return {name for name, _ in model.named_parameters() if name.startswith(prefix)}


def copy_params_into_gr(model, params, pmap, unused=frozenset()):
    import numpy as np
    import torch

    named = dict(model.named_parameters())
    unmapped = sorted(set(named) - set(pmap) - set(unused))
    missing = sorted(set(pmap) - set(named))
    if unmapped or missing:
        raise SystemExit(f"parameter map out of date: GR parameters not mapped {unmapped}; mapped but absent {missing}")
    with torch.no_grad():
        for name, (path, t) in pmap.items():
            v = np.asarray(get_path(params, path))   # params: with per-feature table views (feature_tables)
            v = v.T if t else v
            if tuple(named[name].shape) != v.shape:
                raise SystemExit(f"{name}: GR shape {tuple(named[name].shape)}, ours ({path}) {v.shape}")
            named[name].copy_(torch.from_numpy(np.ascontiguousarray(v)))
    return named


def run_gr(model, batch, unused=frozenset()):
    """Training-mode forward (losses exist only there), backward of the summed task losses."""
    import torch

    captured = {}
    hook = model._multitask_module._prediction_module.register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("logits", out.detach().clone()))
    model.train()
    model.zero_grad(set_to_none=True)
    _, _, aux_losses, preds, labels, _ = model(batch.uih_features_kjt, batch.candidates_features_kjt)
    hook.remove()
    loss = sum(aux_losses.values())
    loss.backward()
    grads = {n: (p.grad.detach().numpy().copy() if p.grad is not None else None) for n, p in model.named_parameters()}
    used = sorted(n for n in unused if grads[n] is not None and grads[n].size and abs(grads[n]).max() > 0)
    if used:
        raise SystemExit(f"GR parameters assumed unused got gradients: {used}")
    return {"logits": captured["logits"].numpy(), "preds": preds.detach().numpy().T, "labels": labels.numpy().T,
            "losses": {k: float(v.detach()) for k, v in aux_losses.items()}, "loss": float(loss.detach()), "grads": grads}


def run_ours(seqs, users, cfg, params, backend: str, dtype: str, num_targets=None, own_query_times: bool = False):
    """Our model's logits, per-task losses and gradients (no dropout) on the same users."""
    import numpy as np

    from backends import get_backend
    from gr_functional.ranking.heads import multitask_loss
    from gr_functional.ranking.model import make_ranking_batch, ranking_logits

    B = get_backend(backend, dtype=dtype)
    extra = {} if num_targets is None and not own_query_times else {"num_targets": num_targets,
                                                                      "own_query_times": own_query_times}
    batch = make_ranking_batch(seqs, list(users), cfg, rng=None, **extra)
    dev = B.asarray_tree(batch)

    def f(p, b):
        z = ranking_logits(B, p, b, cfg)
        total, per_task = multitask_loss(B, z, b.labels, b.cand_mask)
        return total, (z, per_task)

    (loss, (z, per_task)), g = B.value_and_grad(f, has_aux=True)(B.asarray_tree(params), dev)
    z = B.to_numpy(z)
    return {"logits": z, "preds": 1.0 / (1.0 + np.exp(-z.astype(np.float64))), "labels": batch.labels,
            "per_task": B.to_numpy(per_task), "loss": float(loss), "grads": with_feature_tables(B.to_numpy_tree(g), cfg)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gr-src", default=os.environ.get("GR_SRC", "/work/gr_src"))
    ap.add_argument("--embed-dim", type=int, default=8)
    ap.add_argument("--dim", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dqk", type=int, default=3)
    ap.add_argument("--dv", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=46)
    ap.add_argument("--candidates", type=int, default=5)
    ap.add_argument("--id-table", type=int, default=97)
    ap.add_argument("--num-targets", default="",
                    help="candidates per user (batch order), each 1..--candidates, e.g. 5,2,4,1: the variable-"
                         "candidate batch, built by hand on GR's side; default: --candidates each (GR's loader)")
    ap.add_argument("--own-query-times", action="store_true",
                    help="each candidate's query time is its own event time (GR's loader: the newest history event's)")
    ap.add_argument("--group-norm", choices=("false", "true"), default=None,
                    help="the STU output norm, GR's hstu_group_norm and our ranking.group_norm alike: false = "
                         "LayerNorm over H*dv, true = per-head GroupNorm; default: GR's configs.py kuairand-1k "
                         "value (false at HEAD db1bf8f, true at 2e81fab)")
    ap.add_argument("--users", default="", help="user numbers (rows of the sample) in batch order, e.g. 3,1; default all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perturb", type=float, default=0.1,
                    help="noise added to the norm affines and biases GR initialises to 1/0, so they are exercised")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="torch", help="our backends to compare, comma-separated (torch, jax)")
    ap.add_argument("--dtypes", default="float32,float64", help="our dtypes, comma-separated")
    ap.add_argument("--matrix", action="store_true",
                    help="every case in one run: --group-norm false and true, each with GR's loader batch and with "
                         "--num-targets 5,2,4,1 --own-query-times")
    ap.add_argument("--record", metavar="FILE",
                    help="also write one row per case, backend and dtype (worst errors), stamped with the command, "
                         "date, commit and machine (gr_functional/results.py), e.g. results/gr_crosscheck/ranking.jsonl")
    args = ap.parse_args(argv)

    for p in (str(PROJECT), args.gr_src):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch

    torch.set_num_threads(args.threads)
    cases = [dict(group_norm=g, num_targets=n, own_query_times=bool(n)) for g in ("false", "true")
             for n in ("", "5,2,4,1")] if args.matrix else [{}]
    records, worst_all = [], 0.0
    for case in cases:
        case_args = argparse.Namespace(**{**vars(args), **case})
        if case:
            print(f"\n######## case: {case}")
        rows, worst = compare_case(case_args)
        records += rows
        worst_all = max(worst_all, worst)
    ok = worst_all <= args.tol
    print(f"\n{'OK' if ok else 'MISMATCH'}: worst relative error {worst_all:.3e} (tolerance {args.tol:g})")
    if args.record:
        from gr_functional import results

        command = "python tools/gr_ranking_crosscheck.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"{len(records)} records written to {results.write(args.record, command, records)}")
    return 0 if ok else 1


def compare_case(args) -> tuple[list[dict], float]:
    """One comparison (``args``: main's, with this case's group_norm / num_targets /
    own_query_times): ``(rows, worst relative error)``, one row per backend and dtype."""
    import numpy as np
    import torch

    from gr_functional.data.sources import kuairand_ranking as kr
    from gr_functional.data.sources.kuairand import load_kuairand_log
    from gr_functional.data.sources.kuairand_features import load_kuairand_features
    from gr_functional.ranking.model import TASKS, RankingModelConfig, init_ranking_params
    from gr_functional.tree import tree_map_with_path

    seqs = kr.sequences_from_log(load_kuairand_log(columns=kr.LOG_COLUMNS), load_kuairand_features(kind="user"))
    users = [int(u) for u in args.users.split(",")] if args.users else list(range(len(seqs.users)))
    num_targets = [int(c) for c in args.num_targets.split(",")] if args.num_targets else None
    if num_targets is not None and len(num_targets) != len(users):
        raise SystemExit(f"--num-targets gives {len(num_targets)} counts for {len(users)} users")
    hc, tables = small_gr_configs(args)
    ctx_tables = tuple(tables[name].num_embeddings for name in _CONTEXT_TABLES)
    # GR's constants at these dims: action embedding 8, content/action tower 256, item tower and task
    # head 512, 8192 position and 2048 time buckets (modules/dlrm_hstu.py, preprocessors.py)
    # GR HEAD makes the content/action tower width a config field (hstu_preprocessor_hidden_dim, 256)
    cfg = RankingModelConfig(embed_dim=args.embed_dim, dim=args.dim, num_layers=args.layers, heads=args.heads,
                             dqk=args.dqk, dv=args.dv, max_seq_len=args.max_seq_len, num_candidates=args.candidates,
                             video_table=tables["video_id"].num_embeddings, context_tables=ctx_tables,
                             tower_hidden=getattr(hc, "hstu_preprocessor_hidden_dim", 256),
                             input_dropout=0.0, linear_dropout=0.0, group_norm=bool(hc.hstu_group_norm))
    params = init_ranking_params(cfg, seed=args.seed)
    if args.perturb:
        rng = np.random.default_rng(args.seed + 1)

        def perturb(path, leaf):
            name = path.rsplit(".", 1)[-1]
            if name in ("b1", "b2", "b", "bc", "b_uvqk", "ln_b", "sw_b", "gn_b"):
                return (leaf + args.perturb * rng.standard_normal(leaf.shape)).astype(np.float32)
            if name in ("ln_w", "sw_w", "gn_w"):
                return (leaf * (1 + args.perturb * rng.standard_normal(leaf.shape))).astype(np.float32)
            return leaf
        params = tree_map_with_path(perturb, params)

    torch.manual_seed(args.seed)
    model = build_gr_model(hc, tables)
    pmap = parameter_map(args.layers)
    unused = unused_gr_parameters(model)
    copy_params_into_gr(model, with_feature_tables(params, cfg), pmap, unused)
    with tempfile.TemporaryDirectory() as tmp:
        batch = gr_batch(seqs, users, hc, tables, Path(tmp), num_targets, args.own_query_times)
    gr = run_gr(model, batch, unused)

    print(f"users {', '.join(str(int(seqs.users[u])) for u in users)}: events {np.diff(seqs.offsets)[users].tolist()}; "
          f"D={args.dim} E={args.embed_dim} layers={args.layers} heads={args.heads} dqk={args.dqk} dv={args.dv} "
          f"max_seq_len={args.max_seq_len} candidates={args.candidates} group_norm={cfg.group_norm}")
    print(f"candidates per user (GR's num_candidates): {batch.candidates_features_kjt.lengths()[:len(users)].tolist()}; "
          f"query times: {'own event times' if args.own_query_times else 'newest history event (GR loader)'}")
    print(f"GR {gr_describe(args.gr_src)}; bf16_training={'False' if 'bf16_training' in inspect.signature(type(model).__init__).parameters else '(no such argument)'}; "
          f"unused GR parameters left out: {len(unused)}")
    print(f"GR total loss {gr['loss']:.8f}")
    worst_all, records = 0.0, []
    for backend, dtype in [(b, d) for b in args.backends.split(",") for d in args.dtypes.split(",")]:
        try:
            ours = run_ours(seqs, users, cfg, params, backend, dtype, num_targets, args.own_query_times)
        except (ImportError, ValueError) as exc:            # e.g. jax float64 without JAX_ENABLE_X64
            if "backend" not in str(exc) and "x64" not in str(exc):
                raise
            print(f"\n== ours ({backend}, {dtype}): skipped ({exc})")
            continue
        assert np.array_equal(ours["labels"], gr["labels"]), "labels differ: the batches are not the same"
        rows = [("logits [c, 8]", rel_err(ours["logits"], gr["logits"])),
                ("preds [c, 8]", rel_err(ours["preds"], gr["preds"])),
                ("total loss", rel_err(ours["loss"], gr["loss"]))]
        rows += [(f"loss {t}", rel_err(ours["per_task"][k], gr["losses"][t])) for k, t in enumerate(TASKS)]
        grad_rows = []
        for name, (path, t) in pmap.items():
            g_gr = gr["grads"][name]
            g = np.asarray(get_path(ours["grads"], path))
            g = g.T if t else g
            if g_gr is None:
                g_gr = np.zeros_like(g)
            grad_rows.append((f"grad {name}  <- {path}", rel_err(g, g_gr), float(np.abs(g_gr).max())))
        print(f"\n== ours ({backend}, {dtype}) vs GR (PyTorch kernels, float32); rel err = max|ours - GR| / max|GR|")
        for label, e in rows:
            print(f"  {e:10.3e}  {label}")
        for label, e, scale in grad_rows:
            print(f"  {e:10.3e}  {label}   (max|GR| {scale:.3e})")
        worst_fwd = max(e for _, e in rows)
        worst_grad = max(e for _, e, _ in grad_rows)
        print(f"  worst ({backend}, {dtype}): forward {worst_fwd:.3e}, gradients {worst_grad:.3e}")
        worst_all = max(worst_all, worst_fwd, worst_grad)
        worst_param = max(grad_rows, key=lambda r: r[1])[0].split("<- ")[-1]
        records.append({"gr": gr_describe(args.gr_src).rsplit(" at ", 1)[-1], "group_norm": cfg.group_norm,
                        "candidates": ",".join(map(str, batch.candidates_features_kjt.lengths()[:len(users)].tolist())),
                        "query_times": "own" if args.own_query_times else "history", "backend": backend,
                        "dtype": dtype, "logits": rows[0][1], "preds": rows[1][1],
                        "task_losses": max(e for label, e in rows[2:]), "gradients": worst_grad,
                        "worst_gradient": worst_param, "ok": max(worst_fwd, worst_grad) <= args.tol})
    return records, worst_all


if __name__ == "__main__":
    sys.exit(main())
