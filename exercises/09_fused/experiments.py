"""Chapter 09's experiments (run: make try-it ch=09)."""

from __future__ import annotations

import numba

from exercises.try_it import engine, experiment, step_ms
from stages.kernels.sync import dispatch_costs
from stages.threads import default_threads


@experiment("how threads meet between two ops: a fork/join (a new parallel region) or a barrier")
def dispatch(quick):
    """a fork/join wakes the pool and waits for the last thread: about a microsecond where the pool
    spins between regions (OpenMP, the engine's layer), tens of microseconds where it sleeps
    (numba's workqueue); a barrier is an atomic add and a short spin while the threads are already
    running: well under a microsecond on an idle machine, so ten times cheaper or more (on a machine
    other programs load, a barrier waits for a thread that lost its core, and the gap closes)"""
    rows = []
    nt = default_threads()
    costs = dispatch_costs(nt, 200 if quick else 2000)
    rows.append((f"a fork/join (an empty parallel region), {nt} threads", costs["fork_join_us"], "us"))
    rows.append((f"a barrier, {nt} threads", costs["barrier_us"], "us"))
    rows.append(("fork/join over barrier", costs["fork_join_us"] / costs["barrier_us"], "x"))
    numba.set_num_threads(nt)
    return {"rows": rows, "note": f"numba's threading layer here: {costs['layer']}"}


@experiment("one compiled call per token (fused) against a parallel region per op (int8)", model=True)
def int8_vs_fused(quick):
    """SmolLM2's int8 step opens 8 regions per layer x 30 layers + the head: 241 fork/joins, a
    quarter of a millisecond at OpenMP's microsecond, and thousands of Python calls between the ops,
    each a microsecond or so; fused opens 2, makes about 150 calls and keeps the same integer
    kernels' work, so it should be faster by milliseconds a step, most of it Python's (its integer
    tiles save some more)"""
    ctx = 32
    reps = 3 if quick else 9
    int8 = step_ms(engine("int8", n_ctx=ctx + 8), ctx, reps)
    fused = step_ms(engine("fused", n_ctx=ctx + 8), ctx, reps)
    regions = 30 * 8 + 1
    return {"rows": [(f"int8: a decode step ({regions} parallel regions, Python between the ops)", int8, "ms"),
                     ("fused: the same step (2 regions, barriers between the ops)", fused, "ms"),
                     ("int8 over fused", int8 / fused, "x")],
            "note": "multiply dispatch's fork/join cost by the regions a step opens: how much of the gap is it?"}
