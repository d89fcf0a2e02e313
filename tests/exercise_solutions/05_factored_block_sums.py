"""A correct Q4_1 product using the block's algebra: sum_j x_j (d q_j + m) = d (x . q) + m sum x,
with sum x of each block computed once for every row, and the integer nibbles multiplied as they
are read (no decoded row)."""
import numpy as np
from numba import njit

from stages.kernels.toolkit import read_f16


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def matvec_q4_1(x, w, f16):
    nb = w.shape[1] // 20
    block_sums = x.reshape(nb, 32).sum(axis=1)          # the same for every row
    y = np.zeros(w.shape[0], dtype=np.float32)
    for n in range(w.shape[0]):
        for b in range(nb):
            xq = np.float32(0.0)
            for j in range(16):
                q = np.int32(w[n, 20 * b + 4 + j])
                xq += x[32 * b + j] * np.float32(q & 15) + x[32 * b + 16 + j] * np.float32(q >> 4)
            y[n] += read_f16(w[n], 20 * b, f16) * xq + read_f16(w[n], 20 * b + 2, f16) * block_sums[b]
    return y
