"""The optimizer protocol, optax's, on ``B.xp``: a transform is a pair of pure functions.

    tx = chain(clip..., adamw(3e-3))                 # a GradientTransformation
    state = tx.init(B, params)                       # a pytree (dicts, lists, tuples of arrays)
    updates, state = tx.update(B, grads, state, params)
    params = apply_updates(B, params, updates)       # p + u, leaf by leaf

As optax does, with the backend ``B`` passed first: every array operation goes through ``B.xp``
(jax.numpy or array_api_compat's torch), so one transform runs on every backend, and nothing is
hidden in a closure but Python hyper-parameters. Trees are those of ``gr_functional.tree``
(nested dicts, lists, tuples, dataclasses; ``None`` is an empty subtree).

Conventions that make transforms compose and checkpoint:
- Counters (``"step"``) are 0-d floats in the master dtype (``B.float_dtype``), as AdamW's has
  always been (checkpoints store ``opt.step``): exact up to 2**24 updates in fp32.
- A skipped update (non-finite gradient, an accumulation micro-step) is ``-0.0`` everywhere, not
  ``0.0``: ``p + (-0.0) == p`` bit for bit for every ``p`` (``-0.0 + 0.0`` would be ``+0.0``), so
  "params unchanged" holds exactly.
- Decisions on array values are ``xp.where`` selections, never Python branches, so every update
  jits (JAX) and never syncs the device (torch); the price is that both sides are computed.
- Masks and labels (``masked``, ``partition``) are Python values (static), as in optax; a masked
  out leaf is ``None`` in what the inner transform sees, so it holds no state for it.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..tree import tree_items, tree_map
from ..contracts import Backend

Params = Any      # a tree of arrays
Updates = Any     # a tree like params
State = Any       # a tree of arrays (dicts keyed by name, so checkpoint paths read well)


class GradientTransformation(NamedTuple):
    """``init(B, params) -> state``; ``update(B, updates, state, params=None) -> (updates, state)``.

    Both pure: the same inputs give the same outputs, the inputs are not modified."""

    init: Callable[..., State]
    update: Callable[..., tuple]


def is_optax(tx) -> bool:
    """Is ``tx`` one of optax's objects (a transformation or chain: ``(init, update)`` without ``B``)?"""
    return type(tx).__module__.split(".")[0] == "optax"


def as_transform(tx) -> GradientTransformation:
    """``tx`` as this protocol: ours as it is; an object with ``init``/``update`` of ours' signature
    wrapped. An ``optax.GradientTransformation`` (no backend argument) is refused here, naming
    ``from_optax``: the entry points above this module (``grf.fit``) wrap optax objects themselves."""
    if isinstance(tx, GradientTransformation):
        return tx
    if is_optax(tx):
        raise TypeError("an optax transformation: wrap it with gr_functional.optimizers.from_optax(tx) "
                        "(JAX backend only)")
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return GradientTransformation(tx.init, tx.update)
    raise TypeError(f"not a gradient transformation (no init/update): {tx!r}")


# ----------------------------------------------------------------------------- tree helpers
def map_tree(fn: Callable, tree: Any, *rest: Any) -> Any:
    """``tree_map`` that also enters NamedTuples (optax's states are NamedTuples; ``tree_map`` keeps
    them whole) and leaves ``None`` where the first tree has one."""
    if tree is None:
        return None
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_tree(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree)))
    if isinstance(tree, dict):
        return {k: map_tree(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    return tree_map(fn, tree, *rest)   # dataclasses (static fields kept) and leaves


def select(B: Backend, ok, new: Any, old: Any) -> Any:
    """``new`` where the 0-d bool ``ok`` holds, else ``old``, leaf by leaf (``xp.where``: NaNs in
    the branch not taken are harmless, and it jits). Non-array leaves (Python numbers) of ``new``
    are kept."""
    xp = B.xp
    return map_tree(lambda n, o: xp.where(ok, n, o) if hasattr(n, "shape") else n, new, old)


def all_finite(B: Backend, tree: Any):
    """0-d bool: every element of every array leaf of ``tree`` is finite (``True`` for none)."""
    xp = B.xp
    ok = None
    for _, leaf in tree_items(tree):
        if not hasattr(leaf, "shape"):
            continue
        leaf_ok = xp.all(xp.isfinite(leaf))
        ok = leaf_ok if ok is None else xp.logical_and(ok, leaf_ok)
    return B.asarray(True) if ok is None else ok


def no_updates(B: Backend, updates: Updates) -> Updates:
    """``-0.0`` like every leaf of ``updates``: the update that leaves every parameter bit-identical
    (module docstring)."""
    xp = B.xp
    return tree_map(lambda u: -xp.zeros_like(u), updates)


def counter(B: Backend):
    """A fresh 0-d update counter: ``0.0`` in the master dtype."""
    return B.asarray(0.0, dtype=B.float_dtype)


# ----------------------------------------------------------------------------- applying
def apply_updates(B: Backend, params: Params, updates: Updates) -> Params:
    """``p + u`` per leaf, cast back to ``p``'s dtype (optax.apply_updates); ``None`` leaves of
    ``params`` stay ``None``."""
    xp = B.xp

    def add(p, u):
        out = p + u
        return out if out.dtype == p.dtype else xp.astype(out, p.dtype)

    return tree_map(add, params, updates)


# ----------------------------------------------------------------------------- elementary transforms
def identity() -> GradientTransformation:
    """Updates pass through unchanged; empty state ``()``."""
    return GradientTransformation(lambda B, params: (), lambda B, updates, state, params=None: (updates, state))


def scale(factor: float) -> GradientTransformation:
    """``u * factor`` (a Python number); empty state."""
    def update(B: Backend, updates, state, params=None):
        return tree_map(lambda u: u * factor, updates), state

    return GradientTransformation(lambda B, params: (), update)


def scale_by_schedule(schedule: Callable) -> GradientTransformation:
    """``u * schedule(xp, t)`` with ``t`` the 1-based update number (``schedules``: the convention
    of ``schedules.learning_rate``; optax calls its schedules with ``t - 1``). State ``{"step"}``."""
    def init(B: Backend, params):
        return {"step": counter(B)}

    def update(B: Backend, updates, state, params=None):
        step = state["step"] + 1.0
        factor = schedule(B.xp, step)
        return tree_map(lambda u: u * factor, updates), {"step": step}

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate, *, flip_sign: bool = True) -> GradientTransformation:
    """``-lr * u`` (descent) for a number or a schedule ``(xp, t) -> lr`` (optax's)."""
    if callable(learning_rate):
        sign = -1.0 if flip_sign else 1.0
        return scale_by_schedule(lambda xp, t: sign * learning_rate(xp, t))
    return scale(-learning_rate if flip_sign else learning_rate)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """``u + weight_decay * p`` (decoupled weight decay when it comes before the learning rate, as
    in optax.adamw); needs ``params``. Empty state."""
    def update(B: Backend, updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(B, updates, state, params)")
        return tree_map(lambda u, p: u + weight_decay * p, updates, params), state

    return GradientTransformation(lambda B, params: (), update)


# ----------------------------------------------------------------------------- combinators
def chain(*txs) -> GradientTransformation:
    """Apply ``txs`` in order, each to the updates of the one before; state: the tuple of their
    states (checkpoint paths ``0.…``, ``1.…``)."""
    txs = tuple(as_transform(t) for t in txs)

    def init(B: Backend, params):
        return tuple(t.init(B, params) for t in txs)

    def update(B: Backend, updates, state, params=None):
        new_state = []
        for t, s in zip(txs, state):
            updates, s = t.update(B, updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def _hide(tree: Any, keep: Any) -> Any:
    """``tree`` with ``None`` where the (static, Python) ``keep`` tree is false."""
    return tree_map(lambda x, k: x if k else None, tree, keep)


def _labels(labels_fn, tree: Any) -> Any:
    return labels_fn(tree) if callable(labels_fn) else labels_fn


def partition(transforms: dict, labels_fn) -> GradientTransformation:
    """One transform per label (optax.partition / multi_transform): ``labels_fn(params)`` (or a tree
    of labels) gives each leaf a label, a key of ``transforms``; each transform sees only its
    leaves (others are ``None``) and holds state only for them. State ``{label: state}``.

    Why: the dense parameters and a row-sparse table want different optimizers (AdamW beside
    row-wise Adagrad, DESIGN "Sparse side"), yet one state tree and one update call."""
    transforms = {k: as_transform(t) for k, t in transforms.items()}

    def check(labels):
        unknown = sorted({lab for _, lab in tree_items(labels)} - set(transforms))
        if unknown:
            raise ValueError(f"partition: labels {unknown} have no transform (transforms for: "
                             f"{', '.join(map(str, transforms))})")

    def init(B: Backend, params):
        labels = _labels(labels_fn, params)
        check(labels)
        return {lab: t.init(B, _hide(params, tree_map(lambda l, lab=lab: l == lab, labels)))
                for lab, t in transforms.items()}

    def update(B: Backend, updates, state, params=None):
        labels = _labels(labels_fn, updates)
        check(labels)
        outs, new_state = {}, {}
        for lab, t in transforms.items():
            mine = tree_map(lambda l, lab=lab: l == lab, labels)
            outs[lab], new_state[lab] = t.update(B, _hide(updates, mine), state[lab],
                                                 None if params is None else _hide(params, mine))
        order = {lab: i for i, lab in enumerate(transforms)}
        # each leaf's update from the transform of its label (the others hold None there)
        merged = tree_map(lambda lab, *per_label: per_label[order[lab]], labels, *(outs[k] for k in transforms))
        return merged, new_state

    return GradientTransformation(init, update)


def masked(tx, mask) -> GradientTransformation:
    """``tx`` on the leaves where ``mask`` (a tree of Python bools, or ``mask(params)``) is true;
    the other leaves' updates pass through unchanged (optax.masked). State: ``tx``'s, holding
    nothing for masked-out leaves."""
    tx = as_transform(tx)

    def init(B: Backend, params):
        return tx.init(B, _hide(params, _labels(mask, params)))

    def update(B: Backend, updates, state, params=None):
        keep = _labels(mask, updates)
        inner, state = tx.update(B, _hide(updates, keep), state, None if params is None else _hide(params, keep))
        return tree_map(lambda u, i, k: i if k else u, updates, inner, keep), state

    return GradientTransformation(init, update)


def apply_if_finite(tx, max_consecutive_errors: int | None = None) -> GradientTransformation:
    """``tx``, skipped while the incoming updates hold a NaN or Inf (optax.apply_if_finite): a
    skipped step returns ``-0.0`` updates (params bit-identical) and ``tx``'s state unchanged.
    After more than ``max_consecutive_errors`` non-finite steps in a row the update is applied
    anyway (optax's give-up rule); ``None`` never gives up.

    State ``{"notfinite_count", "last_finite", "total_notfinite", "inner"}`` (counts 0-d floats
    in the master dtype, ``last_finite`` 0-d bool). Both branches are computed and selected with
    ``xp.where`` (optax uses ``lax.cond``), so it jits on JAX and never syncs on torch."""
    tx = as_transform(tx)

    def init(B: Backend, params):
        return {"notfinite_count": counter(B), "last_finite": B.asarray(True),
                "total_notfinite": counter(B), "inner": tx.init(B, params)}

    def update(B: Backend, updates, state, params=None):
        xp = B.xp
        finite = all_finite(B, updates)
        bad = state["notfinite_count"] + 1.0
        count = xp.where(finite, xp.zeros_like(bad), bad)
        ok = finite if max_consecutive_errors is None else xp.logical_or(finite, count > max_consecutive_errors)
        new_updates, new_inner = tx.update(B, updates, state["inner"], params)
        total = state["total_notfinite"]
        return select(B, ok, new_updates, no_updates(B, new_updates)), {
            "notfinite_count": count, "last_finite": finite,
            "total_notfinite": xp.where(finite, total, total + 1.0),
            "inner": select(B, ok, new_inner, state["inner"])}

    return GradientTransformation(init, update)
