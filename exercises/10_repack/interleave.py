"""Chapter 10 · repack: lay a Q4_1 matrix out as the vector unit reads it, 8 rows interleaved.

Run the check:   make exercise ch=10
(or: .venv/bin/python -m exercises.check 10)

The fused stage reads one weight row at a time, so every row pays on its own for what it shares
with its neighbours (the activation loads, the scales' conversions, a horizontal add at its end).
The repack stage rewrites each matrix once at load: rows in groups of 8, each block of the 8 rows
rewritten as one "group block" where one 32-byte load holds the same 4 bytes of all 8 rows, and
one vpdpbusd multiplies them into 8 lanes, one per row. Your layout must equal the stage's byte
for byte (stages/kernels/repacked.py); then the repack stage's kernel is timed reading your bytes,
beside the fused stage's row-at-a-time kernel reading the file's.
"""

import numpy as np  # noqa: F401  (for your code)

GROUP = 8               # rows per group: one 32-bit lane each of a 256-bit register
BLOCK_BYTES = 20        # a Q4_1 block: d (2 bytes, float16), m (2 bytes), qs (16 bytes)


def repack_q4_1(raw):
    """The file's Q4_1 rows -> the repacked matrix.

    raw:     uint8 [N, row_bytes]   N rows of row_bytes // 20 blocks each, as the GGUF file holds them
    returns  uint8 [G * GROUP * row_bytes], G = ceil(N / 8): the group blocks, one after another

    The order: for each group g of 8 rows (rows 8g .. 8g + 7; rows past N count as all zeros),
    for each block index b of a row, one group block of 8 x 20 = 160 bytes:

        bytes   0 ..  15   the 8 rows' d fields (2 bytes each): row 0's d, row 1's d, ..., row 7's d
        bytes  16 ..  31   the 8 rows' m fields, in the same order
        bytes  32 .. 159   the 8 rows' qs (16 bytes each) cut into 4-byte pieces, taken in turn:
                           piece 0 of rows 0..7 (32 bytes), then piece 1 of rows 0..7, ... piece 3
                           (piece p of a row = its qs bytes 4p .. 4p + 3)

    So the group block for (g, b) sits at byte (g * nb + b) * 160 of the result (nb = row_bytes
    // 20), and the result is exactly as long as ceil(N / 8) * 8 rows of the file.

    What to write: numpy reshapes and transposes will do it (a loop over groups and blocks is
    fine too; this runs once, at load). Pad the rows to a multiple of 8 with zeros first.

    The edges: N not a multiple of 8 (the last group's missing rows are zeros, not left out), a
    row of one block, the order of the pieces (piece-major, then row: not row-major).

    Why: a 32-byte load of piece p holds 8 values of each of the 8 rows; one activation dword,
    broadcast, multiplies all of them in one vpdpbusd whose 8 int32 lanes are the 8 rows, and a
    group's 8 outputs leave in one vector store: no horizontal add per row.

    Hint: notebooks/10_repack.ipynb, "The layout, drawn from the code". Try it
    before you read stages/kernels/repacked.py (repack, GROUP_FIELDS).
    """
    raise NotImplementedError("write the 8-row interleave of the Q4_1 blocks: see the docstring")
