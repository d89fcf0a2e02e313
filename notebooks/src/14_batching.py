# Source of notebooks/14_batching.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 14 · Many users at once: batching, paged KV, a server
#
# Everything so far ran one sequence. A decode step then reads **every weight** to make one
# token, two FLOPs per weight: deep in the memory-bound corner of the roofline. Serve B users
# in the same step and each weight byte, read once, feeds 2B FLOPs; the step costs about the
# same until the arithmetic catches up with the bandwidth. That is the other half of the
# roofline, and the reason every production server batches.
#
# Three pieces make it work (and `python -m app serve` is built on them):
#
# | piece | file | what it does |
# |---|---|---|
# | batched forward | `common/model.py` (`forward_batch`), `common/batch.py` | one step carries every running sequence's newest token as a row of one matrix, each row at its own position |
# | paged KV cache | `common/paged_kv.py` | one pool of 16-position pages; a page table per sequence; shared prefixes by reference |
# | continuous batching | `app/serve/scheduler.py`, `app/serve/engine_loop.py` | requests join and leave between steps; long prompts in chunks; admission by the pages needed now, preemption when they run out |
#
# The server batches through the stage `make run` picks. For the fused and repack stages a step
# is still one compiled call (`stages/kernels/layer_stack.py`): every row at its own position,
# the rows through the integer multi-row tiles, and attention reading each row's own pages
# through the page table inside the call. This chapter measures that stage.

# %%
import numpy as np

from common.batch import Batch, Segment
from common.paged_kv import PAGE_SIZE, PagePool, PageTable

findings = nb.Findings()
from app.serve.command import serving_stage

stage = serving_stage("fastest")        # the stage `python -m app serve` batches through, as `make run` picks
print(f"stage used in this chapter: {stage}")
engine = nb.load(stage)
mc = engine.config
# at least a page and a bit even in quick mode: full pages are what the prefix cache keeps, and
# what this chapter's cells must cope with (a prompt inside one page would hide it)
prompt = nb.prompt_ids(engine, max(cfg.prompt_tokens, PAGE_SIZE + 5))

# %% [markdown]
# ## One step, B sequences
#
# B sequences, each with its own prompt already in the cache, then decode steps that carry one
# row per sequence. The time of a step barely moves while B is small: the weights are read
# once per step whoever is in it.

# %%
import time

batches = (1, 2, 4, 8) if cfg.quick else (1, 2, 4, 8, 16, 32)
steps = 3 if cfg.quick else 10
pool = PagePool(mc.n_layer, mc.kv_dim, n_pages=max(batches) * (len(prompt) + steps + 16) // 16 + 8,
                dtype=engine.backend.kv_dtype)


def step_time(B: int) -> float:
    """Median seconds of a decode step with B sequences (their prompts prefilled first)."""
    tables = []
    for i in range(B):
        t = PageTable(pool)
        ids = [i + 3] + prompt                                # a different first token: no shared prefix
        # ... between the B sequences of one measurement; an earlier one (a smaller B) left its
        # full pages cached, and admit hands them over: feed only what they do not hold
        cached = t.admit(ids, len(ids) + steps + 1)
        assert cached is not None
        b = Batch(pool, [Segment(t, ids[cached:])], engine.backend.row_block)
        engine.forward_batch(b)
        b.finish()
        tables.append(t)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        b = Batch(pool, [Segment(t, [5]) for t in tables], engine.backend.row_block)
        engine.forward_batch(b)
        times.append(time.perf_counter() - t0)
    for t in tables:
        t.release()
    return float(np.median(times))


step_s = {B: step_time(B) for B in batches}
nb.show_table(["sequences B", "step (ms)", "tokens/s, all sequences", "vs B = 1"],
              [(B, f"{s * 1e3:.1f}", f"{B / s:.0f}", f"{B / s / (1 / step_s[1]):.2f}x") for B, s in step_s.items()])
findings["batched decode (live)"] = ", ".join(f"B={B}: {B / s:.0f} tokens/s" for B, s in step_s.items()) + \
    f" ({stage}; {max(batches) / step_s[max(batches)] * step_s[1]:.1f}x at B={max(batches)})"

# %% [markdown]
# ## Where it flattens: the roofline, per step
#
# A step reads the weights once (W bytes) and computes B tokens (F FLOPs each). It cannot beat
# either ceiling: B x bandwidth / W tokens/s while memory is the limit, peak / F once the
# arithmetic is. The measured curve rises with the first and bends toward the second.

# %%
from app.measure.speculative import integer_matmuls
from common.model import flops_per_token

# the threads the steps above ran on; the peak of the unit the stage's matmuls use (int8: the integer one)
ceil = nb.ceilings(engine.backend.threads, integer_matmuls(engine))
W = engine.weight_stream_bytes()
F = flops_per_token(mc, len(prompt))
roof_mem = [B * ceil["bandwidth_gbs"] * 1e9 / W for B in batches]
roof_flop = ceil["peak_gflops"] * 1e9 / F
nb.line_chart({f"{stage}, measured (this machine)": (list(batches), [B / step_s[B] for B in batches]),
               "bandwidth ceiling, B x bandwidth / weight bytes": (list(batches), roof_mem),
               f"compute ceiling, the {ceil['peak_name']} / operations per token":
                   (list(batches), [roof_flop] * len(batches))},
              "sequences per step (B)", "tokens/s",
              f"Decode throughput vs batch (the ceilings at {ceil['threads']} thread(s))", logy=True)
nb.md(f"_Ceilings at {ceil['threads']} thread(s), {ceil['source']}: {ceil['bandwidth_gbs']:.1f} GB/s, "
      f"{ceil['peak_gflops']:.0f} G operations/s (the {ceil['peak_name']}). Weights read per step: "
      f"{nb.human_bytes(W)}; {F / 1e6:.0f} M operations per token (a multiply-add counts two)._")
findings["the roofline per step"] = (f"bandwidth ceiling {roof_mem[0]:.0f} tokens/s at B=1, rising with B; "
                                     f"compute ceiling {roof_flop:.0f} tokens/s ({ceil['threads']} thread(s))")

# %% [markdown]
# ## A sequence's numbers must not depend on its neighbours
#
# The multi-row matmul (the simd stage's 4 x 4 register block, which every later CPU stage
# reuses for prompt rows) multiplies rows four at a time and the rows left over one at a time.
# The two paths add a row's products in different orders, so the same row gets different last
# bits depending on how many rows came with it. In a server that would make a user's text
# depend on who else was connected. The fix is in `common/backend.py`: a batch is padded to a
# multiple of `row_block` rows, so every row takes the four-row path.

# %%
from stages.simd import matmul_panels

rng = np.random.default_rng(0)
Wp = rng.standard_normal((64, mc.n_embd)).astype(np.float32)
X = rng.standard_normal((5, mc.n_embd)).astype(np.float32)
alone = matmul_panels(X[:1], Wp)[0]                        # one row: the leftover path
in_five = matmul_panels(X, Wp)[0]                          # the same row among five: the 4 x 4 block
padded = matmul_panels(np.vstack([X[:1], np.zeros((3, mc.n_embd), np.float32)]), Wp)[0]
nb.show_table(["the same row, computed", "largest difference from it among five rows"],
              [("alone (1 row)", f"{np.abs(alone - in_five).max():.2e}"),
               ("alone, padded to 4 rows", f"{np.abs(padded - in_five).max():.2e}")])
findings["row paths"] = (f"a row alone differs from itself in a batch by up to {np.abs(alone - in_five).max():.1e}; "
                         f"padded to 4 rows by {np.abs(padded - in_five).max():.1e}")

# %% [markdown]
# And the whole engine: one sequence generated alone, then again among others that are at
# other positions and partly still in their prompts, its prompt cut into other chunks.

# %%
from app.serve.engine_loop import EngineLoop
from app.serve.sequence import Ask, Sequence


def run(loop, texts, n):
    reqs = []
    for text in texts:
        r = Sequence(Ask(engine.tokenizer.encode(text), n))
        loop.submit(r)
        r.sampler = nb.KeepLogits()
        reqs.append(r)
    log = []
    while not loop.scheduler.idle:
        log.append(loop.step())
    return reqs, log


n_gen = 4 if cfg.quick else 16
target = "The quick brown fox jumps over the lazy dog. Then it"
crowd_texts = ["Once upon a time, in a kingdom by the sea, there lived a princess who", "1, 2, 3,", target,
               "The capital of France is"]
(solo,), _ = run(EngineLoop(engine, kv_pages=64), [target], n_gen)
crowd, rows_per_step = run(EngineLoop(engine, kv_pages=64, prefill_chunk=5), crowd_texts, n_gen)
same = all(np.array_equal(a, b) for a, b in zip(solo.sampler.logits, crowd[2].sampler.logits))
print("rows per step in the crowded run:", rows_per_step)
print("alone:   ", engine.tokenizer.decode(solo.generated))
print("in crowd:", engine.tokenizer.decode(crowd[2].generated))
findings["batch invariance"] = (f"logits alone and among {len(crowd_texts) - 1} others: "
                                f"{'identical, bit for bit' if same else 'DIFFERENT'} at every step")

# %% [markdown]
# Against the single-sequence path (what `run -p` does): where a lone decode row takes other
# kernels than a batch's rows (the simd stage's one-row path sums in yet another order), the two
# agree to rounding only; a stage that pads a lone row as it pads a batch gives the same bits.
# A greedy token can differ only where the top two candidates are nearly tied;
# tests/test_batch.py measures that margin at every step. This chapter's stage:

# %%
engine.reset()
single = [engine.forward(solo.ask.prompt, 0, all_logits=False)[0]]
for i, t in enumerate(solo.generated[:-1]):
    single.append(engine.forward([t], len(solo.ask.prompt) + i)[0])
diff = max(float(np.abs(a - b).max()) for a, b in zip(single, solo.sampler.logits))
agree = [int(np.argmax(a)) for a in single] == solo.generated
findings["vs the single-sequence path"] = (f"logits within {diff:.1e}; greedy tokens "
                                           f"{'the same' if agree else 'different at a near-tie'}")
nb.md(f"**{engine.backend.name}**: the single-sequence path's logits "
      + ("are the batch's, bit for bit." if diff == 0 else f"differ from the batch's by up to {diff:.1e}."))
engine.reset()

# %% [markdown]
# ## Paged KV: memory for what is used
#
# The single-sequence arena reserves every position of the context for every layer. A pool of
# pages holds what the running sequences actually use, and a page table per sequence maps
# position t to page `table[t // 16]`, slot `t % 16`. Attention reads K and V through it.

# %%
nb.show_source(PageTable.append_slots)
P = pool.page_size
arena_per_seq = 2 * mc.n_layer * engine.n_ctx * mc.kv_dim * np.dtype(engine.backend.kv_dtype).itemsize
users, length = 32, len(prompt) + 64
paged = users * -(-length // P) * pool.page_bytes
nb.show_table(["KV memory for", "arena (context reserved)", "pages (what is used)"],
              [(f"{users} users, {length} tokens each, context {engine.n_ctx}", nb.human_bytes(users * arena_per_seq),
                nb.human_bytes(paged))])
findings["paged vs arena"] = (f"{users} users x {length} tokens: {nb.human_bytes(paged)} of pages against "
                              f"{nb.human_bytes(users * arena_per_seq)} of arenas")

# %% [markdown]
# ## Shared prefixes
#
# A page whose 16 positions are written holds K and V that depend only on the tokens up to its
# end. The pool registers it under (previous page, its tokens); a later sequence whose prompt
# begins with the same full pages takes them by reference. Counted here on a system prompt:

# %%
loop = EngineLoop(engine, kv_pages=64)
system = ("You are a careful assistant. Answer in one short sentence, and say when you do not know. "
          "Question: ")
first = Sequence(Ask(engine.tokenizer.encode(system + "What is the capital of Italy?"), 8))
second = Sequence(Ask(engine.tokenizer.encode(system + "Who wrote Hamlet?"), 8))
loop.submit(first)
loop.step()
loop.submit(second)
loop.step()
common = next((i for i, (a, b) in enumerate(zip(first.ask.prompt, second.ask.prompt)) if a != b), 0)
shared = loop.pool.n_shared
print(f"common prefix: {common} tokens = {common // P} full pages; pages shared now: {shared}")
while loop.scheduler.running:
    loop.step()
findings["prefix sharing"] = f"{common}-token common prefix: {shared} pages held once for both requests"

# %% [markdown]
# ## When the pages run out: preemption
#
# Admission promises a request only the pages its prompt needs now, plus one to grow into;
# before each step every sequence asks for the pages that step will write. When the pool
# cannot give them, the newest sequence is preempted: its pages go back, it waits at the front
# of the queue, and once readmitted it recomputes its prompt and what it had generated. A
# row's numbers do not depend on its batch, so it carries on exactly where it was. Here a pool
# a third the size of every request's worst case at once:

# %%
texts = [f"Story {i}: once upon a time" for i in range(6)]        # a page each to start with
n_long = 40                                                         # then 3 pages each
worst = sum(PageTable.pages_for(len(engine.tokenizer.encode(t)) + n_long) for t in texts)
tight = EngineLoop(engine, kv_pages=max(worst // 3, max(PageTable.pages_for(len(engine.tokenizer.encode(t)) + n_long)
                                                            for t in texts)), max_batch=len(texts))
squeezed, _ = run(tight, texts, n_long)
alone_each = [run(EngineLoop(engine, kv_pages=64), [t], n_long)[0][0].generated for t in texts]
equal = sum(r.generated == a for r, a in zip(squeezed, alone_each))
nb.show_table(["pool (pages)", "every worst case at once", "preemptions", "outputs equal to alone"],
              [(tight.pool.n_pages, worst, tight.preemptions, f"{equal} of {len(texts)}")])
findings["preemption"] = (f"{len(texts)} requests in {tight.pool.n_pages} pages (worst case {worst}): "
                          f"{tight.preemptions} preemptions, {equal} of {len(texts)} outputs equal to each alone")

# %% [markdown]
# ## One thread drives the engine
#
# A server has two jobs: answer HTTP (an asyncio loop) and run the steps. Which thread runs
# the steps matters more than it looks. numba's OpenMP layer (libgomp) gives every thread that
# opens a parallel region its own team of workers. libgomp counts the workers of all teams,
# and while they outnumber the CPUs, a worker that finishes a region goes to sleep almost at
# once instead of spinning for the next one (`do_spin` in libgomp's `wait.h`), so every region
# begins by waking it: a system call and a context switch. A step opens hundreds of regions (the
# threads stage: several per layer), so `python -m app serve` runs its engine loop in the
# thread that loaded and warmed the engine and gives HTTP the second thread
# (`EngineLoop.run`, `app/serve/command.py`). Measured here: a nearly empty region opened from
# this notebook's thread, then from a second thread while this one's team exists, then from
# this thread again once the second thread, and its team, are gone.

# %%
import threading

import numba
from numba import njit, prange


@njit(parallel=True)
def tiny_region(a):                 # one element per thread: what it costs is the fork and join
    for i in prange(a.shape[0]):
        a[i] += 1.0


def region_us(n: int = 300 if cfg.quick else 3000) -> float:
    """Microseconds per call of tiny_region, from the calling thread."""
    a = np.zeros(numba.get_num_threads())
    tiny_region(a)
    t0 = time.perf_counter()
    for _ in range(n):
        tiny_region(a)
    return (time.perf_counter() - t0) / n * 1e6


here = region_us()
other = {}
second = threading.Thread(target=lambda: other.update(us=region_us()))
second.start()
second.join()
again = region_us()
layer = numba.threading_layer()
nb.show_table(["regions opened from", "us per region"],
              [["this thread (the engine's)", f"{here:.1f}"], ["a second thread", f"{other['us']:.1f}"],
               ["this thread, the second one gone", f"{again:.1f}"]])
findings["a parallel region from a second thread"] = (
    f"{other['us']:.1f} us, against {here:.1f} us from the thread that opened the first "
    f"({layer} threading layer, {numba.get_num_threads()} threads)")

# %% [markdown]
# ## The server, and the load test
#
# `make serve` (`python -m app serve`) puts this behind OpenAI's HTTP API; `make loadtest`
# (`python -m app bench loadtest`) runs 1 to 32 clients of the official `openai` package against it and
# against llama.cpp's own server, and draws `profiles/batching.png` from its record
# (`profiles/bench/batching.json`, table `profiles/bench/batching.md`):

# %%
chart = nb.ROOT / "profiles" / "batching.png"
if nb.show_image(chart):
    import json
    rec = json.loads((nb.ROOT / "profiles" / "bench" / "batching.json").read_text())
    ours = rec["engines"]["ours"]
    findings["recorded load test"] = (f"{ours[-1]['clients']} clients: {ours[-1]['tokens_per_s']:.0f} tokens/s, "
                                      f"{ours[-1]['tokens_per_s'] / ours[0]['tokens_per_s']:.1f}x one client "
                                      f"(profiles/bench/batching.md)")
else:
    nb.md("_No load test recorded on this machine yet: `make loadtest` writes it._")

# %% [markdown]
# ## What one user pays for the stream
#
# `python -m app bench serve-cost` sets one streamed client against `run`, on the same prompt, stage
# and threads (its page: `profiles/bench/serve_cost.md`). A whole request
# goes through the server at nearly `run`'s rate; a stream falls behind, and not because of the
# engine loop. Each token is an event: the HTTP thread formats and writes it, the client reads and
# parses it, both on the cores the step runs on, and a step's thread that loses its core makes the
# others wait at the next barrier. `serve --stream-interval MS` sends the tokens made within MS
# milliseconds as one event: the same text, fewer events, each token at most MS late
# (`profiles/bench/serve_cost_interval50.md`). The two records, each the median of its rounds'
# ratios:

# %%
import json

stream_rows = []
for name, how in (("serve_cost.json", "an event per token (the default)"),
                  ("serve_cost_interval50.json", "`--stream-interval 50`")):
    path = nb.ROOT / "profiles" / "bench" / name
    if path.exists():
        r = json.loads(path.read_text())
        on = f"{r['machine']['cpu']}, {r['threads']} threads, stage {r['stage']}"
        stream_rows.append([how, f"{r['ratio_stream']:.2f}x", f"{r['ratio_whole']:.2f}x", on])
if stream_rows:
    nb.show_table(["the stream", "streamed decode / `run`'s", "whole request / `run`'s",
                   "measured on"], stream_rows)
else:
    nb.md("_No serve-cost record yet: `python -m app bench serve-cost` writes it._")

# %% [markdown]
# Is that the server's cost, or any server's on these cores? `serve-cost --llama-server auto` puts
# llama.cpp's own server beside ours in the same rounds, with the same client, and counts what the
# stream added to a token in milliseconds: the same work per event weighs more on a shorter step.

# %%
from app.measure.serve_cost import streaming_ms

path = nb.ROOT / "profiles" / "bench" / "serve_cost.json"
r = json.loads(path.read_text()) if path.exists() else {}
if r.get("llama"):
    ours_step = 1e3 / np.median([x["run"]["decode"] for x in r["rounds"]])
    their_step = 1e3 / np.median([x["llama"]["decode"] for x in r["rounds"]])
    ours_ms = np.median([streaming_ms(x["stream"], x["run"]["decode"]) for x in r["rounds"]])
    nb.show_table(["server", "a token's step alone", "what the stream added to it", "streamed / alone"],
                  [("ours (`python -m app serve`)", f"{ours_step:.2f} ms", f"{ours_ms:.2f} ms", f"{r['ratio_stream']:.2f}x"),
                   ("llama.cpp's llama-server", f"{their_step:.2f} ms", f"{r['llama']['streaming_ms']:.2f} ms",
                    f"{r['llama']['ratio_stream']:.2f}x")])
    findings["the stream's cost, beside llama-server"] = (f"ours {ours_ms:.2f} ms a token on a {ours_step:.2f} ms "
                                                          f"step, llama-server {r['llama']['streaming_ms']:.2f} ms on "
                                                          f"{their_step:.2f} ms ({nb.rel(path)})")
else:
    nb.md("_The serve-cost record has no llama-server rounds: `python -m app bench serve-cost --llama-server auto` "
          "adds them._")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the scheduler's admit-or-preempt decision.** The starting file,
# [`exercises/14_batching/admit_or_preempt.py`](../exercises/14_batching/admit_or_preempt.py), holds
# the function's signature and a docstring with the shapes, what to write and why, and the edges
# that catch a first attempt. Edit it, then check it:
#
# ```
# make exercise ch=14
# ```
#
# (or `.venv/bin/python -m exercises.check 14`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 14`). The check runs your code and the stage's own,
# [`app/serve/scheduler.py`](../app/serve/scheduler.py) (`Scheduler._reserve, Scheduler._admit`), on
# 6 seeded cases of awkward shapes, holding yours to the stage's: the same rows, preemptions and
# queue, step for step, as the server's scheduler on the same traffic. It stops at the first case
# that differs and says which, where and by how much; once all pass, it times yours beside the
# stage's and beside a server that runs one sequence at a time (counted in steps). `--solution
# reference` runs the check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/14_batching.json` (your machine's figures, not committed). All of
# them: `make try-it ch=14`.
#
# 1. **The rows of one forward pass: 1 to 32 (the batch of a server's step).**
#    - *Predict:* a decode step reads every weight once whatever the rows; while the rows
#      stay under the ridge point (peak FLOP/s over bandwidth, in multiply-adds per byte) a
#      pass of 8 rows costs about one of 1, so 8 users are served for the price of one; past
#      it, each row adds its own time.
#    - *Measure:* `make try-it ch=14 exp=batch_rows` (runs the default model)
#
# 2. **The page pool's size (the server's `--kv-pages`) against the requests' worst case.**
#    - *Predict:* pages are held only by the sequences running at once (8 here), so a pool
#      with room for 8 worst cases serves as fast as one with room for all; below that fewer
#      run at once, sequences outgrow their pages and the newest is preempted (its context
#      computed again), and the steps climb towards serving one request at a time.
#    - *Measure:* `make try-it ch=14 exp=pool_pages`

