"""Chapter 10's experiments (run: make try-it ch=10)."""

from __future__ import annotations

import numba
import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import engine, experiment, step_ms
from stages.kernels import repacked
from stages.kernels.q8 import new_packs, quantize_row
from stages.kernels.toolkit import Q4_1

decode_weight = load_file(__file__.replace("10_repack/experiments", "05_quantized/check")).decode_weight


@experiment("LLM_KV_TYPE: K and V stored as float16 (the stage's default, llama.cpp's) or float32", model=True)
def kv_type(quick):
    """a decode step reads K and V of every position: at 1024 positions 2 x 30 x 1024 x 192 values, 24
    MB as float16 and 47 MB as float32, beside 94 MB of weights: float32 should cost about a quarter
    more at 1024 positions and nothing visible at 64"""
    ctx = 64 if quick else 1024
    rows = []
    for kv in ("f16", "f32"):
        model = engine("repack", n_ctx=ctx + 8, LLM_KV_TYPE=kv)
        ms = step_ms(model, ctx, 3 if quick else 9)
        rows.append((f"LLM_KV_TYPE={kv}: a decode step at {ctx} positions", ms, "ms"))
    rows.append(("f32 over f16", rows[1][1] / rows[0][1], "x"))
    return {"rows": rows, "note": "K and V read per step: 2 x 30 layers x positions x 192 values x 2 or 4 bytes"}


def _kernel():
    """repack's kernel compiled now, with the prefetch choice repacked.GROUP_PREFETCH holds now."""
    @numba.njit
    def run(blob, rb, p32, pk, out, n):
        repacked.group_gemm(Q4_1, blob, 0, rb, p32, pk, 1, out, 0, 0, n)
    return run


@experiment("the software prefetch distance of repack's kernel (repacked.GROUP_PREFETCH: which "
            "cache, how far ahead)")
def prefetch(quick):
    """a prefetch far enough ahead hides the memory's latency when one thread streams a matrix larger
    than the caches: a few tens of percent over none, more where the hardware prefetchers fall
    behind; too near and the line is not there in time, into L1 too early and it is evicted before
    use (on a Zen 4 the K-quants measured slower into L1 than with none at all)"""
    raw, what = decode_weight(quick)
    K = raw.shape[1] // 20 * 32
    blob = repacked.repack(raw, Q4_1)
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    p32, pk = new_packs(1, K)
    quantize_row(x[0], 0, K, True, False, p32, pk)
    out = np.zeros((1, raw.shape[0]), np.float32)
    now = repacked.GROUP_PREFETCH
    choices = [(0, 0), now[Q4_1]] if quick else [(0, 0), (1, 1024), (1, 4096), (2, 4096), (2, 32768)]
    rows = []
    for level, ahead in choices:
        repacked.GROUP_PREFETCH = {**now, Q4_1: (level, ahead)}
        try:
            run = _kernel()
            run(blob, raw.shape[1], p32, pk, out, raw.shape[0])            # compiled with this choice
        finally:
            repacked.GROUP_PREFETCH = now
        s = best_seconds(lambda: run(blob, raw.shape[1], p32, pk, out, raw.shape[0]), 3 if quick else 15)
        name = "no software prefetch" if level == 0 else f"into L{level}, {ahead // 1024} KiB ahead"
        chosen = " (the stage's choice here)" if (level, ahead) == now[Q4_1] else ""
        rows.append((name + chosen, raw.nbytes / s / 1e9, "GB/s"))
    return {"rows": rows, "note": what + "; 1 thread; `python -m app bench prefetch` times every choice and type"}
