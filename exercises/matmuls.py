"""The check the three matmul exercises (chapters 01-03) share: their cases, how a product is
judged, and the timing beside the stage's and the previous one's, on the same shapes. A chapter's
check says which function the learner writes, the stage's own it is checked against, and the
stage before it (`MatmulExercise`). And a matmul's GFLOP/s at a few shapes, for the chapters'
experiments (`gflops_at`).

The cases are chosen for the edges the stages' loops have: a single row (a decode step), sizes
that are not multiples of anything (tiles, vector widths, the 4 x 4 register block), exactly one
tile, partial tiles on every axis, and values of very different sizes. Each product is judged
against the stage's own result within the bound two float32 sums of K products can honestly
differ by (harness.sum_bound), computed from this case's |A| @ |B| in float64.
"""

from __future__ import annotations

import numpy as np

from exercises.harness import Case, Exercise, Timing, best_seconds, close, sum_bound, worst_ratio

# SmolLM2's ffn_up weight: 576 inputs, 1536 outputs, at 16 prompt rows (`python -m app bench tiling`'s);
# --quick: a small stand-in
TIMED = {"full": (16, 576, 1536), "quick": (4, 128, 256)}


def timed_shape(quick: bool) -> tuple[tuple[int, int, int], str]:
    M, K, N = TIMED["quick" if quick else "full"]
    what = "a small stand-in (--quick)" if quick else f"SmolLM2's ffn_up at {M} prompt rows"
    return (M, K, N), f"[{M} x {K}] @ [{K} x {N}], {what}"


def cases(rng, n_multiple: int = 1) -> list[Case]:
    """(M, K, N) shapes, each with a reason; N rounded up to n_multiple (the simd panels' 4)."""
    shapes = [
        ((1, 1, n_multiple), "the smallest"),
        ((1, 576, 192), "one row (a decode step), SmolLM2's attn_k shape"),
        ((3, 7, 5), "odd sizes everywhere"),
        ((8, 64, 64), "exactly one 8 x 64 x 64 tile"),
        ((13, 100, 70), "partial tiles on every axis (13 rows, 100 = 64 + 36, 70 = 64 + 6)"),
        ((5, 37, 12), "rows past a multiple of 4, K past a multiple of 8 and 16"),
        ((9, 130, 132), "9 rows, K and N just past two tiles"),
        ((2, 300, 8), "values from 1e-3 to 1e3 (the bound follows the magnitudes)"),
    ]
    out = []
    for (M, K, N), why in shapes:
        N = -(-N // n_multiple) * n_multiple
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        if "1e3" in why:
            A *= np.float32(10.0) ** rng.integers(-3, 4, size=(M, K)).astype(np.float32)
        out.append(Case(f"M={M} K={K} N={N}: {why}", {"A": A, "B": B}))
    return out


def judge(C, want, A, B) -> tuple[str | None, str]:
    """C (yours) against want (the stage's), both float32 sums of the same K products per value:
    they may differ by the order of the additions and no more (harness.sum_bound)."""
    bound = sum_bound(np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64), A.shape[1])
    return close("C", C, want, bound), worst_ratio(C, want, bound)


def flops(M, K, N) -> tuple[float, str]:
    return 2.0 * M * K * N, "GFLOP/s"


def gflops_at(matmul, shapes, reps: int, panels: bool = False) -> list[float]:
    """matmul's GFLOP/s (2 M K N flops over the best of reps calls) at each (M, K, N) of `shapes`,
    on seeded standard-normal operands: A [M, K] and B [K, N], or with `panels` the weight as the
    simd stage packs it, W [N, K]."""
    rng = np.random.default_rng(0)
    out = []
    for M, K, N in shapes:
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((N, K) if panels else (K, N)).astype(np.float32)
        out.append(2.0 * M * K * N / best_seconds(lambda: matmul(A, B), reps) / 1e9)
    return out


def packed(B):
    """The weight as the simd stage packs it: W = B^T, [N, K] contiguous."""
    return np.ascontiguousarray(B.T)


class MatmulExercise(Exercise):
    """C = A @ B written by the learner (the one name of `reference`), judged against the stage's
    own on every case, then timed beside it and beside `previous` (a label, a function of A and B:
    the stage this one builds on). `panels`: the function takes the weight packed (W = B^T,
    [N, K], N a multiple of `panels`), as the simd stage holds it; 0: it takes B."""

    previous: tuple = ()
    panels = 0

    def _operand(self, B):
        return packed(B) if self.panels else B

    def cases(self, rng, quick):
        out = cases(rng, n_multiple=self.panels or 1)
        for case in out:
            case.inputs["weight"] = self._operand(case.inputs["B"])
        return out

    def judge(self, sol, case):
        (name, stage), = self.reference.items()
        A, B, weight = case.inputs["A"], case.inputs["B"], case.inputs["weight"]
        return judge(getattr(sol, name)(A, weight), stage(A, weight), A, B)

    def timings(self, sol, quick):
        (name, stage), = self.reference.items()
        label, previous = self.previous
        (M, K, N), self.timing_note = timed_shape(quick)
        rng = np.random.default_rng(0)
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        weight, yours = self._operand(B), getattr(sol, name)
        reps = 2 if quick else 5
        work = flops(M, K, N)
        return [Timing("yours", best_seconds(lambda: yours(A, weight), reps), "yours", work),
                Timing(f"the stage's ({self.title.split(':')[0]})", best_seconds(lambda: stage(A, weight), reps),
                       "stage", work),
                Timing(label, best_seconds(lambda: previous(A, B), reps), "previous", work)]
