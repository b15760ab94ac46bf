"""dlrm_v3's HSTU ranking model, joined from its pieces (spec: docs/design/dlrm_v3_ranking_spec.md):
a batch of users (``RankingBatch``, built on the host by ``make_ranking_batch``) -> per-candidate
logits for every task and the multitask loss. Pure functions of ``(B, params, batch, cfg)``.

Per user: the 6 contextual tokens, the history (the oldest ``max_seq_len - num_candidates - 6``
events before the candidates, as GR's ``maybe_truncate_seq`` keeps them) and the last
``num_candidates`` events as candidates, whose action bits are the labels. Ids index the tables
modulo their sizes (GR's ``process_and_hash_x``). The tables here are dense; with
``embedding.kind = "hash"`` the training loop serves them from one hash table (ranking/sparse.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from ..config import RankingConfig
from ..data.sources.kuairand_ranking import CONTEXT_FEATURES
from ..embedding.collection import FeatureSpec, plan_tables
from ..jagged import Jagged, round_up_capacity
from ..model import xavier_normal, xavier_uniform
from .encoding import add_position_time, position_indices, time_buckets
from .heads import multitask_logits, multitask_loss, postprocess, task_labels, time_features
from .stu import init_stu_params, stu_layer
from .tokens import action_bits, assemble, assembly_index, contextual_tokens, init_tower, tower
from ..contracts import Backend

ACTION_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)
TASKS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view", "is_profile_enter")


# The model's configuration is the [ranking] section of the run config (one schema, checked once).
RankingModelConfig = RankingConfig


ID_FEATURES = ("video_id", "user_id") + tuple(CONTEXT_FEATURES)


def kept_history(cfg: RankingModelConfig, before):
    """Events of history a sample keeps when ``before`` events precede its candidates (int or
    numpy array): at most ``max_history``, and at most ``recent_history`` when that is >= 0."""
    kept = np.minimum(before, cfg.max_history)
    return kept if cfg.recent_history < 0 else np.minimum(kept, cfg.recent_history)


def _feature_sizes(cfg: RankingModelConfig) -> dict:
    """id feature -> its number of ids (GR's table size)."""
    return dict(zip(ID_FEATURES, (cfg.video_table,) + tuple(cfg.context_tables)))


@functools.lru_cache(maxsize=None)  # the config is frozen: planned once, not at every forward
def table_plan(cfg: RankingModelConfig) -> list:
    """The physical tables of the id features (``collection.plan_tables``): one when
    ``merge_tables``, else one per feature. ``len(table_plan(cfg))`` is the gathers per step."""
    return plan_tables([FeatureSpec(name, cfg.embed_dim, "dense", num_ids=n) for name, n in _feature_sizes(cfg).items()],
                       merge=cfg.merge_tables)


def _feature_rows(cfg: RankingModelConfig):
    """feature -> (table name, row of id 0): id x (GR's 0-based, already modulo the feature's
    size) lives at row ``start + x`` of its table (row 0 of every table is padding)."""
    return {f: (g.name, g.offsets[f] + 1) for g in table_plan(cfg) for f in g.features}


def feature_tables(tables: dict, cfg: RankingModelConfig) -> dict:
    """Per-feature views of ``tables`` (params["tables"], or its gradient): ``{"video": [n, E],
    "context": {"t0": ..., "t5": ...}}`` in GR's 0-based id order (for comparisons with GR)."""
    sizes = _feature_sizes(cfg)
    rows = _feature_rows(cfg)
    view = {f: tables[rows[f][0]][rows[f][1]:rows[f][1] + sizes[f]] for f in ID_FEATURES}
    return {"video": view["video_id"], "context": {f"t{s}": view[f] for s, f in enumerate(ID_FEATURES[1:])}}


def init_ranking_params(cfg: RankingModelConfig, seed: int = 0) -> dict:
    """numpy parameters with GR's initialisation (spec section 6.1; GR itself is unseeded)."""
    rng = np.random.default_rng(seed)
    E, D, K = cfg.embed_dim, cfg.dim, len(cfg.action_weights)

    Hi, Ht = cfg.item_hidden, cfg.task_hidden
    item = init_tower(E, Hi, D, rng)
    item["w1"], item["w2"] = xavier_uniform(rng, (E, Hi)), xavier_uniform(rng, (Hi, D))     # not re-initialised in GR
    return {
        "tables": _init_tables(cfg, rng),
        "wc": xavier_normal(rng, (cfg.contextual, E, D), fans=(E, D)),
        "bc": np.zeros((cfg.contextual, D), np.float32),
        "content": init_tower(E, cfg.tower_hidden, D, rng),
        "action": init_tower(K * cfg.action_dim, cfg.tower_hidden, D, rng),
        "action_table": (rng.standard_normal((K, cfg.action_dim)) * 0.1).astype(np.float32),
        "action_target": (rng.standard_normal((1, K * cfg.action_dim)) * 0.1).astype(np.float32),
        "position": rng.uniform(-1, 1, (cfg.position_buckets, D)).astype(np.float32) * math.sqrt(1.0 / cfg.position_buckets),
        "time": rng.uniform(-1, 1, (cfg.time_buckets + 1, D)).astype(np.float32) * math.sqrt(1.0 / cfg.time_buckets),
        "stu": {f"layer{i}": init_stu_params(D, cfg.heads, cfg.dqk, cfg.dv, rng, cfg.group_norm)
                for i in range(cfg.num_layers)},
        "post": {"w": xavier_normal(rng, (D + 4, D)),
                 "b": np.zeros(D, np.float32), "ln_w": np.ones(D, np.float32), "ln_b": np.zeros(D, np.float32)},
        "item": item,
        "task": {"w1": xavier_uniform(rng, (D, Ht)), "b1": np.zeros(Ht, np.float32), "sw_w": np.ones(Ht, np.float32),
                 "sw_b": np.zeros(Ht, np.float32), "w2": xavier_uniform(rng, (Ht, K)), "b2": np.zeros(K, np.float32)},
    }


def ranking_param_shapes(cfg: RankingModelConfig) -> dict:
    """``{path: shape}`` of ``init_ranking_params(cfg)`` (``tree.tree_items`` paths) without
    allocating the tables (GR's are 10M rows): a resumed checkpoint is checked against it."""
    from ..tree import tree_items

    tiny = dataclasses.replace(cfg, video_table=1, context_tables=(1,) * cfg.contextual)
    shapes = {k: np.shape(v) for k, v in tree_items(init_ranking_params(tiny)) if not k.startswith("tables.")}
    shapes.update({f"tables.{g.name}": (g.rows, cfg.embed_dim) for g in table_plan(cfg)})
    return shapes


def _init_tables(cfg: RankingModelConfig, rng: np.random.Generator) -> dict:
    """GR's embedding init, U(+-sqrt(1/n)) per feature of n ids, laid out as ``table_plan``
    says (row 0 of each table zero); the same values whether merged or not."""
    sizes = _feature_sizes(cfg)
    values = {f: rng.uniform(-1, 1, (n, cfg.embed_dim)).astype(np.float32) / math.sqrt(n) for f, n in sizes.items()}
    out = {}
    for g in table_plan(cfg):
        t = np.zeros((g.rows, cfg.embed_dim), np.float32)
        for f in g.features:
            t[g.offsets[f] + 1:g.offsets[f] + 1 + sizes[f]] = values[f]
        out[g.name] = t
    return out


@dataclasses.dataclass
class RankingBatch:
    """Host arrays of one batch (``B.asarray_tree`` moves them). ``n`` item tokens (history and
    candidates, user after user), ``c`` candidates, ``T`` tokens in all, ``B`` users, each padded
    to its capacity (``make_ranking_batch``; padding users have no tokens, padding candidates
    ``cand_mask`` 0):

      layout            Jagged over the T tokens (``max_len`` >= the batch's longest sequence)
      norm_len          0-d float32: GR's attention normaliser N, the batch's longest sequence
      item_ids[n]       rows of video ids in their table (``table_plan``);  bitmask[n] action bits
                        (0 for candidates);  is_cand[n, 1]
      ctx_ids[B, S]     each contextual feature's row in its table
      source[T]         ``tokens.assemble`` index;  pos_idx[T], time_idx[T]
      num_targets[B]    candidates per user
      cand_rows[c]      each candidate's token row;  cand_items[c] its video row
      cand_feats[c, 4]  time features of its query time;  labels[c, K];  cand_mask[c]
      input_keep[T, D], block_keep[L, T, 3 H dv]: dropout masks / keep probability, or None
    """

    layout: Jagged
    item_ids: Any
    bitmask: Any
    is_cand: Any
    ctx_ids: Any
    source: Any
    pos_idx: Any
    time_idx: Any
    num_targets: Any
    cand_rows: Any
    cand_items: Any
    cand_feats: Any
    labels: Any
    cand_mask: Any
    norm_len: Any = None
    input_keep: Any = None
    block_keep: Any = None
    lookup: Any = None      # hash tables (ranking/sparse.py): the step's rows; ids above are then local


def make_ranking_batch(seqs, users, cfg: RankingModelConfig, rng: np.random.Generator | None = None,
                       ends=None, pad: bool = False, num_targets=None, own_query_times: bool = False,
                       history_ends=None, dropout_draw: tuple[int, np.ndarray] | None = None) -> RankingBatch:
    """The batch of users ``users`` (indices into ``seqs``, a ``kuairand_ranking.RankingSequences``);
    ``rng`` draws the dropout masks (None: evaluation, no dropout). ``ends[i]`` (default: every
    user's length) cuts user i's sequence at that event: its candidates are the ``num_candidates``
    events before it (a chronological split's training and validation samples). A user needs
    more events than ``num_candidates`` (GR skips the others too).

    ``num_targets[i]`` (default: ``num_candidates`` each), 1..num_candidates, gives user i that
    many candidates instead (its last events; the history before them), as GR's model takes per
    sample; the candidates then come user after user, ``sum(num_targets)`` of them, the padding
    ones after. ``own_query_times``: each candidate's query time is its own event time, not the
    newest kept history event's (GR's KuaiRand loader's, the default); the time buckets then count
    from the sequence's last candidate's time, as GR's kernel does.
    ``history_ends[i]`` (default: the candidates' first event): user i's history is its events
    before that one (a temporal split's window: every candidate chunk of the window sees the same
    history, the events before the window).
    ``dropout_draw = (tokens, rows)``: the dropout masks are drawn for a batch of ``tokens`` tokens
    and these users' tokens take rows ``rows`` of them (a data-parallel rank's share of a global
    batch: its masks are the ones one process draws for those users).

    Shapes: exact (users, item tokens, candidates; the attention width is the longest sequence),
    tokens padded to the capacity ladder; with ``pad`` (``Backend.static_shapes``: JAX compiles a
    program per shape) every size is a ladder capacity (users, tokens, the attention width up to
    ``max_seq_len``; item tokens and candidates follow), so an epoch needs a few programs, not
    one per batch. The real candidates come first; the normaliser ``norm_len`` and the dropout
    masks of the real tokens are the same either way, so is every real candidate's logit."""
    S, C = cfg.contextual, cfg.num_candidates
    if len(users) == 0:
        raise ValueError("make_ranking_batch needs at least one user")
    counts = [C] * len(users) if num_targets is None else [int(c) for c in num_targets]
    if len(counts) != len(users) or not all(1 <= c <= C for c in counts):
        raise ValueError(f"num_targets {counts}: one count per user, each 1..num_candidates={C}")
    items, bits, cand_flag, times, lengths, targets = [], [], [], [], [], []
    cand_items, cand_bits, query = [], [], []
    for i, u in enumerate(users):
        seq = seqs.sequence(u)
        if ends is not None:
            seq = {name: col[:int(ends[i])] for name, col in seq.items()}
        n, c = len(seq["video_id"]), counts[i]
        if n <= c:
            raise ValueError(f"user {int(seqs.users[u])} has {n} events; a ranking sample needs more than "
                             f"its candidates ({c}; num_candidates={C})")
        before = n - c if history_ends is None else min(int(history_ends[i]), n - c)
        if before < 1:
            raise ValueError(f"user {int(seqs.users[u])}: no history event before its candidates")
        kept = int(kept_history(cfg, before))
        # GR keeps the oldest events; ranking.recent_history >= 0 the most recent ones
        hist = slice(0, kept) if cfg.recent_history < 0 else slice(before - kept, before)
        cand = slice(n - c, n)
        v = seq["video_id"] % cfg.video_table
        items += [v[hist], v[cand]]
        bits += [seq["action_weights"][hist], np.zeros(c, np.int64)]
        cand_flag += [np.zeros(kept), np.ones(c)]
        if own_query_times:
            q = np.asarray(seq["time_ms"][cand], np.int64)
        else:  # the candidates' query time: the newest kept history event's (any history's when none is kept)
            newest = seq["time_ms"][hist] if cfg.recent_history < 0 else seq["time_ms"][:before]
            q = np.full(c, int(newest.max()), np.int64)
        times += [np.zeros(S, np.int64), seq["time_ms"][hist], q]
        lengths.append(S + kept + c)
        targets.append(c)
        cand_items.append(v[cand])
        cand_bits.append(seq["action_weights"][cand])
        query.append(q)
    n_users, T, longest = len(users), int(sum(lengths)), int(max(lengths))
    n = T - n_users * S                                                 # item tokens
    t_exact = round_up_capacity(T)
    if pad:
        b_cap = round_up_capacity(n_users, 1)
        t_cap = round_up_capacity(b_cap * S + n)                        # padding users' contextual rows too
        width = max(longest, min(round_up_capacity(longest, 1), cfg.max_seq_len))
        n_cap = t_cap - b_cap * S
    else:
        b_cap, t_cap, width, n_cap = n_users, t_exact, longest, n
    c_cap = b_cap * C if pad else int(sum(targets))                    # the same unless num_targets is given
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    layout = Jagged.from_offsets(np.zeros(T, np.int32), offsets, max_len=width, b_cap=b_cap, t_cap=t_cap)
    ctx = np.stack([np.concatenate([[seqs.users[u]], [seqs.context[name][u] for name in CONTEXT_FEATURES]])
                    for u in users]) % np.asarray(cfg.context_tables)
    starts = _feature_rows(cfg)
    ctx = ctx + np.asarray([starts[f][1] for f in ID_FEATURES[1:]])                 # rows of their tables
    video_start = starts["video_id"][1]
    cand_rows = np.concatenate([offsets[b] + lengths[b] - targets[b] + np.arange(targets[b]) for b in range(n_users)])
    timestamps = np.concatenate(times)

    def fill(x, size, value=0, axis=0):
        x = np.asarray(x)
        if x.shape[axis] == size:
            return x
        shape = list(x.shape)
        shape[axis] = size - x.shape[axis]
        return np.concatenate([x, np.full(shape, value, x.dtype)], axis=axis)

    input_keep = block_keep = None
    if rng is not None:
        # drawn at the exact layout's capacity whatever the padding: the same masks on the real tokens
        t_draw = t_exact if dropout_draw is None else round_up_capacity(int(dropout_draw[0]))
        input_keep = (rng.random((t_draw, cfg.dim)) >= cfg.input_dropout) / (1.0 - cfg.input_dropout)
        block_keep = (rng.random((cfg.num_layers, t_draw, 3 * cfg.heads * cfg.dv)) >= cfg.linear_dropout) / (
            1.0 - cfg.linear_dropout)
        if dropout_draw is not None:
            rows = np.asarray(dropout_draw[1])
            input_keep, block_keep = input_keep[rows], block_keep[:, rows]
        input_keep = fill(input_keep.astype(np.float32), t_cap, 1.0)
        block_keep = fill(block_keep.astype(np.float32), t_cap, 1.0, axis=1)
    item_lengths = [l - S for l in lengths]
    return RankingBatch(
        layout=layout, norm_len=np.asarray(longest, np.float32),
        item_ids=fill(np.concatenate(items) + video_start, n_cap).astype(np.int32),
        bitmask=fill(np.concatenate(bits), n_cap).astype(np.int32),
        is_cand=fill(np.concatenate(cand_flag), n_cap).astype(np.float32)[:, None],
        ctx_ids=fill(ctx, b_cap).astype(np.int32),
        source=assembly_index(b_cap, S, item_lengths, t_cap, item_rows=n_cap),
        pos_idx=fill(position_indices(lengths, targets, S, cfg.position_buckets), t_cap).astype(np.int32),
        time_idx=fill(time_buckets(timestamps, offsets, cfg.cap), t_cap).astype(np.int32),
        num_targets=fill(np.asarray(targets, np.int32), b_cap), cand_rows=fill(cand_rows, c_cap).astype(np.int32),
        cand_items=fill(np.concatenate(cand_items) + video_start, c_cap).astype(np.int32),
        cand_feats=fill(time_features(np.concatenate(query)), c_cap),
        labels=fill(task_labels(np.concatenate(cand_bits), cfg.action_weights), c_cap),
        cand_mask=fill(np.ones(len(cand_rows), np.float32), c_cap), input_keep=input_keep, block_keep=block_keep)


def _lookup(B: Backend, tables: dict, batch: RankingBatch, cfg: RankingModelConfig) -> dict:
    """Every id embedding of the batch with ONE gather per physical table: ``{"items": [n, E],
    "candidates": [c, E], "context": [B, S, E]}``."""
    xp = B.xp
    S = batch.ctx_ids.shape[1]
    where = _feature_rows(cfg)
    wanted = {name: [] for name in tables}                       # table -> [(key, rows[k])]
    wanted[where["video_id"][0]] += [("items", batch.item_ids), ("candidates", batch.cand_items)]
    for s, f in enumerate(ID_FEATURES[1:]):
        wanted[where[f][0]].append((f"ctx{s}", batch.ctx_ids[:, s]))
    got = {}
    for name, parts in wanted.items():
        if not parts:
            continue
        rows = B.gather_table(tables[name], xp.concat([r for _, r in parts]) if len(parts) > 1 else parts[0][1])
        start = 0
        for key, r in parts:
            got[key] = rows[start:start + r.shape[0]]
            start += r.shape[0]
    return {"items": got["items"], "candidates": got["candidates"],
            "context": xp.stack([got[f"ctx{s}"] for s in range(S)], axis=1)}


def ranking_logits(B: Backend, params: dict, batch: RankingBatch, cfg: RankingModelConfig):
    """``[c, K]`` logits of every candidate and task."""
    emb = _lookup(B, params["tables"], batch, cfg)
    item_emb = emb["items"]
    acts = action_bits(B, params["action_table"], batch.bitmask, cfg.action_weights)
    acts = acts * (1.0 - batch.is_cand) + params["action_target"] * batch.is_cand
    items = tower(B, params["content"], item_emb) + tower(B, params["action"], acts)
    ctx_emb = emb["context"]                                                                   # [B, S, E]
    tok = assemble(B, contextual_tokens(B, ctx_emb, params["wc"], params["bc"]), items, batch.source)
    x = add_position_time(B, tok, batch.pos_idx, batch.time_idx, params["position"], params["time"])
    if batch.input_keep is not None:
        x = x * batch.input_keep
    for i in range(cfg.num_layers):
        keep = None if batch.block_keep is None else batch.block_keep[i]
        x = stu_layer(B, params["stu"][f"layer{i}"], x, batch.layout, batch.num_targets, batch.norm_len,
                      cfg.heads, cfg.dqk, keep, group_norm=cfg.group_norm)
    x_cand = B.gather_rows(x, batch.cand_rows)
    user = postprocess(B, params["post"], x_cand, batch.cand_feats)
    item = tower(B, params["item"], emb["candidates"])
    return multitask_logits(B, params["task"], user, item)


def ranking_loss(B: Backend, params: dict, batch: RankingBatch, cfg: RankingModelConfig):
    """``(loss, per_task[K])``: GR's sum over tasks of 0.2 x mean BCE."""
    return multitask_loss(B, ranking_logits(B, params, batch, cfg), batch.labels, batch.cand_mask)


def evaluate_ranking(B: Backend, params: dict, seqs, users, cfg: RankingModelConfig, batch_size: int = 16, ends=None,
                     scorer=None, on_batch=None, transform=None, num_targets=None, history_ends=None) -> dict:
    """Per-task AUC, GAUC (grouped by user), NE over the candidates of ``users`` (no dropout),
    ``batch_size`` users at a time: ``{task: {"auc", "gauc", "gauc_users", "ne"}}`` plus
    ``"candidates"``. GR logs torchrec's windowed AUC and NE; GAUC is the issue's addition. GR's
    attention divides by the batch's longest sequence, so a user's logits depend on its batch-mates:
    ``batch_size`` (GR: 16) is part of the evaluation protocol. ``transform(batch)``, if given,
    rewrites each host batch before scoring (hash tables: ids to rows). Batches are padded to
    capacities where ``B.static_shapes`` (``make_ranking_batch``): the same metrics. ``num_targets``
    and ``history_ends`` (per sample, as ``make_ranking_batch`` takes them): a temporal split's
    samples; GAUC then groups a user's candidates over all its samples."""
    from ..data.ranking_metrics import task_metrics

    logits, labels, owners = [], [], []
    score = scorer or B.jit(lambda p, b: ranking_logits(B, p, b, cfg))
    for s in range(0, len(users), batch_size):
        chunk = list(users[s:s + batch_size])
        part = slice(s, s + batch_size)
        counts = [cfg.num_candidates] * len(chunk) if num_targets is None else list(num_targets[part])
        batch = make_ranking_batch(seqs, chunk, cfg, ends=None if ends is None else ends[part], pad=B.static_shapes,
                                   num_targets=None if num_targets is None else counts,
                                   history_ends=None if history_ends is None else history_ends[part])
        real = int(sum(counts))                                         # padding candidates come last
        logits.append(B.to_numpy(score(params, B.asarray_tree(batch if transform is None else transform(batch))))[:real])
        if on_batch is not None:
            on_batch()
        labels.append(batch.labels[:real])
        owners.append(np.repeat(np.asarray(seqs.users)[chunk], counts))
    names = TASKS[:len(cfg.action_weights)]
    out = task_metrics(np.concatenate(logits), np.concatenate(labels), np.concatenate(owners),
                       [(name, "binary") for name in names])
    out["candidates"] = int(sum(len(x) for x in labels))
    return out
