"""Chapter 08 · int8: round an activation row to 8-bit blocks, exactly as llama.cpp does.

Run the check:   make exercise ch=08
(or: .venv/bin/python -m exercises.check 08)

llama.cpp does not multiply float activations by its 4-bit weights: before each matrix multiply
it rounds the row to blocks of 32 signed 8-bit integers with one scale per block, so that a
block's dot product is a sum of small integer products, scaled once. Which integers come out is
decided by a handful of rules, and a rule off by a hair gives other integers (then other
logits than llama.cpp's). Your function's integers and scales must equal the stage's, bit for
bit (stages/kernels/q8.py); then the int8 stage's integer product is timed fed your blocks,
beside the quantized stage's float product.
"""

import numpy as np  # noqa: F401  (for your code)


def quantize_row_q8_1(x):
    """One activation row -> its Q8_1 blocks (Q8_0's fields, plus the two sums Q8_1 adds).

    x: float32 [K], K a multiple of 32
    returns (q, d, s, sums):
        q    int8 [K]          the rounded values
        d    float32 [K // 32]  each block's scale, as stored: a float16's value
        s    float32 [K // 32]  float16(dd * sum of the block's q), Q8_1's field (see below)
        sums int32 [K // 32]    the sum of the block's q

    The rules, per block of 32 values (ggml's quantize_row_q8_1, in float32 throughout):
        amax = the largest |x_j| of the block
        dd   = amax / 127                       (float32; not yet rounded to float16)
        id   = 1 / dd, or 0 when dd is 0         (a block of zeros gives q = 0, d = 0)
        q_j  = roundf(x_j * id)                 the float32 PRODUCT x_j * id, rounded half AWAY
                                                from zero (2.5 -> 3, -2.5 -> -3)
        d    = dd rounded to float16 (to nearest, ties to even), read back as float32
        s    = (float32(sum q) * dd) rounded to float16, read back
    Note what is rounded when: q uses the float32 dd, not the float16 d it stores.

    What to write: numpy is fine (np.float32 arithmetic, np.float16 for the rounding).
    The traps the check has cases for: np.round and np.rint round half to EVEN (2.5 -> 2);
    x / dd can round differently from x * (1 / dd); rounding dd to float16 before computing q
    moves values near a .5 boundary; a block of zeros must not divide by zero.

    Why: with every activation an int8, a block's dot product with a 4-bit weight block is 32
    small integer products added in int32, and the scales (weight d x activation d) are applied
    once per block; the CPU's integer dot-product instructions (vpdpbusd) do 32 of them at once.

    Hint: notebooks/08_int8.ipynb, "int8: what llama.cpp does to an activation row". Try it before
    you read stages/kernels/q8.py (quantize_row_32).
    """
    raise NotImplementedError("write llama.cpp's Q8_1 rounding of one row: see the docstring")
