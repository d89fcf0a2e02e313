"""Planted bug: q computed with the float16-rounded scale (the stored d), not the float32 amax / 127."""
import numpy as np


def quantize_row_q8_1(x):
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    dd = (amax / np.float32(127.0)).astype(np.float32)
    d = dd.astype(np.float16).astype(np.float32)
    inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = (xb * inv[:, None]).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    sums = q.astype(np.int32).sum(axis=1)
    s = (sums.astype(np.float32) * dd).astype(np.float16).astype(np.float32)
    return q.reshape(-1), d, s, sums
