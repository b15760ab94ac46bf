"""Training losses: a registry of pure functions with one signature, selected by ``[loss] name``.

    fn(B, user[T, D], items[N+1, D], batch: HSTUBatch, cfg: LossConfig) -> loss (0-d, float)

``user`` is the model's output at every position (L2-normalised, ``model.encode``); ``items`` is the
L2-normalised item table, the same vectors evaluation ranks against (row 0 is the padding id).
``batch.targets[T]`` int32 names the item each position predicts (0 = no supervision) and
``batch.weights[T]`` weights it; the loss returns the weighted mean over supervised positions
(``softmax_nll`` does the common part). Each loss declares which negatives its batches carry
(``batch.Negatives``: drawn on the host from the step's numpy generator, so every backend and
every rank sees the same ones):

  "sampled"   batch.negatives[T, R] int32: R uniform ids in 1..N per position (GR's sampler)
  "in_batch"  batch.shared_negatives[R] int32: the targets of R supervised positions of the
              (global) batch, drawn uniformly with replacement and shared by every position
  "pool"      batch.shared_negatives[R] int32 drawn from ``loss.sampler`` (uniform or
              popularity ** alpha) and batch.shared_logq[R] = log(R q(id)), shared by every position
  "mixed"     batch.shared_negatives[Rb + R] int32: Rb (``loss.batch_negatives``) in-batch draws
              then a pool of R, and batch.shared_logq = log of each id's expected count in it
  "catalogue" batch.shared_negatives[N] int32: every item id 1..N (the full softmax)
  "none"      neither

A new loss is one function and one ``register`` call, from any module (an experiment script, or
a file passed to ``grf train --plugin``)::

    from gr_functional import losses

    @losses.register("my_loss", negatives="sampled")
    def my_loss(B: Backend, user, items, batch, cfg):
        ...

and ``[loss] name = "my_loss"`` selects it; the name is written to config.toml and every
checkpoint, and a resume under another loss is refused.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .batch import HSTUBatch, NegativeKind, Negatives
from .config import Config, choices
from .errors import ConfigError
from .registry import Registry
from .contracts import Backend

# A negative equal to the position's target (or the padding id) gets this logit: it drops out of
# the softmax without a data-dependent shape (GR masks sampled collisions the same way).
MASKED_LOGIT = -5e4


@dataclasses.dataclass(frozen=True)
class Loss:
    """A registered loss: ``fn`` (signature in the module docstring) and the negatives its
    batches carry (``negatives``)."""

    name: str
    fn: Callable
    negatives: NegativeKind = "sampled"
    doc: str = ""


LOSSES: Registry[Loss] = Registry(
    "loss", config_key="loss.name",
    how="A loss of your own is registered with @gr_functional.losses.register(NAME) in a module passed to "
        "grf train --plugin")


def register(name: str, fn: Callable | None = None, *, negatives: NegativeKind = "sampled",
             replace: bool = False):
    """Register ``fn`` as loss ``name`` (``register(name, fn)``, or ``@register(name)`` as a decorator).

    Args:
      name: the ``loss.name`` value.
      fn: ``fn(B, user[T, D], items[N+1, D], batch, cfg: LossConfig) -> loss`` (module docstring).
      negatives: the negatives its batches carry: "sampled", "in_batch", "pool", "mixed",
        "catalogue" or "none".
      replace: replace another definition registered under ``name``.
    Returns:
      ``fn`` (or the decorator). Raises ValueError for a taken name (a second import of the same
      function is allowed) or an unknown ``negatives``.
    """
    if negatives not in choices(NegativeKind):
        raise ValueError(f"register({name!r}): negatives={negatives!r} is not one of "
                         f"{', '.join(map(repr, choices(NegativeKind)))}")

    def add(f: Callable) -> Callable:
        LOSSES.add(name, Loss(name, f, negatives, (f.__doc__ or "").strip().split("\n")[0]), origin_of=f,
                   replace=replace)
        return f

    return add if fn is None else add(fn)


def names() -> tuple[str, ...]:
    return LOSSES.names()


def get(name: str) -> Loss:
    """The registered loss ``name``, or ConfigError naming the registered ones."""
    return LOSSES.get_or(name, lambda message: ConfigError(f"loss.name={name!r}: {message}"))


def check_config(cfg: Config) -> list[tuple[str, str, str]]:
    """``(section, key, problem)`` of ``cfg`` this registry owns: ``loss.name`` must be registered."""
    if cfg.loss.name not in LOSSES:
        return [("loss", "name", LOSSES.unknown_message(cfg.loss.name))]
    return []


def negatives_for(cfg: Config, popularity=None) -> Negatives:
    """The negatives a training batch carries under ``cfg.loss``. ``popularity[N+1]`` (training
    events per id) is needed by ``loss.sampler = "popularity"``."""
    lc = cfg.loss
    kind = get(lc.name).negatives
    if lc.sampler != "uniform" and kind not in ("pool", "mixed"):
        raise ConfigError(f"loss.sampler={lc.sampler!r} draws a shared pool, but loss {lc.name!r} takes "
                          f"{kind!r} negatives; use loss.name='shared_pool' (or a loss registered with "
                          f"negatives='pool'), or loss.sampler='uniform'")
    pooled = kind in ("pool", "mixed") and lc.sampler == "popularity"
    if pooled and popularity is None:
        raise ConfigError("loss.sampler='popularity' needs the training data's item counts; "
                          "this caller passed none")
    return Negatives(kind, lc.num_negatives, lc.sampler, lc.popularity_alpha, popularity if pooled else None,
                     batch_count=lc.batch_negatives if kind == "mixed" else 0)


# ----------------------------------------------------------------------------- pieces
def softmax_nll(B: Backend, pos, neg, masked, weights):
    """Weighted mean over positions of ``-log softmax([pos, neg])[0]``.

    pos[T] positive logits, neg[T, R] negative logits, masked[T, R] bool (those negatives are left
    out: logit ``MASKED_LOGIT``), weights[T] (0 = unsupervised). The mean divides by
    ``max(sum(weights), 1)``, so an all-padding batch has loss 0, not NaN."""
    xp = B.xp
    neg = xp.where(masked, xp.full_like(neg, MASKED_LOGIT), neg)
    logits = xp.concat([xp.reshape(pos, (-1, 1)), neg], axis=1)
    nll = B.logsumexp(logits, axis=1) - pos
    total = xp.sum(weights)
    return xp.sum(nll * weights) / xp.maximum(total, xp.ones_like(total))


def positive_logits(B: Backend, user, items, targets, temperature: float):
    """``<user_t, items[target_t]> / temperature`` for every position: ``[T]``."""
    return B.xp.sum(user * B.gather_table(items, targets), axis=-1) / temperature


SCALE_CHUNK_POSITIONS = 1024  # positions per gather when segment_scales reads rows instead of the table


def _position_abs_max(B: Backend, items, ids):
    """``[T]``: the largest |value| of the rows ``ids[T, R]`` names in ``items[N, D]``. One pass
    over the table when it has at most T x R rows, else only the named rows, a chunk of positions
    at a time (a large catalogue is never scanned whole). Not differentiated."""
    xp = B.xp
    items = B.stop_gradient(items)
    T, R = ids.shape
    if items.shape[0] <= T * R:
        row_max = xp.max(xp.abs(items), axis=1)                                               # [N]
        return xp.max(xp.reshape(xp.take(row_max, xp.reshape(ids, (-1,))), (T, R)), axis=1)
    parts = [xp.max(xp.max(xp.abs(B.gather_rows(items, ids[s:s + SCALE_CHUNK_POSITIONS])), axis=2), axis=1)
             for s in range(0, T, SCALE_CHUNK_POSITIONS)]
    return xp.concat(parts) if len(parts) > 1 else parts[0]


def segment_scales(B: Backend, items, ids, layout):
    """``scale[T]``: for each position, the largest |value| among all the negative rows its jagged
    segment (its user sequence) reads, ``items[N, D]`` at ``ids[T, R]`` int32; 1 where that is 0
    (padding rows, all-zero rows). The 16-bit negatives divide by it, so each segment's largest
    value maps to 1 whatever the scale of the others (un-normalised tables, long and short
    sequences alike); one fp32 per segment is all the extra storage. Not differentiated."""
    xp = B.xp
    pos_max = _position_abs_max(B, items, ids)                                                # [T]
    cells = xp.take(xp.concat([pos_max, xp.zeros((1,), dtype=pos_max.dtype, device=B.array_device)]),
                    xp.reshape(layout.dense_index, (-1,)))                                     # empty cell -> 0
    seg_max = xp.max(xp.reshape(cells, tuple(layout.dense_index.shape)), axis=1)               # [B]
    seg_max = xp.where(seg_max > 0, seg_max, xp.ones_like(seg_max))
    return xp.take(xp.concat([seg_max, xp.ones((1,), dtype=seg_max.dtype, device=B.array_device)]), layout.seq_id)


# ----------------------------------------------------------------------------- shipped losses
@register("sampled_softmax", negatives="sampled")
def sampled_softmax(B: Backend, user, items, batch: HSTUBatch, cfg):
    """GR's sampled softmax: each position's target against its own R uniformly sampled items
    (``batch.negatives[T, R]``), logits cosine / temperature; a negative equal to the target is
    masked."""
    xp = B.xp
    pos = positive_logits(B, user, items, batch.targets, cfg.temperature)                      # [T]
    if cfg.negatives_precision == "fp32":
        neg = B.sampled_logits(user, items, batch.negatives)
    else:
        scale = segment_scales(B, items, batch.negatives, batch.layout)
        neg = B.sampled_logits_16bit(user, items, batch.negatives, scale, cfg.negatives_precision)
    neg = neg / cfg.temperature                                                                # [T, R]
    hit = batch.negatives == xp.reshape(batch.targets, (-1, 1))
    return softmax_nll(B, pos, neg, hit, batch.weights)


def shared_softmax(B: Backend, user, items, batch: HSTUBatch, cfg, logq=None):
    """Every position against the same R negatives ``batch.shared_negatives[R]``: the negative
    logits are one ``[T, D] x [D, R]`` product instead of a ``[T, R, D]`` gather, and the R rows
    are looked up once per batch (``B.shared_logsumexp``: torch never materialises the whole
    ``[T, R]`` logits). ``logq[R]`` (or None) is subtracted from the negative logits. Negatives
    equal to the position's target (accidental hits), or the padding id, are masked."""
    xp = B.xp
    shared = batch.shared_negatives                                                            # [R]
    pos = positive_logits(B, user, items, batch.targets, cfg.temperature)                      # [T]
    neg_items = B.gather_table(items, shared)                                                  # [R, D]
    if cfg.negatives_precision != "fp32":  # the pool is one segment: one scale
        pool_max = B.stop_gradient(xp.max(xp.abs(neg_items)))
        neg_items = B.quantize_16bit(neg_items, xp.where(pool_max > 0, pool_max, xp.ones_like(pool_max)),
                                     cfg.negatives_precision)
    bias = xp.zeros(shared.shape, dtype=pos.dtype, device=B.array_device) if logq is None else xp.astype(logq, pos.dtype)
    lse = B.shared_logsumexp(user, neg_items, shared, batch.targets, pos, bias, 1.0 / cfg.temperature,
                             MASKED_LOGIT)
    nll = lse - xp.astype(pos, lse.dtype)
    total = xp.sum(batch.weights)
    return xp.sum(nll * batch.weights) / xp.maximum(total, xp.ones_like(total))


@register("in_batch", negatives="in_batch")
def in_batch(B: Backend, user, items, batch: HSTUBatch, cfg):
    """In-batch negatives with shared logits (TurboGR's intra-batch logit sharing): every position
    is scored against the same R items, targets of other positions of the batch
    (``batch.shared_negatives[R]``), one ``[T, D] x [D, R]`` matmul. In-batch negatives follow the
    item popularity of the batch (no logQ correction: popular items are pushed down more than
    under uniform sampling)."""
    return shared_softmax(B, user, items, batch, cfg)


@register("shared_pool", negatives="pool")
def shared_pool(B: Backend, user, items, batch: HSTUBatch, cfg):
    """One pool of R negatives per batch, drawn once from ``loss.sampler`` (uniform, or item
    popularity ** ``loss.popularity_alpha``) and shared by every position: one lookup of R rows
    and one ``[T, D] x [D, R]`` matmul, instead of GR's R private negatives per position (R row
    gathers per token). With ``loss.logq`` each negative's logit is corrected by
    ``-log(R q(id))`` (``batch.shared_logq``), so the pool's softmax estimates the full softmax."""
    return shared_softmax(B, user, items, batch, cfg, batch.shared_logq if cfg.logq else None)


@register("full_softmax", negatives="catalogue")
def full_softmax(B: Backend, user, items, batch: HSTUBatch, cfg):
    """Softmax cross-entropy over the whole catalogue: each position's target against every
    other item (``batch.shared_negatives`` = 1..N, the target itself masked out of the negatives
    and counted once as the positive), logits cosine / temperature. No sampling, so no bias to
    correct; the cost is a ``[T, D] x [D, N]`` product (``B.shared_logsumexp``: torch never holds
    the whole ``[T, N]`` logits). ``loss.num_negatives`` is not read."""
    return shared_softmax(B, user, items, batch, cfg)


@register("mixed_pool", negatives="mixed")
def mixed_pool(B: Backend, user, items, batch: HSTUBatch, cfg):
    """Mixed negative sampling (Yang et al., WWW 2020): ``loss.batch_negatives`` targets of the
    batch (in-batch positives: popular items, hard for the model) plus a pool of
    ``loss.num_negatives`` drawn from ``loss.sampler`` (the long tail in-batch draws miss), shared by
    every position. With ``loss.logq`` each negative's logit is corrected by the log of its
    expected count in that pool (``batch.shared_logq``)."""
    return shared_softmax(B, user, items, batch, cfg, batch.shared_logq if cfg.logq else None)
