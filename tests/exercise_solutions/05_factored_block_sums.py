"""A correct Q4_1 product using the block's algebra: sum_j x_j (d q_j + m) = d (x . q) + m sum x,
with the integer nibbles multiplied as they are read (no decoded row)."""
import numpy as np
from numba import njit

from stages.kernels.toolkit import read_f16


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def matvec_q4_1(x, w, f16):
    N = w.shape[0]
    nb = w.shape[1] // 20
    y = np.empty(N, dtype=np.float32)
    for n in range(N):
        row = w[n]
        total = np.float32(0.0)
        for b in range(nb):
            o, k = 20 * b, 32 * b
            xq = np.float32(0.0)
            xs = np.float32(0.0)
            for j in range(16):
                q = np.int32(row[o + 4 + j])
                xq += x[k + j] * np.float32(np.int32(q & 15)) + x[k + 16 + j] * np.float32(np.int32(q >> 4))
                xs += x[k + j] + x[k + 16 + j]
            total += read_f16(row, o, f16) * xq + read_f16(row, o + 2, f16) * xs
        y[n] = total
    return y
