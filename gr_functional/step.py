"""The pure training step and the evaluation scorer.

``train_step(B, params, opt_state, batch, cfg) -> (params, opt_state, metrics)`` has no side
effects; ``make_train_step(B, cfg)`` returns it bound to a backend and config and jitted by
the backend (``jax.jit`` on JAX, eager on torch).

Everything a step needs beyond params lives in its arguments (docs/guides/reliability.md "Reliability"):

- ``batch`` is one ``HSTUBatch`` or a list of micro-batches (gradient accumulation,
  ``step.accumulate``). k micro-batches give the update of one batch holding all their
  sequences: each micro-batch's mean loss is weighted by its share of the supervised tokens,
  ``loss = sum_i n_i loss_i / sum_i n_i`` (n_i = ``sum(weights_i)``), the token-weighted mean
  that ``model.loss_fn`` computes over one big jagged batch. Gradients are combined the same way.
- ``cfg.backend.precision`` ("fp32" | "bf16" | "fp16"): params stay in the master dtype (fp32)
  and are cast to the compute dtype inside the differentiated function, so gradients come back
  in fp32 and the optimizer updates fp32 master weights. fp16 scales the loss by
  ``opt_state["loss_scale"]["scale"]`` (dynamic loss scaling, state in the optimizer pytree).
- NaN/Inf and divergence guard: when the loss, any gradient or the update is not finite, or the
  update moves the parameters by more than ``train.max_update_ratio`` of their norm, the step is
  skipped inside the function (``where(ok, new, old)`` on every leaf: params and optimizer state
  are returned unchanged) and ``metrics["finite"]`` is false; the runner logs it and counts bad
  steps. So no non-finite or exploded parameter ever leaves the step.

Data parallel: ``make_dist_train_step`` is one rank's step (torch, over a collective);
``rank_grads`` / ``rank_scales`` hold the math shared with the JAX reference
(``backends.dist_jax.make_sharded_train_step``): each rank's loss is normalised by the GLOBAL
supervised token count and the gradients are SUM-reduced.

metrics: ``loss`` (fp32 scalar, unscaled token-weighted mean), ``finite`` (bool: the update was
applied), ``loss_finite``, ``grads_finite``, ``update_finite`` (bools), ``update_ratio`` (fp32:
``||new - old|| / ||old||`` of the proposed update), ``tokens`` (supervised tokens, float), and
for fp16 ``loss_scale`` (the scale this step used).
"""
from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Callable

import numpy as np

from . import model
from .balance import rank_loss_weight
from .batch import HSTUBatch
from .config import Config, Precision, choices
from .embedding import rowopt
from .errors import ConfigError
from .embedding.lookup import Lookup, looked_up_rows
from .memory import peak_rss_bytes
from .optimizers import GradientTransformation, all_finite, apply_updates, update_loss_scale
from .optimizers import build as build_optimizer
from .optimizers.schedules import learning_rate
from .optimizers import init_loss_scale as _fresh_loss_scale
from .tree import tree_items, tree_map
from .contracts import Backend, RankComm

PRECISIONS = choices(Precision)
TABLE = "item_emb"  # the parameter a row-sparse embedding optimizer updates by rows
# opt_state keys the step keeps beside the dense optimizer's own (which come from optim.name)
STEP_KEYS = ("rows", "pending", "loss_scale")


def row_sparse(cfg: Config) -> bool:
    """The item table is updated by rows (``embedding.optimizer`` lazy_adam / rowwise_adagrad):
    batches then carry a ``Lookup`` and the dense optimizer's state leaves the table out
    (``embedding.optimizer = "adamw"`` means: the table is a dense parameter like the others)."""
    return cfg.embedding.optimizer != "adamw"


# ----------------------------------------------------------------------------- state
def dense_optimizer(B: Backend, cfg: Config) -> GradientTransformation:
    """The dense parameters' optimizer: ``optim.name`` from the registry (gr_functional/optimizers),
    its learning rate the ``optim.schedule``. Its state is a dict with ``"step"`` (the update count,
    which the row-sparse table's schedule reads too) and its moments (AdamW: ``"mu"``, ``"nu"``).
    Built once per (backend, ``[optim]``): ``apply_update`` asks for it at every step."""
    return _built_optimizer(B, cfg.optim)


@functools.lru_cache(maxsize=16)
def _built_optimizer(B: Backend, optim) -> GradientTransformation:
    return build_optimizer(B, optim)


def dense_state(opt_state: dict) -> dict:
    """The dense optimizer's part of ``opt_state`` (everything but ``STEP_KEYS``)."""
    return {k: v for k, v in opt_state.items() if k not in STEP_KEYS}


def _dense_init(B: Backend, params: dict, cfg: Config) -> dict:
    state = dense_optimizer(B, cfg).init(B, params)
    if not isinstance(state, dict) or "step" not in state or set(state) & set(STEP_KEYS):
        raise ConfigError(f"optim.name={cfg.optim.name!r}: grf train keeps the optimizer state as a dict with a "
                          f"'step' count and none of the keys {', '.join(STEP_KEYS)}; got "
                          f"{type(state).__name__} {sorted(state) if isinstance(state, dict) else ''}")
    return dict(state)


def init_opt_state(B: Backend, params: dict, cfg: Config) -> dict:
    """The dense optimizer's state (``dense_optimizer``; AdamW: ``{"step", "mu", "nu"}``), plus for fp16 the dynamic loss
    scaler ``{"loss_scale": {"scale": fp32 scalar, "good_steps": fp32 scalar}}``. With a
    row-sparse embedding optimizer, the dense optimizer covers the dense parameters only and ``"rows"`` holds
    the table's per-row state (``embedding.rowopt.init_row_state``) and, with
    ``embedding.staleness = k > 0``, ``"pending"``: the k row updates not yet applied
    (``rowopt.init_pending``)."""
    if row_sparse(cfg) and TABLE in params:  # (a row-sharded table keeps its state in its shards)
        table = params[TABLE]
        state = _dense_init(B, _dense(params), cfg)
        state["rows"] = rowopt.init_row_state(B, cfg.embedding.optimizer, table.shape[0], table.shape[1])
        if cfg.embedding.staleness:
            state["pending"] = rowopt.init_pending(B, cfg.embedding.staleness, table.shape[1])
    else:
        state = _dense_init(B, params, cfg)
    if cfg.backend.precision == "fp16":
        state["loss_scale"] = init_loss_scale(B, cfg)
    return state


def _dense(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != TABLE}


def init_loss_scale(B: Backend, cfg: Config) -> dict:
    """fp16's dynamic loss scaler at ``train.loss_scale`` (``optimizers.loss_scale``)."""
    return _fresh_loss_scale(B, cfg.train.loss_scale)


# ----------------------------------------------------------------------------- pieces
@dataclasses.dataclass(frozen=True)
class Objective:
    """What a task's step differentiates; the step around it (precision, loss scaling,
    accumulation, the guarded update) is shared by every task.

      loss(P, params, batch) -> scalar   the batch's mean loss, computed with ``P``: the backend, or
                                         its ``with_precision`` view (params and batch then cast)
      tokens(B, batch) -> scalar         what the mean is over (micro-batches are weighted by it)
      cast_batch(B, batch, dtype)        the batch with the float inputs that multiply activations
                                         in the compute dtype (labels and weights stay fp32)
    """

    loss: Callable
    tokens: Callable
    cast_batch: Callable


def retrieval_objective(cfg: Config) -> Objective:
    """The research HSTU's: ``model.loss_fn`` (the registered ``loss.name``) over ``sum(weights)``
    supervised tokens."""
    return Objective(loss=lambda P, params, batch: model.loss_fn(P, params, batch, cfg.model, loss=cfg.loss),
                     tokens=lambda B, batch: B.xp.sum(batch.weights), cast_batch=_cast_batch)


def _cast_batch(B: Backend, batch: HSTUBatch, dtype: str) -> HSTUBatch:
    """Dropout masks in the compute dtype (they multiply activations; 1/(1-p) = 1.25 is exact in
    bf16/fp16). ``weights`` stay fp32: they weight the fp32 loss."""
    return dataclasses.replace(
        batch,
        input_keep=None if batch.input_keep is None else B.cast(batch.input_keep, dtype),
        block_keep=None if batch.block_keep is None else B.cast(batch.block_keep, dtype))


def _loss(B: Backend, params: dict, batch, scale, cfg: Config, objective: Objective | None = None):
    """``(loss * scale, loss)``: the (scaled) objective to differentiate and the fp32 loss
    (``objective``: the task's, default ``retrieval_objective``).

    With a ``batch.lookup``, the step's rows that are not ``touched`` (padding, ids the table did
    not admit: they read the zero row) get no gradient: at a zero row the L2 normalisation's
    gradient is 1/l2_eps times the incoming one, which overflows fp16 although the row is never
    updated."""
    if batch.lookup is not None and TABLE in params:
        params = untouched_frozen(B, params, batch.lookup)
    objective = objective or retrieval_objective(cfg)
    precision = cfg.backend.precision
    if precision == "fp32":
        loss = objective.loss(B, params, batch)
    else:
        P = B.with_precision(precision)
        loss = objective.loss(P, B.cast_tree(params, P.compute_dtype_name),
                              objective.cast_batch(B, batch, P.compute_dtype_name))
        loss = B.cast(loss, B.dtype_name)
    return (loss if scale is None else loss * scale), loss


def untouched_frozen(B: Backend, view: dict, lookup) -> dict:
    """``view`` (``local_params``) with the rows ``lookup`` did not touch cut from the gradient
    (``_loss`` says why)."""
    xp = B.xp
    rows = view[TABLE]
    keep = xp.reshape(lookup.touched, (-1, 1))
    return {**view, TABLE: xp.where(keep, rows, B.stop_gradient(rows))}


def micro_grads(B: Backend, params: dict, opt_state: dict, batch, cfg: Config, objective: Objective | None = None):
    """``(loss, tokens, grads)`` of one (micro-)batch: the fp32 mean loss, its supervised token
    count (``objective.tokens``: ``sum(weights)`` for retrieval) and the unscaled gradients (a
    tree like params, master dtype)."""
    objective = objective or retrieval_objective(cfg)
    scale = opt_state["loss_scale"]["scale"] if "loss_scale" in opt_state else None
    loss_fn = partial(B.compiled(_loss), B, cfg=cfg, objective=objective)
    (_, loss), grads = B.value_and_grad(loss_fn, has_aux=True)(params, batch, scale)
    if scale is not None:
        grads = tree_map(lambda g: g / scale, grads)  # scale is a power of two: exact
    return loss, objective.tokens(B, batch), grads


def accumulate(B: Backend, acc, loss, tokens, grads):
    """Running token-weighted sums ``(sum n_i loss_i, sum n_i, sum n_i g_i)`` (acc None = empty)."""
    if acc is None:
        return loss * tokens, tokens, tree_map(lambda g: g * tokens, grads)
    a_loss, a_tok, a_grads = acc
    return a_loss + loss * tokens, a_tok + tokens, tree_map(lambda a, g: a + g * tokens, a_grads, grads)


def finish(B: Backend, acc):
    """``(loss, tokens, grads)`` of the union of the accumulated micro-batches: sums / total tokens
    (at least 1, as ``model.loss_fn`` divides by ``max(sum(weights), 1)``)."""
    xp = B.xp
    a_loss, a_tok, a_grads = acc
    denom = xp.maximum(a_tok, xp.ones_like(a_tok))
    return a_loss / denom, a_tok, tree_map(lambda g: g / denom, a_grads)


def update_health(B: Backend, params: dict, new_params: dict, new_adam: dict):
    """``(update_finite, update_ratio)`` of a proposed update, both 0-d: every new parameter and
    optimizer-state element is finite, and ``||new - old|| / ||old||`` over all parameters
    (global L2 norms, fp32). A finite gradient can still give a non-finite update (``optim.lr``
    NaN, a moment overflowing) or an exploding one (``optim.lr`` far too high); the guard checks
    the parameters themselves, not only the loss and gradients."""
    xp = B.xp
    sq_step = sq_old = None
    for (_, new), (_, old) in zip(tree_items(new_params), tree_items(params)):
        d = xp.sum((new - old) * (new - old))
        o = xp.sum(old * old)
        sq_step = d if sq_step is None else sq_step + d
        sq_old = o if sq_old is None else sq_old + o
    finite = xp.logical_and(xp.isfinite(sq_step), all_finite(B, new_adam))
    ratio = xp.sqrt(sq_step) / xp.maximum(xp.sqrt(sq_old), xp.full_like(sq_old, 1e-12))
    return finite, ratio


def apply_update(B: Backend, params: dict, opt_state: dict, loss, tokens, grads, cfg: Config, lookup=None, view=None,
                 others_ok=None):
    """The guarded optimizer update (``dense_optimizer``; row-sparse rows by ``embedding.optimizer``)
    and the loss-scale update: ``(params, opt_state, metrics)``.

    The update is applied only when the loss, every gradient and the update itself are finite
    and the update moves the parameters by at most ``train.max_update_ratio`` of their norm
    (``update_health``; 0 turns the ratio check off). Otherwise params and optimizer state come
    back unchanged and ``metrics["finite"]`` is false.

    With a ``lookup`` (row-sparse embeddings), ``grads`` are those of ``view`` (``local_params``:
    the table replaced by the step's rows): dense parameters get the dense optimizer, the looked-up rows the
    row-sparse optimizer (``sparse_update``), and the norms of the guard cover the dense
    parameters and the looked-up rows (not the untouched rest of the table). ``others_ok``: gradients
    not in ``grads`` are finite too (a row-sharded table's, checked on every rank)."""
    xp = B.xp
    loss_ok = xp.isfinite(loss)
    grads_ok = xp.logical_and(loss_ok, all_finite(B, grads))
    if others_ok is not None:
        grads_ok = xp.logical_and(grads_ok, others_ok)
    tx = dense_optimizer(B, cfg)
    adam = dense_state(opt_state)
    stale = lookup is not None and "pending" in opt_state
    if lookup is None:
        updates, new_adam = tx.update(B, grads, adam, params)
        new_params = apply_updates(B, params, updates)
        update_ok, ratio = update_health(B, params, new_params, new_adam)
    else:
        updates, new_adam = tx.update(B, _dense(grads), adam, _dense(params))
        new_dense = apply_updates(B, _dense(params), updates)
        if stale:  # this step's rows are refreshed now; the update applied is the oldest pending one
            table, row_state, pending = refresh_rows(B, params[TABLE], opt_state["rows"], opt_state["pending"],
                                                     view[TABLE], lookup)
            due = pending[0]
            applied = Lookup(due["rows"], due["rows"] > 0, xp.zeros(due["rows"].shape, dtype=xp.bool,
                                                                     device=B.array_device), None)
            old_rows, new_rows, old_state, new_state = sparse_update(
                B, row_state, B.gather_rows(table, due["rows"]), due["grads"], applied, new_adam["step"], cfg)
        else:
            old_rows, new_rows, old_state, new_state = sparse_update(B, opt_state["rows"], view[TABLE], grads[TABLE],
                                                                     lookup, new_adam["step"], cfg)
        update_ok, ratio = update_health(B, {**_dense(params), TABLE: old_rows}, {**new_dense, TABLE: new_rows},
                                         {**new_adam, "rows": new_state})
    ok = xp.logical_and(grads_ok, update_ok)
    if cfg.train.max_update_ratio > 0:
        ok = xp.logical_and(ok, ratio <= cfg.train.max_update_ratio)
    # skip a bad step: select the old leaves (NaNs in the unselected branch are harmless)
    keep = lambda new, old: xp.where(ok, new, old)  # noqa: E731
    if lookup is None:
        params = tree_map(keep, new_params, params)
        state = tree_map(keep, new_adam, adam)
    elif stale:
        # a skipped step drops its own row gradient and the pending one it would have applied
        table = B.set_rows(table, applied.rows, keep(new_rows, old_rows))
        rows_state = rowopt.scatter_state(B, row_state, applied.rows, tree_map(keep, new_state, old_state))
        mine = xp.where(xp.logical_and(lookup.touched, ok), lookup.rows, xp.zeros_like(lookup.rows))
        params = {**tree_map(keep, new_dense, _dense(params)), TABLE: table}
        state = {**tree_map(keep, new_adam, adam), "rows": rows_state,
                 # a skipped step's (non-finite) gradient is not kept: every checkpoint stays finite
                 "pending": [*pending[1:], {"rows": mine, "grads": keep(grads[TABLE], xp.zeros_like(grads[TABLE]))}]}
    else:
        # rows are written back even for a skipped step: fresh rows must hold their initial value
        table = B.set_rows(params[TABLE], lookup.rows, keep(new_rows, old_rows))
        rows_state = rowopt.scatter_state(B, opt_state["rows"], lookup.rows, tree_map(keep, new_state, old_state))
        params = {**tree_map(keep, new_dense, _dense(params)), TABLE: table}
        state = {**tree_map(keep, new_adam, adam), "rows": rows_state}
    metrics = {"loss": loss, "finite": ok, "loss_finite": loss_ok, "grads_finite": grads_ok,
               "update_finite": update_ok, "update_ratio": ratio, "tokens": tokens}
    if "loss_scale" in opt_state:
        # torch.amp.GradScaler's rule: halve on overflow, double after a window of clean steps;
        # a step rejected for its update (not an overflow) leaves the scale alone
        state["loss_scale"] = update_loss_scale(B, opt_state["loss_scale"], grads_ok, applied=ok,
                                                window=cfg.train.loss_scale_window)
        metrics["loss_scale"] = opt_state["loss_scale"]["scale"]
    return params, state, metrics



def local_params(B: Backend, params: dict, lookup) -> dict:
    """``params`` with the item table replaced by the step's rows ``[S, D]`` (``lookup.rows``;
    fresh rows at their initial value ``lookup.init``): what the model and its gradient see when
    the batch's ids are local indices."""
    return {**params, TABLE: looked_up_rows(B, params[TABLE], lookup)}


def sparse_update(B: Backend, row_state: dict, rows, grads, lookup, step, cfg: Config):
    """``(old_rows, new_rows, old_state, new_state)`` of the looked-up rows: the row-sparse
    optimizer (``embedding.optimizer``) at the scheduled learning rate of update ``step``
    (``embedding.lr`` as the base lr when set). Fresh rows start from a zero state."""
    xp = B.xp
    fresh = lookup.fresh
    old_state = tree_map(lambda s: xp.where(xp.reshape(fresh, (-1,) + (1,) * (s.ndim - 1)), xp.zeros_like(s), s),
                         rowopt.gather_state(B, row_state, lookup.rows))
    ocfg = dataclasses.replace(cfg.optim, lr=cfg.embedding.lr or cfg.optim.lr)
    lr = learning_rate(xp, step, ocfg)
    new_rows, new_state = rowopt.row_update(B, cfg.embedding.optimizer, rows, grads, old_state, lookup.touched,
                                            lr, ocfg)
    return rows, new_rows, old_state, new_state


def refresh_rows(B: Backend, table, row_state: dict, pending: list, rows, lookup):
    """``rowopt.refresh_rows`` for a step's ``lookup`` (its rows and fresh flags) and ``rows[S, D]``,
    the step's view of its rows: ``(table, row_state, pending)``; donates table and row_state."""
    return rowopt.refresh_rows(B, table, row_state, pending, rows, lookup.rows, lookup.fresh)


# ----------------------------------------------------------------------------- the step
def train_step(B: Backend, params: dict, opt_state: dict, batch, cfg: Config, objective: Objective | None = None):
    """One optimizer step on ``batch`` (an ``HSTUBatch``, or the ``objective``'s batch type, or a
    list of micro-batches). Pure."""
    batches = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    lookup = batches[0].lookup
    view = params if lookup is None else local_params(B, params, lookup)
    if len(batches) == 1:
        # one batch: its own mean loss and gradients, no re-weighting (bitwise the plain step)
        loss, tokens, grads = micro_grads(B, view, opt_state, batches[0], cfg, objective)
    else:
        acc = None
        for mb in batches:
            acc = accumulate(B, acc, *micro_grads(B, view, opt_state, mb, cfg, objective))
        loss, tokens, grads = finish(B, acc)
    return apply_update(B, params, opt_state, loss, tokens, grads, cfg, lookup=lookup, view=view)


def make_train_step(B: Backend, cfg: Config, objective: Objective | None = None):
    """``step(params, opt_state, batch | [micro-batches]) -> (params, opt_state, metrics)``.

    Computes ``train_step`` (of ``objective``, default the retrieval HSTU's). A single batch runs
    as one jitted program; micro-batches run one jitted gradient program per micro-batch (compiled
    once per capacity) and a running sum, so JAX never compiles a program per combination of
    micro-batch capacities and only one gradient tree is held besides the sum.
    """
    whole = B.jit(partial(train_step, B, cfg=cfg, objective=objective))
    grads_fn = B.jit(partial(micro_grads, B, cfg=cfg, objective=objective))
    first_fn = B.jit(partial(accumulate, B, None))
    acc_fn = B.jit(partial(accumulate, B))
    apply_fn = B.jit(lambda params, opt_state, acc, lookup, view: apply_update(
        B, params, opt_state, *finish(B, acc), cfg, lookup=lookup, view=view))
    view_fn = B.jit(partial(local_params, B))

    def step(params, opt_state, batch):
        if not isinstance(batch, (list, tuple)):
            return whole(params, opt_state, batch)
        if len(batch) == 1:
            return whole(params, opt_state, batch[0])
        lookup = batch[0].lookup
        view = params if lookup is None else view_fn(params, lookup)
        acc = None
        for mb in batch:
            part = grads_fn(view, opt_state, mb)
            acc = first_fn(*part) if acc is None else acc_fn(acc, *part)
        return apply_fn(params, opt_state, acc, lookup, view)

    return step


# ----------------------------------------------------------------------------- data parallel
# N ranks compute the single-process update (docs/guides/distributed.md "Distributed training"). Rank r holds
# micro-batches i with n_ri supervised tokens out of G in the whole (accumulated) global batch.
# It differentiates loss_ri * n_ri / G (its sum of token losses over the GLOBAL count, the factor
# ``balance.rank_loss_weight(G, R, grad_reduce="sum")``), so a SUM all-reduce of the gradients
# gives the gradient of the global token-weighted mean loss whatever the per-rank token counts;
# normalising by the local count instead would over-weight tokens on ranks that hold few.
def rank_scales(tokens, global_tokens: float, world_size: int) -> list[float]:
    """``[n_i / G]``: the weight of each local micro-batch's mean loss (host floats)."""
    w = rank_loss_weight(global_tokens, world_size, grad_reduce="sum") if global_tokens > 0 else 0.0
    return [float(n) * w for n in tokens]


def rank_grads(B: Backend, params: dict, opt_state: dict, micro, scales, cfg: Config, vg=None, last_vg=None,
               objective: Objective | None = None):
    """``(loss_part, grads_part)`` of this rank, before the SUM over ranks: ``sum_i scales[i] *
    loss_i`` (fp32 scalar) and the gradient of the same sum (a tree like params, unscaled).

    micro: local HSTUBatches; scales: ``rank_scales`` (or device scalars, under JAX tracing).
    ``vg`` differentiates ``_loss`` locally (default ``B.value_and_grad``); ``last_vg``, if
    given, is used for the last micro-batch with ``prior=`` the earlier ones' gradient sum and
    must return the REDUCED sum (the torch collective's overlapped all-reduce). Then the
    returned grads are already summed over ranks, the loss part is not. ``objective``: the task's
    (default the retrieval HSTU's), for the default ``vg``."""
    loss_fn = partial(_loss, B, cfg=cfg, objective=objective)
    vg = vg or B.value_and_grad(loss_fn, has_aux=True)
    ls = opt_state["loss_scale"]["scale"] if "loss_scale" in opt_state else None
    loss_part, acc = None, None
    for i, (mb, sc) in enumerate(zip(micro, scales)):
        obj_scale = sc if ls is None else ls * sc
        if last_vg is not None and i == len(micro) - 1:
            (_, loss), acc = last_vg(params, mb, obj_scale, prior=acc)
        else:
            (_, loss), g = vg(params, mb, obj_scale)
            acc = g if acc is None else tree_map(lambda a, b: a + b, acc, g)
        part = loss * sc
        loss_part = part if loss_part is None else loss_part + part
    if ls is not None:
        acc = tree_map(lambda g: g / ls, acc)  # a power of two: exact, also after the sum
    return loss_part, acc


def make_dist_train_step(B: Backend, cfg: Config, comm: RankComm, objective: Objective | None = None):
    """``step(params, opt_state, micro, tokens, global_tokens) -> (params, opt_state, metrics)``
    for one rank of a torch data-parallel run (``comm``: backends.dist_torch.TorchCollective) of
    ``objective`` (the task's; default the retrieval HSTU's, as ``make_train_step``).

    micro: this rank's micro-batches (HSTUBatch on B; a rank may hold none of a global batch's
    sequences, then an empty one); tokens: their supervised token counts (host floats);
    global_tokens: supervised tokens of all ranks' micro-batches of this step. Gradients are
    all-reduced in buckets during the last micro-batch's backward; the loss and per-rank compute
    times in one small all-reduce after it. Every rank then holds the same gradients and loss,
    so the NaN guard and the fp16 scaler decide the same everywhere and params stay identical.

    metrics as ``train_step`` plus host floats ``compute_s`` (this rank's forward+backward wall
    seconds), ``wait_s`` (waiting for gradients after it), ``rank_compute_s`` and
    ``rank_cpu_s`` (lists over ranks: wall and main-thread CPU seconds of forward+backward; CPU
    time is what a rank's work costs even when a shared machine preempts it) and
    ``rank_peak_rss_mb`` (each rank's peak resident memory so far, MiB).
    """
    loss_fn = partial(_loss, B, cfg=cfg, objective=objective)
    local_vg = B.value_and_grad(loss_fn, has_aux=True)
    reduced_vg = comm.value_and_grad(B, loss_fn, has_aux=True)
    R = comm.world_size

    def step(params, opt_state, micro, tokens, global_tokens):
        comm.start_step()
        scales = rank_scales(tokens, global_tokens, R)
        lookup = micro[0].lookup
        view = params if lookup is None else local_params(B, params, lookup)
        loss_part, grads = rank_grads(B, view, opt_state, list(micro), scales, cfg, vg=local_vg,
                                      last_vg=reduced_vg)
        compute, cpu, wait = comm.step_times()
        row = np.zeros(1 + 3 * R)
        row[0] = float(loss_part)
        row[1 + comm.rank] = compute
        row[1 + R + comm.rank] = cpu
        row[1 + 2 * R + comm.rank] = peak_rss_bytes() / 2**20
        row = comm.all_reduce_sum(row)
        loss = B.asarray(row[0], dtype=B.float_dtype)
        params, opt_state, metrics = apply_update(B, params, opt_state, loss, B.asarray(float(global_tokens)),
                                                  grads, cfg, lookup=lookup, view=view)
        metrics.update(compute_s=compute, wait_s=wait,
                       rank_compute_s=[float(x) for x in row[1:1 + R]],
                       rank_cpu_s=[float(x) for x in row[1 + R:1 + 2 * R]],
                       rank_peak_rss_mb=[float(x) for x in row[1 + 2 * R:]])
        return params, opt_state, metrics

    return step


def make_sharded_dist_step(B: Backend, cfg: Config, comm: RankComm, table, objective: Objective | None = None):
    """``step(params, opt_state, micro, tokens, global_tokens, rows, pending, ahead=None)`` for one
    rank of a data-parallel run whose item table is row-sharded (``embedding.sharding = "row"``;
    ``table``: this rank's ``embedding.sharding.ShardedTable``).

    ``params`` holds the dense parameters only; ``rows[U + 1, D]`` are the rows of this rank's
    micro-batches' ids (local index 0 the zero padding row), looked up from their owners
    (``table.lookup``, which left ``pending``). Dense gradients are all-reduced as in
    ``make_dist_train_step``; the rows' gradients stay local and go to the owners
    (``table.update``), which sum them over ranks and apply the row-sparse optimizer. The step
    is skipped everywhere when any rank's row gradients are not finite. The dense optimizer and the guard
    see the dense parameters (the update ratio leaves the rows out).

    ``ahead`` (staleness k >= 1, ``execution.RankSteps``): called at the start with the first half of
    the table's update (``table.land``, which needs nothing this step computes), it runs it
    elsewhere (with the next step's lookup) and returns a function waiting for it; the step then
    only ``table.queue``s its gradients. The result is the same as without it. ``objective``: as
    ``make_dist_train_step``'s."""
    loss_fn = partial(_loss, B, cfg=cfg, objective=objective)
    local_vg = B.value_and_grad(loss_fn, has_aux=True)
    reduced_vg = comm.value_and_grad(B, loss_fn, has_aux=True, local=(TABLE,))
    R = comm.world_size
    ocfg = dataclasses.replace(cfg.optim, lr=cfg.embedding.lr or cfg.optim.lr)

    def step(params, opt_state, micro, tokens, global_tokens, rows, pending, ahead=None):
        xp = B.xp
        lr = learning_rate(xp, opt_state["step"] + 1.0, ocfg)  # this update's (unused when skipped)
        landed = ahead(lambda: table.land(pending, lr, ocfg)) if ahead is not None else None
        comm.start_step()
        scales = rank_scales(tokens, global_tokens, R)
        view = {**params, TABLE: rows}
        loss_part, grads = rank_grads(B, view, opt_state, list(micro), scales, cfg, vg=local_vg, last_vg=reduced_vg)
        row_grads = grads.pop(TABLE)[1:]
        compute, cpu, wait = comm.step_times()
        vec = np.zeros(2 + 3 * R)
        vec[0] = float(loss_part)
        vec[1] = 0.0 if bool(all_finite(B, row_grads)) else 1.0
        vec[2 + comm.rank] = compute
        vec[2 + R + comm.rank] = cpu
        vec[2 + 2 * R + comm.rank] = peak_rss_bytes() / 2**20
        vec = comm.all_reduce_sum(vec)
        loss = B.asarray(vec[0], dtype=B.float_dtype)
        params, opt_state, metrics = apply_update(B, params, opt_state, loss, B.asarray(float(global_tokens)),
                                                  grads, cfg, others_ok=B.asarray(bool(vec[1] == 0)))
        if landed is None:
            table.update(pending, row_grads, lr, ocfg, ok=metrics["finite"])
        else:
            landed()
            table.queue(pending, row_grads, ok=metrics["finite"])
        metrics.update(compute_s=compute, wait_s=wait, rank_compute_s=[float(x) for x in vec[2:2 + R]],
                       rank_cpu_s=[float(x) for x in vec[2 + R:2 + 2 * R]],
                       rank_peak_rss_mb=[float(x) for x in vec[2 + 2 * R:]])
        return params, opt_state, metrics

    return step


# ----------------------------------------------------------------------------- evaluation
def score(B: Backend, params: dict, batch: HSTUBatch, cfg: Config):
    """``[B_cap, N+1]`` scores of every item at the last position of each history, computed in
    ``backend.precision`` (returned in the master dtype). Pure; ``make_scorer`` jits it."""
    precision = cfg.backend.precision
    if precision == "fp32":
        return model.score_last(B, params, batch, cfg.model)
    P = B.with_precision(precision)
    scores = model.score_last(P, B.cast_tree(params, P.compute_dtype_name), batch, cfg.model)
    return B.cast(scores, B.dtype_name)


def make_scorer(B: Backend, cfg: Config):
    """``scores = scorer(params, batch)`` -> [B_cap, N+1] for the last position of each history,
    computed in ``backend.precision`` (returned in the master dtype)."""
    return B.jit(partial(score, B, cfg=cfg))
