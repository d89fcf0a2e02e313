# Source of notebooks/13_amx.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 13 · amx: the prompt on the CPU's matrix unit
#
# Chapter 12 ended on the vector unit's integer peak: the prompt is bound by multiply-adds, and
# the prefill stage does them two prompt rows to a 512-bit `vpdpbusd`, 64 int8 multiply-adds an
# instruction. Intel's Xeons of the 4th generation on (Sapphire Rapids, Emerald Rapids, Granite
# Rapids) carry a second unit built for nothing else: **AMX**, eight tile registers of 16 rows x 64
# bytes and one instruction, `TDPBSSD`, that multiplies two of them into a third,
# 16 x 16 x 64 = 16,384 multiply-adds, about 1,024 a cycle against the vector unit's 128. It is the
# CPU's tensor core, and the prompt is exactly its work.
#
# The amx stage (`stages/amx.py`) sends the prompt's matmuls there. This chapter draws the tile
# layout the stage writes the weights in (from the code), shows the instructions its kernel
# compiles to, checks that it computes repack's bits, and, where the unit is, times the prompt
# against the prefill stage and against the unit's own peak.

# %%
from common.cpu import simd_features
from stages import unavailable_reason
from stages.kernels import amx_tiles

findings = nb.Findings()
why = unavailable_reason("amx")
flags = sorted(f for f in ("amx_tile", "amx_int8", "amx_bf16") if f in simd_features())
print(f"AMX flags of this CPU: {', '.join(flags) or 'none'}")
print(f"the amx stage: {why or 'runs on this machine'}")
findings["the unit here"] = why or "AMX tiles, granted to this process"

# %% [markdown]
# ## Is there one here?
#
# Two things must hold. The CPU must have the unit (`amx_tile` and `amx_int8` among its
# `/proc/cpuinfo` flags). And Linux must give the process its tile registers: they are 8 KiB of
# state that every context switch would have to save, so the kernel keeps them off until a process
# asks (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once; the stage's `tile_refusal`).
# Without either, the first tile instruction kills the process with SIGILL, so the stage checks both
# and says which is missing. Where the unit is missing, everything below that needs it says so; the
# layout, the instructions and the bits are checked here all the same.

# %% [markdown]
# ## The tile layout, drawn from the code
#
# `TDPBSSD C, A, B` computes, for each of A's rows m and each of 16 columns n,
# C[m][n] += sum over k of A[m][4k..4k+3] . B[k][4n..4n+3]: A's row is one activation row, and B's
# row k holds **4 values of each of 16 weight rows, side by side** (the 4-byte groups `vpdpbusd`
# multiplies, "VNNI layout"). The activation rows are already stored one after another in the 8-bit
# packs (`stages/kernels/q8.py`), so an A tile loads straight from them. The weights are laid out
# once, at load, by `amx_tiles.tile_layout`: groups of 16 rows, one B tile per block of 32 values.
# Below, a Q8_0 matrix whose value k of row r is k is laid out by that function, and the first two
# rows of its first B tile are read back (each cell: the value's index k; its weight row above).

# %%
import numpy as np

from common.gguf import GGMLType
from common.quants import quantize

values = np.tile(np.arange(32, dtype=np.float32), (16, 1))          # row r, value k: k
raw = quantize(values, GGMLType.Q8_0).reshape(16, -1)
tiles = amx_tiles.tile_layout(raw, amx_tiles.Q8_0)
b_tile = tiles[:amx_tiles.B_BYTES[amx_tiles.Q8_0]].view(np.int8).reshape(8, 16, 4)
scale = 31 / 127                                                    # Q8_0 stores k as round(k / d), d = 31/127
for k in range(2):
    nb.show_table([f"B row {k}"] + [f"r{n}" for n in range(16)],
                  [("values", *(" ".join(str(int(round(v * scale))) for v in b_tile[k, n]) for n in range(16)))])
findings["tile layout"] = (f"B row 0 holds values 0-3 of rows 0..15 in turn; a block of a 16-row group is "
                           f"{amx_tiles.TILE_AT[amx_tiles.Q4_0]['size']} bytes for Q4_0 (its values as bytes, "
                           f"then 16 scales)")

# %% [markdown]
# Each value is a signed byte with its offset folded in (Q4_0 stores q and means q - 8; the tile holds
# q - 8), so the product is the exact integer repack's kernel sums. The copy costs about a byte per
# weight beside repack's half a byte (Q4_0), and it sits right after the matrix's repacked bytes,
# which decode keeps reading:

# %%
rows = [(GGMLType(k).name, f"{amx_tiles.TILE_AT[k]['size']} B per {amx_tiles.SUB[k] * amx_tiles.SUBS[k]} values "
         f"of 16 rows", f"{amx_tiles.TILE_AT[k]['size'] / 16 / (amx_tiles.SUB[k] * amx_tiles.SUBS[k]):.2f}")
        for k in amx_tiles.AMX_TYPES]
nb.show_table(["type", "a group's block", "bytes per weight"], rows)

# %% [markdown]
# ## The instructions
#
# The kernel (`amx_tiles.amx_gemm`) is written in LLVM IR like the other hand-written kernels: LLVM's
# AMX intrinsics take the tile shapes as operands and write the tile configuration (`ldtilecfg`)
# themselves. numba can compile it for a CPU this one is not (`NUMBA_CPU_NAME=sapphirerapids`), so
# here is what a Sapphire Rapids would run, for Q4_0 and Q4_K, whether or not this machine has
# the unit: per block, two tile loads (16 activation rows, the B tile), one `tdpbssd`, one store
# of the 16 x 16 int32 sums, then the block's float steps, 16 weight rows to a 512-bit register.

# %%
from collections import Counter

counts = {}
for kind in (amx_tiles.Q4_0, amx_tiles.Q4_K):
    asm = nb.amx_kernel_asm(kind)
    ops = Counter(line.split()[0] for line in asm.splitlines() if line.startswith("\t"))
    counts[GGMLType(kind).name] = ops
names = ["ldtilecfg", "tilezero", "tileloadd", "tdpbssd", "tilestored", "tilerelease", "vcvtdq2ps", "vfmadd*ps"]
fmas = {k: sum(v for op, v in c.items() if op.startswith("vfmadd") and op.endswith("ps")) for k, c in counts.items()}
nb.show_table(["instruction"] + list(counts),
              [(n, *(fmas[k] if n == "vfmadd*ps" else c[n] for k, c in counts.items())) for n in names])
findings["kernel"] = ", ".join(f"{k}: {c['tdpbssd']} tdpbssd, {c['tileloadd']} tileloadd" for k, c in counts.items()) \
    + " (compiled for sapphirerapids; loops unrolled by LLVM)"

# %% [markdown]
# ## The same bits as repack's kernel
#
# A tile product is exact (int32 sums of byte products), and the float steps after it are repack's,
# lane for lane: so the kernel must give repack's bits, which is what the tests hold it to. Where
# there is no unit to run it, its **twin** runs: the same kernel with each tile instruction replaced
# by loops over memory that compute what Intel's manual says the instruction computes
# (`amx_tiles.Emulated`; `tests/test_amx.py` holds the twin to the manual's formula). Every type the
# stage takes, a group and a half of weight rows against a tile and a part of one of prompt rows:

# %%
from numba import njit

from stages.kernels import layer_stack, repack_steps, repacked
from stages.kernels.q8 import new_packs, quantize_row


@njit
def _packs(x, p32, pk):
    for m in range(x.shape[0]):
        quantize_row(x[m], m, x.shape[1], True, True, p32, pk)


rng = np.random.default_rng(13)
N, M, K = 24, 19, 512
rows = []
for kind in amx_tiles.AMX_TYPES:
    w = rng.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, GGMLType(kind)).reshape(N, -1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    p32, pk = new_packs(M, K)
    _packs(x, p32, pk)
    got = amx_tiles.emulated_rows(kind, amx_tiles.tile_layout(raw, kind), raw.shape[1], p32, pk, M, N)
    mat = layer_stack.matrix_table([(0, N, raw.shape[1], kind, repack_steps.REPACKED)])
    want = repack_steps.STACK.matmul_rows(x, layer_stack.read_only(repacked.repack(raw, kind)), mat, 1,
                                          repack_steps.Repacked(), np.uint16)   # K/V dtype: the stage's compiled call
    rows.append((GGMLType(kind).name, f"{N} x {M}", "identical" if np.array_equal(got, want) else
                 f"differ: max {np.abs(got - want).max():.3g}"))
nb.show_table(["type", "weight rows x prompt rows", "against repack's kernel"], rows)
findings["bits"] = "; ".join(f"{t} {r}" for t, _, r in rows)

# %% [markdown]
# ## The prompt on the unit
#
# Where the unit is, the stage is timed against the prefill stage on the same prompts (the protocol
# of chapter 12: `app/measure/ttft.py`), and the unit's own peak is measured the way the vector
# unit's was: `tdpbssd` back to back on registers (`app/measure/roofline.py`). A work item goes to the
# unit from `AMX_ROWS` prompt rows on (`stages/kernels/amx_steps.py`): a guess from instruction
# counts until a CPU with the unit times it.

# %%
from app.measure import roofline, ttft
from common.cpu import physical_cores
from stages import load as load_stage

cores = physical_cores()
if why:
    nb.md(f"_Not measured here: {why}._ The other chapters' figures are this machine's; this one needs the unit.")
    findings["prompt"] = "not measured on this machine (no matrix unit)"
else:
    lengths = (16, 64) if cfg.quick else (128, 512, 1024)
    live = {}
    for s in ("prefill", "amx"):
        engine = load_stage(s, nb.model_path(), threads=cores, n_ctx=max(lengths) + 16)
        live[s] = ttft.sweep(engine, lengths, 4)
        del engine
    nb.line_chart({s: (list(lengths), [r[str(n)]["ttft_ms"] for n in lengths]) for s, r in live.items()},
                  "prompt tokens", "time to first token (ms)", f"TTFT against the prompt ({cores} threads, live)")
    peak = roofline.amx_peak_gops(cores)[0]
    nb.show_table(["stage"] + [f"{n} tokens" for n in lengths],
                  [(s, *(f"{r[str(n)]['ttft_ms']:,.0f} ms" for n in lengths)) for s, r in live.items()])
    findings["prompt"] = (f"amx {live['amx'][str(lengths[-1])]['ttft_ms']:,.0f} ms against prefill's "
                          f"{live['prefill'][str(lengths[-1])]['ttft_ms']:,.0f} ms at {lengths[-1]} tokens; "
                          f"the unit's peak {peak:,.0f} Gop/s at {cores} threads")

# %% [markdown]
# ## What to expect from the unit: the matmuls' share
#
# The unit speeds up the prompt's matmuls and nothing else: attention, the norms and the rounding
# of activations stay on the vector unit. So however fast the tiles are, the prompt cannot get
# faster than what is left once its matmuls cost nothing (Amdahl's law). The prefill stage's clock
# per phase (chapter 12) splits a prompt's time on this machine; with the matmuls 8 times faster
# (1,024 int8 multiply-adds a cycle a core against two 512-bit `vpdpbusd` ports' 128, if the unit
# ran at its peak) and the rest unchanged:

# %%
miss = nb.missing_stage("prefill")
if miss:
    nb.md(f"_No split to show: {miss}._")
else:
    n_pred = 64 if cfg.quick else 512
    engine = load_stage("prefill", nb.model_path(), threads=cores, n_ctx=n_pred + 16)
    phases = ttft.sweep(engine, (n_pred,), 4)[str(n_pred)]["phases_ms"]
    del engine
    total = sum(phases.values())
    matmul = sum(phases[k] for k in ("qkv", "wo", "gate_up", "down"))
    best = total - matmul + matmul / 8
    nb.show_table(["a prompt of %d tokens, prefill stage, %d threads" % (n_pred, cores), "ms"],
                  [("the layers' phases, summed", f"{total:,.0f}"),
                   ("of which the matmuls (qkv, wo, gate_up, down)", f"{matmul:,.0f} ({matmul / total:.0%})"),
                   ("the rest (attention, norms, rounding)", f"{total - matmul:,.0f}"),
                   ("with the matmuls 8x faster", f"{best:,.0f}: {total / best:.1f}x faster at most")])
    findings["what the unit can buy"] = (f"matmuls {matmul / total:.0%} of a {n_pred}-token prompt here: at most "
                                         f"{total / best:.1f}x with them 8x faster, {total / (total - matmul):.1f}x "
                                         f"with them free")

# %% [markdown]
# The split is this machine's: on a Xeon with the unit the vector unit's matmuls run at their own
# rate, and the stage's own float steps per block (16 vector multiply-adds for each tile product's
# 8,192 multiply-adds) keep the unit below its peak. The measured figures above replace this
# bound where the unit is.

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor. amx is
# highlighted where the records hold it; a machine without the unit has no record of it, and says so.

# %%
findings["running total"] = nb.journey("amx")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the amx stage's tile layout of a Q4_0 matrix.** The starting file,
# [`exercises/13_amx/tile_layout.py`](../exercises/13_amx/tile_layout.py), holds the function's
# signature and a docstring with the shapes, what to write and why, and the edges that catch a first
# attempt. Edit it, then check it:
#
# ```
# make exercise ch=13
# ```
#
# (or `.venv/bin/python -m exercises.check 13`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 13`). The check runs your code and the stage's own,
# [`stages/kernels/amx_tiles.py`](../stages/kernels/amx_tiles.py) (`tile_layout`), on 6 seeded cases
# of awkward shapes, holding yours to the stage's byte for byte (a wrong byte is named by its group,
# block, B row, weight row and value). It needs no matrix unit: the layout is numpy, so any CPU checks
# it. Once all cases pass, it times your layout at load beside the stage's and beside repack's, the
# layout the prefill stage reads (and decode still reads here). `--solution reference` runs the check
# on the stage's own code. Every chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/13_amx.json` (your machine's figures, not committed). Both run on any
# CPU. All of them: `make try-it ch=13`.
#
# 1. **The weight type under the tile layout (amx_tiles.TILE_AT): bytes per 32 values of a row.**
#    - *Predict:* the unit multiplies whole bytes, so the tile copy holds every value as a byte:
#      32 bytes and its scales per 32 values of a row, 34 for Q4_0 (against the file's 18: 1.89x)
#      and 36 for Q4_1 (against 20: 1.8x); repack's layout, which decode keeps reading, is as
#      large as the file.
#    - *Measure:* `make try-it ch=13 exp=layout_bytes`
#
# 2. **The layout's cost at load: amx_tiles.tile_layout against repacked.repack (numpy, one
# thread).**
#    - *Predict:* the tile layout unpacks every nibble and moves the values four bytes at a time,
#      where repack moves whole 4-byte pieces of the blocks: expect it a few times slower than
#      repack at load, a fraction of a second for a small model's matrices, paid once.
#    - *Measure:* `make try-it ch=13 exp=layout_time`
