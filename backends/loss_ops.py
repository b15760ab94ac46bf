"""The loss's fused ops: ops "sampled_logits" and "shared_logsumexp" of the op registry
(backends/ops.py), selected by ``ops.sampled_logits`` / ``ops.shared_logsumexp``.

- ``reference``: the backend's own formulation of ``Backend.sampled_logits_reference`` /
  ``shared_logsumexp_reference`` (plain ``B.xp`` code; on torch, row-chunked autograd Functions that
  never hold the whole ``[T, N]`` scores or ``[T, R, D]`` rows); every backend.
- ``cpu_fused``: the fused C++ ops of backends/cpu_fused (on CPU, fp32/fp64 arrays; the 16-bit
  negatives in fp32): one dot per (position, id) read straight from the item rows, each logits
  block masked and reduced while in cache. torch runs them as an extension; jax runs the sampled
  logits (16-bit negatives too) as XLA FFI custom calls (``backends.cpu_fused.xla``; the shared
  pool is torch's only). A call it cannot serve (a dtype) raises ``UnsupportedOnBackend``
  naming it.
- ``best`` (the torch and jax default): ``cpu_fused`` for the calls it serves where the ops build
  (a failed build is reported once, as a warning), and for the sampled logits where the catalogue
  has enough rows per negative (``Backend.sampled_per_id_pays``: with negatives numbering a
  quarter of the catalogue or more, JAX's dense product is faster; torch's from a half); else
  ``reference``.
"""
from __future__ import annotations

from gr_functional.errors import UnsupportedOnBackend

from . import cpu_fused, ops


@ops.register("sampled_logits", "reference")
def sampled_reference(B, user, items, ids, scale=None, precision=None):
    """The backend's own formulation (``B.xp``; torch: row-chunked): the oracle."""
    if scale is None:
        return B.sampled_logits_reference(user, items, ids)
    return B.sampled_logits_16bit_reference(user, items, ids, scale, precision)


@ops.register("shared_logsumexp", "reference")
def shared_reference(B, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit):
    """The backend's own formulation (``B.xp``; torch: row-chunked): the oracle."""
    return B.shared_logsumexp_reference(user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit)


def _fused_takes(B, *arrays) -> bool:
    """Whether the fused C++ ops serve a call on ``arrays``: fp32 or fp64 CPU arrays of one dtype."""
    dtype, front = arrays[0].dtype, cpu_fused.ops_for(B)
    return B._dtype_name_of(arrays[0]) in ("float32", "float64") and all(
        a.dtype == dtype and front.on_cpu(a) for a in arrays)


def _fused_sampled(B, user, items, ids, scale=None, precision=None):
    front = cpu_fused.ops_for(B)
    if scale is None:
        return front.sampled_logits(user, items, ids)
    return front.sampled_logits_16bit(user, items, ids, scale, precision)


def _sampled_served(B, user, items, scale) -> bool:
    if scale is None:
        return _fused_takes(B, user, items)
    return B._dtype_name_of(user) == "float32" and _fused_takes(B, user, items, scale)


def _on_cpu(B) -> None:
    if B.device_kind != "cpu":
        raise UnsupportedOnBackend(f"the cpu_fused ops run on the CPU, not on {B.device_kind!r}")
    cpu_fused.ops_for(B).load()


def _strict_sampled(B):
    _on_cpu(B)

    def fused(B, user, items, ids, scale=None, precision=None):
        if not _sampled_served(B, user, items, scale):
            raise UnsupportedOnBackend(f"ops.sampled_logits='cpu_fused' takes fp32/fp64 CPU arrays (fp32 with 16-bit "
                                       f"negatives), got {user.dtype} on {user.device}; use 'best' or 'reference'")
        return _fused_sampled(B, user, items, ids, scale, precision)

    return fused


def _strict_shared(B):
    _on_cpu(B)

    def fused(B, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit):
        if not _fused_takes(B, user, neg_items, pos, neg_bias):
            raise UnsupportedOnBackend(f"ops.shared_logsumexp='cpu_fused' takes fp32/fp64 CPU tensors, got "
                                       f"{user.dtype} on {user.device}; use 'best' or 'reference'")
        return cpu_fused.shared_logsumexp(user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit)

    return fused


def _best_sampled(B):
    on = B.device_kind == "cpu" and cpu_fused.available(B=B)

    def best(B, user, items, ids, scale=None, precision=None):
        if on and B.sampled_per_id_pays(items, ids) and _sampled_served(B, user, items, scale):
            return _fused_sampled(B, user, items, ids, scale, precision)
        return sampled_reference(B, user, items, ids, scale, precision)

    return best


def _best_shared(B):
    on = B.device_kind == "cpu" and cpu_fused.available()

    def best(B, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit):
        if on and _fused_takes(B, user, neg_items, pos, neg_bias):
            return cpu_fused.shared_logsumexp(user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit)
        return shared_reference(B, user, neg_items, neg_ids, targets, pos, neg_bias, scale, masked_logit)

    return best


# fp32 compute only: under a bf16/fp16 precision view the activations are 16-bit, which the fused
# ops do not take ("best" then runs the reference)
_FUSED = dict(devices=("cpu",), precisions=("fp32",))
ops.register("sampled_logits", "cpu_fused", factory=_strict_sampled, backends=("torch", "jax"), **_FUSED,
             doc="fused C++: one dot per (position, id) from the item rows (CPU; torch, jax by XLA FFI)")
ops.register("shared_logsumexp", "cpu_fused", factory=_strict_shared, backends=("torch",), **_FUSED,
             doc="fused C++: each block's logits, mask and logsumexp in one pass in cache (torch CPU)")
ops.register("sampled_logits", "best", factory=_best_sampled, backends=("torch", "jax"),
             doc="cpu_fused for the calls it serves where it builds, else reference")
ops.register("shared_logsumexp", "best", factory=_best_shared, backends=("torch",),
             doc="cpu_fused for the calls it serves where it builds, else reference")
