"""Chapter 08's experiments (run: make try-it ch=08)."""

from __future__ import annotations

import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import experiment
from stages.kernels import vector_ir
from stages.kernels.int_dot import matvec_int8_auto, matvec_int8_named
from stages.kernels.q8 import quantize_q8
from stages.kernels.toolkit import F16_TO_F32, Q4_1

decode_weight = load_file(__file__.replace("08_int8/experiments", "05_quantized/check")).decode_weight


@experiment("the int8 decode kernel: plain integer loops against the instructions named "
            "(vpdpbusd / vpmaddubsw; the int8-loops variant of the stage)")
def named_vs_loops(quick):
    """LLVM turns the loops into vpmaddwd, 8 products an instruction after widening the bytes; vpdpbusd
    multiplies 32 bytes by 32 and adds them in one: several times fewer instructions per block,
    faster until memory sets the pace"""
    raw, what = decode_weight(quick)
    K = raw.shape[1] // 20 * 32
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    q, d, s, sums = (a[0] for a in quantize_q8(x, 32))
    reps = 3 if quick else 10
    rows = []
    for label, fn in (("loops LLVM vectorized (vpmaddwd)", matvec_int8_auto),
                      (f"instructions named ({vector_ir.ISA or 'none here: the loops'})", matvec_int8_named)):
        t = best_seconds(lambda: fn(q, d, s, sums, raw, Q4_1, F16_TO_F32, 1), reps)
        rows.append((label, t * 1e3, "ms"))
    rows.append(("named over loops", rows[0][1] / rows[1][1], "x"))
    return {"rows": rows, "note": what + "; 1 thread"}


@experiment("int8 rounding of an activation row: how far d q lands from x")
def rounding_error(quick):
    """roundf moves each value by at most half a step of its block, amax / 254 (plus float16's rounding
    of d, 1 part in 2048): at most 0.5 steps and a bit. An outlier 20 times an ordinary value makes
    its own block's step several times coarser (20 |x| against the largest of 32 ordinary values,
    about 2.5 of them) and leaves the other blocks alone"""
    rng = np.random.default_rng(8)
    K = 576
    x = rng.standard_normal((64 if quick else 1024, K)).astype(np.float32)
    x[:, 7] *= 20                                                    # an outlier per row, as activations have
    q, d, _, _ = quantize_q8(x, 32)
    back = (q.reshape(-1, K // 32, 32) * d[:, :, None]).reshape(x.shape)
    amax = np.abs(x.reshape(-1, K // 32, 32)).max(axis=2)
    steps = np.abs(x - back).reshape(-1, K // 32, 32).max(axis=2) / (amax / 127)
    w = rng.standard_normal(K).astype(np.float32)
    rel = np.abs(back @ w - x @ w) / (np.abs(x) @ np.abs(w))
    return {"rows": [("largest error, in steps of its block (amax / 127)", float(steps.max()), "steps"),
                     ("the outlier's block: its step over the next block's (median)",
                      float(np.median(amax[:, 0] / amax[:, 1])), "x"),
                     ("a dot product's error, relative to sum |x w| (largest)", float(rel.max()), "")],
            "note": "one scale per 32 values: an outlier coarsens only its own block"}
