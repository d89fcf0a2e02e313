"""Chapter 09 · fused: write the barrier that replaces fork/join.

Run the check:   make exercise ch=09
(or: .venv/bin/python -m exercises.check 09)

The int8 stage opens a parallel region per op: numba wakes the pool's threads, they run their
share, and the caller waits for the last one (a fork and a join), eight times per layer. The
fused stage opens one region per forward pass and keeps its threads inside it; between two ops
that depend on each other the threads wait for one another at a barrier. Your barrier is run by
every thread of a region, thousands of times, with a check after each that no thread went ahead
of another (it runs in a process of its own with a time limit, so a barrier that never opens
cannot hang the check); then it is timed beside the stage's barrier and a fork/join.
"""

from numba import njit

from stages.kernels.sync import ARRIVALS, atomic_add, atomic_load, cpu_relax  # noqa: F401  (for your code)


@njit(cache=True)
def barrier(sync, nt, k):
    """Wait until all nt threads of the region have arrived at barrier number k; return True.

    sync: int64 array (stages/kernels/sync.py's new_sync()); sync[ARRIVALS] counts arrivals,
          starting at 0 and only ever growing
    nt:   the number of threads in the region (each calls barrier(sync, nt, k) with the same k)
    k:    the barrier's number: 1 for the first, 2 for the next, ... (each thread counts its own)

    What to write: arrive, then wait. Barrier k is passed once k * nt arrivals have been counted
    (nt at each of barriers 1 .. k), so a counter that only grows serves every barrier with no
    reset (a reset is where barriers usually go wrong: a fast thread's next arrival racing the
    reset). Arrive with one atomic add: atomic_add(sync, ARRIVALS, 1) returns the count before
    yours. Then, until atomic_load(sync, ARRIVALS) reaches k * nt, spin: call cpu_relax() (x86's
    `pause`) between reads. Read with atomic_load, never sync[ARRIVALS]: a plain read may be kept
    in a register by the compiler and never see the others arrive.

    The edge: the target. Wait for k * nt arrivals exactly: fewer and a thread runs ahead into
    the next op before the others have written what it reads (the check sees it); more and the
    last thread waits for an arrival that never comes.

    Why: a fork/join costs the pool's wake-up and the caller's wait for the last thread, tens of
    microseconds; the threads of one region already run, and a barrier costs them one atomic add
    and the time for the slowest to arrive. (The stage's barrier also sleeps on a futex when the
    wait is long, which yours need not do.)

    Hint: notebooks/09_fused.ipynb, "A fork and a join against a barrier". Try it before you read
    stages/kernels/sync.py (barrier).
    """
    raise NotImplementedError("write the counting barrier: see the docstring")
