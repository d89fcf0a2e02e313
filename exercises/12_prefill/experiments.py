"""Chapter 12's experiments (run: make try-it ch=12)."""

from __future__ import annotations

import time

import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import engine, experiment

check = load_file(__file__.replace("experiments", "check"))


@experiment("the rows of a tile of the prefill stage's attention: 1 (decode's way) to 64")
def tile_rows(quick):
    """a tile reads each block of K and V once for R x G queries: from 1 row to 16 the reads per query
    fall 16 times and the time falls with them, until the arithmetic (scores and weighted sums, the
    same for any R) is what is left: a few times faster, then flat"""
    M, G, hd = (64 if quick else 512), 3, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((M, G, hd)).astype(np.float32)
    k = rng.standard_normal((M, hd)).astype(np.float32)
    v = rng.standard_normal((M, hd)).astype(np.float32)
    scale = np.float32(1 / np.sqrt(hd))
    y = np.ascontiguousarray(q.reshape(M, G * hd))
    out = np.zeros((M, G * hd), np.float32)
    rows = []
    for R in ((1, 16) if quick else (1, 4, 16, 64)):
        cache, _, dims, w = check._layout(q[:R], k, v, 0, scale)
        all_rows = check.rows_at(np.arange(M, dtype=np.int64))
        s = best_seconds(lambda: check._stage_tiles(y, R, cache, all_rows, dims, w, out, G, hd), 3 if quick else 7)
        rows.append((f"tiles of {R} row(s): {R * G} queries per pass over K and V", s * 1e3, "ms"))
    return {"rows": rows, "note": f"one KV head of a {M}-token prompt, G = {G} query heads, 1 thread"}


@experiment("the stage for a prompt: repack (a row at a time through attention, its decode kernel for "
            "every matmul) against prefill", model=True)
def ttft(quick):
    """a prompt is compute-bound: each loaded weight block serves every prompt row. prefill's
    attention reads K and V once per tile, and its pair kernel puts two rows in a 512-bit register,
    which does twice the work only where the core issues it as often as a 256-bit one (Intel's
    AVX-512 cores; Zen 4 runs it as two halves): a 256-token prompt should come out about 1.1x (Zen
    4) to about 2x faster (quick: 32 tokens, less)"""
    n = 32 if quick else 256
    tokens = [(i * 37) % 1000 + 100 for i in range(n)]
    rows = []
    for stage in ("repack", "prefill"):
        model = engine(stage, n_ctx=n + 8)

        def prompt():
            model.reset()
            model.forward(tokens, 0, all_logits=False)
        prompt()
        best = float("inf")
        for _ in range(2 if quick else 5):
            t0 = time.perf_counter()
            prompt()
            best = min(best, time.perf_counter() - t0)
        model.reset()
        rows.append((f"{stage}: a {n}-token prompt's forward pass", best * 1e3, "ms"))
    rows.append(("repack over prefill", rows[0][1] / rows[1][1], "x"))
    return {"rows": rows, "note": "time to first token is this pass plus one sample"}
