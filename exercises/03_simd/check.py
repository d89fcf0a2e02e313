"""Chapter 03's check: your panel matmul against stages/simd.py's matmul_panels; then timed beside
it and beside the tiling stage's blocked loop (the stage this one builds on) on the same product."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from exercises import matmuls
from exercises.harness import Exercise, Timing, as_kernel, best_seconds
from stages.kernels.toolkit import FASTMATH
from stages.simd import PANEL, matmul_panels
from stages.tiling import matmul_tiled


class Simd(Exercise):
    chapter = "03"
    title = "simd: packed weights, a 4 x 4 block of independent sums"
    folder = "exercises/03_simd"
    file = "panels.py"
    names = ("matmul_panels",)
    reference_code = "stages/simd.py: matmul_panels"

    def reference(self):
        return SimpleNamespace(matmul_panels=matmul_panels)

    def prepare(self, sol):
        return SimpleNamespace(matmul_panels=as_kernel(sol.matmul_panels, fastmath=FASTMATH))

    def cases(self, quick):
        out = matmuls.cases(quick, n_multiple=PANEL)
        for case in out:                   # the weight as the stage packs it: W = B^T, [N, K] contiguous
            case.inputs["W"] = np.ascontiguousarray(case.inputs["B"].T)
        return out

    def judge(self, sol, case):
        A, B, W = case.inputs["A"], case.inputs["B"], case.inputs["W"]
        return matmuls.judge(sol.matmul_panels(A, W), matmul_panels(A, W), A, B)

    def timings(self, sol, quick):
        (M, K, N), self.timing_note = matmuls.timed_shape(quick)
        rng = np.random.default_rng(0)
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        W = np.ascontiguousarray(B.T)
        reps = 2 if quick else 5
        work = matmuls.flops(M, K, N)
        return [Timing("yours", best_seconds(lambda: sol.matmul_panels(A, W), reps), "yours", work),
                Timing("the stage's (simd)", best_seconds(lambda: matmul_panels(A, W), reps), "stage", work),
                Timing("the previous stage's (tiling)", best_seconds(lambda: matmul_tiled(A, B), reps), "previous",
                       work)]


EXERCISE = Simd()
