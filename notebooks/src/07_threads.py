# Source of notebooks/07_threads.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 07 · threads: what a second core buys a memory-bound loop
#
# The stage after `quantized` changes one thing: the quantized kernels' rows (and prompt panels,
# and attention heads) split over every core, and attention fused into one kernel per layer.
#
# Decode streams every weight once per token. Chapter 05 set it against that floor (the weights'
# bytes over the memory bandwidth): the floor is **bandwidth**, and if decode sat on it, a second
# core sharing the same memory would buy little. The quantized stage does not sit on it: one core
# unpacks the blocks slower than the memory delivers them. So what does a second core buy?
# Measure it.

# %%
import numpy as np

from app.measure import roofline
from app.measure.machine import physical_cores

findings = nb.Findings()
missing = {s: nb.missing_stage(s) for s in ("threads",)}
for s, why in missing.items():
    print(f"{s}: {why or 'runs on this machine'}")
cores = physical_cores()
counts = sorted({1, cores} | set(range(1, cores + 1)) if cores <= 4 else {1, 2, cores // 2, cores})
ceil = roofline.measure(threads=cores)             # 512 MiB: far more than any cache
bw = {int(k): v for k, v in ceil["bandwidth_gbs"].items()}
peak = {int(k): v for k, v in ceil["peak_gflops"].items()}
nb.show_table(["threads", "read bandwidth", "peak (this numba code)"],
              [(t, f"{bw[t]:.1f} GB/s", f"{peak[t]:.0f} GFLOP/s") for t in sorted(bw)])
findings["the machine"] = (f"{cores} physical core(s); read bandwidth {bw[1]:.1f} GB/s on one thread, "
                           f"{bw[max(bw)]:.1f} on {max(bw)}; peak {peak[1]:.0f} vs {peak[max(peak)]:.0f} GFLOP/s")
gain = bw[max(bw)] / bw[1]
nb.md(f"Here {max(bw)} threads read memory **{gain:.2f}x** as fast as one, and compute "
      f"{peak[max(peak)] / peak[1]:.2f}x as fast. "
      + ("One core already draws most of what the memory delivers: a second core helps decode only as far as "
         "one core could not keep the memory busy." if gain < 1.3 else
         "One core does not draw all the memory can deliver: a second one raises the bandwidth ceiling "
         "itself, and helps decode even where the kernels keep up with the memory."))

# %% [markdown]
# Compute scales with the cores; bandwidth scales only as far as one core leaves the memory idle
# (the table above: measured by `app/measure/roofline.py`, each thread summing its own chunks of a
# 512 MiB array). A second core helps decode twice over where the quantized stage's kernels are:
# their unpacking, not the memory, limits one core, and more memory bandwidth is there for two.
#
# ## The threads stage's code
#
# Nothing about a block format is new: the parallel kernels call the quantized stage's, each
# thread on its own rows (decode) or panels (prefill).

# %%
if missing["threads"]:
    nb.md(f"_Skipped: {missing['threads']}._")
else:
    import stages.kernels.threaded as tk
    import stages.threads as st
    nb.show_source(st.ThreadsBackend.matmul, st.ThreadsBackend.attention)
    nb.show_source(tk.matvec_parallel)

# %% [markdown]
# ## Thread scaling, live
#
# The same stage at 1 .. N threads, each measured by the protocol (prompt, then greedy decode).
# The dotted line is perfect scaling; the dashed one the bandwidth floor: the file's bytes read
# once per token at the bandwidth measured above for that many threads.

# %%
if missing["threads"]:
    nb.md(f"_Skipped: {missing['threads']}._")
else:
    from stages import load as load_stage
    file_bytes = nb.model_path().stat().st_size
    scaling = {}
    for t in counts:
        engine = load_stage("threads", nb.model_path(), threads=t)
        engine.stage = "threads"
        engine.warmup()
        scaling[t] = nb.measure(engine, cfg)
        del engine
    ts = list(scaling)
    dec = [scaling[t]["decode_ms"] for t in ts]
    nb.line_chart({"threads stage, measured": (ts, dec),
                   "perfect scaling": (ts, [dec[0] / t for t in ts]),
                   "bandwidth floor (file / bandwidth)": (ts, [file_bytes / (bw.get(t, bw[max(bw)]) * 1e9) * 1e3
                                                             for t in ts])},
                  "threads", "decode ms per token", "Decode vs threads (live)")
    nb.show_table(["threads", "TTFT (ms)", "decode (ms/token)", "speedup over 1 thread"],
                  [(t, f"{scaling[t]['ttft_ms']:.1f}", f"{scaling[t]['decode_ms']:.2f}",
                    f"{dec[0] / scaling[t]['decode_ms']:.2f}x") for t in ts])
    findings["thread scaling (live)"] = ", ".join(f"{t}: {scaling[t]['decode_ms']:.1f} ms" for t in ts) + \
        f" per token ({dec[0] / dec[-1]:.2f}x on {ts[-1]})"

# %% [markdown]
# ## Beside the article
#
# The article stopped at one CPU thread and a GPU: its last figure was 190 ms per token, from the
# 22.67 s of its naive engine. The recorded naive run of this machine against the fastest live
# run of this chapter is the same journey, on another model and machine.

# %%
naive_rec = nb.recorded().get("naive")
fast_live = None if missing["threads"] else min(scaling.values(), key=lambda r: r["decode_ms"])
nb.article.beside("end_to_end", naive_rec["decode_ms"] / fast_live["decode_ms"] if naive_rec and fast_live else None,
                  f"recorded naive / live threads@{fast_live['threads']}" if naive_rec and fast_live else
                  "no recorded naive run or no live threads run")

# %% [markdown]
# ## On the roofline
#
# Each run placed by its arithmetic intensity (FLOP per byte of weights read) and its achieved
# FLOP/s, under the ceilings of one thread and of all of them. Decode sits far left, a few FLOP
# per byte, where the roof is the bandwidth's slope; how far under that slope it sits is what
# the unpacking costs (the finding below: its share of the bandwidth ceiling).

# %%
if not missing["threads"]:
    from app.report.charts import roofline_points
    for t in (1, max(bw)):
        pts = [(f"threads@{n} {kind}", x, y) for n, r in scaling.items() if n == t
               for kind, x, y in roofline_points(r)]
        nb.roofline_chart({"bandwidth_gbs": bw[t], "peak_gflops": peak[t]}, pts, f"Roofline, {t} thread(s)")
    r = scaling[max(scaling)]
    x, y = [(x, y) for kind, x, y in roofline_points(r) if kind == "decode"][0]
    findings["roofline"] = (f"decode on {max(scaling)} threads: {y:.1f} GFLOP/s at {x:.2f} FLOP/byte, "
                            f"{y / (bw[max(bw)] * x):.0%} of the bandwidth ceiling there")

# %% [markdown]
# ## Attention, fused
#
# The inherited attention was the article's composition: per head, four numba calls (dot,
# scale, softmax, dot) and a transposed view of V. The threads stage runs one kernel per layer,
# one (query row, head) pair per iteration of its parallel loop, reading V row by row. Timed
# here on this model's head geometry at a decode step with a few hundred cached positions:

# %%
if not missing["threads"]:
    from common.gguf import GGUFFile
    from common.model import LlamaConfig
    from stages.kv_cache import KVCacheBackend
    from stages.threads import ThreadsBackend
    mc = LlamaConfig.from_gguf(GGUFFile(nb.model_path()))
    rng = np.random.default_rng(0)
    T = 64 if cfg.quick else 512
    q = rng.standard_normal((1, mc.n_head * mc.head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((T, mc.kv_dim)).astype(np.float32) for _ in range(2))
    args = (q, k, v, mc.n_head, mc.n_head_kv, T - 1)
    composite = KVCacheBackend()
    times = {"composite (kv_cache .. quantized)": nb.best_seconds(lambda: composite.attention(*args), cfg.timing_reps),
             "fused, 1 thread": nb.best_seconds(lambda: ThreadsBackend(threads=1).attention(*args), cfg.timing_reps),
             f"fused, {cores} threads": nb.best_seconds(lambda: ThreadsBackend(threads=cores).attention(*args),
                                                        cfg.timing_reps)}
    nb.bar_chart({k_: s * 1e6 for k_, s in times.items()}, "microseconds per layer",
                 f"Attention at one decode step, {T} cached positions")
    first = list(times.values())[0]
    findings["attention"] = ", ".join(f"{k_} {s * 1e6:.0f} us" for k_, s in times.items()) + \
        f" ({first / times['fused, 1 thread']:.1f}x on one thread)"

# %% [markdown]
# ## Against llama.cpp, recorded
#
# `python -m app bench vs-llama` measures the stages and llama.cpp side by side, at 1 thread and at
# all cores, in alternating rounds, and writes `profiles/bench/vs_llama_<model>.json` with the
# page drawn from it (`vs_llama_<model>.md`). Its ratios for this stage, if it has run:

# %%
ratios = nb.vs_llama_ratios("threads")
if ratios:
    findings["recorded ratios"] = ratios

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). threads is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("threads")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the split of a matrix's rows across the cores.** The starting file,
# [`exercises/07_threads/split_rows.py`](../exercises/07_threads/split_rows.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=07
# ```
#
# (or `.venv/bin/python -m exercises.check 07`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 07`). The check runs your code and the stage's own,
# [`stages/kernels/threaded.py`](../stages/kernels/threaded.py) (`matvec_parallel`), on 6 seeded
# cases of awkward shapes, holding yours to the stage's: bit for bit (a split never reorders the
# additions inside one output). It stops at the first case that differs and says which, where and by
# how much; once all pass, it times yours beside the stage's and beside the quantized stage's kernel
# on one thread. `--solution reference` runs the check on the stage's own code. Every chapter's
# exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/07_threads.json` (your machine's figures, not committed). All of them:
# `make try-it ch=07`.
#
# 1. **Threads: the decode product's rows split over 1 or all physical cores.**
#    - *Predict:* two answers, and the measurement says which holds here: if one core already
#      streams the blocks as fast as memory delivers them, a second core adds little; if one
#      core's unpacking is slower than memory (the chapter's roofline: compare the GB/s of
#      blocks with the machine's bandwidth), each core adds its unpacking, up to the bandwidth
#      floor.
#    - *Measure:* `make try-it ch=07 exp=kernel_threads`
#
# 2. **`--threads N` for the whole decode step (the threads stage, SmolLM2).**
#    - *Predict:* less than the kernel's gain: SmolLM2's matrices are small (under a MiB
#      each), so every matmul's fork and join, and Python between the ops, are a visible share
#      of a step that threads do not shorten.
#    - *Measure:* `make try-it ch=07 exp=model_threads` (runs the default model)

