"""Chapter 02's check: your blocked loop nest against stages/tiling.py's matmul_tiled; then timed
beside it and beside the naive stage's textbook loop (the stage this one builds on). The cases,
the judging and the timing are the three matmul chapters' (exercises/matmuls.py)."""

from __future__ import annotations

from exercises.matmuls import MatmulExercise
from stages.naive import matmul_textbook
from stages.tiling import matmul_tiled


class Tiling(MatmulExercise):
    chapter = "02"
    title = "tiling: the blocked loop nest, partial tiles included"
    folder = "exercises/02_tiling"
    file = "tiled_matmul.py"
    reference = {"matmul_tiled": matmul_tiled}
    reference_code = "stages/tiling.py: make_tiled_matmul (matmul_tiled, tiles 8 x 64 x 64)"
    previous = ("the previous stage's (naive)", matmul_textbook)


EXERCISE = Tiling()
