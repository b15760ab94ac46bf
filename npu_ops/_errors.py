"""Exceptions shared by the npu_ops adapters (no vendor imports here)."""
from __future__ import annotations


class UnsupportedOnBackend(RuntimeError):
    """A kernel cannot run this call here: it is not installed or loaded, or a documented
    shape/dtype limit is violated. The message names the kernel, the limit or missing piece,
    and where the limit is documented. Callers never fall back silently on this error."""


class MxrecSchemaError(UnsupportedOnBackend):
    """The loaded ``torch.ops.mxrec.hstu_jagged`` schema differs from every schema this adapter
    was written against (RecSDK changes it between releases), so argument binding would be
    unverified."""
