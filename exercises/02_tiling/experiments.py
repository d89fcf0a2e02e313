"""Chapter 02's experiments (run: make try-it ch=02)."""

from __future__ import annotations

import numpy as np

from common.cpu import cache_sizes
from exercises.harness import best_seconds
from exercises.matmuls import gflops_at
from exercises.try_it import experiment
from stages.naive import matmul_textbook
from stages.tiling import TILE_I, TILE_J, make_tiled_matmul


def l1_bytes() -> int:
    return cache_sizes()["L1d"]


@experiment("TILE_K, the tile's depth along the sum (stages/tiling.py; make_tiled_matmul(8, 64, TILE_K))")
def tile_k(quick):
    """inside a tile each column walk touches TILE_K cache lines of B (64 bytes each), which the next
    column reuses if they are still in L1: 1 KiB at 16, 4 KiB at 64, 16 KiB at 256, and at 1024
    (capped by K = 576) 36 KiB. The time barely moves while that fits L1d (32-48 KiB) and jumps once
    it does not: every column walk then misses L1 again"""
    M, K, N = (8, 256, 256) if quick else (16, 576, 1536)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    rows = []
    for tk in ((16, 256) if quick else (16, 64, 256, 1024)):
        fn = make_tiled_matmul(TILE_I, TILE_J, tk, cache=False)
        s = best_seconds(lambda: fn(A, B), 2 if quick else 5)
        rows.append((f"TILE_K {tk}: a B tile of {tk * TILE_J * 4 // 1024} KiB", s * 1e3, "ms"))
    return {"rows": rows, "note": f"this machine's L1d: {l1_bytes() // 1024} KiB"}


@experiment("B's width N, K fixed at 256: naive against tiled")
def b_width(quick):
    """the naive loop stays fast while B (K x N x 4 bytes) fits in L2 (1-2 MiB) and slows once it does
    not (it reads B again for each of the 8 rows). If the tiled loop holds its speed there, L2 was
    the whole story; if it slows as much, something else grows with N: a column walk steps N x 4
    bytes at a time, a new 4 KiB page every step once N passes 1024, and 256 pages a walk outrun the
    TLB that translates their addresses"""
    M, K = 8, 256
    shapes = [(M, K, N) for N in ((250, 2000) if quick else (250, 1000, 4000, 16000))]
    naive = gflops_at(matmul_textbook, shapes, 2 if quick else 4)
    tiled = gflops_at(make_tiled_matmul(TILE_I, TILE_J, 64), shapes, 2 if quick else 4)
    rows = []
    for (_, _, N), one, other in zip(shapes, naive, tiled):
        mib = K * N * 4 / 2**20
        rows += [(f"naive, B {mib:.2f} MiB", one, "GFLOP/s"), (f"tiled, B {mib:.2f} MiB", other, "GFLOP/s")]
    return {"rows": rows, "note": f"the naive loop reads all of B per row of A: cheap while B sits in L2 "
                                  f"(here {cache_sizes()['L2'] / 2**20:.1f} MiB)"}


@experiment("B's row length: 4000, 4096 and 4160 bytes (the naive loop)")
def aliasing(quick):
    """a column walk with rows of exactly 4 KiB puts every line in the same L1 set (8-12 ways): it
    misses even when small; 4000 and 4160 bytes spread the lines over all sets and run faster"""
    M, K = 8, (256 if quick else 512)
    widths = (1000, 1024, 1040)
    rates = gflops_at(matmul_textbook, [(M, K, N) for N in widths], 2 if quick else 5)
    return {"rows": [(f"naive, rows of B {N * 4} bytes", rate, "GFLOP/s") for N, rate in zip(widths, rates)],
            "note": "addresses 4 KiB apart share an L1 set"}
