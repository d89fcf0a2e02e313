"""Chapter 13's experiments (run: make try-it ch=13). Both run on any CPU: they measure the tile
layout the matrix unit reads, not the unit."""

from __future__ import annotations

import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import experiment
from stages.kernels import amx_tiles, repacked
from stages.kernels.toolkit import Q4_0, Q4_1

_check = load_file(__file__.replace("experiments", "check"))
_quantized = load_file(__file__.replace("13_amx/experiments", "05_quantized/check"))


@experiment("the weight type under the tile layout (amx_tiles.TILE_AT): bytes per 32 values of a row")
def layout_bytes(quick):
    """the unit multiplies whole bytes, so the tile copy holds every value as a byte: 32 bytes and its
    scales per 32 values of a row, 34 for Q4_0 (against the file's 18: 1.89x) and 36 for Q4_1
    (against 20: 1.8x); repack's layout, which decode keeps reading, is as large as the file"""
    rows = []
    for kind, name, weight in ((Q4_0, "Q4_0", _check.q4_0_weight), (Q4_1, "Q4_1", _quantized.q4_1_weight)):
        raw = weight(np.random.default_rng(0), 64 if quick else 1536, 576)
        tiles, packed = amx_tiles.tile_layout(raw, kind).nbytes, repacked.repack(raw, kind).nbytes
        rows.append((f"{name}: the tile copy over the file's bytes", tiles / raw.nbytes, "x"))
        rows.append((f"{name}: repack's layout over the file's bytes", packed / raw.nbytes, "x"))
    return {"rows": rows, "note": "a matrix of 576-wide rows; the amx stage holds both layouts, one after the other"}


@experiment("the layout's cost at load: amx_tiles.tile_layout against repacked.repack (numpy, one thread)")
def layout_time(quick):
    """the tile layout unpacks every nibble and moves the values four bytes at a time, where repack
    moves whole 4-byte pieces of the blocks: expect it a few times slower than repack at load, a
    fraction of a second for a small model's matrices, paid once"""
    raw, what = _check.load_weight(quick)
    reps = 3 if quick else 7
    tiles = best_seconds(lambda: amx_tiles.tile_layout(raw, Q4_0), reps)
    packed = best_seconds(lambda: repacked.repack(raw, Q4_0), reps)
    return {"rows": [("the tile layout", raw.nbytes / tiles / 1e9, "GB/s of blocks"),
                     ("repack's layout", raw.nbytes / packed / 1e9, "GB/s of blocks"),
                     ("the tile layout's time over repack's", tiles / packed, "x")], "note": what}
