"""Chapter 03's check: your panel matmul against stages/simd.py's matmul_panels, the weight packed
as the stage holds it (W = B^T, [N, K], N a multiple of 4); then timed beside it and beside the
tiling stage's blocked loop (the stage this one builds on) on the same product. The cases, the
judging and the timing are the three matmul chapters' (exercises/matmuls.py)."""

from __future__ import annotations

from exercises.matmuls import MatmulExercise
from stages.simd import PANEL, matmul_panels
from stages.tiling import matmul_tiled


class Simd(MatmulExercise):
    chapter = "03"
    title = "simd: packed weights, a 4 x 4 block of independent sums"
    folder = "exercises/03_simd"
    file = "panels.py"
    reference = {"matmul_panels": matmul_panels}
    panels = PANEL
    reference_code = "stages/simd.py: matmul_panels"
    previous = ("the previous stage's (tiling)", matmul_tiled)


EXERCISE = Simd()
