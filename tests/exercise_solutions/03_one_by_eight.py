"""A correct panel matmul with another register block: one row of A against 8 weight rows at a
time (8 independent sums, kept in a small array), the last panel 4 rows wide when N is not a
multiple of 8."""
import numpy as np
from numba import njit

FASTMATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=FASTMATH)
def matmul_panels(A, W):
    N = W.shape[0]
    C = np.zeros((A.shape[0], N), dtype=np.float32)
    sums = np.empty(8, dtype=np.float32)
    for i in range(A.shape[0]):
        for n in range(0, N, 8):
            width = min(8, N - n)
            sums[:] = 0.0
            for k in range(A.shape[1]):
                a = A[i, k]
                for c in range(width):
                    sums[c] += a * W[n + c, k]
            C[i, n:n + width] = sums[:width]
    return C
