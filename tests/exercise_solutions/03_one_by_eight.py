"""A correct panel matmul with another register block: one row of A against 8 weight rows (8
independent sums), then a 1 x 4 block for the last panel when N is not a multiple of 8."""
import numpy as np
from numba import njit

FASTMATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=FASTMATH)
def matmul_panels(A, W):
    M, K = A.shape
    N = W.shape[0]
    C = np.empty((M, N), dtype=np.float32)
    for i in range(M):
        n = 0
        while n + 8 <= N:
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
            for k in range(K):
                a = A[i, k]
                s0 += a * W[n, k]
                s1 += a * W[n + 1, k]
                s2 += a * W[n + 2, k]
                s3 += a * W[n + 3, k]
                s4 += a * W[n + 4, k]
                s5 += a * W[n + 5, k]
                s6 += a * W[n + 6, k]
                s7 += a * W[n + 7, k]
            C[i, n], C[i, n + 1], C[i, n + 2], C[i, n + 3] = s0, s1, s2, s3
            C[i, n + 4], C[i, n + 5], C[i, n + 6], C[i, n + 7] = s4, s5, s6, s7
            n += 8
        while n < N:
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for k in range(K):
                a = A[i, k]
                s0 += a * W[n, k]
                s1 += a * W[n + 1, k]
                s2 += a * W[n + 2, k]
                s3 += a * W[n + 3, k]
            C[i, n], C[i, n + 1], C[i, n + 2], C[i, n + 3] = s0, s1, s2, s3
            n += 4
    return C
