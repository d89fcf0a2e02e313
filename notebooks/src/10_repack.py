# Source of notebooks/10_repack.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 10 · repack: the same bytes, laid out the way the vector unit reads them
#
# The fused stage's decode kernel reads a weight matrix one row at a time. Each row pays on its
# own for what it could share with its neighbours: loading the activation, unpacking its block
# scales, converting its sums to float, and one horizontal add at its end. llama.cpp does not run
# its plain dot product for Q4_K on x86 at all: at load it rewrites Q4_K matrices into groups of 8
# interleaved rows, so that one activation load serves 8 rows and each row owns one lane of the
# accumulator. The repack stage does that for every type the quantized stage supports, and for
# prefill too. This chapter draws the layout, shows the loop the CPU runs, and measures what the
# rearranging costs (load time, resident memory) and what it buys (bytes per second, decode, TTFT).

# %%
import numpy as np

from app.measure.machine import physical_cores
from stages import load as load_stage
from stages.kernels import repacked
from stages.kernels.toolkit import BLOCK_BYTES, Q4_K

findings = nb.Findings()
missing = {s: nb.missing_stage(s) for s in ("fused", "repack")}
for s, why in missing.items():
    print(f"{s}: {why or 'runs on this machine'}")
cores = physical_cores()

# %% [markdown]
# ## The layout, drawn from the code
#
# Eight Q4_K rows whose every byte holds its row's number, through `repacked.repack` (the function
# the stage calls at load): before, the 8 rows one after another, each 144 bytes per block; after,
# one 1152-byte group block: the 8 rows' scales side by side (`d`, `dmin`, 12 byte planes of
# 6-bit scales), then the packed values in 4-byte pieces taken from the rows in turn.

# %%
import matplotlib.pyplot as plt

rows = np.repeat(np.arange(8, dtype=np.uint8)[:, None], BLOCK_BYTES[Q4_K], axis=1)       # one block per row
after = repacked.repack(rows, Q4_K)
fig, axes = plt.subplots(2, 1, figsize=(10, 2.6))
axes[0].imshow(rows.reshape(1, -1), aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
axes[0].set_title("before: row 0's block, row 1's block, ... (the file)", fontsize=9)
axes[1].imshow(after.reshape(1, -1)[:, :], aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
axes[1].set_title("after: one group block (scales of the 8 rows, then 4-byte pieces of each row in turn)",
                  fontsize=9)
for ax in axes:
    ax.set_yticks([])
axes[1].set_xlabel("byte")
nb.show(fig)
first = after[128:160].tolist()
print("bytes 128..159 of the group block (the first 32 bytes of values) come from rows:", first)
findings["layout"] = f"one 32-byte load = 4 bytes of each of the 8 rows: {first[::4]}"

# %% [markdown]
# ## The loop the CPU runs
#
# The kernel is written as LLVM IR through `stages/kernels/vector_ir.py`, the one place where
# vector instructions are named. Its inner block for Q4_K, from the code numba compiled here:
# each `vpdpbusd` multiplies 32 weight bytes (4 values of 8 rows) by an activation dword
# broadcast from memory (`{1to8}`), adding into 8 int32 lanes, one per row; there is no
# horizontal add anywhere in the loop.

# %%
from collections import Counter

from stages.kernels.vector_ir import ISA

if ISA is None:
    nb.md("_This CPU has no AVX2 + F16C: the repack stage cannot run here, and there is no loop to show._")
else:
    asm = nb.integer_kernel_asm(Q4_K, "repacked", rows=1)
    block = nb.hot_loop(asm, 60, r"vpdpbusd|vpmaddubsw")
    nb.md("```asm\n" + block + "\n```")
    full = nb.hot_loop(asm, 10_000, r"vpdpbusd|vpmaddubsw")
    ops = Counter(line.split()[0] for line in full.splitlines() if line.strip() and not line.strip().endswith(":"))
    nb.show_table(["instruction", "in the hot block"], ops.most_common(12))
    findings["hot block"] = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
    rows_asm = nb.integer_kernel_asm(Q4_K, "rows", rows=1)
    # the instructions that fold a vector's lanes into one sum (after the loop, once a row)
    folds = Counter(op for op in (line.split()[0] for line in rows_asm.splitlines() if line.strip())
                    if op.startswith(("vextract", "vhadd", "vshufp", "vpermilp", "vmovhlp", "vmovshdup")))
    nb.md("The fused stage's row kernel, for comparison, keeps one row in a whole register, so it ends "
          "every row by folding the register's lanes into one sum, after its loop ("
          + (", ".join(f"{n} `{op}`" for op, n in folds.most_common()) or "none found")
          + " in its code), and reads one row's bytes per load.")

# %% [markdown]
# ## Bytes per second, against the memory
#
# Every matrix of this model through each stage's kernel on one activation row (a decode step's
# matmuls, the output head included), at 1 thread and at all cores, as bytes of weights read per
# second, beside the bandwidth this machine measured (the dashed lines: the roofline's). Once a
# kernel reaches the bandwidth, the memory and not the unpacking sets the pace. Each bar times
# one matrix per call, from Python; a small model's matrices are a fraction of a megabyte, which
# the memory delivers in tens of microseconds, about what a call costs outside its loop. So the
# bars sit under the lines by more than the kernels do: a decode step runs every matrix in one
# call (the running total below sets the whole step against the floor).

# %%
from common.gguf import GGUFFile
from stages import backend_class


def matrices_by_type(backend, limit):
    g = GGUFFile(nb.model_path())
    groups = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.type_name not in ("F32", "F16", "BF16") and t.name != "token_embd.weight":
            groups.setdefault(t.type_name, []).append(t)
    return {tn: [backend.prepare_matrix(t) for t in ts[:limit]] for tn, ts in groups.items()}


bandwidth = {t: nb.ceilings(t)["bandwidth_gbs"] for t in sorted({1, cores})}
rates = {}
if not (missing["fused"] or missing["repack"]):
    for name in ("fused", "repack"):
        for threads in sorted({1, cores}):
            b = backend_class(name)(threads=threads)
            groups = matrices_by_type(b, 6 if cfg.quick else 60)
            if name == "repack":                    # the rearranging a model's load does (finish_load)
                from stages.kernels.repacked import repack as _repack
                for ms in groups.values():
                    for m in ms:
                        m.data = _repack(m.source.data, m.kind)
            for tn, ms in groups.items():
                xs = {m.shape[1]: np.random.default_rng(0).standard_normal((1, m.shape[1])).astype(np.float32)
                      for m in ms}
                run = lambda ms=ms, xs=xs, b=b: [b.matmul(xs[m.shape[1]], m) for m in ms]
                best = nb.best_seconds(run, cfg.timing_reps)
                rates[(name, threads, tn)] = sum(m.nbytes for m in ms) / best / 1e9
    nb.bar_chart({f"{n}@{t} {tn}": r for (n, t, tn), r in rates.items()}, "GB/s of weights", "Decode kernels per type",
                 lines={f"memory bandwidth, {t} thread(s): {bw:.1f} GB/s": bw for t, bw in bandwidth.items()})
    nb.md(f"_Bandwidth {nb.ceilings()['source']}._")
    findings["kernels"] = ", ".join(f"{tn}@{t}: {rates[('repack', t, tn)] / rates[('fused', t, tn)]:.2f}x fused"
                                    for (n, t, tn) in rates if n == "repack")

# %% [markdown]
# ## What the rearranging costs: load time and resident memory
#
# The fused stage's weights are views of the mapped file: loading is nearly free and the pages
# are the file's (shared with the page cache). The repack stage's weights are a private copy,
# made at load: the load time grows by the rearranging. Resident memory need not: once a matrix
# is copied, the stage lets go of the file's pages for it (`release` in `stages/repack.py`), so
# the copy takes their place. Each stage in a fresh process, as the report measures it:

# %%
costs = {}
for s in ("fused", "repack"):
    if not missing[s]:
        costs[s] = nb.measure_in_subprocess(s, "The meaning of life is", 4)
file_mb = nb.model_path().stat().st_size / 2**20
if costs:
    nb.show_table(["stage", "load (s)", "weights held (MiB)", "peak RSS (MiB)", "file (MiB)"],
                  [(s, f"{r['load_s']:.2f}", f"{r['weights_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{file_mb:.0f}")
                   for s, r in costs.items()])
    findings["load and memory"] = ", ".join(f"{s}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MiB"
                                            for s, r in costs.items()) + f" (file {file_mb:.0f} MiB)"
if len(costs) == 2:
    from common.gguf import GGUFFile
    with GGUFFile(nb.model_path()) as gg:
        tied = "output.weight" not in gg.tensors                # the output head is the embedding itself
        embd_mb = gg.tensors["token_embd.weight"].nbytes / 2**20
    extra = costs["repack"]["weights_mb"] - costs["fused"]["weights_mb"]
    nb.md(f"Repack holds {extra:.0f} MiB more weights than fused."
          + (f" This model's output head is its token embedding ({embd_mb:.0f} MiB): the lookup still reads "
             "the file's rows, and the head reads a repacked copy, so that matrix is held twice." if tied else ""))

# %% [markdown]
# ## Decode and prefill, live
#
# Both stages by the measurement protocol, at 1 thread and at all cores.

# %%
live = nb.measure_live(("fused", "repack"), sorted({1, cores}), cfg)
live_vs = nb.show_live(live, "repack", "fused", cores)
if live_vs:
    findings["repack vs fused (live)"] = live_vs

# %% [markdown]
# ## K and V in float16: what it buys at long contexts
#
# Attention reads every stored K and V row of the sequence at every step: at a long context that
# is a growing share of a token's bytes. The stage keeps them in float16 (llama.cpp's default);
# `LLM_KV_TYPE=f32` keeps float32. A decode step against the context length, both ways:

# %%
import os

if not missing["repack"]:
    lengths = (16, 64) if cfg.quick else (64, 256, 512, 1024)
    curves = {}
    for kv in ("f16", "f32"):
        os.environ["LLM_KV_TYPE"] = kv
        e = load_stage("repack", nb.model_path(), threads=cores, n_ctx=max(lengths) + 8)
        e.warmup()
        ids = (nb.prompt_ids(e, 32) * (max(lengths) // 32 + 1))[:max(lengths) + 1]
        curves[f"K/V {kv}"] = (list(lengths), [nb.step_ms(e, ids, n) for n in lengths])
        del e
    os.environ.pop("LLM_KV_TYPE")
    nb.line_chart(curves, "context (positions)", "decode ms per token", "A decode step against the context")
    f16, f32 = curves["K/V f16"][1][-1], curves["K/V f32"][1][-1]
    findings["float16 K/V at the longest context"] = f"{f16:.2f} vs {f32:.2f} ms at {lengths[-1]} positions"

# %% [markdown]
# ## Against llama.cpp, recorded
#
# `python -m app bench vs-llama --engines fused,repack,llama.cpp` measures these side by side
# with llama.cpp in alternating rounds (`profiles/bench/vs_llama_<model>.md`). Its ratios, if it
# has measured the repack stage:

# %%
ratios = nb.vs_llama_ratios("repack", "fused,repack,llama.cpp")
if ratios:
    findings["recorded ratios"] = ratios

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). repack is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("repack")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: repack's 8-row interleave of a Q4_1 matrix.** The starting file,
# [`exercises/10_repack/interleave.py`](../exercises/10_repack/interleave.py), holds the function's
# signature and a docstring with the shapes, what to write and why, and the edges that catch a first
# attempt. Edit it, then check it:
#
# ```
# make exercise ch=10
# ```
#
# (or `.venv/bin/python -m exercises.check 10`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 10`). The check runs your code and the stage's own,
# [`stages/kernels/repacked.py`](../stages/kernels/repacked.py) (`repack`), on 6 seeded cases of
# awkward shapes, holding yours to the stage's: byte for byte (a wrong byte is named by its group,
# block, field and row). It stops at the first case that differs and says which, where and by how
# much; once all pass, it times yours beside the stage's and beside the fused stage's row-at-a-time
# kernel on the file's rows (the repack stage's kernel is timed reading your bytes). `--solution
# reference` runs the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/10_repack.json` (your machine's figures, not committed). All of them:
# `make try-it ch=10`.
#
# 1. **LLM_KV_TYPE: K and V stored as float16 (the stage's default, llama.cpp's) or float32.**
#    - *Predict:* a decode step reads K and V of every position: at 1024 positions 2 x 30 x
#      1024 x 192 values, 24 MB as float16 and 47 MB as float32, beside 94 MB of weights:
#      float32 should cost about a quarter more at 1024 positions and nothing visible at 64.
#    - *Measure:* `make try-it ch=10 exp=kv_type` (runs the default model)
#
# 2. **The software prefetch distance of repack's kernel (repacked.GROUP_PREFETCH: which cache, how
# far ahead).**
#    - *Predict:* a prefetch far enough ahead hides the memory's latency when one thread
#      streams a matrix larger than the caches: a few tens of percent over none, more where the
#      hardware prefetchers fall behind; too near and the line is not there in time, into L1
#      too early and it is evicted before use (on a Zen 4 the K-quants measured slower into L1
#      than with none at all).
#    - *Measure:* `make try-it ch=10 exp=prefetch`

