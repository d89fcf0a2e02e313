# Source of notebooks/11_tp.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 11 · tp: splitting a model across processes, and what it costs
#
# Everything so far runs in one process. When a model does not fit one machine's memory, or one
# machine's memory bandwidth is the limit, production engines split **every layer** across
# devices: Megatron-LM's tensor parallelism, which vLLM runs over NCCL and llama.cpp over its RPC
# backend. The stage `tp` does it with processes talking through MPI (`mpiexec -n N`), on this
# machine's cores or on several machines, each running the fastest CPU stage (repack) on its
# share of every layer:
#
# | matrix | split by | what a rank computes | then |
# |---|---|---|---|
# | Wq, Wk, Wv | rows: its heads (whole KV groups) | q, k, v of its heads; attention over its own K/V cache | nothing to exchange |
# | Wo | columns: the same heads | a partial sum of the whole [M, D] output | **all-reduce** (sum over ranks) |
# | W_gate, W_up | rows: its hidden units | its part of silu(gate) * up | nothing to exchange |
# | W_down | columns: the same units | a partial sum | **all-reduce** |
# | output head | rows: its vocabulary | its logits | **gather** (every rank gets all of them) |
#
# Wo and W_down are *row-parallel*: their matmul is complete only once the ranks' partial sums are
# added, so the all-reduce belongs to the matmul (nano-vllm's `RowParallelLinear` ends in one).
# Two all-reduces per layer and one gather per token: that is the price. This chapter measures
# it (per token: compute, all-reduces, gather; bytes; memory per rank), live and from the records
# of `python -m app bench tp`, through shared memory and across a network link.

# %%
import json

from app.measure import tp_bench
from common.gguf import GGUFFile
from common.model import LlamaConfig, context_size
from stages import info
from stages.parallel import split

findings = nb.Findings()
why = nb.missing_stage("tp")
print(f"tp: {why or 'runs on this machine'}")
base = info("tp").builds_on

# %% [markdown]
# ## Who owns what
#
# A rank takes whole KV groups (a KV head and the query heads that read it), so its attention
# never needs another rank's keys or values. A row of a ggml matrix is a run of blocks of 32 or
# 256 values with one scale each, so a row-parallel matrix (Wo, W_down) can only be cut between
# blocks. Where N does not divide the KV heads, the ranks get unequal numbers of them, and the
# hidden units and vocabulary rows are moved to even out the bytes each holds (stages/parallel/split.py).
# The plan for this chapter's model, for every N that splits it:

# %%
g = GGUFFile(nb.model_path())
mcfg = LlamaConfig.from_gguf(g)
down = split.block_values(g, "ffn_down")
wo = split.block_values(g, "attn_output")
cost = split.costs(g, mcfg, context_size(mcfg), down)
valid = split.valid_rank_counts(mcfg, wo, down)
rows = []
for n in valid:
    for s in split.plan(mcfg, n, wo, down, cost):
        held = s.n_kv_heads * cost.kv_group + (s.ff[1] - s.ff[0]) / down * cost.ff_block \
            + (s.vocab[1] - s.vocab[0]) * cost.vocab_row
        rows.append((n, s.rank, f"{s.kv_heads[0]}..{s.kv_heads[1]}", f"{s.heads[0]}..{s.heads[1]}",
                     f"{s.ff[0]}..{s.ff[1]}", f"{s.vocab[0]}..{s.vocab[1]}", nb.human_bytes(held)))
nb.show_table(["N", "rank", "KV heads", "query heads", "hidden units", "vocabulary rows", "weights + KV held"], rows)
refusal = "(no refusal?)"
try:
    split.plan(mcfg, mcfg.n_head_kv + 1, wo, down, cost)
except split.SplitError as e:
    refusal = str(e)
print(refusal)
findings["rank counts that split this model"] = ", ".join(map(str, valid))
findings["a bad rank count"] = refusal

# %% [markdown]
# ## The code
#
# The layers on one rank are the repack stage's compiled stack (chapter 10) on the rank's slices,
# each slice laid out for the vector unit as repack lays out a whole matrix. That stack runs every
# op of every layer in one parallel region, which has no place for an MPI call. So tp runs it in
# pieces: `run_phases` takes a span of the stack's phases, and the row-parallel matmul that ends
# a piece adds its products into a buffer of partial sums instead of into h. Between two pieces,
# Python all-reduces the buffer and adds it to h. The graph is still written once (in the
# stack); what tp adds is where to stop. A piece costs a fork and join of the thread pool and a
# Python call: tp at 1 rank against the base measures what the stops cost.

# %%
if not why:
    from stages.tp import TensorParallelBackend, pieces
    nb.show_source(pieces, TensorParallelBackend._run, TensorParallelBackend.matmul)

# %% [markdown]
# ## Live: 2 ranks of one thread against one process of 2 threads
#
# Each condition in fresh processes, the way `python -m app bench tp` runs them (the report's
# prompt, greedy): per decode token and per rank, the time in the all-reduces and the gather
# (waiting for the slower rank included) and the rest, compute.

# %%
def live(stage, n):
    run = tp_bench.run_condition(stage, n, nb.model_path(), cfg.prompt_tokens, max(4, cfg.n_for("tp")))
    run["round"] = 0
    return run


runs = [] if why else [live(base, 1), live(base, 2), live("tp", 1), live("tp", 2)]
if runs:
    rec = {"runs": runs, "base_stage": base}
    s = tp_bench.summary(rec)
    nb.show_table(["condition", "rank", "decode ms/token", "compute", "all-reduce", "gather", "all-reduce share",
                   "weights + KV", "vs one process"],
                  [(name, r, f"{rk['ms']:.2f}", f"{rk['compute_ms']:.2f}", f"{rk['allreduce_ms']:.2f}",
                    f"{rk['gather_ms']:.2f}", f"{rk['allreduce_share']:.0%}",
                    nb.human_bytes(rk["memory"]["weights_and_kv_bytes"]), f"{rk['memory_vs_one_process']:.2f}x")
                   for name, c in s.items() for r, rk in enumerate(c["ranks"])])
    two = s[tp_bench.label({"stage": "tp", "n_ranks": 2})]
    findings["all-reduce share of a decode step, 2 ranks (live)"] = ", ".join(
        f"rank {r} {rk['allreduce_share']:.0%}" for r, rk in enumerate(two["ranks"]))
    findings["memory per rank, 2 ranks (live)"] = ", ".join(
        f"rank {r} {rk['memory_vs_one_process']:.2f}x one process" for r, rk in enumerate(two["ranks"]))
    one = s[tp_bench.label({"stage": base, "threads": 1})]
    d = tp_bench.divergence(one, two)
    if d is None:
        greedy = f"the same {len(two['tokens'])} tokens"
    else:
        gap = "outside its top logits" if d["gap"] is None else f"{d['gap']:.3f} below its best"
        greedy = f"the same up to step {d['step']}, then a token the base scored {gap} (a near-tie)"
    findings["greedy tokens, 2 ranks against the base (live)"] = greedy
    lat = two["ranks"][0]["latency_us"]
    findings["one collective alone (live)"] = f"all-reduce {lat['allreduce']:.1f} us, gather {lat['gather']:.1f} us"

# %% [markdown]
# Read the all-reduce column with the latency row: an all-reduce of one token's hidden state
# (a few KiB) alone costs what the MPI's round trip costs; inside a decode step it also holds the
# time one rank waits for the other to finish its share. On a machine whose cores other programs
# also use, a waiting rank gives its core away (stages/parallel/ranks.py), and waiting grows.

# %% [markdown]
# ## Recorded: SmolLM2 and the TinyLlama geometry
#
# `python -m app bench tp` measures every condition in alternating rounds and draws the page
# and the chart from its record; the lead figures of each record:

# %%
records = sorted((nb.ROOT / "profiles" / "bench").glob("tp_*.json"))
recorded = []
for path in records:
    rec = json.loads(path.read_text())
    s = tp_bench.summary(rec)
    two = s.get(tp_bench.label({"stage": "tp", "n_ranks": 2}))
    if two is None:
        continue
    name = rec["runs"][0]["model_info"]["file"]
    shares = ", ".join(f"rank {r} {rk['allreduce_share']:.0%}" for r, rk in enumerate(two["ranks"]))
    mem = ", ".join(f"{rk['memory_vs_one_process']:.2f}x" for rk in two["ranks"])
    vs = tp_bench.ratio_in_rounds(rec, tp_bench.label({"stage": "tp", "n_ranks": 2}),
                                  tp_bench.label({"stage": rec["base_stage"], "threads": 2}))
    nb.md(f"**{name}** ({nb.rel(path)}): all-reduce share of a decode step at 2 ranks: {shares}; weights + KV "
          f"per rank: {mem} of one process; decode at 2 ranks / {rec['base_stage']} at 2 threads: {vs:.2f}")
    recorded.append(f"{name}: all-reduce share {shares}; memory per rank {mem}; decode ratio {vs:.2f}")
    nb.show_image(path.with_suffix(".png"))
if recorded:
    findings["recorded at 2 ranks"] = "; ".join(recorded)
if not records:
    nb.md("_No record yet: `python -m app bench tp` writes profiles/bench/tp_<model>.json._")

# %% [markdown]
# ## Across machines
#
# On one machine the ranks talk through shared memory. Across machines every all-reduce and the
# gather cross the network, and two things set the cost: the bytes (each rank sends about twice
# the hidden state per all-reduce, as a ring does, plus its part of the logits), which a link's
# bandwidth divides; and the round trips (2 x layers + 1 per token), which its latency
# multiplies, whatever the size. For one token at a time the messages are small (one token's
# hidden state), so the round trips weigh more than the bytes. From each record (the latency is
# an assumption the record states, not a measurement):

# %%
across = []
for path in records:
    rec = json.loads(path.read_text())
    two = tp_bench.summary(rec).get(tp_bench.label({"stage": "tp", "n_ranks": 2}))
    if two is None:
        continue
    sent = max(rk["per_token"]["allreduce"]["sent_bytes"] + rk["per_token"]["gather"]["sent_bytes"]
               for rk in two["ranks"])
    calls = two["ranks"][0]["per_token"]["allreduce"]["calls"] + two["ranks"][0]["per_token"]["gather"]["calls"]
    lat = rec["network"]["latency_us_assumed"]
    rows = [(f"{g} Gb/s", f"{sent / (g * 1e9 / 8) * 1e3:.3f}", f"{calls * lat / 1e3:.2f}") for g in tp_bench.LINKS_GBIT]
    nb.md(f"**{rec['runs'][0]['model_info']['file']}**: {nb.human_bytes(sent)} sent per token by the busiest rank, "
          f"{calls:.0f} collectives per token; at the measured {1e3 / two['decode_ms']:.1f} tokens/s that is "
          f"{sent * 1e3 / two['decode_ms'] / 1e6:.1f} MB/s")
    nb.show_table(["link", "bytes: ms per token", f"round trips at {lat:g} us: ms per token"], rows)
    across.append(f"{rec['runs'][0]['model_info']['file']}: {nb.human_bytes(sent)}/token, "
                  f"{sent * 1e3 / two['decode_ms'] / 1e6:.1f} MB/s at the measured rate; {calls:.0f} round trips/token "
                  f"= {calls * lat / 1e3:.2f} ms at {lat:g} us each")
if across:
    findings["across machines"] = "; ".join(across)

# %% [markdown]
# ## Across a link, measured
#
# A projection is not a measurement. On one machine, two *network namespaces* (Linux) are two
# hosts as far as the network goes: each has its own interfaces, addresses and routes, and a veth
# pair joins them like a cable. `make netns` (root) makes them and writes an MPICH host file;
# `make stage=tp run np=2 hosts=build/netns/hosts` then runs one rank in each, and every all-reduce
# crosses the kernel's TCP/IP stack (app/netns.py says how mpiexec reaches the second host without
# ssh, and why MPICH must be told to use TCP: two processes of one machine would otherwise talk
# through shared memory). The link has the network stack's latency and no wire's, so it measures
# the round trips' software cost; a real network adds its own latency to each of them.
# `python -m app bench tp` adds this condition where namespaces can be made; each rank reads what its
# end of the link sent from the kernel's counters.

# %%
across_link = []
for path in records:
    rec = json.loads(path.read_text())
    s = tp_bench.summary(rec)
    linked = [name for name, c in s.items() if c["link"]]
    if not linked:
        nb.md(f"_{path.name}: no run across a link in this record (`python -m app bench tp` as root adds it)._")
        continue
    shared = tp_bench.label({"stage": "tp", "n_ranks": 2})
    rows = []
    for name in [shared, *linked]:
        for r, rk in enumerate(s[name]["ranks"]):
            rows.append((name, r, f"{rk['ms']:.2f}", f"{rk['allreduce_ms']:.2f}",
                         "-" if rk.get("wire_bytes_per_token") is None else nb.human_bytes(rk["wire_bytes_per_token"]),
                         f"{(rk['latency_us'] or {}).get('allreduce', float('nan')):.1f}"))
    nb.md(f"**{rec['runs'][0]['model_info']['file']}** ({nb.rel(path)})")
    nb.show_table(["condition", "rank", "decode ms/token", "all-reduce ms/token", "on the wire per token",
                   "all-reduce alone us"], rows)
    for name in linked:
        ratio = tp_bench.ratio_in_rounds(rec, name, shared)
        across_link.append(f"{rec['runs'][0]['model_info']['file']}: {ratio:.2f}x decode time")
if across_link:
    findings["across the veth pair / through shared memory"] = "; ".join(across_link)

# %% [markdown]
# ## Many sequences at once, over the ranks
#
# A server runs one scheduler, on rank 0: it admits, preempts and builds each step's batch
# (chapter 14). Every rank must run that same step over its own KV heads, so rank 0 sends the
# step's arrays (token ids, positions, cache slots, page tables, and the pages it copied) in one
# broadcast, and the other ranks, waiting in `follow`, run it over a page pool of their own laid
# out as rank 0's. Only integers cross; the hidden states cross in the all-reduces as before.
#
# `make serve stage=tp np=2` is that server: rank 0 runs HTTP, the scheduler and the sampler, the
# other ranks only `follow` (app/serve/ranks.py); a rank lost mid-step ends its requests with an
# error that names it, and the server, which cannot run a layer without it, ends every rank.

# %%
if not why:
    nb.show_source(TensorParallelBackend.forward_layers_batch, TensorParallelBackend.follow)

# %% [markdown]
# What limits it, then: the round trips per token, which batching many users' tokens into one
# step amortizes (chapter 14) and which pipeline parallelism (layers on different machines,
# one hand-off per machine instead of two per layer) avoids; the stops in the compiled stack
# (a fork and join and a Python call per piece, two per layer); and the part of every process
# that does not split (the interpreter, numba, the header and vocabulary), which the memory
# table shows beside the weights and the KV cache.

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). tp is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("tp")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: one rank's share of a layer, before the all-reduces.** The starting file,
# [`exercises/11_tp/rank_share.py`](../exercises/11_tp/rank_share.py), holds the function's signature
# and a docstring with the shapes, what to write and why, and the edges that catch a first attempt:
# a rank's first query head is not head 0, ranks hold unequal numbers of KV heads, and the split
# evens out bytes, not hidden units. Edit it, then check it:
#
# ```
# make exercise ch=11
# ```
#
# (or `.venv/bin/python -m exercises.check 11`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 11`). No MPI is needed: the check runs your function once for each rank
# of a plan, in one process, on 5 seeded cases (3 KV heads over 2 ranks, 3 ranks and one decode row,
# no sharing, a split that evens out bytes, one rank). It holds each rank's two partial sums to the
# stage's split of the same layer ([`stages/tp.py`](../stages/tp.py) `BY_ROWS` and `BY_COLUMNS` over
# [`stages/parallel/split.py`](../stages/parallel/split.py) `plan`), within the bound two float32
# computations of them may differ by. Then it adds the ranks' partial sums, as the all-reduce does,
# and shows how far they lie from one process's whole layer. Once all cases pass, it times rank 0's
# share beside the stage's and beside one process's whole layer. `--solution reference` runs the
# check on the stage's own code. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# **Try it.** Each experiment turns one knob. Write your own prediction down before you run it; the
# chapter's model gives the one below. Each command prints the prediction, then the measurement, and
# keeps both in `build/try_it/11_tp.json` (your machine's figures, not committed). All of them:
# `make try-it ch=11`.
#
# 1. **N, the ranks a layer is split over (stages/parallel/split.py plan): each rank's time for its
# share.**
#    - *Predict:* a rank's time follows its share of the layer's multiply-adds; SmolLM2's 3 KV heads
#      split over 2 ranks as 1 and 2, so at N = 2 rank 1 has twice rank 0's attention and the same
#      feed-forward, and the step waits for it at the all-reduce: the slowest rank takes more than
#      half of one process's time; at N = 3 the shares are equal, each near a third.
#    - *Measure:* `make try-it ch=11 exp=rank_time`
#
# 2. **The rows in one all-reduce (a decode token: 1; a prompt: hundreds), between 2 ranks of
# mpiexec.**
#    - *Predict:* an all-reduce first pays a round trip between the processes, a few microseconds
#      through shared memory on one machine, whatever it carries; one token's hidden state (576
#      floats, 2.25 KiB) costs about that, 16 rows (36 KiB) little more; only hundreds of rows (a
#      prompt) cost in proportion to their bytes. Decode pays two round trips per layer, 60 for
#      SmolLM2's 30 layers.
#    - *Measure:* `make try-it ch=11 exp=allreduce_size`
