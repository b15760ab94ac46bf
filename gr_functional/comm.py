"""The collective of a one-process run (``LocalComm``): rank 0 of 1, every exchange the identity,
so the run loop has one path for one process and for N (``backends.dist_torch.TorchCollective``
has the same methods over torch.distributed)."""
from __future__ import annotations

from typing import Any

import numpy as np


class LocalComm:
    """The collective of a one-process run: rank 0 of 1, every exchange the identity, so the loop
    has one path for one process and for N (``backends.dist_torch.TorchCollective``)."""

    world_size = 1
    mesh = False  # are the ranks devices of a JAX mesh, stepped together (backends/dist_jax.py)?
    rank = 0
    is_main = True
    backend = "local"

    def __init__(self):
        self.step = 0

    def progress(self, phase: str) -> None:
        pass

    def post(self, tag: str) -> None:
        pass

    def wait_for(self, tag: str) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def exchange_counts(self, send_counts) -> np.ndarray:
        return np.asarray(send_counts, dtype=np.int64)

    def all_to_all(self, x, send_counts, recv_counts):
        return x

    def all_to_all_start(self, x, send_counts, recv_counts):
        return lambda: x

    def lane(self):
        return self

    def all_reduce_sum(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def gather(self, obj: Any) -> list | None:
        return [obj]

    def fail(self, message: str) -> None:
        pass

    def shutdown(self) -> None:
        pass

