"""A correct row split with other boundaries than the stage's: range c is rows c N / n .. (c + 1) N / n,
so the ranges differ by one row at most (37 in 2: 18 + 19, where the stage takes 19 + 18)."""
import numpy as np
from numba import njit, prange

from stages.kernels.dequant_dot import matvec_q4_1


@njit(cache=True, parallel=True)
def matvec_parallel(x, w, f16, n_chunks):
    N = w.shape[0]
    y = np.zeros(N, dtype=np.float32)
    for c in prange(n_chunks):
        r0, r1 = c * N // n_chunks, (c + 1) * N // n_chunks
        if r0 < r1:
            y[r0:r1] = matvec_q4_1(x, w[r0:r1], f16)
    return y
