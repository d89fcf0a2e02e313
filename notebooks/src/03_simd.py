# Source of notebooks/03_simd.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 03 · simd: break the chain, fill the vector registers
#
# After tiling, the bytes come from cache, yet the loop is still slow, because of one line:
# `acc += A[i, k] * B[k, j]`. Every addition needs the result of the one before it. A
# floating-point add (or fused multiply-add) takes about 4 cycles to produce its result, so the
# loop does one multiply-add every 4 cycles: 0.5 FLOP per cycle.
#
# The core can do far more. It can *start* one or two fused multiply-adds (FMA) every cycle, and
# each can work on a whole vector register: 8 floats (`ymm`, AVX2) or 16 (`zmm`, AVX-512). The
# compiler may not use that on its own: splitting one sum into 8 partial sums changes the order
# of float additions, so the result can differ in the last bits. This stage gives it permission
# (`fastmath` reassociation) and something worth vectorizing:
#
# 1. **packing**: each weight stored as `[N, K]`, so the inner loop over `k` reads consecutive
#    addresses, which is what vector loads need;
# 2. **a 4 x 4 register block**: 4 rows of `x` against 4 rows of `W` keep 16 independent sums in
#    registers; every value loaded is used 4 times.

# %%
import platform

import numpy as np

from app.measure.machine import machine_info

findings = nb.Findings()
info = machine_info()
ceil = nb.ceilings()
print(f"{info['cpu']}: SIMD features {', '.join(info['simd']) or 'none reported'}")
print(f"measured peak, one thread: {ceil['peak_gflops']:.0f} GFLOP/s; bandwidth {ceil['bandwidth_gbs']:.1f} GB/s "
      f"({ceil['source']})")

# %% [markdown]
# ## The stage's code

# %%
import stages.simd

nb.show_source(stages.simd.matmul_panels, stages.simd.Panels, stages.simd.SimdBackend,
               note=f"`FASTMATH = {sorted(stages.simd.FASTMATH)}`: reassociation (what splitting a sum "
                    f"needs), FMA contraction, and ignoring the sign of zero; NaN and Inf keep their meaning.")

# %% [markdown]
# ## The evidence: the assembly LLVM generated
#
# numba compiles each kernel with LLVM; we ask for the machine code and count the fused
# multiply-adds by the width of the registers they work on. `vfmadd231ps` on a `ymm` register is
# 8 multiply-adds in one instruction; `...ss` is one.

# %%
from stages.naive import matmul_textbook
from stages.simd import matmul_panels
from stages.tiling import matmul_tiled

a = np.ones((5, 33), np.float32)
asm = {"naive": nb.kernel_asm(matmul_textbook, a, np.ones((33, 8), np.float32)),
       "tiling": nb.kernel_asm(matmul_tiled, a, np.ones((33, 8), np.float32)),
       "simd": nb.kernel_asm(matmul_panels, a, np.ones((8, 33), np.float32))}
counts = {k: nb.fma_counts(v) for k, v in asm.items()}
kinds = list(next(iter(counts.values())))
nb.show_table(["kernel", *kinds, "lines of assembly"],
              [(k, *[c[x] for x in kinds], len(asm[k].splitlines())) for k, c in counts.items()])
x86 = platform.machine() in ("x86_64", "AMD64")
if not x86:
    print(f"This is a {platform.machine()} machine: the counts above look for x86 instructions; "
          "the excerpts below are its own assembly.")
packed = {k: sum(v for kind, v in c.items() if kind.startswith("packed")) for k, c in counts.items()}
findings["assembly"] = (f"packed FMAs: simd {packed['simd']}, tiling {packed['tiling']}, naive {packed['naive']}"
                        + ("" if x86 else " (x86 patterns on a non-x86 machine)"))

# %% [markdown]
# The inner loop of each, picked out as the basic block doing the most floating-point work:

# %%
nb.md("**simd** (`matmul_panels`):\n\n```asm\n" + nb.hot_loop(asm["simd"], 34) + "\n```")
nb.md("**naive** (`matmul_textbook`):\n\n```asm\n" + nb.hot_loop(asm["naive"], 20) + "\n```")

# %% [markdown]
# In the simd loop, each vector load brings 8 (or 16) consecutive `k` of one row, and each FMA
# accumulates them into a register of partial sums; 16 such registers are the 4 x 4 block. The
# naive loop does one scalar multiply-add (`vfmadd...ss`, or a `mul` and an `add`) per trip.
#
# ## GFLOP/s against the peak
#
# The three kernels on the model's largest matmul shape, at 16 rows (a prompt) and at 1 row (a
# decode step with a KV cache), against the peak this machine reaches with this very kernel on
# data that sits in L1 (`app/measure/roofline.py`).

# %%
from common.gguf import GGUFFile
from common.model import LlamaConfig

mcfg = LlamaConfig.from_gguf(GGUFFile(nb.model_path()))
K, N = mcfg.n_embd, mcfg.n_ff
rng = np.random.default_rng(0)
W = rng.standard_normal((N, K), dtype=np.float32)           # packed layout [N, K]
B = np.ascontiguousarray(W.T)                                # the textbook's [K, N]
results = {}
for rows in (16, 1):
    x = rng.standard_normal((rows, K), dtype=np.float32)
    for name, fn, w in (("naive", matmul_textbook, B), ("tiling", matmul_tiled, B), ("simd", matmul_panels, W)):
        seconds = nb.best_seconds(lambda: fn(x, w), cfg.timing_reps)
        results[f"{name}\n{rows} row{'s' if rows > 1 else ''}"] = 2 * rows * K * N / seconds / 1e9
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(9, 4.2))
bars = ax.bar(range(len(results)), list(results.values()), color=[f"C{i % 3}" for i in range(len(results))])
for b, v in zip(bars, results.values()):
    ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
ax.axhline(ceil["peak_gflops"], color="black", lw=1, ls="--")
ax.annotate(f"peak {ceil['peak_gflops']:.0f} GFLOP/s", (0, ceil["peak_gflops"]), fontsize=8, va="bottom")
ax.set_xticks(range(len(results)), list(results), fontsize=8)
ax.set_yscale("log")
ax.set_ylabel("GFLOP/s (log)")
ax.set_title(f"[rows x {K}] @ [{K} x {N}] (weights hot in cache)", fontsize=10)
ax.grid(axis="y", which="both", alpha=0.25)
fig.tight_layout()
nb.show(fig)
named = {k.replace("\n", ", "): v for k, v in results.items()}          # "simd, 16 rows": the table's names
nb.show_table(["kernel, rows", "GFLOP/s", "share of the measured peak"],
              [(k, f"{v:.1f}", f"{v / ceil['peak_gflops']:.0%}") for k, v in named.items()])
simd16 = results["simd\n16 rows"]
if simd16 > ceil["peak_gflops"]:
    print(f"simd beats the recorded 'peak' of {ceil['peak_gflops']:.0f} GFLOP/s: app/measure/roofline.py measures it "
          "with a small matmul (8 x 512 operands) called many times, which this larger shape outruns. "
          "Read that peak as a floor, not a ceiling.")
findings["kernel GFLOP/s"] = (f"16 rows: simd {simd16:.1f}, tiling {named['tiling, 16 rows']:.1f}, "
                              f"naive {named['naive, 16 rows']:.1f} GFLOP/s "
                              f"({simd16 / named['naive, 16 rows']:.0f}x naive); 1 row: simd "
                              f"{named['simd, 1 row']:.1f} GFLOP/s")

# %% [markdown]
# With one row, the 4 x 4 block degenerates to 1 x 4: each weight loaded is used once, and the
# kernel is bound by loads, not FMAs. And in the real model the weights do not sit in cache:
# one token reads all of them from DRAM. That is the roofline's memory ceiling, and the reason
# the next stages are about *bytes*, not FLOPs.
#
# ## The stage, end to end

# %%
from app.report.charts import roofline_points

live, rows = nb.measure_pair("tiling", "simd", cfg)
t, s = live
findings["simd, live"] = (f"TTFT {s['ttft_ms']:.0f} ms ({t['ttft_ms'] / s['ttft_ms']:.1f}x tiling), "
                          f"decode {s['decode_ms']:.0f} ms/token ({t['decode_ms'] / s['decode_ms']:.1f}x tiling)")

# %% [markdown]
# ## Beside the article: the lesson reverses
#
# The article's SIMD stage gained 3%, and it said why: the loop was bound by memory, so wider
# arithmetic had nothing to win. Here the same step is worth far more. Both are right about
# their machines, and the roofline says which bound applies where: for a loop that moves B bytes
# from memory and takes T seconds, B / bandwidth is the time the memory alone needs. If that is
# close to T, the loop waits on memory (the article's case); if it is far below T, the loop waits
# on something else, here the chain of dependent adds that simd breaks.
#
# The bytes below are modelled from the tiled loop's order (a matrix larger than the last-level
# cache is read from memory once per 8 rows, `app/measure/roofline.py`), for one decode step of
# this model and of the article's TinyLlama 1.1B, with this machine's caches and with the
# article's i3 (3 MiB of L3).

# %%
from types import SimpleNamespace

from app.measure import roofline
from app.report import lessons
from app.synthetic import TINYLLAMA

rows_per_step = t["n_prompt"] + 1                        # no KV cache: every step is the whole text
tiny = SimpleNamespace(n_layer=TINYLLAMA.n_layer, n_embd=TINYLLAMA.n_embd, n_ff=TINYLLAMA.n_ff,
                       n_head=TINYLLAMA.n_head, head_dim=TINYLLAMA.head_dim,
                       kv_dim=TINYLLAMA.n_head_kv * TINYLLAMA.head_dim, n_vocab=TINYLLAMA.n_vocab)
mine = nb.cache_sizes()
table, floors = [], {}
for model_name, conf in ((nb.model_path().stem, mcfg), ("TinyLlama 1.1B (the article's)", tiny)):
    for where, caches in (("this machine", mine), (lessons.ARTICLE_CPU, lessons.ARTICLE_CACHES)):
        moved = roofline.traffic("tiling", conf, rows_per_step, rows_per_step, caches)["decode_bytes"]
        floors[model_name, where] = moved / (ceil["bandwidth_gbs"] * 1e9) * 1e3
        table.append((model_name, where, nb.human_bytes(moved), f"{floors[model_name, where]:,.0f} ms"))
nb.show_table(["model", "caches of", f"tiling: bytes from memory per step ({rows_per_step} rows)",
               f"their time at {ceil['bandwidth_gbs']:.1f} GB/s"], table)
here = floors[nb.model_path().stem, "this machine"]
print(f"tiling measured {t['decode_ms']:,.0f} ms per step here: {t['decode_ms'] / here:,.0f}x the time its memory "
      f"traffic needs, so the loop is not waiting on memory")
nb.article.beside("simd_speedup", t["decode_ms"] / s["decode_ms"], "decode, live",
                  explain=f"Here the step takes {t['decode_ms'] / here:,.0f}x the time its memory traffic needs: "
                          f"arithmetic, not memory, is what simd can shorten. The article's loop had TinyLlama's "
                          f"matrices (tens of MiB each) against 3 MiB of L3: every 8 rows read them from memory again "
                          f"(the table's last row), the memory-bound loop it measured.")
findings["vs the article"] = (f"simd {t['decode_ms'] / s['decode_ms']:.1f}x tiling (the article: +3%); tiling's "
                              f"modelled memory traffic takes {here:,.1f} ms of its {t['decode_ms']:,.0f} ms step here")

# %%
nb.print_profile(rows, "per-op profile, simd (live)")
rec = nb.recorded()
nb.ops_chart_with_records("simd", rows, rec, compare=("tiling",))

# %%
points = [(f"{r['stage']} {kind} (live)", x, y) for r in live for kind, x, y in roofline_points(r)]
nb.roofline_chart(ceil, points, "tiling and simd on this machine's roofline")

# %%
nb.md(rec.note)
nb.stage_chart(live, rec, ["naive", "tiling", "simd"], "naive -> tiling -> simd")

# %% [markdown]
# simd still has no KV cache: every decode step pushes the whole text through the model again.
# That waste is the next chapter.

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). simd is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("simd")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the packed inner loop: a 4 x 4 block of independent sums over the panels.**
# The starting file, [`exercises/03_simd/panels.py`](../exercises/03_simd/panels.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=03
# ```
#
# (or `.venv/bin/python -m exercises.check 03`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 03`). The check runs your code and the stage's own,
# [`stages/simd.py`](../stages/simd.py) (`matmul_panels`), on 8 seeded cases of awkward shapes,
# holding yours to the stage's: within the bound two float32 sums of K products may honestly differ
# by. It stops at the first case that differs and says which, where and by how much; once all pass,
# it times yours beside the stage's and beside the tiling stage's loop. `--solution reference` runs
# the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/03_simd.json` (your machine's figures, not committed). All of them:
# `make try-it ch=03`.
#
# 1. **Fastmath on matmul_panels (stages/simd.py; the flags in stages/kernels/toolkit.py).**
#    - *Predict:* without 'reassoc' LLVM may not split a sum across vector lanes: the 16 sums
#      stay scalar, one lane of 8 or 16, so several times slower (up to the vector width: 8
#      with AVX2, 16 with AVX-512), though the 16 independent chains still keep the FMA units
#      busier than tiling's one.
#    - *Measure:* `make try-it ch=03 exp=fastmath_off`
#
# 2. **The rows of A: 1 (a decode step), 4, 16 (a prompt).**
#    - *Predict:* each weight loaded serves as many FMAs as there are rows in the block (up
#      to 4): 1 row does a quarter of the work per load, so well under half the GFLOP/s of 4
#      rows (not a full quarter: x's loads and the stores are fewer too); 16 rows about as fast
#      as 4.
#    - *Measure:* `make try-it ch=03 exp=one_row`

