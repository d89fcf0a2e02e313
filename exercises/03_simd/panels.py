"""Chapter 03 · simd: write the packed inner loop with independent accumulators.

Run the check:   make exercise ch=03
(or: .venv/bin/python -m exercises.check 03)

After tiling the bytes come from cache, and the loop still waits: every `acc += a * b` needs
the sum before it, so the core finishes one multiply-add every 4 cycles or so while it could
start two per cycle on 8 or 16 floats each. Two changes break the chain: the weight stored as
W [N, K] so the k loop reads consecutive addresses, and several sums kept at once, each
independent of the others. Your function is compared with the stage's (stages/simd.py) and
timed beside it and beside the tiling stage's loop.
"""

import numpy as np  # noqa: F401  (for your code)
from numba import njit

# The liberties the stage gives LLVM: reassociation (a sum may be split across the lanes of a
# vector register), fused multiply-adds, ignoring the sign of zero. Without 'reassoc' LLVM may not
# reorder a float sum, and the k loop stays scalar. (Try it: remove it and time the check again.)
FASTMATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=FASTMATH)
def matmul_panels(A, W):
    """C = A @ W^T with the weight packed in panels of 4 rows.

    A: float32 [M, K]   activations, M rows (1 for a decode step, the prompt's length for prefill)
    W: float32 [N, K]   the weight, one output per row, each row contiguous over the inputs;
                        N is a multiple of 4 (the stage pads it with zero rows when it packs)
    returns C: float32 [M, N],  C[i, n] = sum over k of A[i, k] * W[n, k]

    What to write: for each panel of 4 weight rows (n, n+1, n+2, n+3), take the rows of A 4 at a
    time and keep the 4 x 4 = 16 sums in 16 local float32 variables (c00 .. c33) while k runs:
    load A[i..i+3, k] and W[n..n+3, k] once each, 16 multiply-adds. Then store the 16 sums.
    M need not be a multiple of 4: the rows left over (M % 4 of them, or the single row of a
    decode step) take a 1 x 4 version of the same loop. Other block shapes are allowed (2 x 4,
    1 x 8, ...): the check compares values, not code.

    Why: each of the 16 sums is a chain of its own, so 16 chains are in flight at once and the
    FMA units never wait; with 'reassoc' LLVM also splits each sum across the 8 or 16 lanes of a
    vector register. Every value loaded serves 4 multiply-adds instead of 1.

    Hint: notebooks/03_simd.ipynb, "The evidence: the assembly LLVM generated". Try it before you
    read stages/simd.py (matmul_panels).
    """
    raise NotImplementedError("write the 4 x 4 register block over the panels: see the docstring")
