"""Chapter 01 · naive: write the textbook matmul.

Run the check:   make exercise ch=01
(or: .venv/bin/python -m exercises.check 01)

Every weight of the model is multiplied by this function in the naive stage: one token is a pass
of its row through every weight matrix, about 2 FLOP (a multiply and an add) per weight. Your
function is compared with the stage's own (stages/naive.py) on matrices of awkward shapes, then
timed beside it and beside numpy's (a tuned BLAS: the horizon this course walks towards).
"""

import numpy as np  # noqa: F401  (for your code)
from numba import njit


@njit(cache=True)
def matmul(A, B):
    """C = A @ B, the textbook way.

    A: float32 [M, K]   the activations, one row per token
    B: float32 [K, N]   the weight, stored as the textbook writes y = x B: [in, out], row-major
    returns C: float32 [M, N],  C[i, j] = sum over k of A[i, k] * B[k, j]

    What to write: three loops, i over the rows of A, j over the columns of B, k along the sum,
    with the sum kept in a float32 accumulator (np.float32(0.0)) and stored once per (i, j).
    Allocate C with np.empty((M, N), dtype=np.float32).

    Why: this is the loop the rest of the course takes apart. Notice what the k loop reads:
    A[i, k] walks along a row (consecutive addresses), B[k, j] walks DOWN a column, N floats
    apart, so each load touches a new 64-byte cache line and uses 4 bytes of it (chapter 02 fixes
    that), and every `acc +=` waits for the one before (chapter 03 fixes that).

    Hint: notebooks/01_naive.ipynb, "The stage's code". Try it before you read stages/naive.py.
    """
    raise NotImplementedError("write the i-j-k loop nest: see the docstring")
