"""A correct blocked loop nest, ordered differently from the stage's: j tiles outermost, then k,
then i, with 4 x 32 x 16 tiles."""
import numpy as np
from numba import njit

TI, TJ, TK = 4, 32, 16


@njit(cache=True)
def matmul_tiled(A, B):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    for j0 in range(0, N, TJ):
        j1 = min(j0 + TJ, N)
        for k0 in range(0, K, TK):
            k1 = min(k0 + TK, K)
            for i0 in range(0, M, TI):
                for i in range(i0, min(i0 + TI, M)):
                    for j in range(j0, j1):
                        s = np.float32(0.0)
                        for k in range(k0, k1):
                            s += A[i, k] * B[k, j]
                        C[i, j] += s
    return C
