"""Chapter 13 · amx: lay a Q4_0 matrix out as the matrix unit's B tiles, 16 rows at a time.

Run the check:   make exercise ch=13
(or: .venv/bin/python -m exercises.check 13)

The prefill stage multiplies a prompt's rows by the weights with vpdpbusd: four byte products per
int32 lane, 16 lanes per instruction. The CPU's matrix unit (AMX) has one instruction, TDPBSSD,
that multiplies a tile of up to 16 activation rows by a tile B holding 16 weight rows: 16 x 16 x 64
multiply-adds at once. B must hold its 16 weight rows "VNNI-style": row k of B is values 4k .. 4k+3
of weight row 0, then of weight row 1, ..., of weight row 15. The amx stage rewrites every matrix
that way once, at load (stages/kernels/amx_tiles.py). Your layout must equal the stage's byte for
byte; the check needs no matrix unit (the layout is numpy), and times your layout beside the
stage's and beside the prefill stage's (repack's 8-row groups).
"""

import numpy as np  # noqa: F401  (for your code)

TILE = 16               # weight rows per group: B's 16 columns of int32 sums
BLOCK_BYTES = 18        # a Q4_0 block: d (2 bytes, float16), then qs (16 bytes: 32 values of 4 bits)


def tile_layout_q4_0(raw):
    """The file's Q4_0 rows -> the matrix in the amx stage's tile layout.

    raw:     uint8 [N, row_bytes]   N rows of nb = row_bytes // 18 blocks each, as the GGUF file holds them
    returns  uint8 [G * nb * 544], G = ceil(N / 16): the group blocks, one after another

    A Q4_0 block holds 32 values q (0 .. 15) and a scale d: value i < 16 is the low nibble of qs
    byte i, value i >= 16 the high nibble of qs byte i - 16; the weight is d * (q - 8).

    For each group g of 16 rows (rows 16g .. 16g + 15) and each block index b of a row, one group
    block of 544 bytes, at byte (g * nb + b) * 544:

        bytes   0 .. 511   the B tile: 8 rows of 64 bytes. Row k (k = 0 .. 7) holds values
                           4k .. 4k + 3 of block b of weight row 16g, then those of row 16g + 1, ...,
                           then those of row 16g + 15, each value as the signed byte q - 8
        bytes 512 .. 543   the 16 rows' d fields (2 bytes each, as stored): row 16g's first

    Rows past N (the last group's missing rows) are all zeros: a zero byte in B and a zero d, not
    the byte 0 - 8 (a missing row must add nothing to any sum).

    What to write: unpack the nibbles to 32 values a block, subtract 8, then numpy reshapes and a
    transpose will do it (a loop over groups, blocks and B's rows is fine too; this runs once, at
    load).

    The edges: N not a multiple of 16 (the padding rows), a row of one block, the nibbles' order
    (value i and value i + 16 share a byte), the offset (q - 8 as a signed byte: 0 becomes 0xF8).

    Why: one TDPBSSD multiplies 4 bytes of an activation row by 4 bytes of each of 16 weight rows,
    for all 16 rows and all 16 columns at once; B's row k must therefore hold the same 4 values of
    the 16 weight rows side by side. The values become whole bytes because the unit multiplies
    bytes, not nibbles: the layout holds 34 bytes per 32 values of a row where the file holds 18.

    Hint: notebooks/13_amx.ipynb, "The tile layout, drawn from the code". Try it before you read
    stages/kernels/amx_tiles.py (tile_layout, _integers).
    """
    raise NotImplementedError("write the 16-row tile layout of the Q4_0 blocks: see the docstring")
