"""Chapter 01's check: your textbook matmul against stages/naive.py's matmul_textbook; then timed
beside it and beside numpy's matmul (OpenBLAS: blocked, vectorized, what the next chapters build
towards). There is no stage before this one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from exercises import matmuls
from exercises.harness import Exercise, Timing, as_kernel, best_seconds
from stages.naive import matmul_textbook


class Naive(Exercise):
    chapter = "01"
    title = "naive: the textbook matmul (the i-j-k loop nest)"
    folder = "exercises/01_naive"
    file = "matmul.py"
    names = ("matmul",)
    reference_code = "stages/naive.py: matmul_textbook"
    baseline = "numpy's (the speed of a tuned BLAS; no stage comes before naive)"

    def reference(self):
        return SimpleNamespace(matmul=matmul_textbook)

    def prepare(self, sol):
        return SimpleNamespace(matmul=as_kernel(sol.matmul))

    def cases(self, quick):
        return matmuls.cases(quick)

    def judge(self, sol, case):
        A, B = case.inputs["A"], case.inputs["B"]
        return matmuls.judge(sol.matmul(A, B), matmul_textbook(A, B), A, B)

    def timings(self, sol, quick):
        (M, K, N), self.timing_note = matmuls.timed_shape(quick)
        rng = np.random.default_rng(0)
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        reps = 2 if quick else 5
        work = matmuls.flops(M, K, N)
        return [Timing("yours", best_seconds(lambda: sol.matmul(A, B), reps), "yours", work),
                Timing("the stage's (naive)", best_seconds(lambda: matmul_textbook(A, B), reps), "stage", work),
                Timing("numpy's A @ B (a tuned BLAS)", best_seconds(lambda: A @ B, reps), "previous", work)]


EXERCISE = Naive()
