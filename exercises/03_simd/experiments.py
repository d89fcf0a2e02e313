"""Chapter 03's experiments (run: make try-it ch=03)."""

from __future__ import annotations

import numpy as np
from numba import njit

from exercises.harness import best_seconds
from exercises.try_it import Experiment
from stages.simd import matmul_panels

# the stage's kernel compiled again without fastmath: the same code, no permission to reorder a sum
strict = njit(matmul_panels.py_func)


def fastmath_off(quick):
    M, K, N = (8, 256, 256) if quick else (16, 576, 1536)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((M, K)).astype(np.float32)
    W = rng.standard_normal((N, K)).astype(np.float32)
    flops = 2.0 * M * K * N
    on = best_seconds(lambda: matmul_panels(A, W), 2 if quick else 5)
    off = best_seconds(lambda: strict(A, W), 2 if quick else 5)
    return {"rows": [("fastmath {reassoc, contract, nsz} (the stage)", flops / on / 1e9, "GFLOP/s"),
                     ("fastmath off", flops / off / 1e9, "GFLOP/s"),
                     ("on over off", off / on, "x")],
            "note": "the chapter's assembly cell shows the packed vfmadd...ps the flag allows"}


def one_row(quick):
    K, N = (256, 256) if quick else (576, 1536)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((N, K)).astype(np.float32)
    rows = []
    for M in (1, 4, 16):
        A = rng.standard_normal((M, K)).astype(np.float32)
        s = best_seconds(lambda: matmul_panels(A, W), 2 if quick else 5)
        rows.append((f"{M} row(s) of A", 2.0 * M * K * N / s / 1e9, "GFLOP/s"))
    return {"rows": rows, "note": "with 1 row the 4 x 4 block is a 1 x 4 block: each weight loaded serves one FMA"}


EXPERIMENTS = [
    Experiment("fastmath_off", "fastmath on matmul_panels (stages/simd.py; the flags in stages/kernels/toolkit.py)",
               "without 'reassoc' LLVM may not split a sum across vector lanes: the 16 sums stay scalar, one "
               "lane of 8 or 16, so several times slower (up to the vector width: 8 with AVX2, 16 with "
               "AVX-512), though the 16 independent chains still keep the FMA units busier than tiling's one",
               fastmath_off),
    Experiment("one_row", "the rows of A: 1 (a decode step), 4, 16 (a prompt)",
               "each weight loaded serves as many FMAs as there are rows in the block (up to 4): 1 row does "
               "a quarter of the work per load, so well under half the GFLOP/s of 4 rows (not a full quarter: "
               "x's loads and the stores are fewer too); 16 rows about as fast as 4",
               one_row),
]
