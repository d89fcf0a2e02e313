"""Chapter 07's experiments (run: make try-it ch=07)."""

from __future__ import annotations

import numba
import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import engine, experiment, step_ms
from stages.kernels.threaded import matvec_parallel
from stages.kernels.toolkit import F16_TO_F32, Q4_1
from stages.threads import default_threads

decode_weight = load_file(__file__.replace("07_threads/experiments", "05_quantized/check")).decode_weight


@experiment("threads: the decode product's rows split over 1 or all physical cores")
def kernel_threads(quick):
    """two answers, and the measurement says which holds here: if one core already streams the blocks
    as fast as memory delivers them, a second core adds little; if one core's unpacking is slower
    than memory (the chapter's roofline: compare the GB/s of blocks with the machine's bandwidth),
    each core adds its unpacking, up to the bandwidth floor"""
    raw, what = decode_weight(quick)
    x = np.random.default_rng(1).standard_normal(raw.shape[1] // 20 * 32).astype(np.float32)
    rows = []
    for nt in sorted({1, default_threads()}):
        numba.set_num_threads(nt)
        s = best_seconds(lambda: matvec_parallel(x, raw, Q4_1, F16_TO_F32, nt), 3 if quick else 10)
        rows.append((f"{nt} thread(s): {raw.nbytes / 2**20:.0f} MiB of blocks", s * 1e3, "ms"))
        rows.append(("  GB/s of blocks", raw.nbytes / s / 1e9, "GB/s"))
    numba.set_num_threads(default_threads())
    return {"rows": rows, "note": what}


@experiment("--threads N for the whole decode step (the threads stage, SmolLM2)", model=True)
def model_threads(quick):
    """less than the kernel's gain: SmolLM2's matrices are small (under a MiB each), so every matmul's
    fork and join, and Python between the ops, are a visible share of a step that threads do not
    shorten"""
    model = engine("threads", n_ctx=80)
    rows = []
    n = model.backend.threads
    for nt in sorted({1, n}):
        model.backend.threads = nt
        rows.append((f"threads stage, decode step, {nt} thread(s)", step_ms(model, 32, 3 if quick else 9), "ms"))
    model.backend.threads = n
    return {"rows": rows, "note": "`python -m app run --stage threads --threads 1` runs a whole generation so"}
