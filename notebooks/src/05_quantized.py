# Source of notebooks/05_quantized.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 05 · quantized: fewer bytes per weight
#
# With the KV cache, a decode step multiplies one row by every weight once: 2 FLOP per weight,
# and every weight read from memory. The stages so far hold each weight as a 4-byte float, so a
# token costs *at least* the time to stream all those floats from DRAM, however good the
# arithmetic. The roofline says what to do: raise the FLOP per byte by reading fewer bytes.
#
# The file already has the weights in fewer bytes: Q4_1 keeps 32 weights in 20 bytes (5 bits
# each), Q8_0 in 34. The eager stages threw that away at load, inflating every weight to 32 bits.
# This stage keeps the ggml blocks exactly as they are mapped from the file and decodes them
# inside the matmul, a few rows at a time, so the float32 form of a weight only ever exists in
# the core's caches.
#
# Nothing in this stage makes the arithmetic cheaper: decoding adds work. It wins only because
# the work was never the bottleneck.

# %%
from common.gguf import GGUFFile
from common.model import LlamaConfig, n_params

findings = nb.Findings()
missing = nb.missing_stage("quantized")
if missing:
    nb.md(f"**The live parts of this chapter are skipped:** {missing}. The reasoning below still runs "
          f"from the model file; the recorded results, if any, are shown at the end.")
ceil = nb.ceilings()
g = GGUFFile(nb.model_path())
mcfg = LlamaConfig.from_gguf(g)
params = n_params(mcfg)
# What one decode step must read (matrices + norms; the tied output head once), by representation.
streamed = {t.name: t for t in g.tensors.values() if t.name != "token_embd.weight" or "output.weight" not in g.tensors}
f32_bytes = sum(t.n_elements * 4 for t in streamed.values())
file_bytes = sum(t.nbytes for t in streamed.values())
floor = {"float32 (naive .. kv_cache)": f32_bytes / (ceil["bandwidth_gbs"] * 1e9) * 1e3,
         "ggml blocks (quantized)": file_bytes / (ceil["bandwidth_gbs"] * 1e9) * 1e3}
n_streamed = sum(t.n_elements for t in streamed.values())
nb.show_table(["weights held as", "bytes per weight", "bytes read per token", "memory floor per token"],
              [(kind, f"{nbytes / n_streamed:.2f}", nb.human_bytes(nbytes), f"{floor[kind]:.1f} ms")
               for kind, nbytes in zip(floor, (f32_bytes, file_bytes))])
print(f"at {ceil['bandwidth_gbs']:.1f} GB/s ({ceil['source']}); the quantized floor is "
      f"{f32_bytes / file_bytes:.1f}x lower")
findings["bytes per token"] = (f"{nb.human_bytes(f32_bytes)} as float32, {nb.human_bytes(file_bytes)} as ggml "
                               f"blocks: a memory floor of {floor['float32 (naive .. kv_cache)']:.0f} ms vs "
                               f"{floor['ggml blocks (quantized)']:.1f} ms per token")

# %% [markdown]
# ## The stage's code
#
# The backend keeps each weight as a view of the file's bytes and picks a kernel by ggml type;
# the kernels decode blocks into a small buffer and multiply straight away.

# %%
if missing:
    nb.md(f"_Skipped: {missing}._")
else:
    import stages.quantized as sq
    from stages.kernels import dequant_dot  # the stage file holds none: its kernels live here
    nb.show_source(sq.QuantizedBackend.prepare_matrix, sq.QuantizedBackend.matmul)
    kernels = nb.module_kernels(dequant_dot)
    print("the stage's kernels, in stages/kernels/dequant_dot.py:", ", ".join(k.__name__ for k in kernels))
    if kernels:
        nb.show_source(kernels[0])
    main_type = max({t.ggml_type for t in g.tensors.values()}, key=lambda ty: sum(
        t.nbytes for t in g.tensors.values() if t.ggml_type == ty))
    per_type = nb.find_kernels(sq, main_type.name.lower())
    if per_type:
        nb.show_source(per_type[0], note=f"The decoder for {main_type.name}, the model's main type:")

# %% [markdown]
# ## Bytes per weight, as each stage holds them

# %%
if missing:
    nb.md(f"_Skipped: {missing}._")
else:
    held = {}
    engines = {}
    for stage in ("kv_cache", "quantized"):
        engines[stage] = nb.load(stage)
        held[stage] = engines[stage].weight_bytes()
    nb.bar_chart({s: b / params for s, b in held.items()}, "bytes per weight",
                 "What a stage keeps per weight (weights held / parameters)", fmt="{:.2f}")
    findings["bytes per weight"] = ", ".join(f"{s} {b / params:.2f}" for s, b in held.items())

# %% [markdown]
# ## Memory and page faults
#
# Each stage runs in a fresh process (`python -m app run --json`), so its peak resident memory
# and page faults are its own. The eager stage allocates and fills ~4 bytes per weight before
# the first token; the quantized one maps the file and faults in only the pages it reads.

# %%
if missing:
    nb.md(f"_Skipped: {missing}._")
else:
    runs = {s: nb.measure_in_subprocess(s, "The meaning of life is", cfg.profile_n_for(s))
            for s in ("kv_cache", "quantized")}
    nb.show_table(["stage", "peak RSS", "minor faults", "major faults", "load"],
                  [(s, f"{r['peak_rss_mb']:.0f} MiB", f"{r['minor_faults']:,}", f"{r['major_faults']:,}",
                    f"{r['load_s']:.2f} s") for s, r in runs.items()])
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "peak_rss_mb", "peak RSS (MiB)"), (axes[1], "minor_faults", "minor page faults")):
        ax.bar(list(runs), [r[key] for r in runs.values()], color=["C0", "C1"])
        for i, r in enumerate(runs.values()):
            ax.annotate(f"{r[key]:,.0f}", (i, r[key]), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    fig.suptitle("One short run per stage, each in its own process", fontsize=11)
    fig.tight_layout()
    nb.show(fig)
    k, q = runs["kv_cache"], runs["quantized"]
    findings["memory"] = (f"peak RSS {k['peak_rss_mb']:.0f} MiB (kv_cache) vs {q['peak_rss_mb']:.0f} MiB (quantized); "
                          f"minor faults {k['minor_faults']:,} vs {q['minor_faults']:,}")

# %% [markdown]
# ## Decode against the memory floor

# %%
if missing:
    nb.md(f"_Skipped: {missing}._")
else:
    live = [nb.measure(engines[s], cfg) for s in ("kv_cache", "quantized")]
    for r in live:
        print(f"{r['stage']:>9}: TTFT {r['ttft_ms']:7.1f} ms, decode {r['decode_ms']:6.1f} ms/token  {r['text']!r}")
    measured = {f"{r['stage']}\nmeasured": r["decode_ms"] for r in live}
    floors = {f"{r['stage']}\nmemory floor": r["weights_stream_bytes"] / (ceil["bandwidth_gbs"] * 1e9) * 1e3
              for r in live}
    nb.bar_chart({**measured, **floors}, "ms per token", "Decode: measured, and the time to read the weights once")
    quantized_floor = floors["quantized\nmemory floor"]
    findings["quantized, live"] = (f"decode {live[1]['decode_ms']:.1f} ms/token vs kv_cache's "
                                   f"{live[0]['decode_ms']:.1f} "
                                   f"({live[0]['decode_ms'] / live[1]['decode_ms']:.1f}x); its memory floor is "
                                   f"{quantized_floor:.1f} ms")

# %%
if not missing:
    from app.report.charts import roofline_points
    points = [(f"{r['stage']} {kind} (live)", x, y) for r in live for kind, x, y in roofline_points(r)]
    nb.roofline_chart(ceil, points, "kv_cache and quantized on this machine's roofline")
    rows = nb.profile(engines["quantized"], cfg)
    nb.print_profile(rows, "per-op profile, quantized (live)")
    nb.ops_chart({"quantized (live)": rows}, "quantized: where the time goes")

# %% [markdown]
# ## Beside the article: time to first token
#
# The article's quantized kernels made its time to first token 4 times faster. Prefill multiplies
# every weight by all the prompt's rows: if it reads each weight once per prompt token it waits on
# memory, and 4-bit weights cut that wait; if it multiplies each weight into every row at once
# (as these stages do) it is bound by arithmetic, which decoding 4-bit blocks does not shorten.

# %%
if missing:
    nb.md(f"_Skipped: {missing}._")
else:
    nb.article.beside("quantized_ttft_speedup", live[0]["ttft_ms"] / live[1]["ttft_ms"],
                      f"TTFT of kv_cache / quantized, {cfg.prompt_tokens}-token prompt, live")
    findings["vs the article, TTFT"] = f"quantized TTFT {live[0]['ttft_ms'] / live[1]['ttft_ms']:.2f}x kv_cache's"

# %% [markdown]
# ## What 4 bits cost: perplexity
#
# The article said the precision 4-bit weights lose "matters little", and did not measure it.
# Perplexity measures it: how surprised the model is by a text it did not write, exp of the mean
# negative log-likelihood of each next token (`python -m app perplexity`, llama.cpp's method;
# tests/test_perplexity.py holds it to llama.cpp's figure on the same tokens). The text is the
# first chapters of *Alice's Adventures in Wonderland* (public domain, `tests/fixtures/text/`).
#
# What can be compared: this file's own weights (Q4_1 and Q8_0; the original float weights are
# not in it, so **they are the reference**, not the model as trained), the same weights with
# every activation rounded to 8 bits (int8), and the same weights rounded *again* to other ggml
# types (`perplexity.requantize`: dequantized, then quantized). A second rounding to 4 bits is
# what a 4-bit format loses on top of what this file already lost. A row whose length is not a
# multiple of 256 cannot hold K-quant blocks and falls back, as llama-quantize does (Q4_K to Q4_1
# here, Q6_K to Q8_0): SmolLM2's 576-wide rows do, so its "Q4_K" is mostly Q4_1 rounded again,
# ffn_down alone in Q4_K. The full comparison takes
# many minutes (`python -m app perplexity --compare`, recorded in `perplexity.json`); this
# chapter runs a few chunks of it, fewer in quick mode.

# %%
from app.measure import perplexity as ppl
from stages import runnable_stages

ctx, n_chunks = (64, 2) if cfg.quick else (512, 4)
types = ("Q8_0", "Q4_0") if cfg.quick else ppl.REQUANTIZED_TYPES
rows_ppl = {}
for stage in [s for s in ("quantized", "int8") if s in runnable_stages()]:
    rows_ppl[f"{stage}, the file's weights"] = ppl.perplexity(stage, nb.model_path(), ppl.DEFAULT_TEXT, ctx, n_chunks)
for t in types:
    path = ppl.requantize(nb.model_path(), t)            # written once under models/requantized/, then reused
    rows_ppl[f"requantized to {t}"] = ppl.perplexity("quantized", path, ppl.DEFAULT_TEXT, ctx, n_chunks)
ref = rows_ppl["quantized, the file's weights"]["ppl"]
nb.show_table(["weights / activations", "perplexity", "vs the file's weights"],
              [(name, f"{r['ppl']:.3f}", f"{(r['ppl'] / ref - 1) * 100:+.2f}%") for name, r in rows_ppl.items()])
nb.bar_chart({name.replace(", ", "\n"): r["ppl"] for name, r in rows_ppl.items()}, "perplexity (lower is better)",
             f"{n_chunks} chunks of {ctx} tokens", fmt="{:.2f}")
four_bit = {t: rows_ppl[f"requantized to {t}"]["ppl"] for t in types if t.startswith("Q4")}
worst = max(four_bit, key=four_bit.get)
nb.article.beside("precision_loss_small", (four_bit[worst] / ref - 1) * 100,
                  f"{worst}, {n_chunks} chunks of {ctx} tokens, live")
findings["perplexity"] = (f"{ref:.2f} with the file's weights, {four_bit[worst]:.2f} requantized to {worst} "
                          f"({(four_bit[worst] / ref - 1) * 100:+.1f}%), over {n_chunks} chunks of {ctx} tokens")

# %% [markdown]
# ## Against the record

# %%
rec = nb.recorded()
nb.md(rec.note)
if rec.get("quantized") is None:
    nb.md("_No recorded run of the quantized stage for this model._")
nb.stage_chart([] if missing else live, rec, ["naive", "tiling", "simd", "kv_cache", "quantized"],
               "naive -> ... -> quantized")

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). quantized is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("quantized")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: a Q4_1 matrix-vector product straight from the blocks' bytes.** The starting
# file, [`exercises/05_quantized/q4_dot.py`](../exercises/05_quantized/q4_dot.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=05
# ```
#
# (or `.venv/bin/python -m exercises.check 05`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 05`). The check runs your code and the stage's own,
# [`stages/kernels/dequant_dot.py`](../stages/kernels/dequant_dot.py) (`matvec_q4_1`), on 7 seeded
# cases of awkward shapes, holding yours to the stage's: within the bound two float32 sums of the
# decoded products may differ by. It stops at the first case that differs and says which, where and
# by how much; once all pass, it times yours beside the stage's and beside the simd stage's float32
# product of the same weights. `--solution reference` runs the check on the stage's own code. Every
# chapter's exercise: [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/05_quantized.json` (your machine's figures, not committed). All of
# them: `make try-it ch=05`.
#
# 1. **The bytes per weight the decode kernel streams: float32, Q8_0, Q4_1.**
#    - *Predict:* a memory-bound product takes bytes / bandwidth: Q4_1 (0.625 bytes a weight)
#      about a sixth of float32's time and Q8_0 (1.0625) about a quarter, if one core decodes
#      as fast as memory delivers; where the decoding is slower, the ratios shrink and the GB/s
#      of blocks fall below the machine's bandwidth (its roofline chart).
#    - *Measure:* `make try-it ch=05 exp=bytes_per_weight`
#
# 2. **The rows multiplied per decoded panel: 1 (decode), 16, 64 (a prompt).**
#    - *Predict:* decode decodes every weight for one row; prefill decodes a panel of 64
#      weight rows once and runs all M rows over it with the simd kernel: the time per row
#      falls several times from 1 row to 64.
#    - *Measure:* `make try-it ch=05 exp=prefill_rows`

