"""Planted bug: a square B (K == N) read transposed, B[j, k]; every other shape read right: the
kind of slip only a square case shows."""
import numpy as np
from numba import njit


@njit(cache=True)
def matmul(A, B):
    M, K = A.shape
    N = B.shape[1]
    C = np.empty((M, N), dtype=np.float32)
    for i in range(M):
        for j in range(N):
            acc = np.float32(0.0)
            for k in range(K):
                acc += A[i, k] * B[k % B.shape[0], j % N] if K != N else A[i, k] * B[j, k]
            C[i, j] = acc
    return C
