"""Chapter 09's check: your barrier, run by every thread of one parallel region for many rounds:
in each, every thread writes its round number, meets the others at a barrier, reads everyone's
(all must show this round: nobody ran ahead), and meets them again before the next write. The
stage's barrier (stages/kernels/sync.py) passes the same rounds; a barrier that lets a thread
through early fails with the round and the thread. Then the cost of one barrier, yours and the
stage's, beside a fork/join (an empty parallel region: what the int8 stage pays per op)."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from exercises.harness import Case, Exercise, Timing, best_seconds
from stages.kernels.sync import ARRIVALS, atomic_load, atomic_store, barrier, cycles, empty_regions, new_sync


@njit
def _lag(ticks):
    """Keep this thread busy for a few thousand cycles: makes a thread late on purpose."""
    start = cycles()
    while cycles() - start < ticks:
        pass


@njit
def _rounds(bar, t, sync, seen, n, nt, late, bad):
    """Thread t's part: n rounds of write, barrier, read all, barrier. The first thing wrong is
    kept in bad[t] = (round, other thread or -1 for a False return, what it read); the rounds go on
    regardless, so the other threads' barriers still see this one arrive."""
    for r in range(1, n + 1):
        if (r + t) % nt == 0:
            _lag(late)                             # one thread late each round, a different one each time
        atomic_store(seen, t, r)
        if not bar(sync, nt, 2 * r - 1) and bad[t, 0] == 0:
            bad[t, 0], bad[t, 1] = r, -1
        for u in range(nt):
            got = atomic_load(seen, u)
            if got != r and bad[t, 0] == 0:
                bad[t, 0], bad[t, 1], bad[t, 2] = r, u, got
        if not bar(sync, nt, 2 * r) and bad[t, 0] == 0:
            bad[t, 0], bad[t, 1] = r, -1


@njit(parallel=True)
def region(bar, sync, seen, n, nt, late, bad):
    for t in prange(nt):
        _rounds(bar, t, sync, seen, n, nt, late, bad)


@njit
def _only_barriers(bar, t, sync, n, nt):
    for k in range(1, n + 1):
        bar(sync, nt, k)


@njit(parallel=True)
def barrier_region(bar, sync, n, nt):
    """One parallel region whose threads meet at n barriers in a row (sync.barrier_rounds, with
    the barrier as an argument)."""
    for t in prange(nt):
        _only_barriers(bar, t, sync, n, nt)


def threads() -> int:
    return min(numba.config.NUMBA_NUM_THREADS, 4)


class Fused(Exercise):
    chapter = "09"
    title = "fused: the barrier that replaces fork/join"
    folder = "exercises/09_fused"
    file = "barrier.py"
    reference = {"barrier": barrier}
    reference_code = "stages/kernels/sync.py: barrier"

    def cases(self, rng, quick):
        nt = threads()
        if nt < 2:
            raise RuntimeError("a barrier needs two threads and numba has one: run the check with NUMBA_NUM_THREADS=2")
        return [Case("one thread: barrier 1 of a region of 1 returns at once", {"nt": 1, "n": 1, "late": 0}),
                Case(f"{nt} threads, 200 rounds, nobody late", {"nt": nt, "n": 200, "late": 0}),
                Case(f"{nt} threads, 300 rounds, one thread late by ~20k cycles each round",
                     {"nt": nt, "n": 300, "late": 20_000}),
                Case(f"{nt} threads, 2000 rounds", {"nt": nt, "n": 2000, "late": 0})]

    def judge(self, sol, case):
        nt, n, late = case.inputs["nt"], case.inputs["n"], case.inputs["late"]
        if nt == 1:
            sync = new_sync()
            ok = sol.barrier(sync, 1, 1)
            if not ok:
                return "barrier(sync, 1, 1) returned False: return True once every thread has arrived", ""
            return None, f"returned {ok}"
        numba.set_num_threads(nt)
        sync, seen = new_sync(), np.zeros(nt, np.int64)
        bad = np.zeros((nt, 3), np.int64)
        region(sol.barrier, sync, seen, n, nt, late, bad)
        for t in range(nt):
            r, u, got = bad[t]
            if r and u < 0:
                return f"round {r}: thread {t}'s barrier returned False (return True: nothing aborted)", ""
            if r:
                return (f"round {r}: thread {t} passed the barrier and read thread {u}'s round as {got}, not {r}: "
                        f"thread {u} had not arrived yet (the barrier opened before all {nt} threads were there)"), ""
        arrivals = int(sync[ARRIVALS])
        return None, f"{n} rounds, nobody ahead; {arrivals} arrivals counted"

    def timings(self, sol, quick):
        nt = threads()
        numba.set_num_threads(nt)
        n = 200 if quick else 5000
        self.timing_note = f"per barrier, or per fork/join, {nt} threads, {n} in a row"
        out = np.zeros(nt)
        reps = 3 if quick else 5

        def per(run):
            return best_seconds(run, reps) / n
        return [Timing("your barrier", per(lambda: barrier_region(sol.barrier, new_sync(), n, nt)), "yours", unit="us"),
                Timing("the stage's barrier (fused)", per(lambda: barrier_region(barrier, new_sync(), n, nt)), "stage",
                       unit="us"),
                Timing("a fork/join, the previous stage's way (int8: a region per op)",
                       per(lambda: empty_regions(out, n, nt)), "previous", unit="us")]

    isolated = True         # the whole check in a child process: a barrier that never opens would hang it
    stuck = "a thread is waiting for an arrival that never comes (does barrier k wait for exactly k * nt arrivals?)"


EXERCISE = Fused()
