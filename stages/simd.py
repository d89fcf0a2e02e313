"""Stage 3, simd: lay the weights out the way the inner loop reads them, then let LLVM vectorize.

The lesson: tiling fixed where the bytes come from, but the inner loop was still a chain of
dependent scalar additions. Two changes break it:

1. Packing. Each weight is stored as panels of 4 output rows, each row contiguous over the
   input dimension ([N, K], the transpose of the textbook's B; N padded to a multiple of 4).
   The inner loop now reads consecutive addresses, which is what vector loads need.
2. A 4 x 4 register block. For 4 rows of x and one 4-row panel of W the kernel keeps 16
   running sums in registers: every x value loaded is used 4 times, every weight 4 times.
   With fastmath's 'reassoc' LLVM may split each sum across the lanes of a vector register,
   so one instruction does 8 (ymm) or 16 (zmm) multiply-adds: vfmadd231ps. We allow only
   reassociation, FMA contraction and ignoring the sign of zero; NaN and Inf keep their
   meaning (tests/test_stages.py reads the generated assembly to check the vfmadd...ps).

Rows of x beyond a multiple of 4 (and decode steps, one row) take a 1 x 4 kernel.
The floats are summed in a different order than the textbook, so the logits differ from the
naive stage in the last bits; the tests hold every stage to the same float64 reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from common.quants import dequantize_tensor
from stages.kernels.toolkit import FASTMATH  # {"reassoc", "contract", "nsz"}: the liberties above
from stages.tiling import TilingBackend

PANEL = 4                                   # output rows per panel (= register block width)


@njit(cache=True, fastmath=FASTMATH)
def matmul_panels(A, W):
    """A [M, K] @ W^T -> C [M, N]; W [N, K] with N % 4 == 0 (packed at load)."""
    M, K = A.shape
    N = W.shape[0]
    C = np.empty((M, N), dtype=np.float32)
    for n in range(0, N, PANEL):
        i = 0
        while i + 4 <= M:                    # 4 rows x 4 outputs: 16 sums in registers
            c00 = c01 = c02 = c03 = np.float32(0.0)
            c10 = c11 = c12 = c13 = np.float32(0.0)
            c20 = c21 = c22 = c23 = np.float32(0.0)
            c30 = c31 = c32 = c33 = np.float32(0.0)
            for k in range(K):
                w0, w1, w2, w3 = W[n, k], W[n + 1, k], W[n + 2, k], W[n + 3, k]
                a0, a1, a2, a3 = A[i, k], A[i + 1, k], A[i + 2, k], A[i + 3, k]
                c00 += a0 * w0; c01 += a0 * w1; c02 += a0 * w2; c03 += a0 * w3  # noqa: E702
                c10 += a1 * w0; c11 += a1 * w1; c12 += a1 * w2; c13 += a1 * w3  # noqa: E702
                c20 += a2 * w0; c21 += a2 * w1; c22 += a2 * w2; c23 += a2 * w3  # noqa: E702
                c30 += a3 * w0; c31 += a3 * w1; c32 += a3 * w2; c33 += a3 * w3  # noqa: E702
            C[i, n], C[i, n + 1], C[i, n + 2], C[i, n + 3] = c00, c01, c02, c03
            C[i + 1, n], C[i + 1, n + 1], C[i + 1, n + 2], C[i + 1, n + 3] = c10, c11, c12, c13
            C[i + 2, n], C[i + 2, n + 1], C[i + 2, n + 2], C[i + 2, n + 3] = c20, c21, c22, c23
            C[i + 3, n], C[i + 3, n + 1], C[i + 3, n + 2], C[i + 3, n + 3] = c30, c31, c32, c33
            i += 4
        while i < M:                         # leftover rows: 1 row x 4 outputs
            c0 = c1 = c2 = c3 = np.float32(0.0)
            for k in range(K):
                a = A[i, k]
                c0 += a * W[n, k]; c1 += a * W[n + 1, k]; c2 += a * W[n + 2, k]; c3 += a * W[n + 3, k]  # noqa
            C[i, n], C[i, n + 1], C[i, n + 2], C[i, n + 3] = c0, c1, c2, c3
            i += 1
    return C


class Panels:
    """A weight packed for matmul_panels: data [N rounded up to PANEL, K], zero rows appended."""

    def __init__(self, w: np.ndarray):
        self.n_out = w.shape[0]
        pad = (-self.n_out) % PANEL
        self.data = np.ascontiguousarray(np.pad(w, ((0, pad), (0, 0))) if pad else w)
        self.nbytes = self.data.nbytes


class SimdBackend(TilingBackend):
    name = "simd"

    def prepare_matrix(self, tensor):
        return Panels(dequantize_tensor(tensor))

    def tie_output(self, embedding, tensor):
        return Panels(embedding)     # the [n_vocab, D] table already is W in this layout

    def matmul(self, x, w):
        c = matmul_panels(np.ascontiguousarray(x), w.data)
        return c if w.n_out == c.shape[1] else c[:, :w.n_out]
