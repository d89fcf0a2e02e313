# Source of notebooks/09_fused.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 09 · fused: the cost of dispatch
#
# On a GPU every kernel launch costs a few microseconds whatever the kernel does, and CUDA graphs
# exist to stop paying it between small kernels. A CPU engine pays the same kind of cost, and the
# roofline does not show it either:
#
# | where | what a small op costs besides its arithmetic |
# |---|---|
# | the interpreter | Python calls the op: argument checks, numba's dispatch, array objects made and freed |
# | the thread pool | a parallel kernel wakes the pool's threads (fork) and waits for the last (join) |
#
# The int8 stage pays both at every matmul, norm and attention of every layer. The fused stage
# runs the whole layer stack as **one compiled call**, one parallel region whose threads stay
# inside for every op and meet at barriers between ops that depend on each other; its kernels
# also keep float vector accumulators across blocks, run prefill as an integer GEMM, and split
# decode attention by positions. This chapter measures what each kind of dispatch costs here,
# and what removing it buys.

# %%
import json
import os
import subprocess
import sys
import time

import numpy as np

from app.measure.machine import physical_cores
from stages import load as load_stage

findings = nb.Findings()
missing = {s: nb.missing_stage(s) for s in ("int8", "fused")}
for s, why in missing.items():
    print(f"{s}: {why or 'runs on this machine'}")
cores = physical_cores()

# %% [markdown]
# ## A fork and a join against a barrier
#
# numba's parallel loops run on one of its threading layers: `workqueue` (its own, always there),
# `omp` (OpenMP, where numba was built with it) or `tbb` (Intel's TBB, where that package is
# installed). The layer is fixed once per process, so each is measured in a process of its own:
# an empty parallel region (a fork and a join), and one region whose threads meet at a barrier
# (stages/kernels/sync.py: an atomic counter and a spin).

# %%
probe = ("import json, sys; sys.path.insert(0, '.'); from stages.kernels.sync import dispatch_costs; "
         "print(json.dumps([dispatch_costs(t, {n}) for t in sorted({{1, {c}}})]))")
n_rounds = 200 if cfg.quick else 5000
costs, unavailable = [], {}
for layer in ("workqueue", "omp", "tbb"):
    p = subprocess.run([sys.executable, "-c", probe.format(n=n_rounds, c=cores)], cwd=nb.ROOT, capture_output=True,
                       text=True, env={**os.environ, "NUMBA_THREADING_LAYER": layer})
    if p.returncode == 0:
        costs += json.loads(p.stdout.strip().splitlines()[-1])
    else:
        unavailable[layer] = p.stderr.strip().splitlines()[-1][:120] if p.stderr.strip() else "failed"
nb.show_table(["layer", "threads", "fork + join (us)", "barrier (us)"],
              [(c["layer"], c["threads"], f"{c['fork_join_us']:.2f}", f"{c['barrier_us']:.3f}") for c in costs])
for layer, why in unavailable.items():
    print(f"{layer}: not available here ({why})")
at_n = [c for c in costs if c["threads"] == max(x["threads"] for x in costs)]
findings["dispatch costs"] = "; ".join(f"{c['layer']}@{c['threads']}: fork/join {c['fork_join_us']:.1f} us, "
                                       f"barrier {c['barrier_us']:.2f} us" for c in at_n)
nb.md("The entry points ask numba for `omp`, then `workqueue` (app.configure_numba; stages/fused.py checks it got one of them): both give every "
      "iteration of a parallel loop its own thread, which the barriers need; TBB's work stealing may run two "
      "on one thread, where a barrier would wait for ever. On a machine whose cores other processes share, a "
      "barrier waits for whichever thread the OS has set aside: the measured barrier is then far above its "
      "cost on an idle machine.")

# %% [markdown]
# ## What Python does per token
#
# A decode step of each stage, profiled by Python's own profiler: how many Python-level calls one
# token makes. The fused stage's Python is the graph's head and tail (embedding, the final norm,
# the output matmul, argmax) and one call of the layer stack.

# %%
import cProfile
import pstats


def python_calls(stage, steps):
    engine = nb.load(stage)
    ids = nb.prompt_ids(engine, 8)
    engine.reset()
    tok = engine.greedy_next(ids, 0)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        tok = engine.greedy_next([tok], len(ids) + i)
    prof.disable()
    return pstats.Stats(prof).total_calls / steps, engine


steps = 4 if cfg.quick else 16
calls = {}
engines = {}
for s in ("int8", "fused"):
    if not missing[s]:
        calls[s], engines[s] = python_calls(s, steps)
nb.show_table(["stage", "Python function calls per decode token"], [(s, f"{n:,.0f}") for s, n in calls.items()])
if calls:
    findings["python calls per token"] = ", ".join(f"{s} {n:,.0f}" for s, n in calls.items())

# %% [markdown]
# ## Python's share of a step
#
# The backend times its compiled calls (`kernel_seconds`: the layer stack and the output head);
# everything else in a step is Python (and the small compiled calls around them: the embedding
# row, the final norm, argmax). Both at 1 thread and at all cores.

# %%
if not missing["fused"]:
    shares = {}
    for t in sorted({1, cores}):
        e = load_stage("fused", nb.model_path(), threads=t)
        e.warmup()
        ids = nb.prompt_ids(e, 8)
        e.reset()
        tok = e.greedy_next(ids, 0)
        k0, t0 = e.backend.kernel_seconds, time.perf_counter()
        for i in range(steps * 2):
            tok = e.greedy_next([tok], len(ids) + i)
        wall = time.perf_counter() - t0
        shares[t] = 1 - (e.backend.kernel_seconds - k0) / wall
        del e
    nb.show_table(["threads", "time outside the compiled layer stack and head"],
                  [(t, f"{s:.1%}") for t, s in shares.items()])
    findings["python share of a decode step"] = ", ".join(f"{s:.1%} at {t} thread(s)" for t, s in shares.items())

# %% [markdown]
# ## The code
#
# The stage overrides three things: the hook that runs the layer stack, the output matmul, and
# the choice of threading layer. Inside, each thread walks every op of every layer; a work item
# is taken from an atomic counter, so a thread that another process slows takes fewer.

# %%
if not missing["fused"]:
    import stages.fused as sf
    import stages.kernels.layer_stack as kf
    import stages.kernels.sync as ks
    nb.show_source(sf.FusedBackend.forward_layers)
    nb.show_source(ks.barrier)
    nb.show_source(kf.Stack.run_layers, kf.run_phases)

# %% [markdown]
# ## Vector accumulators across blocks
#
# The int8 stage's named-instruction kernels add the 8 lanes of each block's integer sum
# horizontally, block after block. The fused tiles scale each block's 8 lanes into a float
# vector accumulator and add horizontally once per row. Both decode kernels on one thread, on
# every matrix of this model, grouped by type (`python -m app bench kernels` records the
# same for every type of every model):

# %%
if not (missing["fused"] or missing["int8"]):
    from common.gguf import GGUFFile
    from stages import backend_class
    g = GGUFFile(nb.model_path())
    groups = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.type_name not in ("F32", "F16", "BF16"):
            groups.setdefault(t.type_name, []).append(t)
    rates = {}
    for name in ("int8", "fused"):
        b = backend_class(name)(threads=1)
        for tn, ts in groups.items():
            mats = [b.prepare_matrix(t) for t in ts[: 8 if cfg.quick else 60]]
            xs = {m.shape[1]: np.random.default_rng(0).standard_normal((1, m.shape[1])).astype(np.float32)
                  for m in mats}
            run = lambda: [b.matmul(xs[m.shape[1]], m) for m in mats]
            best = nb.best_seconds(run, cfg.timing_reps)
            rates[(name, tn)] = sum(m.shape[0] * m.shape[1] for m in mats) / best / 1e9
    nb.bar_chart({f"{n} {tn}": r for (n, tn), r in rates.items()}, "Gweights / s, one thread",
                 "Decode kernels per type")
    findings["decode kernels"] = ", ".join(f"{tn}: {rates[('fused', tn)] / rates[('int8', tn)]:.2f}x int8"
                                           for (n, tn) in rates if n == "fused")

# %% [markdown]
# ## The Q4_K decode tile, as the CPU runs it
#
# The tiles are LLVM IR written through `stages/kernels/vector_ir.py`; here is the inner block of
# the Q4_K decode kernel numba compiled on this machine: per 32 bytes of one row, the nibbles
# masked and shifted out, `vpmaddubsw` (32 byte products into 16 sums) and `vpmaddwd` with the
# sub-block scales; the block's sum converted and scaled into a float accumulator. (Chapter 10
# shows the repack stage's kernel beside it.)

# %%
from stages.kernels.toolkit import Q4_K
from stages.kernels.vector_ir import ISA

if ISA is None:
    nb.md("_This CPU has no AVX2 + F16C: the fused stage runs the int8 stage's loops instead of the tiles._")
else:
    from collections import Counter
    asm = nb.integer_kernel_asm(Q4_K, "rows", rows=1)
    nb.md("```asm\n" + nb.hot_loop(asm, 48, r"vpmaddubsw|vpdpbusd|vpmaddwd") + "\n```")
    ops = Counter(x.split()[0] for x in nb.hot_loop(asm, 10_000, r"vpmaddubsw|vpdpbusd|vpmaddwd").splitlines()
                  if x.strip() and not x.strip().endswith(":"))
    findings["Q4_K decode tile"] = ", ".join(f"{op} {n}" for op, n in ops.most_common(4))

# %% [markdown]
# ## Decode and prefill, live
#
# Both stages by the measurement protocol at 1 thread and at all cores.

# %%
live = nb.measure_live(("int8", "fused"), sorted({1, cores}), cfg)
live_vs = nb.show_live(live, "fused", "int8", cores)
if live_vs:
    findings["fused vs int8 (live)"] = live_vs

# %% [markdown]
# ## Long contexts: attention split by positions
#
# At a decode step attention has one query row per head: with a few heads and two or more cores
# there is too little to share by head alone once the context is long. The stage splits each
# head's positions in chunks (flash-decoding) and merges the chunks' partial softmax sums. A
# decode step against the context length:

# %%
if not (missing["fused"] or missing["int8"]):
    lengths = (16, 64) if cfg.quick else (64, 256, 512, 1024, 1536)
    curves = {}
    for s in ("int8", "fused"):
        e = load_stage(s, nb.model_path(), threads=cores, n_ctx=max(lengths) + 8)
        e.warmup()
        ids = (nb.prompt_ids(e, 32) * (max(lengths) // 32 + 1))[:max(lengths) + 1]
        curves[s] = (list(lengths), [nb.step_ms(e, ids, n) for n in lengths])
        del e
    nb.line_chart({f"{s}@{cores}": c for s, c in curves.items()}, "context (positions)", "decode ms per token",
                  "A decode step against the context")
    findings["decode at the longest context"] = ", ".join(f"{s} {c[1][-1]:.2f} ms" for s, c in curves.items()) + \
        f" at {lengths[-1]} positions"

# %% [markdown]
# ## Against llama.cpp, recorded
#
# `python -m app bench vs-llama --engines int8,fused,llama.cpp` measures these side by side
# with llama.cpp in alternating rounds (`profiles/bench/vs_llama_<model>.md`). Its ratios, if it
# has measured the fused stage:

# %%
ratios = nb.vs_llama_ratios("fused", "int8,fused,llama.cpp")
if ratios:
    findings["recorded ratios"] = ratios

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). fused is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("fused")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the barrier that replaces fork/join.** The starting file,
# [`exercises/09_fused/barrier.py`](../exercises/09_fused/barrier.py), holds the function's
# signature and a docstring with the shapes, what to write and why, and the edges that catch a first
# attempt. Edit it, then check it:
#
# ```
# make exercise ch=09
# ```
#
# (or `.venv/bin/python -m exercises.check 09`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 09`). The check runs your code and the stage's own,
# [`stages/kernels/sync.py`](../stages/kernels/sync.py) (`barrier`), on 4 seeded cases of awkward
# shapes, holding yours to the stage's: no thread may pass it before all have arrived, over
# thousands of rounds of a parallel region (run in a process of its own with a time limit: a barrier
# that never opens cannot hang the check). It stops at the first case that differs and says which,
# where and by how much; once all pass, it times yours beside the stage's and beside a fork/join,
# the int8 stage's way between ops. `--solution reference` runs the check on the stage's own code.
# Every chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/09_fused.json` (your machine's figures, not committed). All of them:
# `make try-it ch=09`.
#
# 1. **How threads meet between two ops: a fork/join (a new parallel region) or a barrier.**
#    - *Predict:* a fork/join wakes the pool and waits for the last thread: about a
#      microsecond where the pool spins between regions (OpenMP, the engine's layer), tens of
#      microseconds where it sleeps (numba's workqueue); a barrier is an atomic add and a
#      short spin while the threads are already running: well under a microsecond on an idle
#      machine, so ten times cheaper or more (on a machine other programs load, a barrier
#      waits for a thread that lost its core, and the gap closes).
#    - *Measure:* `make try-it ch=09 exp=dispatch`
#
# 2. **One compiled call per token (fused) against a parallel region per op (int8).**
#    - *Predict:* SmolLM2's int8 step opens 8 regions per layer x 30 layers + the head: 241
#      fork/joins, a quarter of a millisecond at OpenMP's microsecond, and thousands of Python
#      calls between the ops, each a microsecond or so; fused opens 2, makes about 150 calls
#      and keeps the same integer kernels' work, so it should be faster by milliseconds a
#      step, most of it Python's (its integer tiles save some more).
#    - *Measure:* `make try-it ch=09 exp=int8_vs_fused` (runs the default model)

