"""Stage 2, tiling: the same textbook matmul, blocked so each piece of B is reused from cache.

The lesson: the naive loop reads all of B once per row of A, walking down its columns. Cut
the i, j and k loops into tiles and a TILE_K x TILE_J block of B (here 64 x 64 floats =
16 KiB) is loaded into L1 once and then used by TILE_I rows of A before it is evicted.
Consecutive columns j of one tile share cache lines, so the strided walk now uses all 64
bytes of each line it loads instead of 4.

What it cannot fix: the inner loop is still one long chain of dependent float additions
(acc += a * b), which the compiler may not reorder without changing the result, so the core
waits a floating-point add's latency for each one. Tiling buys what the cache can give; the
next stage attacks the chain.

The tile sizes are the ones the reasoning above predicts, 8 x 64 x 64: a 16 KiB B tile plus
8 rows of A's 64-wide slice fit in L1 together. Whether they are the best on your CPU is a
measurement, not a formula: `python -m app bench tiling` sweeps 64 sizes on the model's own matrix
shapes and records the ranking, with the machine it ran on, in profiles/bench/tiling_sweep.json.
Rankings differ between CPUs (cache sizes and hardware prefetchers move them), which is why the
stage keeps the reasoned size instead of one machine's winner.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from stages.naive import NaiveBackend

TILE_I, TILE_J, TILE_K = 8, 64, 64


def make_tiled_matmul(ti: int, tj: int, tk: int, cache: bool = True):
    """The blocked loop nest for one choice of tile sizes (constants, so LLVM sees them)."""

    @njit(cache=cache)
    def matmul_tiled(A, B):
        """A [M, K] @ B [K, N] -> C [M, N], B's column walk cut into tj x tk tiles."""
        M, K = A.shape
        N = B.shape[1]
        C = np.zeros((M, N), dtype=np.float32)
        for i0 in range(0, M, ti):
            for j0 in range(0, N, tj):
                for k0 in range(0, K, tk):
                    # one tile: B[k0:k0+tk, j0:j0+tj] stays in L1 for all ti rows
                    for i in range(i0, min(i0 + ti, M)):
                        for j in range(j0, min(j0 + tj, N)):
                            acc = C[i, j]
                            for k in range(k0, min(k0 + tk, K)):
                                acc += A[i, k] * B[k, j]
                            C[i, j] = acc
        return C

    return matmul_tiled


matmul_tiled = make_tiled_matmul(TILE_I, TILE_J, TILE_K)


class TilingBackend(NaiveBackend):
    name = "tiling"

    def matmul(self, x, w):
        return matmul_tiled(x, w)
