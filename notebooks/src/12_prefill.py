# Source of notebooks/12_prefill.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 12 · prefill: the compute-bound half
#
# The article's CUDA stage made decode faster and the time to first token slower: two problems.
# Decode reads every weight for one row, so it waits on memory, and the repack stage reads the
# weights about as fast as memory delivers them. A prompt of M rows reads each weight once for M
# rows: it has work to spare for every byte, so what counts is how many multiply-adds the core does
# per byte it loads, against the core's own peak. This chapter measures the prompt: its time
# against its length, where that time goes (matmuls, attention), the integer peak of this CPU and
# how close the prompt gets, and what the prefill stage changes: attention in tiles of queries
# against blocks of keys, and the prompt's matmuls two rows to a 512-bit register.

# %%

from app.measure import roofline, ttft
from common.cpu import physical_cores
from common.model import prompt_matmul_ops
from stages import load as load_stage

findings = nb.Findings()
missing = {s: nb.missing_stage(s) for s in ("repack", "prefill")}
for s, why in missing.items():
    print(f"{s}: {why or 'runs on this machine'}")
cores = physical_cores()
lengths = (8, 32) if cfg.quick else (128, 512, 1024, 2048)

# %% [markdown]
# ## The time to first token against the prompt's length
#
# Each stage by the measurement protocol, at every length, on all cores: the prompt, then a few
# decode steps at that context (`app/measure/ttft.py`, the same code the recorded comparison runs).
# Repack attends one query row and one head at a time, so its attention grows with the square of the
# prompt at one multiply-add per value it loads; the prefill stage reads each block of keys once for
# a tile of rows and all the heads that share it.

# %%
live = {}
for s in ("repack", "prefill"):
    if not missing[s]:
        engine = load_stage(s, nb.model_path(), threads=cores, n_ctx=max(lengths) + 16)
        live[s] = ttft.sweep(engine, lengths, 4)
        del engine
if live:
    nb.line_chart({s: (list(lengths), [r[str(n)]["ttft_ms"] for n in lengths]) for s, r in live.items()},
                  "prompt tokens", "time to first token (ms)", f"TTFT against the prompt ({cores} threads, live)")
    nb.show_table(["stage"] + [f"{n} tokens" for n in lengths],
                  [(s, *(f"{r[str(n)]['ttft_ms']:,.0f} ms" for n in lengths)) for s, r in live.items()])
if len(live) == 2:
    n = str(lengths[-1])
    findings["TTFT at the longest prompt"] = (f"prefill {live['prefill'][n]['ttft_ms']:,.0f} ms against repack's "
                                              f"{live['repack'][n]['ttft_ms']:,.0f} ms ({n} tokens, {cores} threads)")

# %% [markdown]
# ## Where the prompt's time goes
#
# The layer stack keeps a clock per phase (`stages/kernels/layer_stack.py`, PHASES): thread 0 reads
# the time-stamp counter at every barrier. Attention is `attend` and `merge`; the matmuls are
# `qkv`, `wo`, `gate_up` and `down`. Before (repack) and after (prefill), at the longest prompt:

# %%
if live:
    n = str(lengths[-1])
    shares = {s: {k: v / sum(r[n]["phases_ms"].values()) for k, v in r[n]["phases_ms"].items()}
              for s, r in live.items() if "phases_ms" in r[n]}
    nb.show_table(["phase"] + list(shares), [(k, *(f"{sh[k]:.1%}" for sh in shares.values()))
                                            for k in ttft.PHASE_NAMES])
    nb.bar_chart({f"{s}: attention": sum(sh[a] for a in ttft.ATTENTION_PHASES) * 100 for s, sh in shares.items()},
                 "% of the prompt's time", f"Attention's share of a {n}-token prompt", fmt="{:.1f}")
    findings["attention share"] = ", ".join(f"{s} {sum(sh[a] for a in ttft.ATTENTION_PHASES):.0%}"
                                            for s, sh in shares.items()) + f" of a {n}-token prompt"

# %% [markdown]
# ## Attention in tiles: a softmax that runs
#
# Attention for one query is a softmax over its scores against every key it may see, then the
# values weighted by it. Done as written, that is two passes over the keys: one for the largest
# score and the sum (the softmax needs both before any weight is known), one for the weighted sum.
# The prefill stage makes one pass, block by block, keeping three running values per query: the
# largest score so far m, the sum of the weights so far l, and the weighted sum so far o. A new
# block with scores S and values v updates them:
#
#     m' = max(m, max S)        a = exp(m - m')        P = exp(S - m')
#     l' = l a + sum P          o' = o a + sum_t P[t] v[t]
#
# and at the end the output is o / l. The factor `a` rescales what was summed against the old
# largest score to the new one, so nothing is summed twice and the block's keys and values are
# read once, while they sit in L1, for every query of the tile. One query, three blocks, in numpy:

# %%
import numpy as np

rng = np.random.default_rng(0)
S = rng.standard_normal(96) * 4                          # one query's scores against 96 keys
V = rng.standard_normal((96, 4))                         # their values (4 numbers each, for the table)
w = np.exp(S - S.max())
two_passes = w @ V / w.sum()
m, l, o = -np.inf, 0.0, np.zeros(4)
for b in range(0, 96, 32):                               # blocks of 32 keys, in order
    s, v = S[b:b + 32], V[b:b + 32]
    m_new = max(m, s.max())
    a, P = np.exp(m - m_new), np.exp(s - m_new)
    l, o, m = l * a + P.sum(), o * a + P @ v, m_new
nb.show_table(["", "the output (4 values)"], [("softmax, then the weighted sum (two passes)", np.round(two_passes, 6)),
                                             ("running, three blocks of 32 (one pass)", np.round(o / l, 6))])
findings["running softmax"] = f"one pass over 3 blocks: largest difference {np.abs(o / l - two_passes).max():.1e}"

# %% [markdown]
# The stage's kernel does this for the 8 query vectors of a group at once, one per lane of a
# register, with the causal mask applied to each lane's scores before the update:
# `stages/kernels/tiled_attention.py` (its module docstring draws the loop).

# %% [markdown]
# ## The integer peak, and how close the prompt gets
#
# The int8 stages' multiply-adds are integer ones, so their ceiling is not the float peak of the
# roofline but the peak of the dot-product instruction they use: `vpdpbusd` (four byte products into
# each int32 lane) where the CPU has VNNI, on 512-bit registers where it has AVX512-VNNI;
# `vpmaddubsw` then `vpmaddwd` with AVX2 alone. `app/measure/roofline.py` runs it back to back on registers; the
# prompt's matmuls are 2 integer operations per multiply-add of every layer matrix with every row.

# %%
instruction = roofline.int_instruction()
if instruction is None:
    nb.md("_No AVX2 here: the integer kernels do not run, and there is no integer peak to measure._")
else:
    peak = {t: roofline.int_peak_gops(t)[0] for t in sorted({1, cores})}
    nb.show_table(["threads", f"integer peak: {instruction} (Gop/s)"], [(t, f"{g:,.0f}") for t, g in peak.items()])
    if live:
        from common.gguf import GGUFFile
        from common.model import LlamaConfig
        with GGUFFile(nb.model_path()) as g:
            model_cfg = LlamaConfig.from_gguf(g)
        rows = []
        for s, r in live.items():
            for n in lengths:
                gops = prompt_matmul_ops(model_cfg, n) / (r[str(n)]["ttft_ms"] / 1e3) / 1e9
                rows.append((s, n, f"{gops:,.0f}", f"{gops / peak[cores]:.0%}"))
        nb.show_table(["stage", "prompt", "matmul Gop/s (TTFT)", f"share of the peak at {cores} threads"], rows)
        findings["integer peak"] = f"{instruction}: {peak[cores]:,.0f} Gop/s at {cores} threads; " + \
            ", ".join(f"{s} {r} at {n} tokens" for s, n, _, r in rows if n == lengths[-1])

# %% [markdown]
# ## Two prompt rows to a register
#
# Repack's kernel gives each of a group's 8 weight rows one lane of a 256-bit register. On a CPU with
# AVX512-VNNI the prefill stage gives the other 8 lanes of a 512-bit register a second prompt row:
# the weight piece in both halves, the upper half's rows swapped in pairs, against one 8-byte
# broadcast of the two rows' activations laid side by side. Every lane is a different (weight row,
# prompt row) pair, and each gets repack's integer sums and float steps: the same bits.
#
# What that buys depends on the core. Where a 512-bit `vpdpbusd` issues as often as a 256-bit one
# (Intel's AVX-512 cores), one instruction now does the work of two, and the prompt's matmuls take
# about half of repack's time. Where the core runs a 512-bit instruction as two 256-bit halves
# (AMD's Zen 4), it does the same work per cycle either way, and the matmuls take about repack's
# time: compare the two stages' matmul Gop/s at 128 tokens in the table above, where attention is
# still small. The gain that remains on every core is attention's, and it grows with the prompt.

# %%
from stages.kernels import pair_gemm, tile_gemm, vector_ir

rows_lanes = [f"r{r}" for r in pair_gemm.LANE_ROWS]
acts_lanes = ["x" if lane % 2 == 0 else "y" for lane in range(16)]
nb.show_table(["lane"] + list(range(16)), [("weight row", *rows_lanes), ("prompt row", *acts_lanes)])
if vector_ir.ZMM:
    asm = nb.integer_kernel_asm(pair_gemm.Q4_K, "pairs", rows=8)
    hot = nb.hot_loop(asm, 10_000, r"vpdpbusd")
    from collections import Counter
    ops = Counter(line.split()[0] for line in hot.splitlines() if line.strip() and not line.strip().endswith(":"))
    nb.show_table(["instruction", "in the hot block"], ops.most_common(10))
    findings["pair kernel"] = ", ".join(f"{op} {k}" for op, k in ops.most_common(4))
else:
    nb.md("_This CPU has no AVX512-VNNI: on AVX2 alone the prefill stage's matmuls run "
          "stages/kernels/tile_gemm.py (repack's lanes, a tile of "
          f"{tile_gemm.ROWS_PER_TILE} prompt rows per unpacked 256-bit piece), "
          "elsewhere repack's kernel in row blocks._")

# %% [markdown]
# ## A long prompt's memory
#
# The layer stack's scratch is sized by the rows of a call, so the stage sends a prompt through it in
# pieces of `PIECE_ROWS` rows (the KV cache carries the context from one piece to the next): a long
# prompt needs the KV cache and one piece's scratch, whatever its length.

# %%
from common.cpu import cache_sizes
from common.gguf import GGUFFile
from common.model import LlamaConfig
from stages.prefill import PIECE_ROWS, scratch_bytes, tile_rows_for

with GGUFFile(nb.model_path()) as g:
    mcfg = LlamaConfig.from_gguf(g)
n_ctx = 4096
kv = 2 * mcfg.n_layer * n_ctx * mcfg.kv_dim * 2
tile = tile_rows_for(mcfg.n_head, mcfg.n_head_kv, mcfg.head_dim, cache_sizes()["L2"])
piece = scratch_bytes(mcfg, PIECE_ROWS, cores, n_ctx, tile)
whole = scratch_bytes(mcfg, n_ctx, cores, n_ctx, tile)
nb.show_table(["", "bytes"], [("KV cache, 4096 positions, float16", nb.human_bytes(kv)),
                              (f"scratch of one piece ({PIECE_ROWS} rows)", nb.human_bytes(piece)),
                              ("scratch of the whole prompt at once (what pieces avoid)", nb.human_bytes(whole))])
findings["a 4096-token prompt"] = f"KV cache {nb.human_bytes(kv)} + one piece's scratch {nb.human_bytes(piece)}"

# %% [markdown]
# ## Against llama.cpp, recorded
#
# `python -m app bench ttft --lengths 128,512,1024,2048` measures repack, prefill and
# llama.cpp with flash attention off and on, in alternating rounds (`profiles/bench/ttft_<model>.md`).

# %%
recorded = nb.recorded_ttft()
if recorded:
    nb.show_table(["model", "engine", "prompt", "TTFT / llama.cpp's better", "decode / llama.cpp's better"], recorded)
    findings["recorded"] = "; ".join(f"{m} {e} {n}: TTFT {t}x" for m, e, n, t, _ in recorded if e == "prefill")
else:
    nb.md("_No recorded sweep yet: `python -m app bench ttft --lengths 128,512,1024,2048` writes it._")

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). prefill is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("prefill")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: a prompt tile of attention, keys in blocks, the online softmax.** The
# starting file,
# [`exercises/12_prefill/attention_tile.py`](../exercises/12_prefill/attention_tile.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=12
# ```
#
# (or `.venv/bin/python -m exercises.check 12`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 12`). The check runs your code and the stage's own,
# [`stages/kernels/tiled_attention.py`](../stages/kernels/tiled_attention.py) (`attend_rows,
# finish_rows`), on 7 seeded cases of awkward shapes, holding yours to the stage's: within the bound
# two float32 attentions may differ by. It stops at the first case that differs and says which,
# where and by how much; once all pass, it times yours beside the stage's and beside the repack
# stage's attention, one row and one head at a time. `--solution reference` runs the check on the
# stage's own code. Every chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/12_prefill.json` (your machine's figures, not committed). All of them:
# `make try-it ch=12`.
#
# 1. **The rows of a tile of the prefill stage's attention: 1 (decode's way) to 64.**
#    - *Predict:* a tile reads each block of K and V once for R x G queries: from 1 row to 16
#      the reads per query fall 16 times and the time falls with them, until the arithmetic
#      (scores and weighted sums, the same for any R) is what is left: a few times faster, then
#      flat.
#    - *Measure:* `make try-it ch=12 exp=tile_rows`
#
# 2. **The stage for a prompt: repack (a row at a time through attention, its decode kernel for
# every matmul) against prefill.**
#    - *Predict:* a prompt is compute-bound: each loaded weight block serves every prompt row.
#      prefill's attention reads K and V once per tile, and its pair kernel puts two rows in a
#      512-bit register, which does twice the work only where the core issues it as often as a
#      256-bit one (Intel's AVX-512 cores; Zen 4 runs it as two halves): a 256-token prompt
#      should come out about 1.1x (Zen 4) to about 2x faster (quick: 32 tokens, less).
#    - *Measure:* `make try-it ch=12 exp=ttft` (runs the default model)

