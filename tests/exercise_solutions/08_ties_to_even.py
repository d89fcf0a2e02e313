"""Planted bug: np.rint (ties to even) where ggml's roundf rounds half away from zero."""
import numpy as np


def quantize_row_q8_1(x):
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    dd = (amax / np.float32(127.0)).astype(np.float32)
    inv = np.where(dd != 0, np.float32(1.0) / np.where(dd != 0, dd, 1), 0).astype(np.float32)
    q = np.rint((xb * inv[:, None]).astype(np.float32)).astype(np.int8)
    sums = q.astype(np.int32).sum(axis=1)
    d = dd.astype(np.float16).astype(np.float32)
    s = (sums.astype(np.float32) * dd).astype(np.float16).astype(np.float32)
    return q.reshape(-1), d, s, sums
