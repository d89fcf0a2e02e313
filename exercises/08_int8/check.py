"""Chapter 08's check: your rounding against stages/kernels/q8.py's (the int8 stage's quantize_q8,
llama.cpp's quantize_row_q8_1): every integer and every scale equal, bit for bit. Then the int8
stage's integer product (stages/kernels/int_dot.py) fed your blocks, timed beside the quantized
stage's float product, and the rounding itself beside the stage's."""

from __future__ import annotations

import numpy as np

from exercises.harness import Case, Exercise, Timing, best_seconds, exact, load_file
from stages.kernels.dequant_dot import matvec_q4_1
from stages.kernels.int_dot import matvec_int8
from stages.kernels.q8 import quantize_q8
from stages.kernels.toolkit import F16_TO_F32, Q4_1

_quantized = load_file(__file__.replace("08_int8", "05_quantized"))
q4_1_weight, decode_weight = _quantized.q4_1_weight, _quantized.decode_weight
FIELDS = ("q", "d", "s", "sums")
f32 = np.float32


def stage_round(x):
    q, d, s, sums = quantize_q8(np.ascontiguousarray(x, dtype=f32)[None, :], 32)
    return q[0], d[0], s[0], sums[0]


def product_not_quotient(rng) -> np.ndarray:
    """A block where x * (1 / dd), rounded to float32, lands on the other side of a .5 than
    x / dd does: found by walking the float32 neighbours of (n + 0.5) * dd (seeded)."""
    while True:
        block = rng.standard_normal(32).astype(f32)
        block[0] = f32(4.0) * np.sign(block[0])                # amax = 4: dd = 4 / 127
        dd = np.abs(block).max() / f32(127.0)
        inv = f32(1.0) / dd
        for n in rng.integers(1, 126, size=64):
            x = f32((n + 0.5) * dd)
            for _ in range(4):
                up = round_away(f32(x * inv)) != round_away(f32(x / dd))
                if up and np.abs(x) < 4.0:
                    block[1] = x
                    return block
                x = np.nextafter(x, f32(np.inf))


def round_away(v) -> int:
    return int(np.sign(v) * np.floor(np.abs(np.float64(v)) + 0.5))


class Int8(Exercise):
    chapter = "08"
    title = "int8: llama.cpp's rounding of an activation row to Q8_1 blocks"
    folder = "exercises/08_int8"
    file = "round_q8.py"
    reference = {"quantize_row_q8_1": stage_round}
    reference_code = "stages/kernels/q8.py: quantize_row_32 (through quantize_q8)"

    def cases(self, rng, quick):
        ties = np.zeros(32, f32)
        ties[:8] = [127.0, 2.5, -2.5, 0.5, -0.5, 126.5, -1.5, 3.5]     # amax 127: dd = 1, x * id = x
        ties[8:] = rng.integers(-120, 120, 24) + f32(0.5)
        negative = rng.standard_normal(64).astype(f32)
        negative[37] = f32(-9.0)                                      # the largest magnitude, negative
        mixed = rng.standard_normal(96).astype(f32)
        mixed[32:64] = 0.0                                            # one block of zeros
        plans = [(rng.standard_normal(32).astype(f32), "one block of ordinary values"),
                 (ties, "ties: x * id exactly on .5 (roundf rounds away from zero, np.round to even)"),
                 (product_not_quotient(rng), "x * (1 / dd) and x / dd round to different sides of a .5"),
                 (mixed, "a block of zeros between two others: d = 0, q = 0, no division by zero"),
                 (negative, "the block's largest magnitude is negative"),
                 ((rng.standard_normal(576) * 3).astype(f32), "SmolLM2's width: 18 blocks (dd vs float16(dd) "
                                                               "moves values near .5)"),
                 ((rng.standard_normal(64) * 1e-5).astype(f32), "tiny values: d below float16's normal range"),
                 ((rng.standard_normal(1536) * 200).astype(f32), "ffn_down's width, large values (s in the "
                                                                 "thousands)")]
        return [Case(f"K={len(x)}: {why}", {"x": x}) for x, why in plans]

    def judge(self, sol, case):
        x = case.inputs["x"]
        got = sol.quantize_row_q8_1(x.copy())
        if not isinstance(got, tuple) or len(got) != 4:
            return "return (q, d, s, sums): four arrays", ""
        want = stage_round(x)
        for name, g, w in zip(FIELDS, got, want):
            g = np.asarray(g)
            wrong = exact(name, g.astype(w.dtype) if g.dtype.kind == w.dtype.kind else g, w)
            if wrong:
                b = None
                if "[" in wrong:
                    i = int(wrong.split("[")[1].split("]")[0])
                    b = i // 32 if name == "q" else i
                where = f"\n(block {b}: x = {x[32 * b:32 * b + 32].tolist()})" if b is not None else ""
                return wrong + where, ""
        return None, "every integer and scale equal"

    def timings(self, sol, quick):
        raw, what = decode_weight(quick)
        K = raw.shape[1] // 20 * 32
        self.timing_note = what + ", 1 thread; and the rounding of one row of 576"
        x = np.random.default_rng(1).standard_normal(K).astype(f32)
        q, d, s, sums = (np.ascontiguousarray(np.asarray(a).astype(w.dtype))
                         for a, w in zip(sol.quantize_row_q8_1(x), stage_round(x)))
        mine = lambda: matvec_int8(q, d, s, sums, raw, Q4_1, F16_TO_F32, 1)
        theirs = stage_round(x)
        reps = 3 if quick else 10
        work = (raw.nbytes, "GB/s of blocks")
        return [Timing("the int8 stage's integer product, fed your blocks", best_seconds(mine, reps), "yours", work),
                Timing("the int8 stage's, fed its own", best_seconds(
                    lambda: matvec_int8(*theirs, raw, Q4_1, F16_TO_F32, 1), reps), "stage", work),
                Timing("the previous stage's float product (quantized)",
                       best_seconds(lambda: matvec_q4_1(x, raw, F16_TO_F32), reps), "previous", work),
                Timing("rounding one row: yours", best_seconds(lambda: sol.quantize_row_q8_1(x), reps), "other"),
                Timing("rounding one row: the stage's", best_seconds(lambda: stage_round(x), reps), "other")]


EXERCISE = Int8()
