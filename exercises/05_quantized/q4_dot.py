"""Chapter 05 · quantized: write a Q4_1 matrix-vector product straight from the file's bytes.

Run the check:   make exercise ch=05
(or: .venv/bin/python -m exercises.check 05)

A decode step multiplies one activation row by every weight once: it costs what it takes to
bring the weights from memory. The stages before this one expanded each 4-bit weight to a 32-bit
float at load; this one reads the file's blocks and decodes them in registers, 5 bits per weight
instead of 32. Your function is compared with the stage's (stages/kernels/dequant_dot.py) on
rows of one block, of many, and on blocks with odd scales, then timed beside it and beside the
simd stage's float32 product (the same products, six times the bytes).
"""

import numpy as np  # noqa: F401  (for your code)
from numba import njit

from stages.kernels.toolkit import FASTMATH, read_f16  # noqa: F401  (read_f16: for your code)

BLOCK_BYTES = 20        # one Q4_1 block: d (float16), m (float16), qs (16 bytes, 32 nibbles)
BLOCK_VALUES = 32


@njit(cache=True, fastmath=FASTMATH)
def matvec_q4_1(x, w, f16):
    """y = W x for a weight W stored as Q4_1 blocks, decoded as it is read.

    x:   float32 [K]                     the activation row (K a multiple of 32)
    w:   uint8 [N, K // 32 * 20]         the weight as the GGUF file holds it: row n is K // 32
                                         blocks of 20 bytes, one after another
    f16: float32 [65536]                 float16 bit pattern -> its value (numba has no float16):
                                         read_f16(row, o, f16) is the float16 at row[o:o+2]
    returns y: float32 [N],  y[n] = sum over k of x[k] * W[n, k]

    One block (20 bytes, 32 values), at byte offset o = 20 * b of its row, value index k = 32 * b:
        d = read_f16(row, o, f16), m = read_f16(row, o + 2, f16)
        byte j (j = 0 .. 15) of qs = row[o + 4 + j]: its low nibble (q & 15) is value j, its high
        nibble (q >> 4) is value j + 16
        value = d * nibble + m

    What to write: for each row n, for each block b, decode the 32 values and multiply them into
    x (or use the algebra: sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j). The values
    exist only in registers (or a one-row buffer): no float32 copy of W.
    Casting the nibble to np.int32 before np.float32 lets LLVM convert 8 lanes at once (numba
    computes integers in 64 bits otherwise).

    The edges: a row of one block; N of 1 or odd; blocks whose m is negative or d is 0.

    Why: 20 bytes carry 32 weights, 0.625 bytes each, against 4 for float32. A decode step that
    waits on memory waits about a sixth as long, if the decoding keeps up with the memory.

    Hint: notebooks/05_quantized.ipynb, "Bytes per weight, as each stage holds them"; notebooks/00_gguf_and_tokens.ipynb
    decodes a Q4_1 block by hand. Try it before you read stages/kernels/dequant_dot.py
    (_row_q4_1, matvec_q4_1).
    """
    raise NotImplementedError("write the fused decode-and-multiply over the Q4_1 blocks: see the docstring")
