# Source of notebooks/16_journey.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 16 · The journey: every stage, side by side
#
# Every stage changes one thing and builds on one stage before it. The table below is the
# stage registry itself (`stages/registry.py`), so it lists every stage this checkout has,
# ours beyond the article's six included.
#
# `make report` measures every stage this machine can run with the same protocol and draws the
# charts below from the records. Then this notebook runs every CPU stage again, live, at its own
# settings, so you can see the whole story on your machine in one go.

# %%
from stages import STAGES, info

nb.show_table(["#", "stage", "the lesson", "builds on", "KV cache", "chapter"],
              [(info(s).number, s, info(s).lesson, info(s).builds_on or "-", "yes" if info(s).kv_cache else "no",
                info(s).chapter) for s in STAGES])

# %%
from app.models import DEFAULT_MODEL
from app.report import charts

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
# `make report` draws the default model's charts into profiles/, another model's into `profiles/<model>/`.
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

cpu = [s for s in runnable_stages() if not info(s).gpu]
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
by_stage = {r["stage"]: r for r in live}
rows, steps = [], []
for r in live:
    parent = by_stage.get(info(r["stage"]).builds_on)
    vs_prev = f"{parent['decode_ms'] / r['decode_ms']:,.2f}x ({parent['stage']})" if parent else "-"
    if parent:
        steps.append((r["stage"], parent["stage"], parent["decode_ms"] / r["decode_ms"]))
    share = nb.matmul_share(profiles[r["stage"]])
    rows.append((r["stage"], f"{r['ttft_ms']:,.1f}", f"{r['decode_ms']:,.1f}",
                 f"{naive['decode_ms'] / r['decode_ms']:,.1f}x", vs_prev, f"{share:.0%}"))
nb.show_table(["stage", "TTFT (ms)", "decode (ms/token)", "decode vs naive", "vs the stage it builds on",
               "time in matmuls"], rows)
if steps:
    biggest = max(steps, key=lambda s: s[2])
    findings["biggest single step"] = f"{biggest[0]}: {biggest[2]:.1f}x faster decode than {biggest[1]}"
fastest = min(live, key=lambda r: r["decode_ms"])
findings["end to end"] = (f"decode from {naive['decode_ms']:,.0f} ms/token ({naive['stage']}) to "
                          f"{fastest['decode_ms']:,.1f} ms/token ({fastest['stage']}): "
                          f"{naive['decode_ms'] / fastest['decode_ms']:,.0f}x")

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
from app.report.charts import roofline_points

ceil = nb.ceilings()
points = [(f"{r['stage']} {kind}", x, y) for r in live for kind, x, y in roofline_points(r) if kind == "decode"]
nb.roofline_chart(ceil, points, "Decode of every CPU stage on this machine's roofline")
best = max(points, key=lambda p: p[2])
findings["closest to the roof"] = (f"{best[0]}: {best[2]:.1f} GFLOP/s at {best[1]:.2f} FLOP/byte; the memory "
                                   f"ceiling there is {min(ceil['peak_gflops'], ceil['bandwidth_gbs'] * best[1]):.1f}")

# %% [markdown]
# ## The article beside this machine
#
# Every claim of the article, its figure, and this machine's from the records `make report`
# wrote, with a verdict and the reason (`python -m app lessons`; `make report` writes it to
# `profiles/lessons.md`). The live journey above gives the end-to-end figure again.

# %%
from app.report import lessons

sources = lessons.find_sources()
ledger_rows = lessons.ledger(sources)
nb.md(lessons.markdown(ledger_rows, sources).split("\n", 2)[2])
chart_path = nb.ROOT / "profiles" / "lessons.png"
if not nb.show_image(chart_path):
    nb.md("_`profiles/lessons.png` is not drawn yet: `make report` draws it from the records._")
nb.article.beside("end_to_end", naive["decode_ms"] / fastest["decode_ms"],
                  f"decode, {naive['stage']} to {fastest['stage']}, live")
verdicts = {v: sum(r.verdict == v for r in ledger_rows) for v in lessons.VERDICTS}
findings["the article's claims"] = ", ".join(f"{n} {v}" for v, n in verdicts.items())

# %% [markdown]
# ## The running total, and what each stage removed
#
# The three costs of the first page, stage by stage. Every step that mattered removed something:
# cache lines fetched and wasted (tiling), dependent scalar operations (simd), whole tokens of
# recomputation (kv_cache), bytes per weight (quantized), trips across the bus (cuda), idle cores
# (threads), float conversions per weight (int8), Python and a fork and join between the ops
# (fused: the layer stack in one compiled call), horizontal adds and scattered loads (repack: the
# weights laid out the way the vector unit reads them), a whole model's memory in one process (tp:
# the layers split over processes, for two all-reduces per layer), and the prompt's idle
# multiply-adds (prefill: attention in tiles, two prompt rows to a register). What is left is the
# distance to the floor, beside every bar below (the stage that decoded fastest live is
# highlighted). Measure first, then remove the biggest waste.

# %%
findings["running total"] = nb.journey(fastest["stage"] if rec.get(fastest["stage"]) else cpu[-1])

# %%
findings.show()
