"""Chapter 02 · tiling: write the blocked loop nest.

Run the check:   make exercise ch=02
(or: .venv/bin/python -m exercises.check 02)

The naive loop reads all of B once per row of A, walking down its columns. Cut the i, j and k
loops into tiles and a TILE_K x TILE_J block of B is brought into L1 once and then used by all
TILE_I rows of A before it is pushed out. Your function is compared with the stage's
(stages/tiling.py) on shapes whose tiles do not divide them, then timed beside the tiling and
naive stages' matmuls.
"""

import numpy as np  # noqa: F401  (for your code)
from numba import njit

# The tile: TILE_I rows of A x TILE_J columns of B x TILE_K along the sum. 64 x 64 floats of B
# are 16 KiB, half an L1 data cache of 32-48 KiB. Change them and run the check again.
TILE_I, TILE_J, TILE_K = 8, 64, 64


@njit(cache=True)
def matmul_tiled(A, B):
    """C = A @ B, the loops cut into tiles.

    A: float32 [M, K],  B: float32 [K, N]  (the textbook layout, as chapter 01)
    returns C: float32 [M, N],  C[i, j] = sum over k of A[i, k] * B[k, j]

    What to write: six loops. The outer three step over tile corners (i0 by TILE_I, j0 by TILE_J,
    k0 by TILE_K); the inner three run over the elements of one tile. Because the k loop is cut,
    one C[i, j] is summed in pieces: start C at zero (np.zeros) and add each tile's partial sum
    to it (load C[i, j] into an accumulator, add the tile's products, store it back).

    The edges are the exercise: M, N and K are not multiples of the tile. A tile that starts at
    i0 ends at min(i0 + TILE_I, M), not at i0 + TILE_I; the same for j and k. Drop the partial
    tile and the last rows, columns or products go missing (the check has cases for each).

    Why: inside one tile the k loop still walks down columns of B, but only TILE_K lines of them,
    and the next column j + 1 finds those lines still in L1: each 64-byte line is used 16 times
    instead of once.

    Hint: notebooks/02_tiling.ipynb, "The reasoning, with this machine's numbers". Try it before
    you read stages/tiling.py (make_tiled_matmul).
    """
    raise NotImplementedError("write the blocked loop nest: see the docstring")
