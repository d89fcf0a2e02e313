"""Chapter 02, written from the exercise's starting file alone, without reading stages/tiling.py or
the other solution: the k tiles outermost, then i and j tiles; inside a tile i, then k, then j
innermost (a row of B and a row of C, both contiguous)."""

import numpy as np
from numba import njit

TILE_I, TILE_J, TILE_K = 8, 64, 64


@njit(cache=True)
def matmul_tiled(A, B):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    for k0 in range(0, K, TILE_K):
        k1 = min(k0 + TILE_K, K)
        for i0 in range(0, M, TILE_I):
            i1 = min(i0 + TILE_I, M)
            for j0 in range(0, N, TILE_J):
                j1 = min(j0 + TILE_J, N)
                for i in range(i0, i1):
                    for k in range(k0, k1):
                        a = A[i, k]
                        for j in range(j0, j1):
                            C[i, j] += a * B[k, j]
    return C
