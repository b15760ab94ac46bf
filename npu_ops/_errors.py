"""Exceptions shared by the npu_ops adapters (no vendor imports here)."""
from __future__ import annotations

# defined in the leaf gr_functional.errors (backends raises it too); re-exported here
from gr_functional.errors import UnsupportedOnBackend


class MxrecSchemaError(UnsupportedOnBackend):
    """The loaded ``torch.ops.mxrec.hstu_jagged`` schema differs from every schema this adapter
    was written against (RecSDK changes it between releases), so argument binding would be
    unverified."""


__all__ = ["MxrecSchemaError", "UnsupportedOnBackend"]
