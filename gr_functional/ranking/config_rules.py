"""The ranking task's config rules: the keys it reads joined (the temporal split's cutoffs, the
tables a hash embedding needs), checked with every other rule when a config is read
(``config.validate`` runs a task's ``config_rules``), before anything runs. A light module: the
config check imports it without the ranking model."""
from __future__ import annotations

from ..config import Config, cutoff_ms


def ranking_rules(cfg: Config, fail) -> None:
    """The rules of ``model.task = "ranking"``: ``fail(section, key, message)`` on the first broken one."""
    d = cfg.data
    if d.split == "temporal":
        cut = {}
        for key in ("valid_start", "test_start", "test_end"):
            if getattr(d, key) == "" and key != "test_end":
                fail("data", key, 'data.split="temporal" needs it: the first time of the validation window '
                                  '(valid_start) or of the test window (test_start), e.g. "2022-05-01"')
            try:
                cut[key] = cutoff_ms(getattr(d, key)) if getattr(d, key) else None
            except ValueError as exc:
                fail("data", key, str(exc))
        if cut["valid_start"] >= cut["test_start"]:
            fail("data", "test_start", f"must come after data.valid_start={d.valid_start!r}: validation is "
                                       f"[valid_start, test_start)")
        if cut["test_end"] is not None and cut["test_end"] <= cut["test_start"]:
            fail("data", "test_end", f"must come after data.test_start={d.test_start!r} (or be \"\": to the end)")
    elif any(getattr(d, key) for key in ("valid_start", "test_start", "test_end")):
        key = next(k for k in ("valid_start", "test_start", "test_end") if getattr(d, k))
        fail("data", key, 'is a cutoff of data.split="temporal"; set data.split="temporal" or drop it')
    if d.history_prefix and (d.dataset != "kuairand-rank-log" or d.split != "temporal"):
        fail("data", "history_prefix", "prefixes an official KuaiRand log's users with their pre-period ids: it needs "
                                       "data.dataset='kuairand-rank-log' and data.split='temporal'")
    if cfg.dist.balance == "lookahead":
        fail("dist", "balance", "model.task='ranking' splits each global batch as it is (\"none\" or \"kk\"); "
                                "lookahead moves samples between batches, which ranking's loader does not plan")
    emb = cfg.embedding
    if emb.sharding == "row" and emb.kind != "hash":
        fail("embedding", "sharding", "model.task='ranking' row-shards its one merged hash table: set "
                                      "embedding.kind='hash' (the dense tables are replicated)")
    if emb.kind == "dense" and emb.optimizer != "adamw":
        fail("embedding", "optimizer", "model.task='ranking' updates dense tables with AdamW; the row-sparse "
                                       "optimizers come with embedding.kind='hash' (ranking/sparse.py)")
    if emb.kind == "hash" and not cfg.ranking.merge_tables:
        fail("ranking", "merge_tables", "embedding.kind='hash' keeps every id feature in one hash table: set "
                                        "ranking.merge_tables=true")
    if emb.kind == "hash" and emb.init == "dense":
        fail("embedding", "init", "model.task='ranking' starts hash rows from hashed_init: set embedding.init='hashed'")
