"""The retrieval task: GR's research HSTU trained on per-user sequences with sampled negatives,
evaluated on each user's held-out last (test) and second-to-last (valid) item by full-catalogue
ranking (docs/results/ml1m.md "Evaluation"). The run loop (runner.py) calls it through ``task.Task``.

Data-parallel (docs/guides/distributed.md "Distributed training"): under torchrun every rank trains its share of
every global batch (``data.batching.RankSplit``) with ``step.make_dist_train_step``; with
``embedding.sharding = "row"`` the item table is row-sharded over the ranks (``ShardedTable``).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from .. import model
from ..config import Config, ConfigError, replace
from ..data import batching, metrics
from ..data import split as split_mod
from ..data.datasets import load_dataset
from ..embedding.lookup import make_host, table_params
from ..embedding.sharding import assemble_table, gathered_view, make_sharded
from ..errors import DataError, Diverged
from ..execution import make_steps
from ..hooks import Evaluation
from ..memory import check_fits, table_items
from ..resume import missing_host
from ..task import ModelState, Prepared, Task, register_task
from ..step import make_scorer
from ..contracts import Backend, Comm, is_mesh


def load_sequences(cfg: Config):
    """The dataset named by ``cfg.data`` as a SequenceData (ids 1..num_items, time-sorted)."""
    return load_dataset(cfg.data)


def resolve(cfg: Config, data) -> Config:
    """Fill ``model.num_items`` from the data when the config leaves it 0."""
    if cfg.model.num_items == 0:
        cfg = replace(cfg, model={"num_items": int(data.num_items)})
    elif cfg.model.num_items < data.num_items:
        raise ConfigError(f"model.num_items={cfg.model.num_items} but the data ({data.name or 'dataset'}) has item ids "
                          f"up to {data.num_items}; set model.num_items = 0 (take it from the data) or >= "
                          f"{data.num_items}")
    if cfg.embedding.kind == "hash" and cfg.embedding.capacity == 0:
        cfg = replace(cfg, embedding={"capacity": cfg.model.num_items})  # one row per item: recorded
    return cfg


_INT32_MAX = int(np.iinfo(np.int32).max)

_LATEST_SECONDS = 10**11



ITEM_IDS = "item_ids.tsv"  # beside the checkpoints: "ID<TAB>RAW" of a CSV's string item ids


def item_ids_text(table: list[str]) -> str:
    return "id\traw_id\n" + "".join(line + "\n" for line in table)


def check_item_ids(data, saved: Path) -> None:
    """``DataError`` when ``saved`` (the run's item_ids.tsv) maps an id to another string than
    ``data`` does now: the file's set of string ids changed since training, so every id the
    checkpoint's item table rows mean moved (dense ids are ranks among the distinct strings)."""
    if not saved.is_file():
        return
    now = data.item_id_table()
    then = saved.read_text().splitlines()[1:]
    if now is not None and now == then:
        return
    first = next((i for i, (a, b) in enumerate(zip(then, now or [])) if a != b), min(len(then), len(now or [])))
    raise DataError(f"{saved}: the run's item ids do not match {data.source or 'the data'} now (line {first + 2}: "
                    f"saved {then[first] if first < len(then) else 'nothing'!r}, now "
                    f"{(now or [])[first] if first < len(now or []) else 'nothing'!r}): the file's string ids changed "
                    f"since training, so the checkpoint's item rows would be read as other items. Evaluate with "
                    f"the data the run trained on")


def check_data(data, splits) -> None:
    """Reject data the training loop would only trip over later (after OUT was written to), with a
    ``DataError`` naming the dataset and the fix. The loaders already reject malformed lines,
    negative timestamps, ids < 1, ids beyond int32 and sparse raw ids (unless ``data.remap_items``)
    and count exact duplicate rows (kept; ``data.describe()`` reports them); per-user time order is
    restored by a stable sort. ``memory.check_fits`` (called next) checks the config against the
    data: ``loss.num_negatives`` against the items, the memory estimate against what is free."""
    name = data.source or data.name or "dataset"
    if data.num_events and int(data.times.max()) - int(data.times.min()) > _INT32_MAX:
        raise DataError(f"{name}: timestamps span {int(data.times.max()) - int(data.times.min())} units, more than "
                        f"int32 seconds hold (68 years); they look like milliseconds. Convert them to seconds")
    if data.num_events and int(data.times.max()) > _LATEST_SECONDS:
        # unix seconds reach 1e11 in the year 5138; milliseconds of any date since 1973 exceed it
        raise DataError(f"{name}: the largest timestamp, {int(data.times.max()):,}, is after the year 5000 in unix "
                        f"seconds; the timestamps look like milliseconds (or microseconds). Convert them to "
                        f"seconds (the time bias buckets log-seconds)")
    for split in ("valid", "test"):
        if len(getattr(splits, split)) == 0:
            need = 3 if split == "valid" else 2
            raise DataError(f"{name}: the {split} split is empty: no user has >= {need} events (leave-one-out "
                            f"holds out each user's {'second-to-last' if split == 'valid' else 'last'} event)")


def data_fingerprint(data) -> str:
    """sha256 of the packed sequences (items, times, offsets): resuming on changed data is refused."""
    import hashlib

    h = hashlib.sha256()
    for arr in (data.items, data.times, data.offsets):
        h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


# ----------------------------------------------------------------------------- evaluation
def evaluate(B: Backend, params, cfg: Config, examples, candidates=None, scorer=None, max_users: int = 0,
             on_batch=None, host=None) -> dict:
    """HR@K / NDCG@K / MRR on leave-one-out ``examples`` (split.test or split.valid): full-catalogue
    ranking of the held-out item among ``candidates`` (all ids when None) minus the user's history.
    ``on_batch()``, if given, is called before each batch (the distributed watchdog's progress).
    ``host``: a hash table's ``EmbeddingHost``: items are scored through their rows (ids without
    a row read the zero row in histories and rank last as targets)."""
    scorer = scorer or make_scorer(B, cfg)
    absent = None
    if host is not None and host.table is not None:
        rows = host.eval_rows(np.arange(cfg.model.num_items + 1))
        params = {**params, "item_emb": B.gather_rows(params["item_emb"], B.asarray(rows))}  # indexed by id
        absent = np.flatnonzero(rows[1:] == 0) + 1
    ranks = []
    for batch, targets, exclude in batching.iter_eval(examples, cfg.model, cfg.eval.batch_size,
                                                    max_users=max_users or cfg.eval.max_users):
        if on_batch is not None:
            on_batch()
        scores = B.to_numpy(scorer(params, B.asarray_tree(batch)))[: len(targets)]
        if not np.isfinite(scores).all():
            bad = int((~np.isfinite(scores)).any(axis=1).sum())
            raise Diverged(f"evaluation produced non-finite scores for {bad} of {len(targets)} users in a batch "
                           f"(NaN/Inf in the model's output: the parameters diverged or overflowed in "
                           f"backend.precision={cfg.backend.precision})")
        if absent is not None and absent.size:
            scores = np.array(scores)  # a JAX array's numpy view is read-only
            scores[:, absent] = -np.inf
        ranks.append(metrics.ranks_from_scores(scores, targets, exclude, candidates=candidates))
    return metrics.metrics_from_ranks(np.concatenate(ranks), cfg.eval.ks)


class RetrievalTask(Task):
    """``model.task = "retrieval"`` (the module docstring)."""

    select_metric, curve_label = "hr@10", "HR@10"
    rng_generator = "numpy default_rng((train.seed, epoch, batch))"
    unused_keys = {"ranking": None, "data": ("split", "valid_start", "test_start", "test_end", "history_prefix")}

    def config_rules(self, cfg: Config, fail) -> None:
        ks = cfg.eval.ks
        if not ks or any(k < 1 for k in ks):
            fail("eval", "ks", "must be a non-empty list of cut-offs >= 1, e.g. [10, 50, 200]")
        if 10 not in ks:
            fail("eval", "ks", "must contain 10: the epoch is selected by validation HR@10")

    def prepare(self, cfg: Config, world_size: int) -> Prepared:
        data = load_sequences(cfg)
        cfg = resolve(cfg, data)
        splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
        check_data(data, splits)
        check_fits(cfg, data)  # negatives vs items, estimated memory vs available: before any allocation
        fingerprint = data_fingerprint(data)
        loader = batching.TrainLoader.from_config(splits.train, cfg, world_size=world_size)
        return Prepared(cfg, loader, fingerprint, {"sha256": fingerprint, "users": len(data),
                                                   "events": int(data.num_events)},
                        describe=f"data {data.describe()}", label=data.name, payload=(data, splits))

    def _sharded(self, cfg: Config, comm: Comm) -> bool:
        return cfg.embedding.sharding == "row" and comm.world_size > 1

    def fresh(self, B: Backend, prepared: Prepared, comm: Comm) -> ModelState:
        cfg = prepared.cfg
        dense = model.model_of(cfg.model).init_params(cfg.model, seed=cfg.train.seed)
        host = make_host(cfg, dense["item_emb"])
        if self._sharded(cfg, comm):  # the rows live in the shards; the params are the dense ones
            shard = make_sharded(B, cfg, comm, dense["item_emb"])
            dense = {k: v for k, v in dense.items() if k != "item_emb"}
            return ModelState(B.asarray_tree(dense), host, shard)
        return ModelState(B.asarray_tree(table_params(dense, host)), host, None)

    def restore(self, B: Backend, prepared: Prepared, comm: Comm, checkpoint) -> ModelState:
        cfg = prepared.cfg
        host, shard = make_host(cfg), None
        saved = (checkpoint.host or {}).get("embedding") or {}
        if self._sharded(cfg, comm):
            shard = make_sharded(B, cfg, comm)
            shard.load(saved["shards"])
        elif host.sparse:
            host.load_state_dict(saved or missing_host(checkpoint))
        return ModelState(B.asarray_tree(checkpoint.params), host, shard)

    def host_state(self, state: ModelState, comm: Comm) -> dict | None:
        if state.shard is not None:
            return {"embedding": {"shards": state.shard.export_all(comm)}}  # every rank takes part
        return {"embedding": state.host.state_dict()} if state.host.sparse else None

    def steps(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState):
        return make_steps(B, prepared.cfg, prepared.loader, comm, state.host, state.shard)

    def evaluation(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState, ckdir):
        cfg, (data, splits) = prepared.cfg, prepared.payload
        # the ranks of a mesh (comm.mesh, backends/dist_jax.py) score their share of each batch
        scorer = comm.scorer(B, cfg) if is_mesh(comm) else make_scorer(B, cfg)
        if state.shard is not None:
            return Evaluation(evaluate, splits, data.candidates, scorer, ckdir,
                              view=gathered_view(B, cfg, comm, state.shard))
        return Evaluation(partial(evaluate, host=state.host), splits, data.candidates, scorer, ckdir)

    def run_files(self, prepared: Prepared) -> dict[str, str]:
        data, _ = prepared.payload
        table = data.item_id_table()
        return {} if table is None else {f"checkpoints/{ITEM_IDS}": item_ids_text(table)}

    def param_shapes(self, cfg: Config, host_state: dict | None) -> dict:
        expected = model.model_of(cfg.model).param_shapes(cfg.model, table_items(cfg))
        if "shards" in ((host_state or {}).get("embedding") or {}):
            expected.pop("item_emb")  # a row-sharded table: its rows are in host.embedding.shards
        return expected

    def evaluate_checkpoint(self, B: Backend, cfg: Config, checkpoint, split: str) -> dict:
        params, host_state = checkpoint.params, checkpoint.host
        data = load_sequences(cfg)
        check_item_ids(data, Path(checkpoint.path).parent / ITEM_IDS)
        cfg = resolve(cfg, data)
        splits = split_mod.leave_one_out(data, valid_in_train=cfg.data.valid_in_train)
        host = make_host(cfg)
        saved = (host_state or {}).get("embedding") or {}
        if "shards" in saved:
            table, host = assemble_table(cfg, saved["shards"])
            params = {**params, "item_emb": table}
        elif host.sparse:
            host.load_state_dict(saved or missing_host(checkpoint))
        result = evaluate(B, B.asarray_tree(params), cfg, getattr(splits, split), data.candidates, host=host)
        return {**result, "dataset": data.name}


register_task("retrieval", RetrievalTask())
