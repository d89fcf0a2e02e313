"""Chapter 03's experiments (run: make try-it ch=03)."""

from __future__ import annotations

from numba import njit

from exercises.matmuls import gflops_at
from exercises.try_it import experiment
from stages.simd import matmul_panels

# the stage's kernel compiled again without fastmath: the same code, no permission to reorder a sum
strict = njit(matmul_panels.py_func)


@experiment("fastmath on matmul_panels (stages/simd.py; the flags in stages/kernels/toolkit.py)")
def fastmath_off(quick):
    """without 'reassoc' LLVM may not split a sum across vector lanes: the 16 sums stay scalar, one
    lane of 8 or 16, so several times slower (up to the vector width: 8 with AVX2, 16 with AVX-512),
    though the 16 independent chains still keep the FMA units busier than tiling's one"""
    shape = (8, 256, 256) if quick else (16, 576, 1536)
    (on,), (off,) = (gflops_at(fn, [shape], 2 if quick else 5, panels=True) for fn in (matmul_panels, strict))
    return {"rows": [("fastmath {reassoc, contract, nsz} (the stage)", on, "GFLOP/s"),
                     ("fastmath off", off, "GFLOP/s"),
                     ("on over off", on / off, "x")],
            "note": "the chapter's assembly cell shows the packed vfmadd...ps the flag allows"}


@experiment("the rows of A: 1 (a decode step), 4, 16 (a prompt)")
def one_row(quick):
    """each weight loaded serves as many FMAs as there are rows in the block (up to 4): 1 row does a
    quarter of the work per load, so well under half the GFLOP/s of 4 rows (not a full quarter: x's
    loads and the stores are fewer too); 16 rows about as fast as 4"""
    K, N = (256, 256) if quick else (576, 1536)
    rates = gflops_at(matmul_panels, [(M, K, N) for M in (1, 4, 16)], 2 if quick else 5, panels=True)
    return {"rows": [(f"{M} row(s) of A", rate, "GFLOP/s") for M, rate in zip((1, 4, 16), rates)],
            "note": "with 1 row the 4 x 4 block is a 1 x 4 block: each weight loaded serves one FMA"}
