"""The ranking task (``model.task = "ranking"``): dlrm_v3's HSTU ranking model trained on a
ranking dataset (ranking/data.py) by the one run loop (runner.py), with its files, checkpoints
and exact resume; only the data, the step and the evaluation are its own.

The step is the guarded update of ``step.apply_update`` on GR's multitask loss (sum over tasks of
0.2 x mean BCE): the dense optimizer (``optim.name``), and with hash tables (ranking/sparse.py) the
row-sparse optimizer on the step's rows. Evaluation after every ``train.eval_every`` epochs:
per-task AUC, GAUC and NE on the validation and test samples (``eval.batch_size`` users per batch:
GR's attention normaliser is the batch's longest sequence, so this is part of the protocol; GR uses
16). The epoch is selected by validation ``SELECT`` (click AUC: the rare tasks' AUCs are too noisy
at 1K-user scale to select on); eval.json holds that epoch's test metrics.

``backend.precision`` (bf16 / fp16 with fp32 master weights and, for fp16, loss scaling),
``step.accumulate`` (k loader batches per step, sharing the attention normaliser) and, with hash
tables, ``embedding.staleness`` (row updates applied k steps late) run through
``step.make_train_step``, the retrieval step, on ``ranking_objective``.

``train.max_tokens`` fills each batch up to a token budget (RankingLoader).

Data-parallel (``grf train --nproc N``, torchrun): each rank trains its share of every global batch
(``RankingLoader.rank_share``: policy ``dist.balance`` "none" or "kk") with the dropout masks and
normaliser one process gives those samples, through ``execution.RankSteps``, the retrieval ranks'
runner: gradients all-reduced in the step, the hash table replicated (every rank maps the global
step's keys) or, with ``embedding.sharding = "row"``, row-sharded over the ranks (each rank looks
up its own keys from their owners). N ranks equal one process up to float summation order
(tests/distributed/test_ranking_equality.py).
"""
from __future__ import annotations

import dataclasses
from typing import cast
import itertools
import math

import numpy as np

from ..config import Config, ModelConfig
from .config_rules import ranking_rules
from ..data.batching import RankSplit
from ..data.prefetch import PrefetchStats
from ..embedding.lookup import EmbeddingHost
from ..embedding.sharding import assemble_table, gathered_view, make_sharded
from ..errors import ConfigError, Diverged
from ..execution import BatchIds, RankSteps, lookup_record, step_groups
from ..hooks import Evaluation, Run, StepResult
from ..memory import ENV_LIMIT, available_bytes
from ..report import RANKING_SELECT
from ..resume import missing_host
from ..task import ModelState, Prepared, Task, register_task
from ..step import TABLE, Objective, make_train_step
from . import sparse
from .data import RankingLoader, split_samples, fingerprint, load_ranking_data
from .heads import multitask_loss
from .model import (TASKS, _feature_sizes, evaluate_ranking, init_ranking_params, ranking_logits,
                    ranking_param_shapes, table_plan)
from ..contracts import Backend, Comm, RankComm

SELECT = RANKING_SELECT
SUMMARY = ("auc", "gauc", "ne")


def _cast_ranking_batch(B: Backend, batch, dtype: str):
    """The float inputs that multiply activations in the compute dtype (dropout masks, the
    candidate flags and time features); labels and ``cand_mask`` stay fp32 (they weight the loss)."""
    cast = lambda x: None if x is None else B.cast(x, dtype)  # noqa: E731
    return dataclasses.replace(batch, is_cand=cast(batch.is_cand), cand_feats=cast(batch.cand_feats),
                               input_keep=cast(batch.input_keep), block_keep=cast(batch.block_keep))


def ranking_objective(cfg: Config) -> Objective:
    """GR's multitask loss (sum over tasks of 0.2 x mean BCE) over the batch's candidates
    (``sum(cand_mask)``). In bf16 / fp16 the logits are cast to the master dtype before the BCE.
    With hash tables the parameters carry the step's rows as ``TABLE`` (ranking/sparse.py)."""
    mc, hashed = cfg.ranking, sparse.hashed(cfg)

    def loss(P, params, batch):
        logits = ranking_logits(P, sparse.model_params(params, mc) if hashed else params, batch, mc)
        # the BCE in the master dtype (in fp32 the cast copies a [c, K] array: not worth a branch)
        return multitask_loss(P, P.cast(logits, P.dtype_name), batch.labels, batch.cand_mask)[0]

    return Objective(loss=loss, tokens=lambda B, batch: B.xp.sum(batch.cand_mask), cast_batch=_cast_ranking_batch)


def make_ranking_step(B: Backend, cfg: Config):
    """``step(params, opt_state, batch | [micro-batches]) -> (params, opt_state, metrics)``:
    ``step.make_train_step`` on ``ranking_objective`` (metrics as its; ``tokens`` = candidates):
    AdamW on every parameter, or with hash tables (ranking/sparse.py) AdamW on the dense ones and
    the row-sparse optimizer on the step's rows (``batch.lookup``); ``backend.precision`` and
    ``step.accumulate`` as for retrieval."""
    return make_train_step(B, cfg, ranking_objective(cfg))


def table_size(cfg: Config) -> dict:
    """``{"dim", "num_items"}`` of the hash table: the virtual merged table's rows (ranking/sparse.py)."""
    (group,) = table_plan(cfg.ranking)
    return {"dim": cfg.ranking.embed_dim, "num_items": group.rows - 1}


def make_host(cfg: Config):
    """The hash table's ``EmbeddingHost`` (None without hash tables): one table over the virtual
    merged table's rows (ranking/sparse.py)."""
    if not sparse.hashed(cfg):
        return None
    return EmbeddingHost(cfg, **table_size(cfg))


def init_params(cfg: Config, host) -> dict:
    """numpy parameters of a fresh run (dense tables, or hash mode's)."""
    if host is None:
        return init_ranking_params(cfg.ranking, seed=cfg.train.seed)
    return sparse.init_hashed_params(cfg.ranking, host.rows, cfg.train.seed)


def shared_norm(micro: list) -> list:
    """The micro-batches of one accumulated step with their group's attention normaliser: GR's
    STU divides by the batch's longest sequence (``norm_len``), so each micro-batch takes the
    longest of the group, and k micro-batches give the step of the one batch holding all their
    users (tested)."""
    if len(micro) < 2:
        return micro
    norm = max(np.asarray(b.norm_len) for b in micro)
    return [dataclasses.replace(b, norm_len=norm) for b in micro]


# a ranking batch's keys and its step's shared normaliser, for a data-parallel rank (execution.RankSteps)
RANKING_IDS = BatchIds(of=sparse.batch_keys, localize=sparse.localize_ranking, join=shared_norm)


class RankingSteps:
    """``step.accumulate`` loader batches per optimizer step (the runner's ``steps`` protocol),
    sharing their normaliser (``shared_norm``). With a hash table, ``host`` maps each step's ids to
    rows on the main thread, in step order (a checkpoint holds the table state of the last trained
    step)."""

    def __init__(self, B: Backend, cfg: Config, loader: RankingLoader, host=None):
        self.B, self.loader, self.prefetch, self.host = B, loader, cfg.train.prefetch, host
        self.k = cfg.train.accumulate
        self.prefetch_stats = PrefetchStats()
        self.fn = make_ranking_step(B, cfg)

    def batches(self, epoch: int, start: int, limit: int | None = None):
        batches = self.loader.epoch(epoch, start, prefetch=self.prefetch, stats=self.prefetch_stats,
                                    pad=self.B.static_shapes)
        return itertools.islice((shared_norm(group) for group in step_groups(batches, self.k)), limit)

    def run(self, params, opt_state, micro, step: int, epoch: int):
        tokens, stats = sum(b.layout.num_tokens() for b in micro), None
        if self.host is not None:
            micro, stats = sparse.prepare(self.host, micro, step)
        dev = [self.B.asarray_tree(b) for b in micro]
        params, opt_state, m = self.fn(params, opt_state, dev if len(dev) > 1 else dev[0])
        return params, opt_state, StepResult(step, epoch, m, tokens, embedding=lookup_record(self.host, stats))


def summarise(metrics: dict) -> dict:
    """Flat JSON-safe record of ``evaluate_ranking``'s output: ``{task}/{auc,gauc,ne}`` (None where
    undefined: a task without positives), ``{task}/positives``, and the means over tasks where
    defined as ``auc`` / ``gauc`` / ``ne``."""
    out = {"candidates": metrics["candidates"]}
    for key in SUMMARY:
        vals = []
        for task in TASKS:
            if task not in metrics:
                continue
            v = metrics[task][key]
            ok = v is not None and math.isfinite(v)
            out[f"{task}/{key}"] = float(v) if ok else None
            if ok:
                vals.append(float(v))
        out[key] = float(np.mean(vals)) if vals else None
    for task in TASKS:
        if task in metrics and "positives" in metrics[task]:
            out[f"{task}/positives"] = int(metrics[task]["positives"])
    return out


def make_scorer(B: Backend, cfg: Config):
    """``logits = scorer(params, batch)`` [c, K] of the run's parameter tree (hash mode's too)."""
    mc = cfg.ranking
    if sparse.hashed(cfg):
        return B.jit(lambda p, b: ranking_logits(B, sparse.model_params(p, mc), b, mc))
    return B.jit(lambda p, b: ranking_logits(B, p, b, mc))


def evaluate_samples(B: Backend, params, cfg: Config, seqs, samples, scorer=None, on_batch=None, host=None) -> dict:
    """``summarise`` of the model on ``samples`` (ranking/data.Samples); ``Diverged`` when a
    logit is not finite. ``host``: the hash table's (ids read rows without inserting)."""
    score = scorer or make_scorer(B, cfg)

    def finite_scorer(p, b):
        logits = score(p, b)
        if not np.isfinite(B.to_numpy(logits)).all():
            raise Diverged("non-finite ranking logits")
        return logits

    transform = None if host is None else (lambda b: sparse.eval_rows(host, b))
    first = samples.take(cfg.eval.max_users or len(samples))   # the first eval.max_users samples (0: all)
    return summarise(evaluate_ranking(B, params, seqs, first.users, cfg.ranking, cfg.eval.batch_size,
                                      scorer=finite_scorer, on_batch=on_batch, transform=transform,
                                      **first.batch_args(slice(None))))


class RankingEvaluation(Evaluation):
    """Validation and test metrics every ``train.eval_every`` epochs and after the last
    (``hooks.Evaluation`` with the ranking samples and metrics)."""

    def __init__(self, seqs, splits, scorer, ckdir, host=None):
        super().__init__(None, splits, None, scorer, ckdir)
        self.seqs, self.host = seqs, host

    def evaluate_split(self, run: Run, params, host, name: str) -> dict:
        return evaluate_samples(run.B, params, run.cfg, self.seqs, getattr(self.splits, name), self.scorer,
                                on_batch=lambda: run.comm.progress("eval"), host=self.host if host is None else host)

    def summary(self, record: dict) -> str:
        v, t = record["valid"], record["test"]
        fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        return (f"valid click AUC {fmt(v[SELECT])}  test click AUC {fmt(t[SELECT])} GAUC {fmt(t['is_click/gauc'])}  "
                f"mean AUC {fmt(t['auc'])}")


def param_shapes(cfg: Config) -> dict:
    """``{path: shape}`` of the run's parameters (checkpoint checks, the memory check)."""
    shapes = ranking_param_shapes(cfg.ranking)
    if not sparse.hashed(cfg):
        return shapes
    host = make_host(cfg)
    shapes = {k: v for k, v in shapes.items() if not k.startswith("tables.")}
    shapes[TABLE] = (host.rows, cfg.ranking.embed_dim)
    return shapes


def check_ranking_fits(cfg: Config) -> int:
    """``ConfigError`` naming the key to change when the parameters, their gradients and AdamW's
    two moments (16 bytes per parameter, the tables dominating: GR's defaults hold 7 tables of 10M
    rows, 70M x 256 x 16 B = 287 GB), plus 4 B for the running gradient sum of ``step.accumulate``
    > 1 and 4 B for bf16 / fp16's 16-bit copies of the parameters and their gradients, exceed the
    available memory; returns that byte count. Activations are left out (small at these widths
    next to the tables)."""
    mc = cfg.ranking
    shapes = param_shapes(cfg)
    per_param = 16 + 4 * (cfg.train.accumulate > 1) + 4 * (cfg.backend.precision != "fp32")
    need = per_param * sum(int(np.prod(s)) for s in shapes.values())
    avail, source = available_bytes()
    if avail is None or need <= avail:
        return need
    sizes = _feature_sizes(mc)
    key = "ranking.video_table" if sizes["video_id"] >= max(sizes.values()) else "ranking.context_tables"
    if sparse.hashed(cfg):
        raise ConfigError(f"embedding.capacity={cfg.embedding.capacity}: the ranking model's parameters, gradients and "
                          f"optimizer state need ~{need / 1e9:.1f} GB but {avail / 1e9:.1f} GB is available ({source}); "
                          f"lower embedding.capacity (hash rows) or ranking.embed_dim ({ENV_LIMIT} overrides the "
                          f"available figure)")
    raise ConfigError(f"{key}: the ranking model's parameters, gradients and AdamW moments need ~{need / 1e9:.1f} GB "
                      f"(tables of {sum(sizes.values()):,} rows x ranking.embed_dim={mc.embed_dim}) but {avail / 1e9:.1f} GB "
                      f"is available ({source}); size the id tables to the data (ids index them modulo their "
                      f"sizes), e.g. ranking.video_table = the number of videos ({ENV_LIMIT} overrides the available "
                      f"figure)")


class RankingTask(Task):
    """``model.task = "ranking"`` (the module docstring)."""

    select_metric, curve_label = SELECT, "click AUC"
    rng_generator = "numpy default_rng((train.seed, epoch[, batch]))"
    # [model] holds the retrieval HSTU (the ranking model is [ranking]); [loss] is retrieval's losses
    unused_keys = {"loss": None, "model": tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "task")}
    result_fields = {"task": "ranking"}

    def config_rules(self, cfg: Config, fail) -> None:
        ranking_rules(cfg, fail)

    def table_dim(self, cfg: Config) -> int:
        return cfg.ranking.embed_dim

    def check(self, cfg: Config, world_size: int) -> None:
        check_ranking_fits(cfg)

    def prepare(self, cfg: Config, world_size: int) -> Prepared:
        seqs = load_ranking_data(cfg)
        splits, how = split_samples(seqs, cfg)
        fp = fingerprint(seqs)
        mc = cfg.ranking
        split = RankSplit.from_config(cfg, world_size, dims=(mc.dim, mc.heads, mc.dqk, mc.dv)) if world_size > 1 else None
        loader = RankingLoader(seqs, splits.train, mc, cfg.train.batch_size, cfg.train.seed,
                               max_tokens=cfg.train.max_tokens, split=split)
        lengths = np.diff(seqs.offsets)
        describe = (f"data {cfg.data.dataset}: {len(seqs.users):,} users, {int(lengths.sum()):,} events; "
                    f"{len(splits.train):,} training samples of "
                    f"{'up to ' if splits.train.counts is not None else ''}{mc.num_candidates} candidates, "
                    f"{len(splits.valid):,} validation and {len(splits.test):,} test samples; split: {how}")
        return Prepared(cfg, loader, fp, {"sha256": fp, "users": len(seqs.users), "events": int(seqs.offsets[-1])},
                        describe=describe, label=cfg.data.dataset, payload=(seqs, splits))

    def _sharded(self, cfg: Config, comm: Comm) -> bool:
        return cfg.embedding.sharding == "row" and comm.world_size > 1

    def fresh(self, B: Backend, prepared: Prepared, comm: Comm) -> ModelState:
        cfg = prepared.cfg
        if self._sharded(cfg, comm):  # the rows live in the shards; the params are the dense ones
            dense = {k: v for k, v in sparse.init_hashed_params(cfg.ranking, 1, cfg.train.seed).items() if k != TABLE}
            return ModelState(B.asarray_tree(dense), None, make_sharded(B, cfg, comm, **table_size(cfg)))
        host = make_host(cfg)
        return ModelState(B.asarray_tree(init_params(cfg, host)), host)

    def restore(self, B: Backend, prepared: Prepared, comm: Comm, checkpoint) -> ModelState:
        cfg = prepared.cfg
        saved = (checkpoint.host or {}).get("embedding") or {}
        if self._sharded(cfg, comm):
            shard = make_sharded(B, cfg, comm, **table_size(cfg))
            shard.load(saved["shards"] if "shards" in saved else missing_host(checkpoint))
            return ModelState(B.asarray_tree(checkpoint.params), None, shard)
        host = make_host(cfg)
        if host is not None:
            host.load_state_dict(saved or missing_host(checkpoint))
        return ModelState(B.asarray_tree(checkpoint.params), host)

    def host_state(self, state: ModelState, comm: Comm) -> dict | None:
        if state.shard is not None:
            return {"embedding": {"shards": state.shard.export_all(comm)}}  # every rank takes part
        return None if state.host is None else {"embedding": state.host.state_dict()}

    def steps(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState):
        if comm.world_size == 1:
            return RankingSteps(B, prepared.cfg, prepared.loader, state.host)
        # several ranks of ranking are torch's (the JAX mesh trains retrieval: config._validate_devices)
        return RankSteps(B, prepared.cfg, prepared.loader, cast(RankComm, comm), state.host, state.shard,
                         objective=ranking_objective(prepared.cfg), ids=RANKING_IDS)

    def evaluation(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState, ckdir):
        cfg, (seqs, splits) = prepared.cfg, prepared.payload
        evaluation = RankingEvaluation(seqs, splits, make_scorer(B, cfg), ckdir, state.host)
        if state.shard is not None:
            evaluation.view = gathered_view(B, cfg, comm, state.shard, **table_size(cfg))
        return evaluation

    def param_shapes(self, cfg: Config, host_state: dict | None) -> dict:
        shapes = param_shapes(cfg)
        if "shards" in ((host_state or {}).get("embedding") or {}):
            shapes.pop(TABLE)  # a row-sharded table: its rows are in host.embedding.shards
        return shapes

    def evaluate_checkpoint(self, B: Backend, cfg: Config, checkpoint, split: str) -> dict:
        seqs = load_ranking_data(cfg)
        samples = getattr(split_samples(seqs, cfg)[0], split)
        params, host = checkpoint.params, make_host(cfg)
        saved = (checkpoint.host or {}).get("embedding") or {}
        if "shards" in saved:
            table, host = assemble_table(cfg, saved["shards"], **table_size(cfg))
            params = {**params, TABLE: table}
        elif host is not None:
            host.load_state_dict(saved or missing_host(checkpoint))
        result = evaluate_samples(B, B.asarray_tree(params), cfg, seqs, samples, host=host)
        return {**result, "dataset": cfg.data.dataset, "task": "ranking"}


register_task("ranking", RankingTask())
