"""Cases, tolerances and error measures shared by the differential suite.

Error measure: ``rel_err(a, ref) = max|a - ref| / max|ref|`` (the infinity-norm relative error of
the whole tensor), which is what a per-layer table reports too (gr_functional.crosscheck).
"""
from __future__ import annotations

import numpy as np

from gr_functional.jagged import Jagged

FWD_TOL = 1e-6      # fp32 forward, relative
GRAD_TOL = 1e-5     # fp32 gradients, relative
TRAJ_TOL = 1e-4     # fp32 loss after a 50-step trajectory, relative

MAX_LEN = 12

# name -> (lengths, b_cap): lengths 1 and max_len, mixed, batch of 1, empty slots (also in the middle)
LAYOUT_CASES = {
    "len1": ([1, 1, 1, 1], None),
    "maxlen": ([MAX_LEN] * 3, None),
    "mixed": ([3, MAX_LEN, 1, 7, 5, 2], None),
    "single": ([9], None),
    "empty_slots": ([4, 0, 6, 0, 1], 8),
}


def rel_err(a, ref) -> float:
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max(initial=0.0)
    diff = np.abs(a - ref).max(initial=0.0)
    return float(diff / scale) if scale > 0 else float(diff)


def make_layout(case: str, max_len: int = MAX_LEN) -> Jagged:
    lengths, b_cap = LAYOUT_CASES[case]
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    return Jagged.from_sequences(seqs, max_len=max_len, b_cap=b_cap)
