"""Ranking data for ``grf train`` (``model.task = "ranking"``): the datasets, the chronological
split and the training loader.

Datasets (``data.dataset``, registered with ``task="ranking"`` in gr_functional/data/registry.py):
  kuairand-rank-synthetic  the KuaiRand-shaped generator (data/sources/kuairand_ranking_synthetic.py):
                           data.synthetic_users / synthetic_items / synthetic_max_events / zipf_a / seed
  kuairand-rank-gr         GR's processed_seqs.csv (data.path), as GR's KuaiRand preprocessor writes it
  kuairand-rank-log        an official KuaiRand log (data.path, e.g. log_standard_4_08_to_4_21_1k.csv)
                           joined with the official user feature file
  kuairand-rank-stream     the KuaiRand-27K-shaped ranking stream, generated per user on demand
                           (data/sources/kuairand_ranking_stream.py): data.synthetic_users (first
                           users, up to 27,285) / synthetic_max_events (first events of each) / seed

Split, chronological per user (every user is in every split): with C = ``ranking.num_candidates``
and n a user's events, the test sample's candidates are its last C events, validation's the C
before them, and training has one sample per earlier window of C events: candidates
``[e - C, e)`` for e = n - 2C, n - 3C, ... while at least one history event precedes them. Each
sample's history is every event before its candidates (truncated to ``ranking.max_history``, the
oldest kept, as GR does). GR's own protocol differs: one sample per user (its last C events),
users split 75/25 by file order, no validation (docs/design/dlrm_v3_ranking_spec.md section 5.3).

``data.split = "temporal"`` (``temporal_split``) splits by time instead, as KuaiRand papers do:
training windows before ``data.valid_start``, then each user's impressions in the validation and
test windows as candidates (a variable number per user, in chunks of up to C), their history
everything before the window; it needs no minimum number of events per user.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from ..config import cutoff_ms
from ..data.registry import get_dataset
from ..data.registry import names as dataset_names
from ..errors import DataError
from ..data.batching import RankBatch, RankSplit, advance, consecutive_batches
from ..embedding.lookup import unique_ids
from ..data.prefetch import PrefetchStats
from ..data.sources.kuairand_ranking import SEQUENCE_COLUMNS, RankingSequences
from .model import kept_history, make_ranking_batch
from .sparse import batch_keys


def load_ranking_data(cfg) -> RankingSequences:
    """The ``RankingSequences`` of ``cfg.data`` (a ``Config``): the registered ranking dataset's
    ``load(cfg, path)`` (gr_functional/data/registry.py); ``DataError`` naming the file."""
    spec = get_dataset(cfg.data.dataset)
    if spec.task != "ranking":
        raise DataError(f"data.dataset={cfg.data.dataset!r} is a {spec.task} dataset; model.task='ranking' trains "
                        f"on one of: {', '.join(dataset_names('ranking'))}")
    return spec.load(cfg, Path(cfg.data.path) if cfg.data.path else None)


def fingerprint(seqs: RankingSequences) -> str:
    """sha256 of the sequences and contexts (a stream's of what generates it): resuming on
    changed data is refused."""
    if hasattr(seqs, "fingerprint"):
        return seqs.fingerprint()
    h = hashlib.sha256()
    arrays = [seqs.users, seqs.offsets, *(seqs.columns[c] for c in SEQUENCE_COLUMNS),
              *(seqs.context[c] for c in sorted(seqs.context))]
    if getattr(seqs, "history_only", None) is not None:
        arrays.append(seqs.history_only)
    for arr in arrays:
        h.update(np.ascontiguousarray(arr, np.int64).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def history_only(seqs) -> np.ndarray:
    """``[U]`` int64: each user's first events that are history only (a prefix; zeros when the
    sequences have none, or are a dataset of one's own without the field)."""
    prefix = getattr(seqs, "history_only", None)
    return np.zeros(len(seqs.users), np.int64) if prefix is None else np.asarray(prefix, np.int64)


@dataclasses.dataclass
class Samples:
    """``users[S]`` (indices into the sequences) and ``ends[S]``: sample i's candidates are the
    ``counts[i]`` events of user ``users[i]`` before event ``ends[i]`` (default ``num_candidates``
    each), its history the events before ``history_ends[i]`` (default: before the candidates)."""

    users: np.ndarray
    ends: np.ndarray
    counts: np.ndarray | None = None          # [S] int, 1..num_candidates (a temporal split's windows)
    history_ends: np.ndarray | None = None    # [S] int (a temporal split's window starts)

    def __len__(self) -> int:
        return len(self.users)

    def take(self, n: int) -> "Samples":
        """The first ``n`` samples."""
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Samples(self.users[:n], self.ends[:n], cut(self.counts), cut(self.history_ends))

    def batch_args(self, pick) -> dict:
        """``make_ranking_batch``'s per-sample arguments for the samples ``pick``."""
        return {"ends": self.ends[pick], "num_targets": None if self.counts is None else self.counts[pick],
                "history_ends": None if self.history_ends is None else self.history_ends[pick]}

    def candidates(self, num_candidates: int) -> np.ndarray:
        """``[S]`` each sample's number of candidates (``counts``, else ``num_candidates`` each)."""
        return np.full(len(self.users), num_candidates, np.int64) if self.counts is None else np.asarray(self.counts)

    def tokens(self, model_cfg) -> np.ndarray:
        """``[S]`` each sample's tokens as ``make_ranking_batch`` lays it out: contextual, history,
        candidates."""
        counts = self.candidates(model_cfg.num_candidates)
        ends = np.asarray(self.ends)
        before = ends - counts if self.history_ends is None else np.minimum(self.history_ends, ends - counts)
        return model_cfg.contextual + kept_history(model_cfg, before) + counts


@dataclasses.dataclass
class RankingSplits:
    train: Samples
    valid: Samples
    test: Samples


def chronological_split(seqs: RankingSequences, num_candidates: int) -> RankingSplits:
    """The split of the module docstring; ``DataError`` naming a user with too few events."""
    C = num_candidates
    if np.any(history_only(seqs)):
        raise DataError("the windows split takes every event as a candidate; a history prefix "
                        "(data.history_prefix) needs data.split='temporal'")
    lengths = np.diff(seqs.offsets)
    short = np.flatnonzero(lengths < 3 * C + 1)
    if len(short):
        u = int(short[0])
        raise DataError(f"user {int(seqs.users[u])} has {int(lengths[u])} events; the chronological split needs "
                        f"3 x ranking.num_candidates + 1 = {3 * C + 1} (test, validation and one training window "
                        f"after a history event): {len(short)} user(s) are that short. Lower ranking.num_candidates, "
                        f"or set data.split='temporal' (validation and test by time: users of any length; "
                        f"data.valid_start / data.test_start), or remove those users from the file (no key drops "
                        f"them)")
    users = np.arange(len(lengths))
    tu, te = [], []
    for u, n in enumerate(lengths):
        ends = np.arange(n - 2 * C, C, -C)               # candidates [e - C, e) need >= 1 history event before
        tu.append(np.full(len(ends), u))
        te.append(ends)
    return RankingSplits(train=Samples(np.concatenate(tu), np.concatenate(te)),
                         valid=Samples(users, lengths - C), test=Samples(users, lengths.copy()))


def temporal_split(seqs: RankingSequences, num_candidates: int, valid_start: int, test_start: int,
                   test_end: int | None = None, source: str = "the data") -> tuple[RankingSplits, dict]:
    """``(splits, counts)`` by time (``data.split = "temporal"``, cutoffs in epoch ms; config.py's
    ``DataConfig.split``): training = windows of ``num_candidates`` events before ``valid_start``,
    each after at least one history event (the latest window ends at the last training event);
    validation / test = each user's events in ``[valid_start, test_start)`` / ``[test_start,
    test_end)`` in chunks of up to C, every chunk with the history before its window. ``counts``:
    users without history before a window or without events in it (no sample there). A sequence's
    first ``seqs.history_only`` events (a pre-period prefix) are history, never candidates.
    DataError naming the key when a cutoff leaves a split empty."""
    C = num_candidates
    times = np.asarray(seqs.columns["time_ms"], np.int64)
    t_min, t_max = int(times.min()), int(times.max())
    lengths = np.diff(seqs.offsets)
    prefix = history_only(seqs)
    tu, te, tc = [], [], []
    window = {"valid": ([], [], [], []), "test": ([], [], [], [])}
    skipped = {"valid_no_history": 0, "test_no_history": 0}
    bounds = {"valid": (valid_start, test_start), "test": (test_start, test_end if test_end is not None else t_max + 1)}
    for u, n in enumerate(lengths):
        t = times[seqs.offsets[u]:seqs.offsets[u + 1]]
        if np.any(np.diff(t) < 0):
            raise DataError(f"{source}: user {int(seqs.users[u])}'s events are not in time order; a temporal split "
                            f"needs each user's events sorted by time_ms")
        n_train = int(np.searchsorted(t, valid_start, side="left"))
        first = max(1, prefix[u])                                 # a prefix is history only, never a candidate
        ends = np.arange(n_train, first, -C)                      # candidates [e - c, e), c <= C, after >= 1
        tu.append(np.full(len(ends), u))                          # history event: the earliest chunk may be short
        te.append(ends)
        tc.append(np.minimum(C, ends - first))
        for name, (lo, hi) in bounds.items():
            a, b = (int(np.searchsorted(t, x, side="left")) for x in (lo, hi))
            if a == b:
                continue
            if a == 0:
                skipped[f"{name}_no_history"] += 1
                continue
            users, ends_, counts, hist = window[name]
            for start in range(a, b, C):
                stop = min(start + C, b)
                users.append(u)
                ends_.append(stop)
                counts.append(stop - start)
                hist.append(a)

    def samples(name):
        users, ends_, counts, hist = (np.asarray(x, np.int64) for x in window[name])
        return Samples(users, ends_, counts, hist)

    splits = RankingSplits(train=Samples(*(np.concatenate(x).astype(np.int64) for x in (tu, te, tc))),
                           valid=samples("valid"), test=samples("test"))
    when = lambda ms: f"{ms} ms = {np.datetime64(int(ms), 'ms')} UTC"  # noqa: E731
    span = f"{source} spans {when(t_min)} .. {when(t_max)}"
    for name, key in (("train", "valid_start"), ("valid", "test_start"), ("test", "test_end")):
        if len(getattr(splits, name)) == 0:
            raise DataError(f"data.{key}: the temporal split leaves no {name} sample ({span}; train is before "
                            f"valid_start = {when(valid_start)}, validation before test_start = {when(test_start)}, "
                            f"test before test_end{'' if test_end is None else ' = ' + when(test_end)}): move the "
                            f"cutoffs inside the data")
    return splits, skipped


def split_samples(seqs: RankingSequences, cfg) -> tuple[RankingSplits, str]:
    """The splits ``cfg.data.split`` asks for (``cfg``: a Config) and a line describing them."""
    C = cfg.ranking.num_candidates
    if cfg.data.split == "windows":
        return chronological_split(seqs, C), f"windows of {C} (test: each user's last {C} events)"
    d = cfg.data
    splits, skipped = temporal_split(seqs, C, cutoff_ms(d.valid_start), cutoff_ms(d.test_start),
                                     cutoff_ms(d.test_end) if d.test_end else None, source=f"data.dataset={d.dataset!r}")
    return splits, (f"temporal: train before {d.valid_start}, validation to {d.test_start}, test to "
                    f"{d.test_end or 'the end'}; {skipped['valid_no_history']:,} / {skipped['test_no_history']:,} "
                    f"users without history before the validation / test window left out there")


class RankingLoader:
    """Training batches of ``train.batch_size`` samples, or, with ``max_tokens > 0``
    (``train.max_tokens``), of as many consecutive samples as fit that many tokens (contextual,
    history and candidates; at most ``batch_size``), shuffled per epoch by ``default_rng((seed,
    epoch))``; batch b's dropout masks come from ``default_rng((seed, epoch, b))``, so a resume
    from (epoch, b) rebuilds exactly the batches an uninterrupted run sees. The last batch of an
    epoch may be smaller. ``position`` is (epoch, next batch).

    Data-parallel (``split``, a ``data.batching.RankSplit`` of policy "none" or "kk"): every rank
    plans the same global batches and builds only its share (``rank_share``), with the dropout
    masks and attention normaliser one process gives those samples, so N ranks compute the
    one-process step up to float summation order."""

    def __init__(self, seqs: RankingSequences, samples: Samples, model_cfg, batch_size: int, seed: int,
                 max_tokens: int = 0, split: RankSplit | None = None):
        self.seqs, self.samples, self.model_cfg, self.split = seqs, samples, model_cfg, split
        self.batch_size, self.seed, self.max_tokens = batch_size, seed, int(max_tokens)
        self.position = (0, 0)
        self.tokens = samples.tokens(model_cfg)
        self.candidates = samples.candidates(model_cfg.num_candidates)   # [S]: a rank share's loss weights
        if self.max_tokens and len(self.tokens) and self.max_tokens < int(self.tokens.max()):
            raise DataError(f"train.max_tokens={self.max_tokens} is smaller than one training sample's "
                            f"{int(self.tokens.max())} tokens; use train.max_tokens >= ranking.max_seq_len="
                            f"{model_cfg.max_seq_len} or 0 (off)")
        self._plan: tuple[int, list[np.ndarray]] | None = None

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The sample indices of each batch of ``epoch`` (a partition of the samples)."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.samples))
        steps = consecutive_batches(order, self.tokens, self.batch_size, self.max_tokens)
        self._plan = (epoch, steps)
        return steps

    @property
    def steps_per_epoch(self) -> int:
        """Batches of the current epoch (the same for every epoch unless ``max_tokens`` is on)."""
        return len(self.plan(self.position[0]))

    def state_dict(self) -> dict:
        return {"epoch": self.position[0], "batch": self.position[1], "samples": len(self.samples),
                "batch_size": self.batch_size, "max_tokens": self.max_tokens}

    def load_state_dict(self, state: dict) -> None:
        if state.get("samples") != len(self.samples) or state.get("batch_size") != self.batch_size or \
                state.get("max_tokens", 0) != self.max_tokens:
            raise DataError(f"the checkpoint's loader had {state.get('samples')} training samples in batches of "
                            f"{state.get('batch_size')} (max_tokens {state.get('max_tokens', 0)}); this data and "
                            f"config give {len(self.samples)} in batches of {self.batch_size} (max_tokens "
                            f"{self.max_tokens}): the data, train.batch_size or train.max_tokens changed (pass "
                            f"--fresh to start over)")
        self.position = (int(state["epoch"]), int(state["batch"]))

    def batch(self, epoch: int, b: int, pad: bool = False):
        """Batch ``b`` of ``epoch`` (random access; the position does not move)."""
        pick = self.plan(epoch)[b]
        rng = np.random.default_rng((self.seed, epoch, b))
        return make_ranking_batch(self.seqs, self.samples.users[pick], self.model_cfg, rng, pad=pad,
                                  **self.samples.batch_args(pick))

    def _moved(self, position) -> None:
        self.position = position

    def rank_share(self, epoch: int, b: int, rank: int, with_ids: bool = False) -> RankBatch:
        """Rank ``rank``'s share of batch ``b`` of ``epoch`` (``split.assign`` on the samples' tokens):
        a ``RankBatch`` whose batch holds its samples with the global batch's dropout rows and
        normaliser (its longest sequence); a rank given no sample gets the batch's first one with
        no candidate counted (``cand_mask`` 0: it adds nothing). Tokens are candidates (the loss's
        denominator); ``rank_tokens`` input tokens; ``with_ids``: ``step_ids`` of the whole global
        batch (a replicated hash table: every rank maps the same keys)."""
        pick = self.plan(epoch)[b]
        tok = self.tokens[pick]
        assign = self.split.assign(tok, f"epoch {epoch} batch {b}")
        mine = np.flatnonzero(assign == rank)
        take = mine if len(mine) else np.zeros(1, np.int64)
        starts = np.concatenate([[0], np.cumsum(tok)])
        rows = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in take])
        rng = np.random.default_rng((self.seed, epoch, b))
        batch = make_ranking_batch(self.seqs, self.samples.users[pick[take]], self.model_cfg, rng,
                                   dropout_draw=(int(tok.sum()), rows), **self.samples.batch_args(pick[take]))
        batch = dataclasses.replace(batch, norm_len=np.asarray(tok.max(), np.float32))
        if not len(mine):
            batch = dataclasses.replace(batch, cand_mask=np.zeros_like(batch.cand_mask))
        step_ids = None
        if with_ids:
            whole = make_ranking_batch(self.seqs, self.samples.users[pick], self.model_cfg,
                                       **self.samples.batch_args(pick))
            step_ids = unique_ids(batch_keys(whole))
        cands = self.candidates[pick]
        R = self.split.world_size
        return RankBatch(batch, float(cands.sum()), float(cands[mine].sum()),
                         np.bincount(assign, weights=tok, minlength=R).astype(np.int64),
                         np.bincount(assign, weights=self.split.costs(tok), minlength=R), step_ids)

    def rank_epoch(self, epoch: int, start: int = 0, *, rank: int, capacity: str = "exact", with_ids: bool = False,
                   prefetch: int = 0, stats: PrefetchStats | None = None, group: int = 0, finish=None,
                   limit: int | None = None, pairs: bool = False):
        """This rank's ``rank_share`` of each batch of ``epoch`` from ``start``, as
        ``data.batching.TrainLoader.rank_epoch`` yields them (``group``, ``finish``, ``limit``,
        ``pairs``); shapes are exact (torch ranks; ``capacity`` is accepted for that interface)."""
        return advance(len(self.plan(epoch)), epoch, start, lambda b: self.rank_share(epoch, b, rank, with_ids),
                       self._moved, prefetch, stats, group, finish, limit, pairs)

    def epoch(self, epoch: int, start: int = 0, prefetch: int = 0, stats: PrefetchStats | None = None,
              pad: bool = False):
        """The batches of ``epoch`` from batch ``start``, built ``prefetch`` ahead on a thread
        (bitwise the synchronous batches); ``position`` advances as each is handed out. ``pad``:
        shapes padded to capacities (``make_ranking_batch``; ``Backend.static_shapes``)."""
        return advance(len(self.plan(epoch)), epoch, start, lambda b: self.batch(epoch, b, pad), self._moved,
                       prefetch, stats)
