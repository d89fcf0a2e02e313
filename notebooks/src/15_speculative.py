# Source of notebooks/15_speculative.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 15 · Speculative decoding: verify k guesses for the price of one step?
#
# The roofline chapters say decode is bound by memory: one token reads every weight for two flops
# each. Then a forward pass of k+1 rows should cost about what one row costs, as long as the
# rows stay below the machine's ridge point: the weights are read once whatever the number of
# rows. Its consequence is the most practical trick in inference today:
#
# 1. **guess** the next k tokens cheaply (from the text itself, or with a small model),
# 2. **verify** them in one forward pass of k+1 rows over the KV cache: the newest token and
#    the k guesses, at positions n..n+k,
# 3. **accept** the longest prefix the model agrees with, plus one token of its own: 1 to k+1
#    tokens for one pass; the rejected positions are rolled back in the KV cache.
#
# Whether it pays depends on one measured figure: what a pass of k+1 rows costs here. This
# chapter measures it, places it on the roofline, and runs the whole thing
# (`common/speculative.py`; `python -m app run --spec lookup`).

# %%
import numpy as np

from app.args import fastest_stage
from app.measure import speculative as ms
from common import speculative as sp
from common.generate import Sampler, SamplingParams

findings = nb.Findings()
stage = fastest_stage()
engine = nb.load(stage)
threads = engine.backend.threads
print(f"stage {stage}, {threads} thread(s)")

# %% [markdown]
# ## What a verify pass costs
#
# One pass of k+1 rows at the end of a cached context, against one plain decode step, in
# alternating rounds; beside it the roofline's floor, `max(bytes / bandwidth, rows x flops per
# row / peak)`: flat while the weights' bytes are the limit, rising by a step per row once the
# arithmetic is.

# %%
k_max = 4 if cfg.quick else 16
rounds = 1 if cfg.quick else 3
context = nb.prompt_ids(engine, 16 if cfg.quick else 64)
ours = ms.medians(ms.verify_times(engine, context, k_max, rounds))
ceil = ms.ceilings(threads, ms.integer_matmuls(engine))      # the stage's matmuls are int8: the integer peak
roof = ms.roofline_prediction(engine, len(context), k_max, ceil)
ks = list(range(k_max + 1))
nb.line_chart({f"ours ({stage}), measured": (ks, ours), "the roofline's floor": (ks, roof["ratio"])},
              "guesses k (a pass of k+1 rows)", "time / one decode step", "What verifying k guesses costs")
nb.show_table(["k", "rows", "measured", "roofline"], [(k, k + 1, f"{o:.2f}x", f"{r:.2f}x")
                                                       for k, o, r in zip(ks, ours, roof["ratio"])])
findings["verify cost"] = (f"a pass of {k_max + 1} rows costs {ours[-1]:.2f}x one decode step ({stage}, {threads} "
                           f"thread(s)); the roofline's floor {roof['ratio'][-1]:.2f}x")

# %% [markdown]
# ## Where the ridge is
#
# The roofline puts the ridge at the number of rows whose flops take as long as reading the
# weights once. A model stored in 4-bit blocks brings few bytes per weight, so its ridge sits
# at a few rows on a CPU (few flops per byte of bandwidth), while a GPU, or a CPU with many
# cores, has its ridge much further out. And a kernel slower than the machine's peak (one that
# spends several instructions unpacking each weight) pays for every extra row above the floor:
# what the measured curve shows over the dashed one.

# %%
nb.md(f"_Ceilings: {ceil['bandwidth_gbs']:.1f} GB/s and {ceil['peak_gflops']:.0f} G operations/s (the "
      f"{ceil['peak_name']}) at {ceil['threads']} "
      f"thread(s), {ceil['source']}. A pass reads {nb.human_bytes(roof['bytes'])}, "
      f"{roof['flops_per_token'] / 1e6:.0f} MFLOP per row._")
one_step_ms = roof["ms"][0]
findings["the ridge"] = (f"at {roof['ridge_rows']:.1f} rows here: reading the weights once takes "
                         f"{one_step_ms:.2f} ms at the bandwidth, one row's flops "
                         f"{roof['flops_per_token'] / (ceil['peak_gflops'] * 1e9) * 1e3:.2f} ms at the peak")

# %% [markdown]
# ## The guesses: prompt lookup
#
# The cheapest guess needs no model: find the longest n-gram at the end of the text that occurred
# earlier in it, and propose what followed it there. Text that copies itself (code being edited,
# a list recited, a passage quoted) is full of such matches; free text has few. When the match is
# recent, what followed it runs into the text's end, and the guess goes on as the copy would (an
# LZ77 decoder's overlapping copy): a text that repeats every p tokens is guessed k ahead, not p.
# Small models fall into such loops ("cheese, cheese, cheese, ..."), and lists and tables repeat
# their separators.
#
# A scan of the whole text at every step would grow with the text; `NgramIndex` keeps, for every
# n-gram seen, the position after its latest occurrence, so a step looks its ending up in a few
# dictionary lookups.

# %%
nb.show_source(sp.NgramIndex)
look = sp.PromptLookup()
text = [5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2]
n, guess = look.find(text, 4)
print(f"text {text}: the last {n} tokens {text[-n:]} last occurred earlier at", end=" ")
print(f"{[i for i in range(len(text) - n) if text[i:i + n] == text[-n:]][-1]}; guess {guess}")

# %% [markdown]
# ## The rule
#
# Greedy: keep a guess while it is the model's argmax; the first argmax that differs is the
# model's own token. Sampling (Leviathan et al., Chen et al.): keep a guess x drawn from the
# draft's distribution q with probability min(1, p(x)/q(x)), and on rejection draw from
# norm(max(0, p - q)); p is the plain sampler's own distribution (penalties, top-k, top-p, min-p,
# temperature: `Sampler.distribution`).

# %%
nb.show_source(sp.accept)

# %% [markdown]
# Why the rule keeps p: a token x comes out either as the guess, kept (probability
# q(x) min(1, p(x)/q(x)) = min(p(x), q(x))), or from the residual after a rejection (probability
# 1 - sum min(p, q), times max(0, p(x) - q(x)) normalized), and the two add up to p(x). Checked
# here on this model's next-token distribution p, with the q of a draft model made from its first
# layers (`app/draft_model.py`); tests/test_speculative.py checks it by drawing, with a chi-square test.

# %%
from app.draft_model import first_layers
from stages import load as load_stage

draft_layers = max(1, engine.config.n_layer // 4)
draft = load_stage(stage, first_layers(nb.model_path(), draft_layers), threads=threads)
prompt = engine.tokenizer.encode("The capital of France is")
sampler = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0))
engine.reset()
draft.reset()
V = engine.config.n_vocab
p = sp.dense_distribution(*sampler.distribution(engine.forward(prompt, 0, all_logits=False)[0], prompt), V)
q = sp.dense_distribution(*sampler.distribution(draft.forward(prompt, 0, all_logits=False)[0], prompt), V)
engine.reset()
draft.reset()
kept = np.minimum(p, q)
residual = np.maximum(p - q, 0)
emitted = kept + (1 - kept.sum()) * residual / residual.sum()
print(f"a guess from the {draft_layers}-layer draft is kept with probability {kept.sum():.3f}; "
      f"max |emitted - p| = {np.abs(emitted - p).max():.1e}")
findings["the rule keeps p"] = (f"kept guesses plus residual draws give p to {np.abs(emitted - p).max():.0e} "
                                f"(a {draft_layers}-layer draft's guess kept with probability {kept.sum():.2f})")

# %% [markdown]
# ## Plain decoding against prompt lookup, live
#
# Greedy, the same stage: the text must be plain decoding's, token for token (a stage whose
# multi-row pass rounds activations otherwise, the 8-bit ones, may part at a near-tie, and the
# cell measures by how much). How many guesses a step makes is the planner's (`Speculation.plan`,
# the one `serve --spec` runs over its batch, here over a batch of one): from the step times it
# measured on this engine and the accept rate so far; where guesses keep failing, or cost more
# than they gained, it stops guessing.

# %%
prompts = ms.prompt_sets()
n_gen = 16 if cfg.quick else 64
rows, live, texts = [], {}, {}
for kind in ("copy", "free"):
    ids = engine.tokenizer.encode(prompts[kind][-1 if kind == "copy" else 0])
    plain = ms.run_ours(engine, ids, n_gen)
    looked = ms.run_ours(engine, ids, n_gen, sp.from_flags("lookup", 10))     # run --spec lookup --draft-max 10
    part = ms.parting(engine, ids, plain["tokens"], looked["tokens"])
    rate = looked["accepted"] / looked["drafted"] if looked["drafted"] else 0.0
    live[kind] = looked["tokens_per_s"] / plain["tokens_per_s"]
    texts[kind] = engine.tokenizer.decode(looked["tokens"])
    rows.append((kind, f"{plain['tokens_per_s']:.1f}", f"{looked['tokens_per_s']:.1f}", f"{live[kind]:.2f}x",
                 f"{looked['accepted']} of {looked['drafted']} ({rate:.0%})",
                 "yes" if part is None else f"parts at token {part['at']}, lead {part['gap']:.3f} logits"))
nb.show_table(["text", "plain tokens/s", "lookup tokens/s", "lookup / plain", "guesses kept", "plain's text"], rows)
nb.md(f"The copy prompt's answer, with lookup: `{texts['copy'][:120]!r}`")
findings["lookup, live"] = (f"{live['copy']:.2f}x plain decoding on text that copies itself, {live['free']:.2f}x on free "
                            f"text ({stage}, {n_gen} tokens, one run each: the benchmark alternates rounds)")

# %% [markdown]
# ## The benchmark and its record
#
# `python -m app bench speculative` measures the curve above at 1 thread and at all cores,
# beside llama.cpp's own verify pass, and the tokens/s of plain decoding and prompt lookup,
# ours and llama-cpp-python's `LlamaPromptLookupDecoding`, on every committed prompt
# (`app/measure/speculative_prompts.json`), in alternating rounds. It writes
# `profiles/bench/speculative.json` and draws `profiles/bench/speculative.md` and this chart:

# %%
import json

from app.report import speculative as spec_page

record = nb.ROOT / "profiles" / "bench" / "speculative.json"
if nb.show_image(nb.ROOT / "profiles" / "speculative.png") and record.exists():
    rec = json.loads(record.read_text())
    claim = spec_page.claim_rows(rec, "profiles/bench/speculative.json")
    nb.show_table(["claim", "recorded", "verdict", "why"],
                  [(r.claim, f"{r.measured:.2f}x", r.verdict, r.why) for r in claim])
    findings["recorded"] = "; ".join(f"{r.id}: {r.measured:.2f}x, {r.verdict}" for r in claim) + \
        (" (quick settings)" if rec["settings"].get("quick") else "")
else:
    nb.md("_No benchmark recorded yet: `python -m app bench speculative` writes it._")

# %% [markdown]
# What decides it, then, is the machine and the kernel, not the idea: speculative decoding turns
# spare arithmetic into tokens, and pays only where a pass of k+1 rows really costs about one
# step. On a GPU, or a CPU whose decode is far under its compute peak, that holds for many rows;
# on a small CPU running a 4-bit model, the ridge is near and every row costs. Measure first.

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the acceptance rule of speculative sampling.** The starting file,
# [`exercises/15_speculative/acceptance.py`](../exercises/15_speculative/acceptance.py), holds the
# function's signature and a docstring with the shapes, what to write and why, and the edges that
# catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=15
# ```
#
# (or `.venv/bin/python -m exercises.check 15`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 15`). The check runs your code and the stage's own,
# [`common/speculative.py`](../common/speculative.py) (`accept`), on 8 seeded cases of awkward
# shapes, holding yours to the stage's: greedy choices token for token, sampled ones by their
# distribution over thousands of seeded draws (the stage's rule beside yours). It stops at the first
# case that differs and says which, where and by how much; once all pass, it times yours beside the
# stage's and beside plain decoding (the default model generates with prompt lookup and your rule).
# `--solution reference` runs the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/15_speculative.json` (your machine's figures, not committed). All of
# them: `make try-it ch=15`.
#
# 1. **`--draft-max K`: how many guesses a verify pass may check.**
#    - *Predict:* on text that copies its prompt, prompt lookup's guesses are mostly right:
#      each pass of K + 1 rows, costing about one step, yields up to K + 1 tokens. Tokens/s
#      should rise from K = 0 and flatten once the guesses run past what the text repeats or
#      the pass's rows pass the ridge.
#    - *Measure:* `make try-it ch=15 exp=draft_max` (runs the default model)
#
# 2. **The rows of a verify pass: 1 to 17.**
#    - *Predict:* under the ridge point a pass of m rows reads the same weights as one row:
#      about 1 step for m up to a handful, then rising by a step per few rows as the
#      multiply-adds take over.
#    - *Measure:* `make try-it ch=15 exp=verify_cost` (runs the default model)

