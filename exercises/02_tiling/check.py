"""Chapter 02's check: your blocked loop nest against stages/tiling.py's matmul_tiled; then timed
beside it and beside the naive stage's textbook loop (the stage this one builds on)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from exercises import matmuls
from exercises.harness import Exercise, Timing, as_kernel, best_seconds
from stages.naive import matmul_textbook
from stages.tiling import matmul_tiled


class Tiling(Exercise):
    chapter = "02"
    title = "tiling: the blocked loop nest, partial tiles included"
    folder = "exercises/02_tiling"
    file = "tiled_matmul.py"
    names = ("matmul_tiled",)
    reference_code = "stages/tiling.py: make_tiled_matmul (matmul_tiled, tiles 8 x 64 x 64)"

    def reference(self):
        return SimpleNamespace(matmul_tiled=matmul_tiled)

    def prepare(self, sol):
        return SimpleNamespace(matmul_tiled=as_kernel(sol.matmul_tiled))

    def cases(self, quick):
        return matmuls.cases(quick)

    def judge(self, sol, case):
        A, B = case.inputs["A"], case.inputs["B"]
        return matmuls.judge(sol.matmul_tiled(A, B), matmul_tiled(A, B), A, B)

    def timings(self, sol, quick):
        (M, K, N), self.timing_note = matmuls.timed_shape(quick)
        rng = np.random.default_rng(0)
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        reps = 2 if quick else 5
        work = matmuls.flops(M, K, N)
        return [Timing("yours", best_seconds(lambda: sol.matmul_tiled(A, B), reps), "yours", work),
                Timing("the stage's (tiling)", best_seconds(lambda: matmul_tiled(A, B), reps), "stage", work),
                Timing("the previous stage's (naive)", best_seconds(lambda: matmul_textbook(A, B), reps), "previous",
                       work)]


EXERCISE = Tiling()
