"""The time-gap buckets of HSTU's relative attention bias, one definition for every kernel.

A leaf (imports nothing of the project): the reference ops (backends) and the Triton kernel
(npu_ops, which imports nothing of backends) both bucket by these thresholds.
"""
from __future__ import annotations

import math

import numpy as np

TIME_BUCKET_DIVISOR = 0.301  # generative-recommenders: floor(log(max(|dt|, 1)) / 0.301)


def time_bucket_thresholds(num_buckets: int) -> np.ndarray:
    """``thr[k]`` = smallest integer x >= 1 with floor(log(x) / 0.301) >= k, k = 0..num_buckets.

    Bucketing by integer comparison against these thresholds is exact, so every backend
    assigns every time gap to the same bucket (float32 ``log`` can disagree by one ulp at a
    bucket edge between libraries). Thresholds beyond int32 are clipped: gaps that large
    cannot occur in int32 seconds.
    """
    thr = np.empty(num_buckets + 1, dtype=np.int64)
    for k in range(num_buckets + 1):
        x = max(1, int(math.floor(math.exp(k * TIME_BUCKET_DIVISOR))) - 2)
        while math.floor(math.log(x) / TIME_BUCKET_DIVISOR) < k:
            x += 1
            if x > np.iinfo(np.int32).max:
                break
        thr[k] = x
    return np.minimum(thr, np.iinfo(np.int32).max).astype(np.int32)


__all__ = ["TIME_BUCKET_DIVISOR", "time_bucket_thresholds"]
