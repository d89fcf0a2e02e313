# Source of notebooks/02_tiling.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 02 · tiling: use every byte the cache brings in
#
# Memory does not hand the core single floats. It moves **cache lines** of 64 bytes, and keeps
# recently used lines in small, fast caches (L1, L2, L3) in front of slow DRAM. A load that finds
# its line in L1 costs a few cycles; one that goes to DRAM costs hundreds. So what matters is not
# how many floats a loop reads but how many *lines* it makes the caches fetch, and how often it
# fetches the same line twice.
#
# The naive loop computes `C[i][j]` by walking down column `j` of `B`. Consecutive `k` are a
# whole row of `B` apart, so each of the `K` loads lands on a different line and uses 4 of its
# 64 bytes. The next column, `j + 1`, needs the neighbouring 4 bytes of the *same* `K` lines: a
# hit if those lines are still in L1, a miss if the walk has pushed them out. Tiling cuts the
# loops into blocks so that a small tile of `B` stays in L1 while it is used up.

# %%
import numpy as np

from common.gguf import GGUFFile
from common.model import LlamaConfig

findings = nb.Findings()
caches = nb.cache_sizes()
print("this machine's caches (per core):", {k: nb.human_bytes(v) for k, v in caches.items()})
LINE = 64
l1 = caches.get("L1d", 32 * 2**10)

# %% [markdown]
# ## The reasoning, with this machine's numbers
#
# For every matmul of the model (`B` is `K x N`): the bytes of cache lines one column walk touches
# (`K` lines of 64 bytes), which the next column reuses if they are still in L1; and the size of
# all of `B`, which the next *row* of `A` reads again and finds close by only if it fits in L2.

# %%
mcfg = LlamaConfig.from_gguf(GGUFFile(nb.model_path()))
shapes = {"attn_q / attn_output": (mcfg.n_embd, mcfg.n_head * mcfg.head_dim),
          "attn_k / attn_v": (mcfg.n_embd, mcfg.kv_dim),
          "ffn_gate / ffn_up": (mcfg.n_embd, mcfg.n_ff), "ffn_down": (mcfg.n_ff, mcfg.n_embd),
          "output": (mcfg.n_embd, mcfg.n_vocab)}
rows = []
for name, (K, N) in shapes.items():
    walk = K * LINE
    rows.append((name, f"{K} x {N}", nb.human_bytes(walk), "yes" if walk <= l1 else "**no**",
                 nb.human_bytes(K * N * 4), "yes" if K * N * 4 <= caches.get("L2", 0) else "**no**"))
nb.show_table(["matmul", "B: K x N", "lines one column walk touches", f"fit in L1d ({nb.human_bytes(l1)})?",
               "all of B (float32)", f"fits in L2 ({nb.human_bytes(caches.get('L2', 0))})?"], rows)

# %% [markdown]
# Two things can go wrong, then. Across `j`, the `K` lines of one column walk must survive until
# the next column needs them (`K x 64` bytes against L1, or L2 behind it). Across `i`, every row of
# `A` walks *all* of `B` again: that stays cheap only while `B` fits in L2. Which one hurts more on
# this machine is a question for a measurement: the same matmul with `K` fixed and `B` growing
# wider, naive against tiled. (The widths avoid powers of two; see the aside below for why.)

# %%
from stages.naive import matmul_textbook
from stages.tiling import TILE_I, TILE_J, TILE_K, matmul_tiled

rng = np.random.default_rng(0)
M, K = 8, 256
widths = [250, 1000, 2000, 4000, 8000] + ([] if cfg.quick else [16000, 32000])


def gflops(fn, a, b):
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / nb.best_seconds(lambda: fn(a, b), cfg.timing_reps) / 1e9


A = rng.standard_normal((M, K), dtype=np.float32)
size_mib, naive_g, tiled_g = [], [], []
for N in widths:
    B = rng.standard_normal((K, N), dtype=np.float32)
    size_mib.append(B.nbytes / 2**20)
    naive_g.append(gflops(matmul_textbook, A, B))
    tiled_g.append(gflops(matmul_tiled, A, B))
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 4.2))
ax.plot(size_mib, naive_g, marker="o", label="naive (column walk)")
ax.plot(size_mib, tiled_g, marker="o", label=f"tiled {TILE_I}x{TILE_J}x{TILE_K}")
for name in ("L2", "L3"):
    if name in caches and caches[name] / 2**20 <= max(size_mib) * 2:
        ax.axvline(caches[name] / 2**20, color="gray", ls="--", lw=1)
        ax.annotate(f"{name} = {nb.human_bytes(caches[name])}", (caches[name] / 2**20, max(naive_g)), fontsize=8,
                    xytext=(4, 0), textcoords="offset points", va="top")
ax.set_xscale("log", base=2)
ax.set_xlabel(f"size of B (MiB), K = {K}, N growing")
ax.set_ylabel("GFLOP/s")
ax.set_title(f"[{M} x {K}] @ [{K} x N]: does B fit in L2?", fontsize=10)
ax.grid(alpha=0.25)
ax.legend(fontsize=8)
fig.tight_layout()
nb.show(fig)
l2 = caches.get("L2", 0)
inside = [g for s, g in zip(size_mib, naive_g) if s * 2**20 <= l2 / 2]
outside = [g for s, g in zip(size_mib, naive_g) if s * 2**20 > 2 * l2]
if inside and outside:
    findings["B against L2"] = (f"naive: {np.mean(inside):.2f} GFLOP/s while B fits in half of L2, "
                                f"{np.mean(outside):.2f} once B is over twice L2 "
                                f"({np.mean(inside) / np.mean(outside):.1f}x slower); tiled stays at "
                                f"{min(tiled_g):.2f}-{max(tiled_g):.2f} GFLOP/s")

# %% [markdown]
# **An aside: the 4 KiB trap.** A cache is divided into *sets*, and a line's address decides its
# set. L1 here has 64 sets of 64-byte lines: addresses 4 KiB apart land in the same set. If a row
# of `B` is exactly 1024 floats (4 KiB), every line of a column walk competes for one set (a
# handful of ways), and the walk misses even when it is tiny. One float wider and the lines
# spread over all the sets:

# %%
K2 = 512
A2 = rng.standard_normal((M, K2), dtype=np.float32)
alias = {}
for N in (1000, 1024, 1040):
    B2 = rng.standard_normal((K2, N), dtype=np.float32)
    alias[f"N = {N} (row = {N * 4} B)"] = gflops(matmul_textbook, A2, B2)
nb.bar_chart(alias, "GFLOP/s", f"naive [{M} x {K2}] @ [{K2} x N]: rows of exactly 4 KiB", fmt="{:.2f}")
findings["4 KiB aliasing"] = (f"naive loop with 4096-byte rows: {alias['N = 1024 (row = 4096 B)']:.2f} GFLOP/s, "
                              f"with 4000-byte rows: {alias['N = 1000 (row = 4000 B)']:.2f}")

# %% [markdown]
# ## The stage's code
#
# The whole stage is one loop nest and a one-method backend; the tile sizes are constants so
# that LLVM sees them when it compiles the loop.

# %%
import stages.tiling

nb.show_source(stages.tiling.make_tiled_matmul, stages.tiling.TilingBackend,
               note=f"Tile sizes: `TILE_I, TILE_J, TILE_K = {TILE_I}, {TILE_J}, {TILE_K}`: a "
                    f"{TILE_K} x {TILE_J} float32 tile of B is {nb.human_bytes(TILE_K * TILE_J * 4)}, "
                    f"against an L1d of {nb.human_bytes(l1)} here.")

# %% [markdown]
# ## Choosing the tile: a sweep
#
# Tile sizes are measured, not derived: `python -m app bench tiling` times every combination on the
# model's own matmul shapes and records the sweep in `profiles/bench/tiling_sweep.json`. Here is
# a small live sweep on the two feed-forward shapes (the largest matmuls of a layer), each tile
# size compiled fresh. `1 x 1 x 4096` is the untiled loop written the tiled way.

# %%
from stages.tiling import make_tiled_matmul

rows_m = 16                                             # prompt rows, as `bench tiling` uses
ffn = [(mcfg.n_embd, mcfg.n_ff), (mcfg.n_ff, mcfg.n_embd)]
data = [(rng.standard_normal((rows_m, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32))
        for K, N in ffn]


def ffn_ms(fn):
    return sum(nb.best_seconds(lambda: fn(a, b), cfg.timing_reps) for a, b in data) * 1e3


naive_ms = ffn_ms(matmul_textbook)
sweep = []
for ti, tj, tk in cfg.tile_grid:
    sweep.append(((ti, tj, tk), ffn_ms(make_tiled_matmul(ti, tj, tk, cache=False))))
sweep.sort(key=lambda r: r[1])
nb.show_table(["TILE_I x TILE_J x TILE_K", "ms (gate/up + down)", "vs naive"],
              [(f"{ti} x {tj} x {tk}", f"{ms:.1f}", f"{naive_ms / ms:.2f}x") for (ti, tj, tk), ms in sweep])
print(f"naive textbook loop on the same shapes: {naive_ms:.1f} ms")
chosen = next((ms for t, ms in sweep if t == (TILE_I, TILE_J, TILE_K)), None)
findings["live sweep"] = (f"best {'x'.join(map(str, sweep[0][0]))}: {naive_ms / sweep[0][1]:.2f}x the naive loop"
                          + (f"; the stage's {TILE_I}x{TILE_J}x{TILE_K}: {naive_ms / chosen:.2f}x" if chosen else ""))

# %%
import json

sweep_file = nb.ROOT / "profiles" / "bench" / "tiling_sweep.json"
if sweep_file.exists():
    recorded_sweep = json.loads(sweep_file.read_text())
    nb.md(f"Recorded sweep (`{nb.rel(sweep_file)}`, {recorded_sweep['rows']} rows, on "
          f"{recorded_sweep['machine']['cpu']}): the 8 best of {len(recorded_sweep['sweep'])}.")
    nb.show_table(["tile", "ms per forward's matmuls", "vs naive"],
                  [(f"{r['tile_i']} x {r['tile_j']} x {r['tile_k']}", f"{r['seconds'] * 1e3:.0f}",
                    f"{r['speedup_vs_naive']:.2f}x") for r in recorded_sweep["sweep"][:8]])
else:
    nb.md(f"No recorded sweep yet (`{nb.rel(sweep_file)}`): `python -m app bench tiling` writes it.")

# %% [markdown]
# ## The stage, end to end
#
# Now the real thing: naive and tiling on the same prompt, measured live, and the per-op profile
# of the tiled stage.

# %%
live, rows = nb.measure_pair("naive", "tiling", cfg)
findings["tiling, live"] = (f"TTFT {live[1]['ttft_ms']:.0f} ms ({live[0]['ttft_ms'] / live[1]['ttft_ms']:.2f}x naive), "
                            f"decode {live[1]['decode_ms']:.0f} ms/token "
                            f"({live[0]['decode_ms'] / live[1]['decode_ms']:.2f}x naive)")

# %% [markdown]
# ## Beside the article
#
# The article's tiled matmul halved its time per token. Whether tiling pays here depends on what
# the naive loop was waiting for. Below, the bytes each loop order brings from memory for one
# decode step of this model (modelled from the loop order and the cache sizes,
# `app/measure/roofline.py`), with this machine's caches and with the article's i3's.

# %%
from app.measure import roofline
from app.report import lessons

decode_rows = live[0]["n_prompt"] + 1                 # no KV cache: the whole text again
mine = nb.cache_sizes()
traffic = {(stage, where): roofline.traffic(stage, mcfg, decode_rows, decode_rows, caches)["decode_bytes"]
           for stage in ("naive", "tiling") for where, caches in (("here", mine), ("i3", lessons.ARTICLE_CACHES))}
nb.show_table(["loop order", f"this machine (L3 {nb.human_bytes(mine.get('L3', 0))})",
               f"{lessons.ARTICLE_CPU} (L3 {nb.human_bytes(lessons.ARTICLE_CACHES['L3'])})"],
              [(stage, nb.human_bytes(traffic[stage, "here"]), nb.human_bytes(traffic[stage, "i3"]))
               for stage in ("naive", "tiling")])
nb.article.beside("tiling_speedup", live[0]["decode_ms"] / live[1]["decode_ms"],
                  f"decode, {decode_rows}-token text, live",
                  explain="Where a matrix does not fit the last-level cache, the naive loop reads it from memory "
                          "once per row and tiling once per 8 rows: that is the saving the article measured. Where "
                          "it fits, both read it once, and what tiling buys is only the L1 reuse of the tiles; the "
                          "dependent adds remain (chapter 03).")
findings["vs the article"] = (f"tiling {live[0]['decode_ms'] / live[1]['decode_ms']:.2f}x naive in decode; modelled "
                              f"bytes per step: naive {nb.human_bytes(traffic['naive', 'here'])} here, "
                              f"{nb.human_bytes(traffic['naive', 'i3'])} with the i3's caches")

# %%
nb.print_profile(rows, "per-op profile, tiling (live)")
rec = nb.recorded()
nb.ops_chart_with_records("tiling", rows, rec, compare=("naive",))

# %%
nb.md(rec.note)
nb.stage_chart(live, rec, ["naive", "tiling"], "naive -> tiling")

# %% [markdown]
# What tiling cannot fix: inside a tile, the `k` loop is still one chain of dependent additions
# (`acc += a * b`), each waiting for the one before. The next chapter breaks that chain.

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). tiling is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("tiling")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the blocked loop nest, partial tiles included.** The starting file,
# [`exercises/02_tiling/tiled_matmul.py`](../exercises/02_tiling/tiled_matmul.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=02
# ```
#
# (or `.venv/bin/python -m exercises.check 02`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 02`). The check runs your code and the stage's own,
# [`stages/tiling.py`](../stages/tiling.py) (`make_tiled_matmul`), on 8 seeded cases of awkward
# shapes, holding yours to the stage's: within the bound two float32 sums of K products may honestly
# differ by. It stops at the first case that differs and says which, where and by how much; once all
# pass, it times yours beside the stage's and beside the naive stage's loop. `--solution reference`
# runs the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/02_tiling.json` (your machine's figures, not committed). All of them:
# `make try-it ch=02`.
#
# 1. **TILE_K, the tile's depth along the sum (stages/tiling.py; make_tiled_matmul(8, 64,
# TILE_K)).**
#    - *Predict:* inside a tile each column walk touches TILE_K cache lines of B (64 bytes
#      each), which the next column reuses if they are still in L1: 1 KiB at 16, 4 KiB at 64,
#      16 KiB at 256, and at 1024 (capped by K = 576) 36 KiB. The time barely moves while that
#      fits L1d (32-48 KiB) and jumps once it does not: every column walk then misses L1 again.
#    - *Measure:* `make try-it ch=02 exp=tile_k`
#
# 2. **B's width N, K fixed at 256: naive against tiled.**
#    - *Predict:* the naive loop stays fast while B (K x N x 4 bytes) fits in L2 (1-2 MiB)
#      and slows once it does not (it reads B again for each of the 8 rows). If the tiled loop
#      holds its speed there, L2 was the whole story; if it slows as much, something else grows
#      with N: a column walk steps N x 4 bytes at a time, a new 4 KiB page every step once N
#      passes 1024, and 256 pages a walk outrun the TLB that translates their addresses.
#    - *Measure:* `make try-it ch=02 exp=b_width`
#
# 3. **B's row length: 4000, 4096 and 4160 bytes (the naive loop).**
#    - *Predict:* a column walk with rows of exactly 4 KiB puts every line in the same L1 set
#      (8-12 ways): it misses even when small; 4000 and 4160 bytes spread the lines over all
#      sets and run faster.
#    - *Measure:* `make try-it ch=02 exp=aliasing`

