# Source of notebooks/04_kv_cache.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 04 · kv_cache: stop recomputing the past
#
# Every stage so far produces token `L + 1` by running all `L` tokens of the text through the
# model again. Yet almost all of that work was already done for token `L`: in a causal model,
# a position's hidden state depends only on the positions before it, so its **keys** and
# **values** (the K and V rows attention reads) never change once computed.
#
# Keep them, and a decode step only has to push the *new* token through the matmuls: one row
# instead of `L`. Attention still looks at every earlier position (one dot product per stored
# key), so that part of the cost keeps growing with the text, but it is small next to the
# matmuls for a long while.
#
# The price is memory: K and V for every layer and every position up to the context length.

# %%
findings = nb.Findings()
engine = nb.load("kv_cache")
c = engine.config
per_position = 2 * c.n_layer * c.kv_dim * 4
print(f"K and V per position: 2 x {c.n_layer} layers x {c.kv_dim} (= {c.n_head_kv} KV heads x {c.head_dim}) "
      f"x 4 bytes = {nb.human_bytes(per_position)}")
print(f"the arena for {engine.n_ctx} positions: {nb.human_bytes(engine.kv_bytes())}, allocated once at load")
findings["KV arena"] = (f"{nb.human_bytes(per_position)} per position, {nb.human_bytes(engine.kv_bytes())} for "
                        f"{engine.n_ctx} positions")

# %% [markdown]
# ## The stage's code
#
# The whole stage: an arena, a `store` that writes the new rows and returns views of all rows so
# far, and a backend that hands the model one. The model (`common/model.py`) calls `store` when a
# backend gives it a cache, and the generation loop (`common/generate.py`) then feeds only the
# tokens the cache has not seen.

# %%
import stages.kv_cache
from common.generate import Session

nb.show_source(stages.kv_cache.KVCache, stages.kv_cache.KVCacheBackend, Session._feed, Session.next_token)

# %% [markdown]
# ## The work removed
#
# We count what the matmuls really compute, token by token, by wrapping the backend's `matmul`
# while generating: each call multiplies `M` rows, and costs `M x K x N` multiply-adds. Without a
# cache (the simd stage, whose matmul this stage shares), `M` is the whole text; with one, the
# prompt once and then 1.

# %%
n_gen = min(max(cfg.n_for("kv_cache"), 4), 16)          # enough steps to see the trend
prompt = nb.prompt_ids(engine, cfg.prompt_tokens)
with_cache = nb.matmul_work(engine, prompt, n_gen)
simd = nb.load("simd")
without = nb.matmul_work(simd, prompt, n_gen)
steps = list(range(1, n_gen + 1))
nb.show_table(["token", "rows per matmul, simd", "rows per matmul, kv_cache", "multiply-adds, simd",
               "multiply-adds, kv_cache"],
              [(i, w, k, f"{wm / 1e6:,.0f} M", f"{km / 1e6:,.0f} M")
               for i, w, k, wm, km in zip(steps, without.rows, with_cache.rows, without.macs, with_cache.macs)])
nb.line_chart({"simd (no cache)": (steps, [m / 1e9 for m in without.macs]),
               "kv_cache": (steps, [m / 1e9 for m in with_cache.macs])},
              "generated token", "billion multiply-adds in the matmuls",
              "Work per token: the whole text again, or one row")
saved = 1 - sum(with_cache.macs[1:]) / sum(without.macs[1:])
findings["work removed"] = (f"over {n_gen - 1} decode steps the cache skipped {saved:.0%} of the matmul work "
                            f"(the first token is the prompt's forward pass for both)")

# %% [markdown]
# ## Decode time against the length of the text
#
# The time of one decode step at growing context lengths: without a cache it grows with the
# whole text; with one it stays nearly flat, rising only by the attention over the stored keys.

# %%
lengths = cfg.lengths
tokens = nb.prompt_ids(engine, max(lengths))
t_simd = [nb.step_ms(simd, tokens, n, reps=cfg.timing_reps) for n in lengths]
t_kv = [nb.step_ms(engine, tokens, n, reps=cfg.timing_reps) for n in lengths]
nb.line_chart({"simd (no cache)": (lengths, t_simd), "kv_cache": (lengths, t_kv)},
              "tokens of text before the new one", "ms for the next token",
              "One decode step: the whole text again, or one token")
nb.show_table(["context", "simd ms", "kv_cache ms", "ratio"],
              [(n, f"{a:.1f}", f"{b:.1f}", f"{a / b:.1f}x") for n, a, b in zip(lengths, t_simd, t_kv)])
findings["decode vs length"] = (f"at {lengths[-1]} tokens of context: simd {t_simd[-1]:.0f} ms, kv_cache "
                                f"{t_kv[-1]:.1f} ms per token ({t_simd[-1] / t_kv[-1]:.0f}x); from {lengths[0]} to "
                                f"{lengths[-1]} kv_cache went from {t_kv[0]:.1f} to {t_kv[-1]:.1f} ms")

# %% [markdown]
# ## The stage, end to end

# %%
live = [nb.measure(simd, cfg), nb.measure(engine, cfg)]
for r in live:
    print(f"{r['stage']:>8}: TTFT {r['ttft_ms']:7.0f} ms, decode {r['decode_ms']:7.1f} ms/token "
          f"({r['n_generated']} generated)  {r['text']!r}")
del simd
rows = nb.profile(engine, cfg)
nb.print_profile(rows, "per-op profile, kv_cache (live)")
floor_ms = engine.weight_stream_bytes() / (nb.ceilings()["bandwidth_gbs"] * 1e9) * 1e3
print(f"reading the float32 weights once takes {floor_ms:.0f} ms at this machine's bandwidth: decode is "
      f"{live[1]['decode_ms'] / floor_ms:.1f}x that floor")
findings["kv_cache, live"] = (f"decode {live[1]['decode_ms']:.1f} ms/token against simd's "
                              f"{live[0]['decode_ms']:.0f} after a {cfg.prompt_tokens}-token prompt; the float32 "
                              f"weights alone take {floor_ms:.0f} ms to read")

# %% [markdown]
# ## Beside the article
#
# The article's KV cache made decode 10.6 times faster with a 512-token prompt, and left the time
# to first token where it was. The decode-step sweep above has the same setting at its longest
# context (512 tokens with the full settings; quick mode stops earlier, and the ratio grows with
# the context), and the end-to-end runs give the time to first token.

# %%
at = lengths[-1]
nb.article.beside("kv_decode_speedup", t_simd[-1] / t_kv[-1], f"one decode step at {at} tokens of context, live")
nb.article.beside("kv_ttft_unchanged", live[0]["ttft_ms"] / live[1]["ttft_ms"],
                  f"TTFT of simd / kv_cache, {cfg.prompt_tokens}-token prompt, live")
findings["vs the article"] = (f"decode {t_simd[-1] / t_kv[-1]:.1f}x faster at {at} tokens of context (the article: "
                              f"10.6x at 512); TTFT simd / kv_cache {live[0]['ttft_ms'] / live[1]['ttft_ms']:.2f}")

# %%
rec = nb.recorded()
nb.ops_chart_with_records("kv_cache", rows, rec, compare=("simd",))
nb.md(rec.note)
nb.stage_chart(live, rec, ["naive", "tiling", "simd", "kv_cache"], "naive -> ... -> kv_cache")

# %% [markdown]
# With one row per matmul, the decode step reads every weight once and does 2 FLOP with each:
# back at 0.5 FLOP per byte, deep under the memory ceiling. From here on the way forward is
# fewer bytes per weight: the next chapter.

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). kv_cache is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("kv_cache")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the KV cache's store and the attention that reads the arena.** The starting
# file, [`exercises/04_kv_cache/kv_attention.py`](../exercises/04_kv_cache/kv_attention.py), holds
# the function's signature and a docstring with the shapes, what to write and why, and the edges
# that catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=04
# ```
#
# (or `.venv/bin/python -m exercises.check 04`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 04`). The check runs your code and the stage's own,
# [`stages/kv_cache.py`](../stages/kv_cache.py) (`KVCache.store`) and
# [`common/backend.py`](../common/backend.py) (`Backend.attention`), on 4 seeded cases of awkward
# shapes, holding yours to the stage's: the arena equal value for value after every piece of a
# sequence, the output within the bound two float32 attentions may differ by. It stops at the first
# case that differs and says which, where and by how much; once all pass, it times yours beside the
# stage's and beside the simd stage, which recomputes the whole text each step. `--solution
# reference` runs the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/04_kv_cache.json` (your machine's figures, not committed). All of
# them: `make try-it ch=04`.
#
# 1. **The KV cache: the kv_cache stage against simd, which has none (the same matmul).**
#    - *Predict:* at 512 tokens a step without the cache pushes 512 rows through every matmul
#      where the cache pushes 1: the matmul work falls 512 times. The step time falls less,
#      since the simd kernel does a row 2 to 4 times faster in a block of 4 than alone (chapter
#      03's one_row): some 130 to 250 times (quick, 16 tokens: a few times).
#    - *Measure:* `make try-it ch=04 exp=cache_off` (runs the default model)
#
# 2. **The context length with the cache: 8 to 1024 positions.**
#    - *Predict:* a step's matmuls cost the same at every length; attention adds one 64-wide
#      dot product and one weighted row per stored position, per head and layer (30 x 9 x 1024
#      x 2 x 64 x 2 = 70 MFLOP at 1024, against 270 MFLOP of matmuls): the step grows by a
#      fraction, not a multiple.
#    - *Measure:* `make try-it ch=04 exp=context_growth` (runs the default model)

