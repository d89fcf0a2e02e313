"""A correct blocked loop nest, ordered differently from the stage's: j tiles outermost, then k,
then i, with 4 x 32 x 16 tiles, and each tile's partial sums kept in a buffer of its own that is
added to C once the tile's k range is done."""
import numpy as np
from numba import njit

TI, TJ, TK = 4, 32, 16


@njit(cache=True)
def matmul_tiled(A, B):
    (M, K), N = A.shape, B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    part = np.empty((TI, TJ), dtype=np.float32)
    for j0 in range(0, N, TJ):
        nj = min(TJ, N - j0)
        for k0 in range(0, K, TK):
            k1 = min(k0 + TK, K)
            for i0 in range(0, M, TI):
                ni = min(TI, M - i0)
                part[:ni, :nj] = 0.0
                for k in range(k0, k1):
                    for i in range(ni):
                        a = A[i0 + i, k]
                        for j in range(nj):
                            part[i, j] += a * B[k, j0 + j]
                C[i0:i0 + ni, j0:j0 + nj] += part[:ni, :nj]
    return C
