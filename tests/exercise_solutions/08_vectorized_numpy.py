"""A correct rounding, all blocks at once in numpy (the stage's is a numba loop per block)."""
import numpy as np


def quantize_row_q8_1(x):
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    dd = (np.abs(xb).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(dd != 0, dd, np.float32(1.0))
    inv = np.where(dd != 0, np.float32(1.0) / safe, np.float32(0.0)).astype(np.float32)
    v = (xb * inv[:, None]).astype(np.float32)                         # the float32 product
    q = np.copysign(np.floor(np.abs(v.astype(np.float64)) + 0.5), v).astype(np.int8)
    sums = q.astype(np.int32).sum(axis=1, dtype=np.int32)
    d = dd.astype(np.float16).astype(np.float32)
    s = (sums.astype(np.float32) * dd).astype(np.float32).astype(np.float16).astype(np.float32)
    return q.reshape(-1), d, s, sums
