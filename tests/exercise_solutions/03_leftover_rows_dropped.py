"""Planted bug: rows of A taken 4 at a time only; the M % 4 rows left over never computed."""
import numpy as np
from numba import njit

FASTMATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=FASTMATH)
def matmul_panels(A, W):
    M, K = A.shape
    N = W.shape[0]
    C = np.zeros((M, N), dtype=np.float32)
    for n in range(0, N, 4):
        for i in range(0, M - M % 4, 4):
            for r in range(4):
                for c in range(4):
                    s = np.float32(0.0)
                    for k in range(K):
                        s += A[i + r, k] * W[n + c, k]
                    C[i + r, n + c] = s
    return C
