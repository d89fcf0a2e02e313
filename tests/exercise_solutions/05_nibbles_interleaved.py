"""Planted bug: byte j's nibbles taken as values 2j and 2j + 1 (neighbours), not j and j + 16."""
import numpy as np
from numba import njit

from stages.kernels.toolkit import read_f16


@njit(cache=True)
def matvec_q4_1(x, w, f16):
    N = w.shape[0]
    nb = w.shape[1] // 20
    y = np.empty(N, dtype=np.float32)
    for n in range(N):
        row = w[n]
        acc = np.float32(0.0)
        for b in range(nb):
            o, k = 20 * b, 32 * b
            d, m = read_f16(row, o, f16), read_f16(row, o + 2, f16)
            for j in range(16):
                q = np.int32(row[o + 4 + j])
                acc += x[k + 2 * j] * (d * np.float32(q & 15) + m) + x[k + 2 * j + 1] * (d * np.float32(q >> 4) + m)
        y[n] = acc
    return y
