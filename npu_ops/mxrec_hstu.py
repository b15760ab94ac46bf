"""Adapter: our jagged HSTU attention contract -> RecSDK's ``torch.ops.mxrec.hstu_jagged``.

Our contract (``backends.base.Backend.hstu_attention``, bias computed by ``relative_bias``)::

    q[T_cap, H, dqk], k[T_cap, H, dqk], v[T_cap, H, dv], layout: Jagged, n: int, bias[B_cap|1, L, L] | None
    out[T_cap, H, dv]:  out_i = sum_{j <= i, same sequence} SiLU(q_i . k_j + bias[b, i, j]) / n * v_j
                        (zeros on padding rows; bias is shared by all heads)

The kernel (RecSDK ``cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp`` and its
README; npu_ops/README.md)::

    hstu_jagged(q[ΣS, N, D], k, v, mask=None, attn_bias[B, N, S, S]=None, mask_type=0,
                max_seq_len=S, silu_scale, seq_offset[B+1], ..., alpha=1.0) -> [ΣS, N, Dv]
    HSTU = (SiLU(q k^T + bias) * silu_scale * mask) v,   silu_scale == 0 means 1/max_seq_len

Translation (each line is checked against a fake of the documented semantics in
tests/npu_ops/test_mxrec_adapter.py; none of it has run on Ascend hardware):

- rows: only the T = offsets[-1] real tokens are passed (``q[:T]``); the output is padded back to
  T_cap rows with zeros.
- sequences: empty sequences (trailing capacity slots, and any zero-length sequence) are dropped,
  because the kernel docs say no B/S/N/D dimension may be 0; ``seq_offset`` is int64 [B+1] of
  the non-empty sequences, starting at 0.
- ``silu_scale = 1/n`` is ALWAYS passed: the kernel's default 0 means 1/max_seq_len, and our n
  (GR: max_len + max_output_len) is not max_seq_len.
- ``mask_type = 0``: the built-in lower-triangular causal mask (diagonal included) = our j <= i.
- ``max_seq_len = S = layout.max_len``: the bias is documented as [B, N, S, S] with S the model's
  maximum sequence length, and our bias is [B_cap, L, L] with L = layout.max_len, indexed by
  in-sequence positions, so S = L makes the two index the same cells. (It also bounds every
  sequence, which Jagged guarantees.)
- ``attn_bias``: ours is shared by heads and may be [1, L, L]; the kernel does not broadcast rab
  (docs/en/rec_ops/hstu_v1_forward.md), so it is expanded to a contiguous [B, H, L, L] in q's
  dtype (the docs require the bias dtype to equal q's). Autograd through the expand sums the
  kernel's per-head bias gradient back to our shared bias.
- ``alpha = 1.0`` explicitly (its placement is not in the documented formula).

Cost note: the host needs the offsets to size the trimmed tensors, so each call copies
``layout.offsets`` to the host once (a device sync on NPU).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ._errors import MxrecSchemaError, UnsupportedOnBackend

# ----------------------------------------------------------------------------------------
# Documented limits: the ONE place they live. Sources are paths in the Ascend/RecSDK repository
# (npu_ops/README.md). None is verified on hardware.
_SRC_README = "Ascend/RecSDK cust_op/framework/torch_plugin/torch_library/hstu/README.md (Atlas A2/A3 table)"
_SRC_DOC = "Ascend/RecSDK docs/en/rec_ops/hstu_v1_forward.md (inputs table)"
_SRC_CHECK = "Ascend/RecSDK cust_op/framework/torch_plugin/torch_library/hstu/hstu_common.h (MaxSeqLenCheck)"

LIMIT_SOURCES = {
    "dtype": f"{_SRC_README}; {_SRC_DOC}: q/k/v float32/float16/bfloat16, bias dtype = q dtype",
    "batch": f"{_SRC_README}; {_SRC_DOC}: B in [1, 2048]",
    "max_seq_len": f"{_SRC_CHECK} (TORCH_CHECK in the op); {_SRC_README}: S in [1, 20480]",
    "heads": (f"{_SRC_DOC}: N_q in [1, 16] (the older {_SRC_README} says N in [2, 8] and even for "
              "hstu_dense; RecSDK's jagged tests use 1, 7 and 16 heads)"),
    "head_dim_qk": (f"{_SRC_README}: D in [16, 512] and a multiple of 16 (the newer {_SRC_DOC} relaxes "
                    "D_q to [1, 512]; the stricter rule is kept until verified on hardware)"),
    "head_dim_v": f"{_SRC_README}; {_SRC_DOC}: D_v in [16, 512] and a multiple of 16",
}


@dataclasses.dataclass(frozen=True)
class HstuJaggedLimits:
    """Documented limits of ``mxrec.hstu_jagged`` on Atlas A2/A3 (sources: ``LIMIT_SOURCES``).

    Tests may widen ``dtypes`` (e.g. add "float64") to check the translation against the fake
    at float64 precision; the real kernel has no float64.
    """

    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    batch: tuple[int, int] = (1, 2048)
    max_seq_len: tuple[int, int] = (1, 20480)
    heads: tuple[int, int] = (1, 16)
    head_dim: tuple[int, int] = (16, 512)
    head_dim_multiple: int = 16


HSTU_JAGGED_LIMITS = HstuJaggedLimits()

# ----------------------------------------------------------------------------------------
# Schemas this adapter was written against, verbatim from the op registration. RecSDK changes
# the schema between releases (README examples show max_seq_len_k/seq_offset_k keywords that
# this registration lacks), so anything else is refused until checked and added here.
PINNED_SCHEMAS = {
    "Ascend/RecSDK cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp "
    "(TORCH_LIBRARY_FRAGMENT(mxrec), overload 'equal')":
        "mxrec::hstu_jagged.equal(Tensor q, Tensor k, Tensor v, Tensor? mask=None, "
        "Tensor? attn_bias=None, int mask_type=0, int max_seq_len=0, float silu_scale=0.0, "
        "Tensor seq_offset=None, Tensor? num_context=None, Tensor? num_target=None, "
        "int? target_group_size=0, float? alpha=1.0, bool deterministic=False) -> Tensor",
}

MASK_TYPE_CAUSAL = 0  # built-in lower-triangular mask, diagonal included (README: maskType 0)


def _signature(schema) -> tuple[list[tuple[str, str]], list[str]]:
    args = [(a.name, str(a.type)) for a in schema.arguments]
    rets = [str(r.type) for r in schema.returns]
    return args, rets


def _live_overloads(op) -> list[tuple[str, Any, Any]] | None:
    """``[(overload name, callable, schema)]`` of an OpOverloadPacket/OpOverload, or None when
    ``op`` exposes no schema (a plain Python fake)."""
    overloads = getattr(op, "overloads", None)
    if callable(overloads):
        found = []
        for name in overloads():
            overload = getattr(op, name)
            found.append((name, overload, overload._schema))
        return found
    default = getattr(op, "default", None)
    if default is not None and hasattr(default, "_schema"):
        return [("default", default, default._schema)]
    if hasattr(op, "_schema"):
        return [(getattr(op, "_overloadname", "?"), op, op._schema)]
    return None


def _schema_diff(live, pinned) -> str:
    largs, lrets = _signature(live)
    pargs, prets = _signature(pinned)
    lmap, pmap = dict(largs), dict(pargs)
    parts = []
    missing = [n for n, _ in pargs if n not in lmap]
    extra = [f"{n}: {t}" for n, t in largs if n not in pmap]
    changed = [f"{n}: {pmap[n]} -> {lmap[n]}" for n, _ in largs if n in pmap and pmap[n] != lmap[n]]
    if missing:
        parts.append("missing " + ", ".join(missing))
    if extra:
        parts.append("new " + ", ".join(extra))
    if changed:
        parts.append("retyped " + ", ".join(changed))
    if not (missing or extra or changed) and [n for n, _ in largs] != [n for n, _ in pargs]:
        parts.append("reordered arguments")
    if lrets != prets:
        parts.append(f"returns {lrets} instead of {prets}")
    return "; ".join(parts) or "differs"


def resolve_hstu_jagged(op) -> tuple[Any, str]:
    """Check ``op`` (e.g. ``torch.ops.mxrec.hstu_jagged``) against ``PINNED_SCHEMAS``.

    Returns ``(callable, note)``: the exact overload whose schema matched (so the call cannot
    bind to another overload), or ``op`` itself when it exposes no schema (a Python fake).
    Raises ``MxrecSchemaError`` listing the differences when no overload matches.
    """
    import torch

    overloads = _live_overloads(op)
    if overloads is None:
        return op, "schema not inspectable (a Python callable), argument names not checked"
    pinned = {src: torch._C.parse_schema(text) for src, text in PINNED_SCHEMAS.items()}
    for name, overload, live in overloads:
        for src, schema in pinned.items():
            if _signature(live) == _signature(schema):
                return overload, f"schema matches overload {name!r} of {src}"
    lines = []
    for name, _, live in overloads:
        diffs = "; ".join(f"vs {src}: {_schema_diff(live, schema)}" for src, schema in pinned.items())
        lines.append(f"  overload {name!r}: {live}\n    {diffs}")
    raise MxrecSchemaError(
        "torch.ops.mxrec.hstu_jagged schema drift: no loaded overload matches a schema this adapter "
        "was written against, so argument binding is unverified.\n" + "\n".join(lines) +
        "\nPinned: " + "; ".join(PINNED_SCHEMAS.values()) +
        "\nUse the RecSDK release the pin names, or update npu_ops/mxrec_hstu.py (translation, "
        "PINNED_SCHEMAS, the fake) and re-run tests/npu on Ascend hardware.")


# ----------------------------------------------------------------------------------------
def _limit_error(name: str, what: str) -> UnsupportedOnBackend:
    return UnsupportedOnBackend(f"mxrec.hstu_jagged limit '{name}': {what} "
                                f"(documented in {LIMIT_SOURCES[name]})")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _host_offsets(offsets) -> list[int]:
    if hasattr(offsets, "detach"):  # a torch tensor, possibly on the device: one host copy
        offsets = offsets.detach().cpu().numpy()
    return [int(x) for x in np.asarray(offsets).reshape(-1)]


def check_limits(limits: HstuJaggedLimits, *, dtypes: Sequence[Any], batch: int, max_seq_len: int,
                 heads: int, dqk: int, dv: int) -> None:
    """Raise ``UnsupportedOnBackend`` naming the first documented limit the call violates."""
    names = sorted({_dtype_name(d) for d in dtypes})
    if len(names) != 1 or names[0] not in limits.dtypes:
        raise _limit_error("dtype", f"q/k/v dtypes {names} must be one dtype of {list(limits.dtypes)}")
    lo, hi = limits.batch
    if not lo <= batch <= hi:
        raise _limit_error("batch", f"{batch} non-empty sequences, allowed [{lo}, {hi}]")
    lo, hi = limits.max_seq_len
    if not lo <= max_seq_len <= hi:
        raise _limit_error("max_seq_len", f"S = layout.max_len = {max_seq_len}, allowed [{lo}, {hi}]")
    lo, hi = limits.heads
    if not lo <= heads <= hi:
        raise _limit_error("heads", f"{heads} heads, allowed [{lo}, {hi}]")
    lo, hi = limits.head_dim
    m = limits.head_dim_multiple
    for name, d in (("head_dim_qk", dqk), ("head_dim_v", dv)):
        if not (lo <= d <= hi and d % m == 0):
            raise _limit_error(name, f"head dim {d}, allowed [{lo}, {hi}] and a multiple of {m}")


class MxrecHstuAttention:
    """``attention(q, k, v, layout, norm_len, bias) -> out[T_cap, H, dv]`` on ``mxrec.hstu_jagged``.

    Args (of the call):
      q[T_cap, H, dqk], k[T_cap, H, dqk], v[T_cap, H, dv]: one float dtype, rows >= T ignored.
      layout: ``gr_functional.jagged.Jagged`` (offsets[B_cap+1], max_len used).
      norm_len: n >= 1, the fixed normaliser.
      bias: [B_cap, L, L] or [1, L, L] (L = layout.max_len) shared by heads, or None.
    Returns out[T_cap, H, dv] in q's dtype, zeros on padding rows; differentiable in q, k, v
    and bias through the op's autograd.

    Construction: ``ops`` is the op namespace (default ``torch.ops.mxrec``; tests inject a fake);
    its ``hstu_jagged`` schema is checked against ``PINNED_SCHEMAS`` once, here.
    """

    def __init__(self, ops: Any = None, *, limits: HstuJaggedLimits = HSTU_JAGGED_LIMITS,
                 deterministic: bool = False):
        if ops is None:
            import torch

            ops = torch.ops.mxrec
        try:
            packet = getattr(ops, "hstu_jagged")
        except (AttributeError, RuntimeError) as exc:
            raise UnsupportedOnBackend(
                f"{ops!r} has no hstu_jagged op: RecSDK's HSTU ops are not loaded (see "
                f"npu_ops.mxrec_status() and npu_ops/README.md)") from exc
        self.op, self.schema_note = resolve_hstu_jagged(packet)
        self.limits = limits
        # The C++ autograd wrapper drops this flag (hstu_jagged.cpp), so it only affects calls
        # without grad; kept explicit so the argument list is complete.
        self.deterministic = bool(deterministic)

    def __repr__(self):
        return f"MxrecHstuAttention({self.schema_note})"

    def __call__(self, q, k, v, layout, norm_len: int, bias=None):
        import torch
        import torch.nn.functional as F

        # ---- our contract (violations are caller bugs: ValueError) ----
        if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
            raise ValueError(f"expected q, k [T_cap, H, dqk] and v [T_cap, H, dv]; got "
                             f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
        t_cap, heads, dqk = (int(s) for s in q.shape)
        dv = int(v.shape[2])
        L, b_cap = int(layout.max_len), int(layout.b_cap)
        offsets = _host_offsets(layout.offsets)
        if len(offsets) != b_cap + 1 or offsets[0] != 0:
            raise ValueError(f"layout.offsets must be [B_cap+1] starting at 0, got {offsets[:4]}...")
        total = offsets[-1]
        if total > t_cap:
            raise ValueError(f"layout has {total} tokens but q has only {t_cap} rows")
        n = int(norm_len)
        if n < 1:
            raise ValueError(f"norm_len must be >= 1, got {norm_len}")
        if bias is not None and (bias.ndim != 3 or bias.shape[0] not in (1, b_cap)
                                 or tuple(bias.shape[1:]) != (L, L)):
            raise ValueError(f"bias must be [B_cap={b_cap} or 1, L={L}, L={L}], got {tuple(bias.shape)}")

        keep = [b for b in range(b_cap) if offsets[b + 1] > offsets[b]]
        if total == 0:  # nothing to attend; the kernel rejects empty inputs
            return v.new_zeros((t_cap, heads, dv))

        # ---- documented vendor limits (UnsupportedOnBackend, before any device work) ----
        check_limits(self.limits, dtypes=(q.dtype, k.dtype, v.dtype), batch=len(keep),
                     max_seq_len=L, heads=heads, dqk=dqk, dv=dv)

        # ---- translation ----
        seq_offset = torch.tensor([0] + [offsets[b + 1] for b in keep], dtype=torch.int64,
                                  device=q.device)
        attn_bias = None
        if bias is not None:
            full = bias.expand(b_cap, L, L)
            if keep != list(range(len(keep))):
                full = full.index_select(0, torch.tensor(keep, dtype=torch.int64, device=bias.device))
            else:
                full = full[: len(keep)]
            # cast before the head expansion (B*L*L elements, not B*H*L*L); the forward
            # does not call .contiguous() on the bias (hstu_jagged.cpp), so materialise it here
            attn_bias = (full.to(dtype=q.dtype, device=q.device).unsqueeze(1)
                         .expand(len(keep), heads, L, L).contiguous())
        out = self.op(
            q[:total], k[:total], v[:total],
            mask=None,
            attn_bias=attn_bias,
            mask_type=MASK_TYPE_CAUSAL,
            max_seq_len=L,
            silu_scale=1.0 / n,
            seq_offset=seq_offset,
            num_context=None,
            num_target=None,
            target_group_size=0,
            alpha=1.0,
            deterministic=self.deterministic,
        )
        if tuple(out.shape) != (total, heads, dv):
            raise RuntimeError(f"mxrec.hstu_jagged returned shape {tuple(out.shape)}, expected "
                               f"{(total, heads, dv)}: the op's semantics differ from its documentation")
        if total < t_cap:
            out = F.pad(out, (0, 0, 0, 0, 0, t_cap - total))
        return out

    def attend(self, B, q, k, v, layout, norm_len: int, bias):
        """The attention-kernel signature of backends/kernels.py (``bias`` an ``AttentionBias``):
        the dense bias is ``B.relative_bias`` on the calling backend (or its precision view)."""
        return self(q, k, v, layout, norm_len, B.relative_bias(layout, norm_len, bias))
