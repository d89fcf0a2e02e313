"""Threads that stay inside one parallel region and meet at barriers (the fused stage's dispatch).

A numba `prange` loop is a parallel region: the pool's threads are woken, run their share, and
the caller waits for the last one (a fork and a join). The fused stage opens one region per
forward pass, with one iteration per thread, and separates the ops inside it by barriers:

    next_item(counters, op, t, nt, n)   the next work item of an op for thread t: its own
                                        contiguous range first, then the others' (atomic adds)
    barrier(sync, nt, k)           wait until all nt threads have arrived at barrier k (a counter
                                   that only grows: barrier k is reached at k * nt arrivals)

How a barrier waits decides what happens when the cores are shared. A thread that arrives
early spins (`pause` between reads): on an idle machine the others come within microseconds,
and a spin is the quickest way to see them. But when another process runs on the cores, the
thread it waits for may be off its core for a scheduler's time slice (milliseconds); spinning
or yielding (sched_yield) then keeps the waiting thread runnable, so it takes its fair share of
a core to do nothing while the one it waits for queues behind it. So after a bounded spin the
thread sleeps in the kernel on a futex (the generation word, sync[GEN]), off every run queue,
and the last to arrive wakes the sleepers (only if there are any: sync[SLEEPERS]). The spin
bound adapts (sync[SPIN]): a barrier that ended in a sleep halves it, one that ended within the
spin doubles it back towards sync[SPIN_MOST], so a loaded machine stops paying the spin at every barrier.
(The same rule as glibc's adaptive mutexes and libgomp's GOMP_SPINCOUNT: spin a little, then
sleep.) The bound is a time, read from the time-stamp counter, not a count of `pause`s: one
`pause` waits a few nanoseconds on some x86 cores and over a hundred cycles on others, so a count
that spins long enough on one CPU sleeps at every slightly uneven barrier on another, and each
sleep costs a wake-up of tens of microseconds.

A barrier needs every iteration of the region on its own thread, which numba's workqueue and
OpenMP layers do with one iteration per thread (TBB may run two on one thread: stages/fused.py
chooses the layer). If the others never come (sync[GIVE] sleeps of WAIT_NS: GIVE_UP unless a
test asks for less), it raises the abort flag sync[ABORT] and every thread leaves at its next
barrier: the caller reports the error instead of hanging. `new_sync()` makes the array; with
`phases`, it also holds a clock per phase (sync[CLOCK + i]: the cycles thread 0 saw phase i take,
up to the barrier after it, added over the layers: where a call's time went, at the cost of one
read of the time-stamp counter per phase).

A barrier also decides what a shared core costs: CoreShare, the policy the stage's Python side
follows between calls, runs a call on one thread while another process holds a core (below).

The atomics are LLVM's (atomicrmw add, load/store with acquire/release ordering), the futex
calls Linux's syscall(2) (x86-64): numba has neither for the CPU.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from stages.kernels.toolkit import per_phase

SPIN_NS = 50_000        # how long a waiting thread spins before it sleeps, at most: a futex wake-up
                        # costs tens of microseconds, so a shorter wait is cheaper spun
SPIN_FLOOR = 64         # the least a loaded machine's barriers spin: SPIN_NS / SPIN_FLOOR
WAIT_NS = 1_000_000     # a sleep's timeout (1 ms): how often a sleeping thread looks at the abort flag
GIVE_UP = 120_000       # sleeps (two minutes) before a barrier gives up: the abort flag
# The sync array's words: arrivals, abort flag, sleeps before giving up, the futex's generation,
# threads asleep, the spin bound now and at most (time-stamp counter ticks); then, where new_sync
# made room, phase i's cycles at CLOCK + i.
ARRIVALS, ABORT, GIVE, GEN, SLEEPERS, SPIN, SPIN_MOST, CLOCK = range(8)
SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129      # x86-64 Linux


def new_sync(give_up: int = GIVE_UP, phases: int = 0) -> np.ndarray:
    """The words above (with a clock for each of `phases` phases), int64."""
    most = int(SPIN_NS * ticks_per_ns())
    return np.array([0, 0, give_up, 0, 0, most, most] + [0] * phases, dtype=np.int64)


def _slot(context, builder, arrty, arr, idx, idxty):
    a = context.make_array(arrty)(context, builder, arr)
    return builder.gep(a.data, [context.cast(builder, idx, idxty, types.intp)])


@intrinsic
def atomic_add(typingctx, arr, idx, value):
    """arr[idx] += value as one atomic step (int64 array); returns the old value."""
    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), v,
                                  "seq_cst")
    return types.int64(arr, idx, value), codegen


@intrinsic
def atomic_add2(typingctx, arr, i, j, value):
    """arr[i, j] += value as one atomic step (a C-contiguous 2-D int64 array); the old value."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        i, j = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2))
        cols = builder.extract_value(a.shape, 1)
        slot = builder.gep(a.data, [builder.add(builder.mul(i, cols), j)])
        v = context.cast(builder, args[3], sig.args[3], types.int64)
        return builder.atomic_rmw("add", slot, v, "seq_cst")
    return types.int64(arr, i, j, value), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] read with acquire ordering: what other threads wrote before they released it."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), "acquire", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, value):
    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), "release", 8)
        return context.get_dummy_value()
    return types.none(arr, idx, value), codegen


@intrinsic
def cpu_relax(typingctx):
    """x86 `pause`: a spinning core tells the CPU so (less power, no memory-order flush on exit)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


def _futex(builder, address, op, value, timeout):
    """syscall(SYS_futex, address, op, value, timeout, NULL, 0), every argument as a 64-bit integer."""
    i64 = ir.IntType(64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64], var_arg=True), "syscall")
    args = [ir.Constant(i64, SYS_FUTEX), builder.ptrtoint(address, i64), ir.Constant(i64, op), value, timeout,
            ir.Constant(i64, 0), ir.Constant(i64, 0)]
    return builder.call(fn, args)


@intrinsic
def cycles(typingctx):
    """The time-stamp counter (rdtsc through llvm.readcyclecounter): a clock at a constant rate."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


@intrinsic
def futex_wait(typingctx, arr, idx, expected):
    """Sleep while the low 32 bits of arr[idx] (an int64 word) equal `expected`'s, at most WAIT_NS;
    returns at once if they differ already, or when futex_wake is called on the word."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.LiteralStructType([i64, i64]))     # struct timespec
        builder.store(ir.Constant(ir.LiteralStructType([i64, i64]), [0, WAIT_NS]), ts)
        value = builder.and_(context.cast(builder, args[2], sig.args[2], types.int64), ir.Constant(i64, 0xFFFFFFFF))
        _futex(builder, _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), FUTEX_WAIT_PRIVATE,
               value, builder.ptrtoint(ts, i64))
        return context.get_dummy_value()
    return types.none(arr, idx, expected), codegen


@intrinsic
def futex_wake(typingctx, arr, idx):
    """Wake every thread sleeping on arr[idx] (futex_wait)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        _futex(builder, _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), FUTEX_WAKE_PRIVATE,
               ir.Constant(i64, 2**31 - 1), ir.Constant(i64, 0))
        return context.get_dummy_value()
    return types.none(arr, idx), codegen


@njit(cache=True)
def _ticks():
    return cycles()


@functools.cache
def ticks_per_ns() -> float:
    """The time-stamp counter's rate, measured once per process against the OS clock (2 ms)."""
    _ticks()
    t0, c0 = time.perf_counter_ns(), _ticks()
    while time.perf_counter_ns() - t0 < 2_000_000:
        pass
    c1, t1 = _ticks(), time.perf_counter_ns()
    return max(1e-3, (c1 - c0) / (t1 - t0))


@per_phase
def next_item(counters, op, t, nt, n):
    """The next work item (0 <= item < n) of op `op` for thread t of nt, or -1 when none is left.
    The items are cut into nt contiguous ranges, one per thread, each with its own counter
    (counters[op, r]): a thread takes its own range front to back, so it reads weight rows in
    one long sequential stream, as the memory prefetchers follow best, and when it is done it
    takes from the others' ranges, so a thread another process slows down takes fewer."""
    for k in range(nt):
        r = t + k if t + k < nt else t + k - nt
        start, end = r * n // nt, (r + 1) * n // nt
        if start < end:
            i = start + atomic_add2(counters, op, r, 1)
            if i < end:
                return i
    return -1


@per_phase
def _arrived(sync, target):
    """The last thread in: the next generation, and the sleepers woken (if any sleep)."""
    atomic_add(sync, GEN, 1)
    if atomic_load(sync, SLEEPERS) > 0:
        futex_wake(sync, GEN)
    return atomic_load(sync, ABORT) == 0


@per_phase
def barrier(sync, nt, k):
    """All nt threads past barrier k (sync[ARRIVALS] counts arrivals), or False if the region
    aborted. Spin for up to sync[SPIN] ticks, then sleep on the futex until the last one wakes us."""
    target = k * nt
    if atomic_add(sync, ARRIVALS, 1) + 1 == target:
        return _arrived(sync, target)
    limit, most = atomic_load(sync, SPIN), sync[SPIN_MOST]
    start = cycles()
    while cycles() - start < limit:
        if atomic_load(sync, ARRIVALS) >= target:
            if limit < most:                            # it came within the spin: spin longer next time
                atomic_store(sync, SPIN, min(most, 2 * limit))
            return atomic_load(sync, ABORT) == 0
        cpu_relax()
    atomic_store(sync, SPIN, max(most // SPIN_FLOOR, limit // 2))   # it did not: spin less next time
    sleeps = 0
    while atomic_load(sync, ARRIVALS) < target:
        if atomic_load(sync, ABORT) != 0:
            return False
        # asleep before reading the generation: a last arrival that misses this thread in
        # SLEEPERS has moved GEN already, so the read below sees it and the wait returns at once
        atomic_add(sync, SLEEPERS, 1)
        gen = atomic_load(sync, GEN)
        if atomic_load(sync, ARRIVALS) < target:
            futex_wait(sync, GEN, gen)
            sleeps += 1
        atomic_add(sync, SLEEPERS, -1)
        if sleeps > sync[GIVE]:
            atomic_store(sync, ABORT, 1)
            futex_wake(sync, GEN)
            return False
    return atomic_load(sync, ABORT) == 0


# ---- what a fork/join and a barrier cost (the fused stage's chapter measures them) -------------

@njit(cache=True, parallel=True)
def empty_regions(out, n, nt):
    """n parallel regions in a row, each of nt iterations doing almost nothing: n forks and joins."""
    for _ in range(n):
        for t in prange(nt):
            out[t] += 1.0
    return out


@njit(cache=True)
def _rounds(t, sync, out, n, nt):
    for k in range(n):
        out[t] += 1.0
        if not barrier(sync, nt, k + 1):
            return


@njit(cache=True, parallel=True)
def barrier_rounds(sync, out, n, nt):
    """One parallel region of nt iterations meeting at n barriers in a row. (The loop body is a
    call: a `return` inside a prange loop would make numba run it serially.)"""
    for t in prange(nt):
        _rounds(t, sync, out, n, nt)
    return out


class CoreShare:
    """How many threads the next compiled call runs on: all of them, unless the cores are shared.

    A barrier waits for the slowest thread. When another process takes one of the cores, one of
    our threads is off its core for a scheduler's time slice (milliseconds) now and then, and each
    barrier it owes waits that long: a step of hundreds of barriers slows down many times over,
    far more than the share of the core it lost (one thread alone on the core that is left pays
    only for the work the other thread did). So the stage tries one thread now and then and
    keeps what is faster:

    * when the load changes: two calls in a row on all threads SLOW times slower than the median
      of the last calls of as many rows (once is noise: a page fault, a timer);
    * when it was there from the start, which no change shows: the first call after the median
      has three calls, then every EXPLORE-th call, of EXPLORE_ROWS rows at most (on an idle
      machine, one decode step in EXPLORE runs on one thread and loses: a fraction of a percent).

    A try on one thread that beats the calls on all threads starts a spell of `hold` calls on one
    thread (HOLD, doubled each time a retry on all threads loses again, up to MAX_HOLD); a try
    after slow calls that loses says the work grew (a longer context), and the median starts
    over. 1 thread and N give the same bits (work items and attention chunks do not depend on the
    thread count), so the choice changes the time, never the numbers."""

    SLOW = 2.0          # a call this many times the median of its kind: the cores look shared
    HISTORY = 8         # calls on all threads the median is taken over (per row count)
    EXPLORE = 256       # calls on all threads between two tries of one thread
    EXPLORE_ROWS = 64   # tried on calls of at most this many rows: decode steps and batches repeat,
                        # a prompt's pieces are few and a try would cost one of them twice over
    HOLD, MAX_HOLD = 16, 256

    def __init__(self):
        self.history = {}           # rows -> recent seconds on all threads
        self.single = 0             # calls left to run on one thread
        self.hold = self.HOLD
        self.slow = 0               # slow calls on all threads in a row
        self.calls = 0              # calls on all threads with a median to judge them by
        self.trial = None           # (rows, seconds to beat, threads to try, after slow calls)
        self.switches = 0           # spells on one thread begun

    def threads(self, nt: int) -> int:
        return 1 if self.single > 0 or (self.trial is not None and self.trial[2] == 1) else nt

    def ran(self, used: int, nt: int, rows: int, seconds: float):
        """After a call of `rows` rows on `used` of nt threads that took `seconds`."""
        if nt == 1:
            return
        trial, self.trial = self.trial, None
        if used == 1:
            if trial is not None:                       # a try of one thread
                if trial[0] == rows and seconds < trial[1]:
                    self.single, self.switches = self.hold, self.switches + 1
                elif trial[3]:                          # slow calls, not the cores: the work grew
                    self.history[rows] = deque([trial[1]], maxlen=self.HISTORY)
            else:
                self.single -= 1
                if self.single == 0:                    # next: all threads again, against this
                    self.trial = (rows, seconds, nt, False)
            return
        if trial is not None:                           # all threads again after a spell on one
            if trial[0] == rows and seconds > trial[1]:
                self.hold = min(self.MAX_HOLD, 2 * self.hold)
                self.single = self.hold
                return
            self.hold = self.HOLD
        past = self.history.setdefault(rows, deque(maxlen=self.HISTORY))
        if len(past) >= 3 and seconds > self.SLOW * statistics.median(past):
            self.slow += 1
            if self.slow >= 2:                          # not a one-off: try one thread next
                self.slow, self.trial = 0, (rows, seconds, 1, True)
            return
        self.slow = 0
        past.append(seconds)
        if len(past) >= 3 and rows <= self.EXPLORE_ROWS:
            if self.calls % self.EXPLORE == 0:          # the first judged call, then every EXPLORE-th
                self.trial = (rows, statistics.median(past), 1, False)
            self.calls += 1


def dispatch_costs(threads: int, n: int = 2000) -> dict:
    """Microseconds per fork/join (an empty parallel region) and per barrier on `threads`
    threads, in this process's numba threading layer: the best of 3 runs of n each."""
    import time

    import numba
    numba.set_num_threads(threads)
    out = np.zeros(threads)
    costs = {}
    for name, run in (("fork_join_us", lambda: empty_regions(out, n, threads)),
                      ("barrier_us", lambda: barrier_rounds(new_sync(), out, n, threads))):
        run()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        costs[name] = best / n * 1e6
    return {"layer": numba.threading_layer(), "threads": threads, **costs}
