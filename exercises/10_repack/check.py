"""Chapter 10's check: your Q4_1 layout against stages/kernels/repacked.py's repack, byte for byte;
a wrong byte is reported as (group, block, field, row). Then the repack stage's kernel (group_gemm)
reading your bytes, timed beside the fused stage's row-at-a-time kernel (int_tiles.decode_rows)
reading the file's, and the two layouts' load-time cost."""

from __future__ import annotations

import numpy as np
from numba import njit

from exercises.harness import Case, Exercise, Timing, best_seconds, load_file, same_bytes
from stages.kernels import int_tiles, repacked
from stages.kernels.q8 import new_packs, quantize_row
from stages.kernels.toolkit import Q4_1

_quantized = load_file(__file__.replace("10_repack", "05_quantized"))
q4_1_weight, decode_weight = _quantized.q4_1_weight, _quantized.decode_weight


def stage_repack(raw):
    return repacked.repack(raw, Q4_1)


def locate(offset: int, nb: int) -> str:
    """Byte `offset` of a repacked Q4_1 matrix, in words: which group block, field, row, byte."""
    gblock, o = divmod(offset, 160)
    g, b = divmod(gblock, nb)
    if o < 16:
        return f"group {g} (rows {8 * g}..{8 * g + 7}), block {b}: d of row {8 * g + o // 2}"
    if o < 32:
        return f"group {g}, block {b}: m of row {8 * g + (o - 16) // 2}"
    piece, rest = divmod(o - 32, 32)
    return (f"group {g}, block {b}: qs piece {piece} of row {8 * g + rest // 4}, "
            f"that is qs byte {4 * piece + rest % 4} of the row's block")


@njit
def _packs(x):
    M, K = x.shape
    p32, pk = new_packs(M, K)
    for m in range(M):
        quantize_row(x[m], m, K, True, False, p32, pk)
    return p32, pk


@njit
def _grouped(blob, rb, p32, pk, out, n):
    repacked.group_gemm(Q4_1, blob, 0, rb, p32, pk, out.shape[0], out, 0, 0, n)


@njit
def _row_by_row(w, rb, p32, pk, out, n):
    int_tiles.decode_rows(Q4_1, w, 0, rb, rb // 20, p32, pk, 0, out, 0, n)


class Repack(Exercise):
    chapter = "10"
    title = "repack: a Q4_1 matrix as 8-row group blocks"
    folder = "exercises/10_repack"
    file = "interleave.py"
    reference = {"repack_q4_1": stage_repack}
    reference_code = "stages/kernels/repacked.py: repack (GROUP_FIELDS[Q4_1])"

    def cases(self, rng, quick):
        plans = [((8, 32), "one group of 8 rows, one block each"),
                 ((16, 64), "two groups, two blocks a row"),
                 ((13, 96), "13 rows: the second group has 5 rows and 3 rows of zeros"),
                 ((1, 32), "a single row: one group of 1 row and 7 of zeros"),
                 ((24, 576), "24 rows of SmolLM2's width (18 blocks)"),
                 ((197, 576), "197 rows: 24 full groups and one of 5")]
        return [Case(f"N={N} K={K}: {why}", {"raw": q4_1_weight(rng, N, K)}) for (N, K), why in plans]

    def judge(self, sol, case):
        raw = case.inputs["raw"]
        nb = raw.shape[1] // 20
        return same_bytes(sol.repack_q4_1(raw.copy()), stage_repack(raw),
                          f"ceil({raw.shape[0]} / 8) groups x 8 rows x {raw.shape[1]} bytes", lambda o: locate(o, nb))

    def timings(self, sol, quick):
        raw, what = decode_weight(quick)
        N, K = raw.shape[0], raw.shape[1] // 20 * 32
        self.timing_note = what + ", 1 thread, one activation row (a decode step)"
        x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
        p32, pk = _packs(x)
        mine = np.ascontiguousarray(np.asarray(sol.repack_q4_1(raw), np.uint8).reshape(-1))
        theirs = stage_repack(raw)
        flat = np.ascontiguousarray(raw.reshape(-1))
        out = np.zeros((1, N), np.float32)
        reps = 3 if quick else 10
        work = (raw.nbytes, "GB/s of blocks")
        return [Timing("the repack stage's kernel on your layout", best_seconds(
                    lambda: _grouped(mine, K // 32 * 20, p32, pk, out, N), reps), "yours", work),
                Timing("the repack stage's kernel on its own", best_seconds(
                    lambda: _grouped(theirs, K // 32 * 20, p32, pk, out, N), reps), "stage", work),
                Timing("the previous stage's row-at-a-time kernel (fused)", best_seconds(
                    lambda: _row_by_row(flat, K // 32 * 20, p32, pk, out, N), reps), "previous", work),
                Timing("laying the matrix out at load: yours", best_seconds(lambda: sol.repack_q4_1(raw), 2), "other"),
                Timing("laying the matrix out at load: the stage's", best_seconds(lambda: stage_repack(raw), 2),
                       "other")]


EXERCISE = Repack()
