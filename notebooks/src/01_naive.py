# Source of notebooks/01_naive.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 01 · naive: the textbook, and what it costs
#
# The first stage is the engine as a textbook would write it: every weight converted to float32
# when the model loads, matmul as the triple loop `C[i][j] += A[i][k] * B[k][j]`, and no memory
# of past tokens, so every new token runs the whole text through the model again.
#
# **How fast could it be?** Producing one token multiplies the current row by every weight
# matrix once: about 2 FLOP (a multiply and an add) per weight. With float32 weights each
# weight is 4 bytes that must come from memory, so the work has an *arithmetic intensity* of
# 2 / 4 = 0.5 FLOP per byte. A machine has two ceilings, its memory bandwidth (bytes/s) and its
# peak arithmetic (FLOP/s); at 0.5 FLOP/byte the bandwidth one is far lower. So the best a
# decode step can do is *the time to read every weight once*. That is the yardstick for the
# whole journey.

# %%
import numpy as np

findings = nb.Findings()
ceil = nb.ceilings()
print(f"this machine, one thread: {ceil['bandwidth_gbs']:.1f} GB/s, {ceil['peak_gflops']:.0f} GFLOP/s "
      f"({ceil['source']})")
print(f"ridge point: {ceil['peak_gflops'] / ceil['bandwidth_gbs']:.1f} FLOP/byte; below it, memory is the limit")

# %% [markdown]
# ## The stage's code
#
# The lesson is the matmul and the weight layout; the other primitives (norms, RoPE, softmax)
# are simple loops in the same file that every later CPU stage inherits.

# %%
import stages.naive

nb.show_source(stages.naive.matmul_textbook, stages.naive.NaiveBackend.prepare_matrix,
               stages.naive.NaiveBackend.matmul)

# %% [markdown]
# The inner loop walks down a column of `B`: consecutive `k` are a whole row of `B` apart in
# memory, so each load touches a new 64-byte cache line and uses 4 bytes of it. Chapter 02 is
# about that.
#
# ## Loading: the RAM balloon
#
# The file stores most weights in 4- and 8-bit blocks; this stage turns every one of them into a
# 4-byte float before the first token.

# %%
before = nb.memory_now()
engine = nb.load("naive")
after = nb.memory_now()
file_size = engine.gguf.file_size
held = engine.weight_bytes()
nb.show_table(["", "size"],
              [("model file (quantized blocks)", nb.human_bytes(file_size)),
               ("weights as this stage holds them (float32)", nb.human_bytes(held)),
               ("resident memory added by loading", f"{after['rss_mb'] - before['rss_mb']:.0f} MiB"),
               ("load time (dequantize + transpose)", f"{engine.load_s:.2f} s"),
               ("JIT compile or cache load", f"{engine.jit_s:.2f} s")])
nb.bar_chart({"file": file_size / 2**20, "float32 weights": held / 2**20,
              "RSS added by load": after["rss_mb"] - before["rss_mb"]},
             "MiB", "The RAM balloon: the same weights, before and after dequantizing", fmt="{:,.0f}")
findings["RAM balloon"] = (f"a {nb.human_bytes(file_size)} file became {nb.human_bytes(held)} of float32 "
                           f"weights ({held / file_size:.1f}x); loading added "
                           f"{after['rss_mb'] - before['rss_mb']:.0f} MiB of resident memory")

# %% [markdown]
# The article saw the same balloon, with figures of its own that do not add up: TinyLlama's
# 1.1 billion weights take 4.4 GB as float32, more than the process it reported. Here the ratio
# is the file's bits per weight against 32 (and, where the output matrix is tied to the
# embedding, this stage holds that matrix twice: once per layout).

# %%
nb.article.beside("ram_balloon", held / file_size, f"{nb.human_bytes(held)} held / {nb.human_bytes(file_size)} file")

# %% [markdown]
# ## Running it
#
# One generation by the measurement protocol (`app/measure/bench.py`): fixed prompt ids, greedy,
# the JIT warmed up first. TTFT is the prompt's forward pass plus the first token; decode is
# the median time of each token after it.

# %%
live = nb.measure(engine, cfg)
print(f"prompt {live['n_prompt']} tokens -> {live['text']!r}")
print(f"TTFT {live['ttft_ms']:.0f} ms, decode {live['decode_ms']:.0f} ms/token")
lower_bound_ms = engine.weight_stream_bytes() / (ceil["bandwidth_gbs"] * 1e9) * 1e3
print(f"reading the float32 weights once at {ceil['bandwidth_gbs']:.1f} GB/s takes {lower_bound_ms:.0f} ms: "
      f"decode is {live['decode_ms'] / lower_bound_ms:.1f}x that floor")
findings["naive, live"] = (f"TTFT {live['ttft_ms']:.0f} ms, decode {live['decode_ms']:.0f} ms/token; "
                           f"the memory floor for one token is {lower_bound_ms:.0f} ms")

# %% [markdown]
# The run's counters (`app/measure/counters.py`) came with it: task clock, context switches, page
# faults, and, where the machine exposes a performance monitoring unit, instructions and cycles.
# The article counted 0.98 instructions per cycle for its naive engine: a core that can retire
# four or more per cycle, mostly waiting.

# %%
counted = live["counters"]
pmu = counted["pmu"]
print(f"timed region: {counted['wall_ms']:.0f} ms wall, {counted['task_clock_ms']:.0f} ms task clock, "
      f"{counted['context_switches']} context switches, {counted['minor_faults']:,} minor / "
      f"{counted['major_faults']:,} major faults")
nb.article.beside("ipc_naive", pmu.get("ipc") if pmu["available"] else None,
                  "this run's counters" if pmu["available"] else pmu["reason"])
findings["IPC"] = (f"{pmu['ipc']:.2f} instructions per cycle ({pmu['cache_miss_rate']:.1%} of cache references "
                   f"missed)" if pmu["available"] else f"not measured here: {pmu['reason']}")

# %% [markdown]
# ## Where the time goes
#
# A per-op profile (`common/profile.py`) wraps every op of the backend in a timer. The matmuls
# are split by the weight they multiply.

# %%
rows = nb.profile(engine, cfg)
nb.print_profile(rows, "per-op profile, naive (live)")
rec = nb.recorded()
nb.ops_chart_with_records("naive", rows, rec)
findings["matmul share"] = f"{nb.matmul_share(rows):.0%} of the profiled run is spent in the weight matmuls"

# %% [markdown]
# ## No KV cache: every token costs more than the last
#
# Without a cache, the step that produces token `L + 1` pushes all `L` tokens through every
# matmul again. Timing one such step at growing lengths shows the cost growing with the text.

# %%
lengths = cfg.naive_lengths
tokens = nb.prompt_ids(engine, max(lengths))
step = [nb.step_ms(engine, tokens, n, reps=1) for n in lengths]
slope, intercept = np.polyfit(lengths, step, 1)
nb.line_chart({"naive: one decode step": (lengths, step)}, "tokens in the text (rows through every matmul)",
              "ms for the next token", "Without a KV cache, the next token re-reads the whole text")
print("\n".join(f"  {n:4d} tokens: {ms:8.0f} ms" for n, ms in zip(lengths, step)))
print(f"each extra token of text adds about {slope:.0f} ms to every later step")
findings["cost vs length"] = (f"one step grows from {step[0]:.0f} ms at {lengths[0]} tokens to {step[-1]:.0f} ms "
                              f"at {lengths[-1]}: about {slope:.0f} ms per token of text")

# %% [markdown]
# ## A cold start: the article's page faults
#
# The article counted over a million page faults in a naive run. Two kinds hide in that figure.
# A *major* fault waits for the disk: the model file's page was not in memory. A *minor* one only
# maps a page already there, or a fresh page of memory touched for the first time, which is what
# filling float32 copies of every weight does, once per 4 KiB. To see both, the model file is
# evicted from the page cache (`posix_fadvise`, no root needed: `counters.evict`), then the stage
# loads and runs one forward pass, each counted.

# %%
import gc

from app.measure import bench

del engine
gc.collect()                                  # unmapped, so that the file's pages can be evicted
cold = bench.cold_start("naive", nb.model_path(), cfg.prompt_tokens)
load_c, first_c = cold["load"], cold["first_forward"]
nb.show_table(["", "wall", "minor faults", "major faults", "faults per second"],
              [(name, f"{c['wall_ms']:,.0f} ms", f"{c['minor_faults']:,}", f"{c['major_faults']:,}",
                f"{c['faults_per_s']:,.0f}") for name, c in (("load (dequantize every weight)", load_c),
                                                             ("first forward pass", first_c))])
ev = cold["eviction"]
print(f"file resident before eviction {ev['resident_before']:.0%}, after {ev['resident_after']:.0%}"
      + (f": {ev['note']}" if ev["note"] else ""))
faults = sum(c["minor_faults"] + c["major_faults"] for c in (load_c, first_c))
pages = held / 4096
nb.article.beside("page_faults", float(faults),
                  f"load + first pass after eviction; the float32 weights are {pages:,.0f} pages of 4 KiB")
findings["cold start"] = (f"{faults:,} page faults ({load_c['major_faults'] + first_c['major_faults']:,} major) in "
                          f"loading and one pass after evicting the file; {pages:,.0f} pages of float32 weights")

# %% [markdown]
# ## On the roofline
#
# Each run is a point: FLOP per byte read (x) against FLOP/s achieved (y). Prefill processes all
# prompt rows per weight read, so it sits further right than a single token would. The bytes are
# those the textbook loop order really brings from memory, modelled from the matrix shapes and
# this machine's cache sizes (`roofline.traffic`, in the run's record): a matrix larger than the
# last-level cache is read again for every row.

# %%
from app.report.charts import roofline_points

points = [(f"naive {kind} (live)", x, y) for kind, x, y in roofline_points(live)]
nb.roofline_chart(ceil, points, "naive on this machine's roofline")
best = max(y for _, _, y in points)
findings["roofline"] = (f"at best {best:.2f} GFLOP/s, {best / ceil['peak_gflops']:.1%} of the measured peak "
                        f"of {ceil['peak_gflops']:.0f} GFLOP/s")

# %% [markdown]
# ## Against the record
#
# `make report` measures every stage with the same protocol and keeps the records in `profiles/`.

# %%
nb.md(rec.note)
nb.stage_chart([live], rec, ["naive"], "naive: live run and record")

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). naive is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("naive")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the textbook matmul, the triple loop this stage runs for every weight.** The
# starting file, [`exercises/01_naive/matmul.py`](../exercises/01_naive/matmul.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=01
# ```
#
# (or `.venv/bin/python -m exercises.check 01`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 01`). The check runs your code and the stage's own,
# [`stages/naive.py`](../stages/naive.py) (`matmul_textbook`), on 8 seeded cases of awkward shapes,
# holding yours to the stage's: within the bound two float32 sums of K products may honestly differ
# by (K and the products' magnitudes set it). It stops at the first case that differs and says
# which, where and by how much; once all pass, it times yours beside the stage's and beside numpy's
# matmul (a tuned BLAS: the horizon). `--solution reference` runs the check on the stage's own code.
# Every chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/01_naive.json` (your machine's figures, not committed). All of them:
# `make try-it ch=01`.
#
# 1. **The order of the loops in matmul_textbook (stages/naive.py): i-j-k against i-k-j.**
#    - *Predict:* i-k-j reads B along its rows (every byte of a 64-byte line used), and its
#      inner loop's adds go to different C[i, j], so none waits for another and LLVM can do 8
#      or 16 at once in a vector register: tens of times faster, with no other change (chapters
#      02 and 03 get there by other roads).
#    - *Measure:* `make try-it ch=01 exp=loop_order`
#
# 2. **The text's length L, with no KV cache (a step's matmul has L rows).**
#    - *Predict:* a step multiplies L rows by every weight: 2 L flops per weight, so the time
#      grows in proportion to L (64 tokens: about 64 times one).
#    - *Measure:* `make try-it ch=01 exp=text_length`
#
# 3. **The bits per weight the stage holds: float32 against the file's blocks.**
#    - *Predict:* SmolLM2's Q4_1 blocks hold 5 bits per weight (20 bytes per 32) and its
#      embedding Q8_0 8.5: as float32 (32 bits) the weights take about 4 to 6 times the file,
#      plus the output matrix the stage holds twice (once per layout).
#    - *Measure:* `make try-it ch=01 exp=balloon` (runs the default model)

