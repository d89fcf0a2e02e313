"""Chapter 07's check: your row split against the quantized stage's kernel on all rows (the same
bits, value for value: a split never reorders an output's additions) and against the threads
stage's own (stages/kernels/threaded.py: matvec_parallel); then timed on this machine's cores
beside it and beside the single-thread kernel (the quantized stage, which this one builds on)."""

from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np

from exercises.harness import Case, Exercise, Timing, as_kernel, best_seconds, exact, kernel_flags, load_file
from stages.kernels import dequant_dot, toolkit
from stages.kernels.dequant_dot import matvec_q4_1
from stages.kernels.threaded import matvec_parallel
from stages.kernels.toolkit import F16_TO_F32, Q4_1
from stages.threads import default_threads

_quantized = load_file(__file__.replace("07_threads", "05_quantized"))
q4_1_weight, decode_weight = _quantized.q4_1_weight, _quantized.decode_weight


def stage_split(x, w, f16, n_chunks):
    return matvec_parallel(x, w, Q4_1, f16, n_chunks)


class Threads(Exercise):
    chapter = "07"
    title = "threads: a matrix's rows split across the cores"
    folder = "exercises/07_threads"
    file = "split_rows.py"
    reference = {"matvec_parallel": stage_split}
    reference_code = "stages/kernels/threaded.py: matvec_parallel"

    def cases(self, rng, quick):
        plans = [((37, 576, 2), "37 rows in 2 ranges (19 + 18)"),
                 ((9, 64, 4), "9 rows in 4 ranges (3 + 3 + 3 + 0: the last is empty)"),
                 ((1, 32, 2), "1 row, 2 ranges: more ranges than rows"),
                 ((10, 96, 3), "10 rows in 3 ranges (4 + 4 + 2)"),
                 ((64, 64, 64), "one row per range"),
                 ((1536, 576, 7), "SmolLM2's ffn_up in 7 ranges")]
        out = []
        for (N, K, chunks), why in plans:
            w = q4_1_weight(rng, N, K)
            x = rng.standard_normal(K).astype(np.float32)
            out.append(Case(f"N={N} n_chunks={chunks}: {why}", {"x": x, "w": w, "n": chunks}))
        return out

    def prepare(self, sol):
        fn = as_kernel(sol.matvec_parallel, **kernel_flags(matvec_parallel))
        # a cached compile inlines the quantized kernel: recompile when that file changes
        toolkit.guard_cache(f"exercise07.{id(type(fn))}", [fn], [dequant_dot.__file__, toolkit.__file__])
        return SimpleNamespace(matvec_parallel=fn)

    def judge(self, sol, case):
        x, w, n = case.inputs["x"], case.inputs["w"], case.inputs["n"]
        got = sol.matvec_parallel(x, w, F16_TO_F32, n)
        one = matvec_q4_1(x, w, F16_TO_F32)
        wrong = exact("y (against one thread's kernel on all rows)", got, one)
        if wrong is None:
            wrong = exact("y (against the threads stage's)", got, stage_split(x, w, F16_TO_F32, n))
        return wrong, "the same bits as one thread"

    def timings(self, sol, quick):
        nt = default_threads()
        numba.set_num_threads(nt)
        raw, what = decode_weight(quick)
        K = raw.shape[1] // 20 * 32
        self.timing_note = what + f", {nt} threads (this machine's physical cores)"
        x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
        reps = 3 if quick else 10
        work = (raw.nbytes, "GB/s of blocks")
        return [Timing(f"yours, {nt} threads", best_seconds(lambda: sol.matvec_parallel(x, raw, F16_TO_F32, nt), reps),
                       "yours", work),
                Timing(f"the stage's (threads), {nt} threads", best_seconds(lambda: stage_split(x, raw, F16_TO_F32, nt),
                                                                           reps), "stage", work),
                Timing("the previous stage's (quantized), 1 thread",
                       best_seconds(lambda: matvec_q4_1(x, raw, F16_TO_F32), reps), "previous", work)]


EXERCISE = Threads()
