"""Chapter 13's check: your Q4_0 tile layout against stages/kernels/amx_tiles.py's tile_layout,
byte for byte; a wrong byte is reported as (group, block, B row, weight row, value) or the d of a
row. Then the layout's cost at load, yours beside the amx stage's and beside the prefill stage's
(repack's 8-row groups, which the amx stage keeps for decode). No matrix unit is needed: the
layout is numpy; the unit's speed is the chapter's to measure."""

from __future__ import annotations

import functools

import numpy as np

from common.gguf import GGMLType
from common.quants import quantize
from exercises.harness import Case, Exercise, Timing, best_seconds, same_bytes
from stages.kernels import amx_tiles, repacked
from stages.kernels.toolkit import Q4_0

GROUP = amx_tiles.AMX_TILE                       # 16 weight rows per group
BLOCK = amx_tiles.TILE_AT[Q4_0]["size"]          # 544 bytes: the B tile (512) and the 16 rows' d (32)


def stage_layout(raw):
    return amx_tiles.tile_layout(raw, Q4_0)


def q4_0_weight(rng, N, K, scale=0.05) -> np.ndarray:
    """uint8 [N, K/32 * 18]: random values quantized by common/quants.py (gguf-py's Q4_0, byte for
    byte). Read-only, as the stages hold weights."""
    raw = quantize((rng.standard_normal((N, K)) * scale).astype(np.float32), GGMLType.Q4_0)
    raw.flags.writeable = False
    return raw


def locate(offset: int, nb: int) -> str:
    """Byte `offset` of a Q4_0 tile layout, in words: which group block, and where in it."""
    gblock, o = divmod(offset, BLOCK)
    g, b = divmod(gblock, nb)
    if o < 512:
        k, rest = divmod(o, 64)
        row, i = divmod(rest, 4)
        return (f"group {g} (rows {GROUP * g}..{GROUP * g + GROUP - 1}), block {b}: B row {k}, "
                f"value {4 * k + i} of weight row {GROUP * g + row}")
    return f"group {g}, block {b}: d of row {GROUP * g + (o - 512) // 2}"


@functools.cache
def load_weight(quick: bool) -> tuple[np.ndarray, str]:
    """The matrix the layouts are timed on: SmolLM2's ffn_up (1536 rows of 576), or a small one."""
    N = 256 if quick else 1536
    what = "a small stand-in (--quick)" if quick else "SmolLM2's ffn_up"
    return q4_0_weight(np.random.default_rng(0), N, 576), f"a Q4_0 matrix [{N} x 576], {what}, laid out at load"


class TileLayout(Exercise):
    chapter = "13"
    title = "amx: a Q4_0 matrix as the matrix unit's B tiles"
    folder = "exercises/13_amx"
    file = "tile_layout.py"
    reference = {"tile_layout_q4_0": stage_layout}
    reference_code = "stages/kernels/amx_tiles.py: tile_layout (_integers, TILE_AT[Q4_0])"
    baseline = "repack's layout (the prefill stage's)"

    def cases(self, rng, quick):
        plans = [((16, 32), "one group of 16 rows, one block each"),
                 ((32, 64), "two groups, two blocks a row"),
                 ((13, 96), "13 rows: one group, its last 3 rows zeros (not 0 - 8)"),
                 ((1, 32), "a single row: one group of 1 row and 15 of zeros"),
                 ((48, 576), "48 rows of SmolLM2's width (18 blocks)"),
                 ((197, 576), "197 rows: 12 full groups and one of 5")]
        return [Case(f"N={N} K={K}: {why}", {"raw": q4_0_weight(rng, N, K)}) for (N, K), why in plans]

    def judge(self, sol, case):
        raw = case.inputs["raw"]
        nb = raw.shape[1] // 18
        sizes = f"ceil({raw.shape[0]} / {GROUP}) groups x {nb} blocks x {BLOCK} bytes"
        return same_bytes(sol.tile_layout_q4_0(raw), stage_layout(raw), sizes, lambda o: locate(o, nb),
                          " (a value q - 8 as its byte: -8 is 248)")

    def timings(self, sol, quick):
        raw, what = load_weight(quick)
        self.timing_note = what + ", 1 thread"
        reps = 3 if quick else 7
        work = (raw.nbytes, "GB/s of blocks")
        return [Timing("laying the matrix out at load: yours", best_seconds(lambda: sol.tile_layout_q4_0(raw), reps),
                       "yours", work),
                Timing("laying the matrix out at load: the amx stage's", best_seconds(lambda: stage_layout(raw), reps),
                       "stage", work),
                Timing("repack's 8-row groups at load (the prefill stage's layout)",
                       best_seconds(lambda: repacked.repack(raw, Q4_0), reps), "previous", work)]


EXERCISE = TileLayout()
