# Source of notebooks/07_journey.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 07 · The journey: every stage, side by side
#
# Six stages, each changing one thing:
#
# | stage | what changed | what it attacks |
# |---|---|---|
# | naive | nothing: the textbook | (the baseline) |
# | tiling | loops blocked for the caches | cache lines fetched and thrown away |
# | simd | weights packed, a 4 x 4 register block, vectorized | one dependent scalar add at a time |
# | kv_cache | keys and values of past tokens kept | the whole text recomputed for every token |
# | quantized | weights kept in their 4- and 8-bit blocks | bytes read from memory per token |
# | cuda | everything on the GPU, nothing per token on the bus | the CPU's bandwidth |
#
# `make report` measures every stage this machine can run with the same protocol and draws the
# charts below from the records. Then this notebook runs every CPU stage again, live, at its own
# settings, so you can see the whole story on your machine in one go.

# %%
from common import charts
from common.models import DEFAULT_MODEL

findings = nb.Findings()
rec = nb.recorded()
nb.md(rec.note)

# %% [markdown]
# ## The report

# %%
if rec.results is not None:
    nb.md(charts.results_table(rec.results))
else:
    nb.md("_No records, so no table: `make report` writes them._")
# `make report` draws the default model's charts into profiles/, another model's into profiles/<model>/.
charts_dir = nb.ROOT / "profiles" if nb.model_path().resolve() == DEFAULT_MODEL.path.resolve() \
    else nb.ROOT / "profiles" / nb.model_path().stem
for name, what in (("speedup.png", "TTFT and decode per stage"), ("ops.png", "where the time goes, per op"),
                   ("roofline.png", "every stage on the roofline")):
    nb.md(f"**{what}** (`{nb.rel(charts_dir / name)}`)")
    if not nb.show_image(charts_dir / name):
        nb.md(f"_Not drawn yet: `make report` draws `{nb.rel(charts_dir / name)}` from the records._")

# %% [markdown]
# ## Live: every CPU stage on this machine, now
#
# Each stage is loaded, measured by the protocol and profiled per op, then dropped before the
# next one loads (the eager stages hold hundreds of MiB of float32 weights each).

# %%
from stages import runnable_stages

cpu = [s for s in runnable_stages() if s != "cuda"]
live, profiles = [], {}
for stage in cpu:
    engine = nb.load(stage)
    live.append(nb.measure(engine, cfg))
    profiles[stage] = nb.profile(engine, cfg)
    del engine
    r = live[-1]
    print(f"{stage:>10}: TTFT {r['ttft_ms']:8.1f} ms, decode {r['decode_ms']:8.1f} ms/token  {r['text']!r}")

# %%
nb.stage_chart(live, rec, cpu, "The journey, live and recorded (log scale)")

# %%
naive = next((r for r in live if r["stage"] == "naive"), live[0])
rows, prev = [], None
for r in live:
    vs_prev = f"{prev['decode_ms'] / r['decode_ms']:,.2f}x" if prev else "-"
    share = nb.matmul_share(profiles[r["stage"]])
    rows.append((r["stage"], f"{r['ttft_ms']:,.1f}", f"{r['decode_ms']:,.1f}",
                 f"{naive['decode_ms'] / r['decode_ms']:,.1f}x", vs_prev, f"{share:.0%}"))
    prev = r
nb.show_table(["stage", "TTFT (ms)", "decode (ms/token)", "decode vs naive", "vs previous", "time in matmuls"], rows)
steps = [(live[i]["stage"], live[i - 1]["decode_ms"] / live[i]["decode_ms"]) for i in range(1, len(live))]
if steps:
    biggest = max(steps, key=lambda s: s[1])
    findings["biggest single step"] = f"{biggest[0]}: {biggest[1]:.1f}x faster decode than the stage before"
findings["end to end"] = (f"decode from {naive['decode_ms']:,.0f} ms/token ({naive['stage']}) to "
                          f"{live[-1]['decode_ms']:,.1f} ms/token ({live[-1]['stage']}): "
                          f"{naive['decode_ms'] / live[-1]['decode_ms']:,.0f}x")

# %%
if cfg.quick:
    nb.md(f"_These are quick settings, not the report's: with a {cfg.prompt_tokens}-token prompt the stages "
          f"without a KV cache recompute only a few tokens per step, so the cache's win looks smaller than at "
          f"the report's prompt length (and it keeps growing with the text, see chapter 04)._")

# %% [markdown]
# ## Where the time goes, stage by stage

# %%
nb.ops_chart({f"{s} (live)": rows_ for s, rows_ in profiles.items()}, "Per-op shares, live")

# %% [markdown]
# ## Every stage on the roofline

# %%
from common.charts import roofline_points

ceil = nb.ceilings()
points = [(f"{r['stage']} {kind}", x, y) for r in live for kind, x, y in roofline_points(r) if kind == "decode"]
nb.roofline_chart(ceil, points, "Decode of every CPU stage on this machine's roofline")
best = max(points, key=lambda p: p[2])
findings["closest to the roof"] = (f"{best[0]}: {best[2]:.1f} GFLOP/s at {best[1]:.2f} FLOP/byte; the memory "
                                   f"ceiling there is {min(ceil['peak_gflops'], ceil['bandwidth_gbs'] * best[1]):.1f}")

# %% [markdown]
# Every step that mattered removed something: cache lines fetched and wasted (tiling), dependent
# scalar operations (simd), whole tokens of recomputation (kv_cache), bytes per weight
# (quantized), trips across the bus (cuda). Measure first, then remove the biggest waste.

# %%
findings.show()
