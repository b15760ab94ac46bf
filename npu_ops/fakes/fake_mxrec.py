"""A FAKE of RecSDK's ``torch.ops.mxrec.hstu_jagged``, written from its documentation.

What it is: plain torch, one sequence at a time, with autograd from torch, implementing OUR
READING of the documented semantics (RecSDK ``cust_op/ascendc_op/ai_core_op/hstu_dense_forward/
README.md``, ``cust_op/framework/torch_plugin/torch_library/hstu/README.md``,
``docs/en/rec_ops/hstu_v1_forward.md``; npu_ops/README.md)::

    HSTU(q, k, v, mask, bias, siluScale) = (SiLU(q k^T + bias) * siluScale * mask) v
    jagged q/k/v [ΣS, N, D] split by seq_offset [B+1] (int32/int64, starting at 0)
    attn_bias [B, N, S, S] indexed by in-sequence positions, S = max_seq_len, dtype = q dtype
    mask_type 0: built-in lower-triangular mask, diagonal included; 2: no mask; 3: mask [B, N, S, S]
    silu_scale == 0 means 1 / max_seq_len; max_seq_len in [1, 20480] (checked in the C++ op)

It is registered with the op's real schema string (copied from RecSDK's ``hstu_jagged.cpp``
``m.def``) in its own namespace, so calls go through torch's real schema binding.

What it proves: that the adapter (npu_ops/mxrec_hstu.py) passes arguments whose documented
meaning reproduces our reference attention, in outputs and gradients, and that keyword names
bind to the documented schema.

What it does NOT prove: that the Ascend kernel behaves as documented (numerics, rounding,
accumulation dtype, layouts, limits, determinism, whether empty sequences are accepted),
or anything about speed. Those need tests/npu on Ascend hardware. Where the docs are silent
the fake refuses rather than guesses: ``alpha != 1`` (placement undocumented), context/target
masks (num_context/num_target). It is stricter than the docs in one place: the offsets must
cover exactly the rows passed (``seq_offset[-1] == q.shape[0]``). It also accepts float64,
which the kernel does not, so the translation can be checked at float64 precision.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FAKE_NAMESPACE = "grf_fake_mxrec"

# Copied from Ascend/RecSDK cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp
# (m.def of hstu_jagged.equal), deliberately not imported from the adapter's pin.
DOCUMENTED_SCHEMA = (
    "hstu_jagged.equal(Tensor q, Tensor k, Tensor v, Tensor? mask=None, Tensor? attn_bias=None, "
    "int mask_type=0, int max_seq_len=0, float silu_scale=0.0, Tensor seq_offset=None, "
    "Tensor? num_context=None, Tensor? num_target=None, int? target_group_size=0, "
    "float? alpha=1.0, bool deterministic=False) -> Tensor")

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: fake only
_MAX_SEQ_LEN = 20480  # hstu_common.h MaxSeqLenCheck


class FakeMxrecError(ValueError):
    """The fake refused a call that the documentation forbids (or leaves undefined)."""


def hstu_jagged(q, k, v, mask=None, attn_bias=None, mask_type=0, max_seq_len=0, silu_scale=0.0,
                seq_offset=None, num_context=None, num_target=None, target_group_size=0, alpha=1.0,
                deterministic=False):
    """The documented ``hstu_jagged`` in plain torch. Shapes: q[ΣS, Nq, D], k[ΣS, Nk, D],
    v[ΣS, Nk, Dv], seq_offset[B+1] int; returns [ΣS, Nq, Dv] in q's dtype. Defaults equal the
    schema's, because the dispatcher drops trailing arguments equal to their defaults."""
    def need(cond, what):
        if not cond:
            raise FakeMxrecError(f"fake mxrec.hstu_jagged: {what}")

    need(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be 3-D in the jagged layout")
    need(q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype,
         f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must be one float32/float16/bfloat16 dtype "
         "(float64 is accepted by this fake only)")
    total, nq, d = q.shape
    nk = k.shape[1]
    need(k.shape[0] == total and v.shape[0] == total and k.shape[2] == d and v.shape[1] == nk,
         f"shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} disagree")
    need(nq % nk == 0, f"GQA needs N_q % N_k == 0, got {nq} and {nk}")
    need(1 <= max_seq_len <= _MAX_SEQ_LEN, f"max_seq_len expect in [1, 20480], got {max_seq_len}")
    need(mask_type in (0, 2, 3), f"mask_type must be 0 (causal), 2 (none) or 3 (custom), got {mask_type}")
    need(alpha is None or float(alpha) == 1.0, "alpha != 1 is not modelled: its placement is undocumented")
    need(num_context is None and num_target is None,
         "context/target masks (num_context/num_target) are not modelled by this fake")
    need(isinstance(seq_offset, torch.Tensor) and seq_offset.dim() == 1 and seq_offset.numel() >= 2
         and seq_offset.dtype in (torch.int32, torch.int64), "seq_offset must be an int32/int64 [B+1] tensor")
    offs = [int(x) for x in seq_offset.tolist()]
    batch = len(offs) - 1
    need(offs[0] == 0, f"seq_offset must start at 0, got {offs[0]}")
    need(all(b >= a for a, b in zip(offs, offs[1:])), f"seq_offset must be non-decreasing: {offs}")
    need(offs[-1] == total, f"seq_offset[-1]={offs[-1]} must equal the {total} rows passed")
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    need(max(lengths) <= max_seq_len, f"a sequence of length {max(lengths)} exceeds max_seq_len={max_seq_len}")
    dense_shape = (batch, nq, max_seq_len, max_seq_len)
    if attn_bias is not None:
        need(tuple(attn_bias.shape) == dense_shape,
             f"attn_bias must be [B, N, S, S] = {list(dense_shape)}, got {list(attn_bias.shape)}")
        need(attn_bias.dtype == q.dtype, f"attn_bias dtype {attn_bias.dtype} must equal q's {q.dtype}")
    if mask_type == 3:
        need(mask is not None and tuple(mask.shape) == dense_shape,
             f"mask_type 3 needs a mask [B, N, S, S] = {list(dense_shape)}")
    scale = 1.0 / max_seq_len if silu_scale == 0.0 else float(silu_scale)

    rep = nq // nk
    pieces = []
    for b, (start, length) in enumerate(zip(offs, lengths)):
        if length == 0:
            continue
        qb = q[start:start + length].transpose(0, 1)                                  # [Nq, Lb, D]
        kb = k[start:start + length].repeat_interleave(rep, dim=1).transpose(0, 1)    # [Nq, Lb, D]
        vb = v[start:start + length].repeat_interleave(rep, dim=1).transpose(0, 1)    # [Nq, Lb, Dv]
        scores = qb @ kb.transpose(1, 2)                                              # [Nq, Lb, Lb]
        if attn_bias is not None:
            scores = scores + attn_bias[b, :, :length, :length]
        probs = F.silu(scores) * scale
        if mask_type == 0:
            probs = probs * torch.tril(torch.ones(length, length, dtype=probs.dtype, device=probs.device))
        elif mask_type == 3:
            probs = probs * mask[b, :, :length, :length].to(probs.dtype)
        pieces.append((probs @ vb).transpose(0, 1))                                   # [Lb, Nq, Dv]
    return torch.cat(pieces, dim=0)


_LIBRARIES: dict[str, Any] = {}  # namespace -> torch.library.Library (kept alive)


def fake_mxrec_ops(namespace: str = FAKE_NAMESPACE, schema: str = DOCUMENTED_SCHEMA, impl=hstu_jagged):
    """Register the fake as ``torch.ops.<namespace>.hstu_jagged`` (once per namespace) and
    return the namespace, a drop-in for ``torch.ops.mxrec``. ``schema``/``impl`` let tests
    register a drifted schema (``impl=None`` registers the schema only)."""
    if namespace not in _LIBRARIES:
        if namespace == "mxrec":
            raise ValueError("refusing to register a fake under the real 'mxrec' namespace")
        lib = torch.library.Library(namespace, "DEF")
        lib.define(schema)
        if impl is not None:
            # CompositeImplicitAutograd: the body is plain torch, so autograd comes for free.
            lib.impl(schema.split("(", 1)[0], impl, "CompositeImplicitAutograd")
        _LIBRARIES[namespace] = lib
    return getattr(torch.ops, namespace)


class _RecordingOverload:
    def __init__(self, target, calls):
        self._target, self._calls = target, calls

    @property
    def _schema(self):
        return self._target._schema

    def __call__(self, *args, **kwargs):
        self._calls.append({"args": args, "kwargs": dict(kwargs)})
        return self._target(*args, **kwargs)


class _RecordingPacket:
    def __init__(self, packet, calls):
        self._packet, self._calls = packet, calls

    def overloads(self):
        return self._packet.overloads()

    def __getattr__(self, name):
        return _RecordingOverload(getattr(self._packet, name), self._calls)

    def __call__(self, *args, **kwargs):
        self._calls.append({"args": args, "kwargs": dict(kwargs)})
        return self._packet(*args, **kwargs)


class RecordingOps:
    """Wraps an ops namespace (default: the fake) and records every ``hstu_jagged`` call's
    positional and keyword arguments exactly as the adapter passed them, in ``calls``."""

    def __init__(self, ops=None):
        self._ops = fake_mxrec_ops() if ops is None else ops
        self.calls: list[dict] = []

    @property
    def hstu_jagged(self):
        return _RecordingPacket(self._ops.hstu_jagged, self.calls)
