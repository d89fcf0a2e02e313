"""Chapter 07 · threads: split a matrix's rows across the cores.

Run the check:   make exercise ch=07
(or: .venv/bin/python -m exercises.check 07)

A decode step streams every weight once. One core may unpack the blocks more slowly than memory
delivers them; then a second core, streaming other rows, adds its unpacking until the two
together reach the memory's bandwidth. Your function is compared with the single-thread kernel
(the results must be the same bits: splitting the rows never changes the order of the additions
inside one output) and with the stage's (stages/kernels/threaded.py), then timed on all cores
beside them.
"""

import numpy as np  # noqa: F401  (for your code, as the next two imports)
from numba import njit, prange  # noqa: F401

from stages.kernels.dequant_dot import matvec_q4_1  # noqa: F401


@njit(cache=True, parallel=True)
def matvec_parallel(x, w, f16, n_chunks):
    """y = W x for a Q4_1 weight, the rows cut into n_chunks contiguous ranges, one per iteration
    of a parallel loop.

    x:        float32 [K]               the activation row
    w:        uint8 [N, K // 32 * 20]   the weight's Q4_1 rows, as the file holds them
    f16:      float32 [65536]           the float16 table the kernel reads scales with
    n_chunks: int                       how many ranges (the caller sets numba's thread count)
    returns y: float32 [N]

    What to write: allocate y; compute how many rows each range gets (per = ceil(N / n_chunks));
    in a `for c in prange(n_chunks)` loop, range c is rows r0 = c * per .. r1 = min(N, r0 + per),
    and y[r0:r1] = matvec_q4_1(x, w[r0:r1], f16): the quantized stage's kernel on those rows.

    The edges: N not a multiple of n_chunks (the last range is shorter: per = N // n_chunks loses
    the rows left over), and more chunks than rows (some ranges are empty: r0 >= N).

    Why: the threads share nothing but x (read-only, a few KiB): each streams its own rows'
    blocks from memory. And each output is summed by one thread in the kernel's own order, so
    1 thread and N threads give the same bits.

    Hint: notebooks/07_threads.ipynb, "The threads stage's code". Try it before
    you read stages/kernels/threaded.py (matvec_parallel).
    """
    raise NotImplementedError("write the split of the rows into n_chunks ranges: see the docstring")
