# Source of notebooks/08_int8.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 08 · int8: activations rounded to 8 bits, integer dot products
#
# The stage after `threads` changes one thing: every activation row is rounded to 8-bit blocks,
# as llama.cpp does, and the matrices multiply integers. llama.cpp multiplies 8-bit activations
# by the 4-bit weights with integer dot-product instructions; does LLVM, vectorizing our loops,
# find them too, and are they faster here?

# %%
import numpy as np

from common.gguf import GGUFFile
from stages.kernels.vector_ir import ISA as NAMED

findings = nb.Findings()
missing = {s: nb.missing_stage(s) for s in ("threads", "int8")}
for s, why in missing.items():
    print(f"{s}: {why or 'runs on this machine'}")
findings["byte products here"] = {"vnni": "vpdpbusd (AVX512-VNNI / AVX-VNNI)", "avx2": "vpmaddubsw + vpmaddwd (AVX2)",
                                  None: "none named: the plain integer loops (no AVX2 + F16C)"}[NAMED]

# %% [markdown]
# ## int8: what llama.cpp does to an activation row
#
# Before a matrix multiply, llama.cpp rounds the activation row to blocks of 8-bit integers
# with one scale each: 32 values per block (Q8_0/Q8_1) for the 32-value weight formats, 256
# (Q8_K, with the sums of every 16) for the K-quants. Then a block's dot product is a sum of
# integer products, and the scales are applied once per block.

# %%
if missing["int8"]:
    nb.md(f"_Skipped: {missing['int8']}._")
else:
    import stages.int8 as si
    import stages.kernels.int_dot as ik
    import stages.kernels.q8 as q8
    from stages.kernels.vector_ir import ISA
    nb.show_source(si.Int8Backend.matmul)
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    x[0, 5] = 9.0                                            # one large channel in the first block
    qx, dx, sx, sums = q8.quantize_q8(x, 32)
    back = q8.dequantize_q8(qx, dx, 32)
    print("first 8 values:      ", np.round(x[0, :8], 3))
    print("their int8:          ", qx[0, :8], " block scales d:", dx[0])
    print("and back, d * q:     ", np.round(back[0, :8], 3))
    err = np.abs(back - x).reshape(2, 32).max(axis=1)
    print(f"largest rounding error per block: {err[0]:.4f} (the block with the 9.0), {err[1]:.4f}")

# %% [markdown]
# ## The instructions LLVM chose
#
# The int8 kernels' sums are written as plain loops over integer products. LLVM recognizes a
# loop of 16-bit products summed into 32 bits and emits `vpmaddwd` (8 products, adjacent pairs
# added, per 128-bit register) or, with VNNI, `vpdpwssd` (the add folded in). llama.cpp's
# hand-written AVX2 code uses `vpmaddubsw` (32 unsigned x signed byte products per 256-bit
# register) and keeps each block's 8 lanes to convert and scale them in float: no horizontal
# add per block. An auto-vectorizer only forms these instructions inside a reduction, which
# ends in a horizontal add, once per block.

# %%
if not missing["int8"]:
    import platform
    import re
    from collections import Counter

    from common.gguf import GGMLType
    from stages.kernels.toolkit import F16_TO_F32

    row_kernels = nb.int8_row_kernels()
    nb.show_source(*row_kernels.values(), note="matvec_int8_auto's loop, one type each, no prange:")
    if platform.machine() not in ("x86_64", "AMD64"):
        nb.md("_The assembly below is x86; this machine is not._")
    else:
        table, seen = [], []
        for name, fn, qk_, size in (("Q4_1 (SmolLM2)", row_kernels[GGMLType.Q4_1], 32, 20),
                                     ("Q4_K (TinyLlama)", row_kernels[GGMLType.Q4_K], 256, 144)):
            K = 512
            w = np.zeros((2, K // qk_ * size), np.uint8)
            w.flags.writeable = False
            qa, da_, sa, sm = q8.quantize_q8(np.ones((1, K), np.float32), qk_)
            asm = nb.kernel_asm(fn, qa[0], da_[0], sa[0], sm[0], w, F16_TO_F32)
            ops = Counter(re.findall(r"^\s+(?:\{vex\}\s+)?(vpmaddwd|vpdpwssds?|vpdpbusds?|vpmaddubsw|vpmulld|vpmuldq)"
                                     r"\b[^\n]*%([xyz])mm", asm, re.M))
            for (op, reg), n in sorted(ops.items()):
                table.append((name, op, {"x": "xmm (128-bit)", "y": "ymm (256-bit)", "z": "zmm (512-bit)"}[reg], n))
                seen.append(f"{name.split()[0]}: {op} {reg}mm x{n}")
        nb.show_table(["kernel", "instruction", "register", "count"], table)
        findings["int8 instructions"] = "; ".join(seen) or "no integer multiply-add found (see the CPU's flags)"

# %% [markdown]
# ## When the compiler will not find the instruction, name it
#
# No rewriting of those loops makes LLVM emit `vpdpbusd` (VNNI: 32 unsigned x signed byte
# products, 4 summed into each 32-bit lane) or `vpmaddubsw`. numba's `intrinsic` lets a jitted
# function write LLVM IR itself, and LLVM IR can call an x86 instruction's intrinsic by name.
# The helper below loads a Q4_0/Q4_1 block's 16 bytes and the activation's 32, unpacks the
# nibbles into 32 unsigned bytes and multiplies them with one instruction; the kernel around it
# is the loop above with the sum replaced. The stage uses these kernels where the CPU has AVX2
# (`vpmaddubsw` + `vpmaddwd`) or VNNI (`vpdpbusd`), the loops elsewhere.

# %%
if not missing["int8"]:
    if ISA is None:
        nb.md("_This CPU (or numba's target) has no AVX2: the int8 stage runs the loops above._")
    else:
        nb.show_source(ik.dot_nibbles_16._defn, ik._dot_q4_x_named,
                       note=f"The instructions this CPU gets: `{ISA}`.")
        from common.gguf import GGMLType
        from common.quants import quantize
        rng = np.random.default_rng(2)
        w = quantize(rng.normal(0, 0.02, (1536, 576)).astype(np.float32), GGMLType.Q4_1)   # SmolLM2's FFN geometry
        w.flags.writeable = False     # read-only as the mapped file is: to numba a writeable array is
                                      # another type, for which both kernels would compile again
        qa, da_, sa, sm = q8.quantize_q8(rng.standard_normal((1, 576)).astype(np.float32), 32)
        run = {name: (lambda f=f: f(qa[0], da_[0], sa[0], sm[0], w, int(GGMLType.Q4_1), F16_TO_F32, 1))
               for name, f in (("loops (auto-vectorized)", ik.matvec_int8_auto), ("named instructions", ik.matvec_int8_named))}
        same = np.array_equal(run["loops (auto-vectorized)"](), run["named instructions"]())
        times = {k_: nb.best_seconds(f, cfg.timing_reps) for k_, f in run.items()}
        nb.bar_chart({k_: 1536 * 576 / t / 1e9 for k_, t in times.items()}, "Gweights / s",
                     "Q4_1 1536 x 576, one thread")
        ratio = times["loops (auto-vectorized)"] / times["named instructions"]
        findings["named instructions"] = f"{ISA}: {ratio:.2f}x the loops on Q4_1, results {'identical' if same else 'DIFFERENT'}"

# %% [markdown]
# ## int8 against threads: numbers, and speed
#
# Rounding activations to 8 bits moves the logits by a few percent, as it does in llama.cpp:
# the float64 reference and the recorded llama.cpp logits (tests/golden) tell by how much.

# %%
if not missing["int8"]:
    from common import reference
    gold = np.load(nb.ROOT / "tests" / "golden" / "llama_cpp_logits.npz")
    default = nb.model_path().resolve() == (nb.ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").resolve()
    ids = gold["p0_ids"].tolist() if default else [1, 2, 3, 4, 5]
    ref = reference.forward(GGUFFile(nb.model_path()), ids)
    live = {}
    rows_ = []
    for s in ("threads", "int8"):
        e = nb.load(s)
        e.reset()
        lg = e.forward(ids, 0)
        e.reset()
        rel = np.sqrt(((lg - ref) ** 2).mean() / (ref ** 2).mean())
        row = [s, f"{np.abs(lg - ref).max():.3f}", f"{rel:.2%}"]
        if default:
            sub, want = gold["subset_ids"], gold["p0_subset_logits"]
            row.append(f"{np.sqrt(((lg[:, sub] - want) ** 2).mean() / (want ** 2).mean()):.2%}")
        live[s] = nb.measure(e, cfg)
        row.append(f"{live[s]['decode_ms']:.2f}")
        rows_.append(row)
        del e
    heads = ["stage", "max abs vs float64", "rel. RMS vs float64"]
    nb.show_table(heads + (["rel. RMS vs llama.cpp"] if default else []) + ["decode ms/token (live)"], rows_)
    findings["int8 vs threads (live)"] = (f"decode {live['int8']['decode_ms']:.1f} vs "
                                          f"{live['threads']['decode_ms']:.1f} ms/token; logits "
                                          f"{rows_[1][2]} from float64 (threads {rows_[0][2]})")
    ratio = live["threads"]["decode_ms"] / live["int8"]["decode_ms"]
    nb.md(f"**Faster here?** In this run int8 decodes at {ratio:.2f}x threads' speed. "
          + ("A gain that small is inside one run's noise on a shared machine (the recorded comparison "
             "below alternates rounds). " if abs(ratio - 1) < 0.1 else "")
          + "Both stages still open a parallel region for every operation and run Python between them, "
            "and a decode step's integer products are a small part of that: chapter 09 measures what the "
            "dispatch costs, and the integer kernels pay off once it is gone.")

# %% [markdown]
# ## Against llama.cpp, recorded
#
# `python -m app bench vs-llama` measures these stages and llama.cpp side by side, at 1 thread and
# at all cores, in alternating rounds, and writes `profiles/bench/vs_llama_<model>.json` with the
# page drawn from it (`vs_llama_<model>.md`). Its ratios, if it has run:

# %%
recorded_rows = nb.show_vs_llama(["int8"], "_No recorded comparison yet: `python -m app bench vs-llama` "
                                           "writes it._")
if recorded_rows:
    behind = sum(float(r[2]) > 1 for r in recorded_rows)
    findings["recorded ratios"] = (f"decode slower than llama.cpp in {behind} of {len(recorded_rows)} rows "
                                   f"(profiles/bench/vs_llama_*.md)")

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). int8 is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("int8")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: llama.cpp's rounding of an activation row to Q8_1 blocks.** The starting
# file, [`exercises/08_int8/round_q8.py`](../exercises/08_int8/round_q8.py), holds the function's
# signature and a docstring with the shapes, what to write and why, and the edges that catch a first
# attempt. Edit it, then check it:
#
# ```
# make exercise ch=08
# ```
#
# (or `.venv/bin/python -m exercises.check 08`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 08`). The check runs your code and the stage's own,
# [`stages/kernels/q8.py`](../stages/kernels/q8.py) (`quantize_row_32`), on 8 seeded cases of
# awkward shapes, holding yours to the stage's: bit for bit, every integer and every scale. It stops
# at the first case that differs and says which, where and by how much; once all pass, it times
# yours beside the stage's and beside the quantized stage's float product (the int8 stage's integer
# product is timed fed your blocks). `--solution reference` runs the check on the stage's own code.
# Every chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/08_int8.json` (your machine's figures, not committed). All of them:
# `make try-it ch=08`.
#
# 1. **The int8 decode kernel: plain integer loops against the instructions named (vpdpbusd /
# vpmaddubsw; the int8-loops variant of the stage).**
#    - *Predict:* LLVM turns the loops into vpmaddwd, 8 products an instruction after
#      widening the bytes; vpdpbusd multiplies 32 bytes by 32 and adds them in one: several
#      times fewer instructions per block, faster until memory sets the pace.
#    - *Measure:* `make try-it ch=08 exp=named_vs_loops`
#
# 2. **Int8 rounding of an activation row: how far d q lands from x.**
#    - *Predict:* roundf moves each value by at most half a step of its block, amax / 254
#      (plus float16's rounding of d, 1 part in 2048): at most 0.5 steps and a bit. An outlier
#      20 times an ordinary value makes its own block's step several times coarser (20 |x|
#      against the largest of 32 ordinary values, about 2.5 of them) and leaves the other
#      blocks alone.
#    - *Measure:* `make try-it ch=08 exp=rounding_error`

