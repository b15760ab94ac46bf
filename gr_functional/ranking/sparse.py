"""Hash embedding tables for the ranking model (``embedding.kind = "hash"``, MTGRBoost's dynamic
tables): GR's id tables have 10M rows per feature (7 x 10M x 256 fp32 = 72 GB with AdamW); with a
hash table only the ids a run meets get rows, up to ``embedding.capacity``, evicting by
``embedding.policy``, updated by a row-sparse optimizer (``embedding.optimizer``).

Keys: the batch builder already names every id by its row in the *virtual* merged table
(``model.table_plan``: feature offset + id modulo the feature's size + 1, unique per feature and
id); in hash mode those rows are never allocated, they are the keys of one ``HashTable`` (so
``ranking.merge_tables`` must be on). Per step, ``EmbeddingHost.plan`` maps the batch's distinct
keys to physical rows (inserting, evicting; a fresh row starts at ``hashed_init(seed, key)``, not
GR's per-feature uniform init) and the batch is rewritten to local indices 1..U into the step's
rows (``localize_ranking``), exactly as the retrieval table does (embedding/lookup.py): the step
sees ``params["item_emb"]`` replaced by those U + 1 rows, its gradient updates only them.
Evaluation reads rows without inserting (an unseen id reads the zero row).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..embedding.lookup import local_indexer, unique_ids
from ..step import TABLE
from .model import table_plan

ID_FIELDS = ("item_ids", "cand_items", "ctx_ids")


def hashed(cfg) -> bool:
    """The run's ranking tables are one hash table (``embedding.kind = "hash"``)."""
    return cfg.embedding.kind == "hash"


def batch_keys(batch) -> list[np.ndarray]:
    """The virtual-table rows a ``RankingBatch`` names (numpy)."""
    return [np.asarray(getattr(batch, f)) for f in ID_FIELDS]


def localize_ranking(batch, ids: np.ndarray, lookup=None):
    """``batch`` with every key replaced by its local index 1 + position in ``ids`` (the step's
    distinct keys, increasing int64) and ``lookup`` attached."""
    index = local_indexer(np.asarray(ids, np.int64))
    return dataclasses.replace(batch, lookup=lookup, **{f: index(np.asarray(getattr(batch, f))).astype(np.int32)
                                                        for f in ID_FIELDS})


def prepare(host, batches: list, step: int):
    """``(the micro-batches on local indices, each with the step's Lookup; LookupStats)`` for one
    training step: one lookup over the distinct keys of all of them."""
    ids, refs = unique_ids([keys for b in batches for keys in batch_keys(b)])
    lookup, stats = host.plan(ids, refs, step)
    return [localize_ranking(b, ids, lookup) for b in batches], stats


def eval_rows(host, batch):
    """``batch`` with every key replaced by its physical row (0: not in the table), no insertion."""
    return dataclasses.replace(batch, **{f: host.eval_rows(np.asarray(getattr(batch, f))).astype(np.int32)
                                         for f in ID_FIELDS})


def model_params(params: dict, mc) -> dict:
    """The model's parameter tree from a hash-mode one: ``params[TABLE]`` (the step's rows, or the
    whole physical table) as the one merged table ``ranking_logits`` reads."""
    (group,) = table_plan(mc)
    out = {k: v for k, v in params.items() if k != TABLE}
    out["tables"] = {group.name: params[TABLE]}
    return out


def init_hashed_params(mc, rows: int, seed: int) -> dict:
    """numpy parameters of hash mode: the dense ones (GR's init; drawn with 1-row stand-ins for the
    tables, which are never allocated) and ``TABLE`` = ``rows`` zero rows (a row gets its value
    when a key is assigned to it)."""
    from .model import init_ranking_params

    tiny = dataclasses.replace(mc, video_table=1, context_tables=(1,) * mc.contextual)
    params = {k: v for k, v in init_ranking_params(tiny, seed=seed).items() if k != "tables"}
    params[TABLE] = np.zeros((rows, mc.embed_dim), np.float32)
    return params
