"""Planted bug: the k loop steps over whole tiles only, the partial tile at K's end dropped."""
import numpy as np
from numba import njit

TILE_I, TILE_J, TILE_K = 8, 64, 64


@njit(cache=True)
def matmul_tiled(A, B):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    for i0 in range(0, M, TILE_I):
        for j0 in range(0, N, TILE_J):
            for k0 in range(0, K - K % TILE_K, TILE_K):
                for i in range(i0, min(i0 + TILE_I, M)):
                    for j in range(j0, min(j0 + TILE_J, N)):
                        acc = C[i, j]
                        for k in range(k0, k0 + TILE_K):
                            acc += A[i, k] * B[k, j]
                        C[i, j] = acc
    return C
