"""Chapter 01's check: your textbook matmul against stages/naive.py's matmul_textbook; then timed
beside it and beside numpy's matmul (OpenBLAS: blocked, vectorized, what the next chapters build
towards). There is no stage before this one. The cases, the judging and the timing are the three
matmul chapters' (exercises/matmuls.py)."""

from __future__ import annotations

import numpy as np

from exercises.matmuls import MatmulExercise
from stages.naive import matmul_textbook


class Naive(MatmulExercise):
    chapter = "01"
    title = "naive: the textbook matmul (the i-j-k loop nest)"
    folder = "exercises/01_naive"
    file = "matmul.py"
    reference = {"matmul": matmul_textbook}
    reference_code = "stages/naive.py: matmul_textbook"
    baseline = "numpy's (the speed of a tuned BLAS; no stage comes before naive)"
    previous = ("numpy's A @ B (a tuned BLAS)", np.matmul)


EXERCISE = Naive()
