"""Planted bug: per = N // n_chunks, so the N % n_chunks rows at the end belong to no range."""
import numpy as np
from numba import njit, prange

from stages.kernels.dequant_dot import matvec_q4_1


@njit(cache=True, parallel=True)
def matvec_parallel(x, w, f16, n_chunks):
    N = w.shape[0]
    y = np.zeros(N, dtype=np.float32)
    per = N // n_chunks
    for c in prange(n_chunks):
        r0 = c * per
        r1 = min(N, r0 + per)
        if r0 < r1:
            y[r0:r1] = matvec_q4_1(x, w[r0:r1], f16)
    return y
