"""A correct textbook matmul that copies each column of B into a contiguous buffer once, then
takes every row of A's dot product with it: j outermost, each sum still k = 0 .. K-1 in order."""
import numpy as np
from numba import njit


@njit(cache=True)
def matmul(A, B):
    C = np.empty((A.shape[0], B.shape[1]), dtype=np.float32)
    column = np.empty(B.shape[0], dtype=np.float32)
    for j in range(B.shape[1]):
        for k in range(B.shape[0]):
            column[k] = B[k, j]
        for i in range(A.shape[0]):
            acc = np.float32(0.0)
            for k in range(A.shape[1]):
                acc += A[i, k] * column[k]
            C[i, j] = acc
    return C
