# Source of notebooks/06_cuda.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 06 · cuda: the whole forward pass on the GPU
#
# A GPU has what decode needs most: memory bandwidth, many times a CPU core's. But it sits
# at the end of a bus (PCIe) that is slower than either memory, and every trip across it, and
# every call into its driver, costs microseconds that a small model's whole forward pass cannot
# afford. So the lesson of this stage is less about kernels than about *distance*:
#
# - the weights cross the bus **once**, at load, still in their ggml blocks;
# - the KV cache and every intermediate live on the device, in memory allocated **once** (an
#   arena handed out again for every forward pass: no allocation, no free, per token);
# - per token, the host sends one token id and gets one token id back: the **argmax runs on the
#   device**, so the logits never cross the bus.
#
# The article this project retells moved its kernels to the GPU and found its time to first
# token *slower* than the CPU's (3.93 s against 2.76 s), for two reasons it named: the embedding
# lookup ran on the host, and every op was wrapped in a `cudaMalloc` and a `cudaFree`. Copying
# the logits back to pick the token on the host was not one of them: that was its sound design
# (this stage goes one step further and picks the token on the device).
#
# Most readers' machines have no NVIDIA GPU. This chapter then shows the design from the code
# and the recorded results, and says so; it never needs a GPU to run.

# %%
import re

from common.gguf import GGUFFile
from common.model import LlamaConfig

findings = nb.Findings()
missing = nb.missing_stage("cuda")
print("cuda stage:", missing or "runs on this machine")
findings["this machine"] = missing or "has a usable GPU: the figures below are live"
cuda_py = nb.ROOT / "stages" / "cuda.py"
kernel_files = sorted((nb.ROOT / "stages" / "kernels").glob("*.cu"))

# %% [markdown]
# ## The design, in the stage's own code
#
# Read from `stages/cuda.py` without importing it (that needs PyCUDA). First the arena: one
# device allocation, handed out front to back and reset at the start of each forward pass.

# %%
if not nb.show_class_from_file(cuda_py, "Arena"):
    nb.md("_`stages/cuda.py` has no `Arena` class (or the file is missing): nothing to show._")

# %% [markdown]
# Then the two ends of a token: the greedy argmax reduced on the device (4 bytes come back), and
# a matmul that picks the fused dequantize-matmul kernel for the weight's ggml type.

# %%
if not nb.show_class_from_file(cuda_py, "CudaBackend", ["argmax", "matmul"]):
    nb.md("_`stages/cuda.py` (CudaBackend.argmax, .matmul) is not in this checkout._")

# %% [markdown]
# ## The kernels
#
# The kernels are CUDA C in one file, compiled when the stage first loads. Their names:

# %%
if not kernel_files:
    nb.md("_No `.cu` kernel source in `stages/kernels/` yet._")
for path in kernel_files:
    src = path.read_text()
    names = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)\s*\(", src)
    print(f"{nb.rel(path)}: {len(src.splitlines())} lines, {len(names)} __global__ definitions "
          f"(## marks a kernel a macro writes once per ggml type):")
    print("  " + ", ".join(dict.fromkeys(names)))
    findings["kernel source"] = f"{nb.rel(path)}: {len(names)} kernel definitions"

# %% [markdown]
# One of them in full: attention fused into a single kernel with an *online softmax*. Each
# (query row, head) keeps a running maximum, a running sum and a running weighted sum of the
# values while it walks the cached keys once, so the scores are never written to memory.

# %%
shown = any(nb.show_file_excerpt(p, r'^extern "C" __global__[^\n]*\n\s*attention\s*\(', max_lines=70)
            for p in kernel_files)
if not shown and kernel_files:
    shown = nb.show_file_excerpt(kernel_files[0], r"__global__", max_lines=40)
if not shown:
    nb.md("_No kernel source to show._")

# %% [markdown]
# ## PCIe traffic per token
#
# What must cross the bus, for this model: the weights once, and per token only ids. The article
# copied the logits back and took the argmax on the host, `n_vocab` floats per token, a sound
# design; what cost it time was the embedding lookup on the host, an embedding row over the bus
# per token, with the allocations around every op.

# %%
g = GGUFFile(nb.model_path())
mcfg = LlamaConfig.from_gguf(g)
upload = sum(t.nbytes for t in g.tensors.values())
per_token_ids = 4 + 4                                 # an int32 token id each way
per_token_logits = 4 + 4 * mcfg.n_vocab               # the id in, every logit out
per_token_host_embedding = 4 * mcfg.n_embd + 4        # the article: a float32 row in, the id out
nb.show_table(["what crosses the bus", "bytes", "when"],
              [("the weights, in their ggml blocks", nb.human_bytes(upload), "once, at load"),
               ("token id in + argmax id out (this stage)", f"{per_token_ids} B", "per token"),
               (f"token id in + {mcfg.n_vocab:,} float32 logits out (host-side argmax: the article's, sound)",
                nb.human_bytes(per_token_logits), "per token"),
               (f"a {mcfg.n_embd}-float embedding row in, looked up on the host (the article's mistake)",
                nb.human_bytes(per_token_host_embedding), "per token, and every prompt row")])
findings["PCIe per token"] = (f"{per_token_ids} bytes with the argmax on the device, "
                              f"{nb.human_bytes(per_token_logits)} if the logits came back "
                              f"({per_token_logits // per_token_ids:,}x); weights: {nb.human_bytes(upload)} once")

# %% [markdown]
# ## The article's two mistakes, as switches
#
# Each comes back behind a switch of the stage, off by default, so that whoever has a GPU can
# measure what it costs (`LLM_CUDA_ALLOC_PER_OP=1` or `LLM_CUDA_HOST_EMBEDDING=1` before
# `make stage=cuda run`, or the `CudaBackend` arguments below). The tests run both through the
# CPU emulator of the kernels (tests/test_cuda_mistakes.py): the same logits, bit for bit, and
# the allocations and copies each one adds.

# %%
if not nb.show_class_from_file(cuda_py, "CudaBackend", ["_empty", "_embed_on_host"]):
    nb.md("_`stages/cuda.py` has no switches in this checkout._")

# %% [markdown]
# ## Live: the kernel table and the copies (only with a GPU)

# %%
live = []
if missing:
    nb.md(f"_No live run: {missing}. The recorded results follow._")
else:
    engine = nb.load("cuda")
    b = engine.backend
    live.append(nb.measure(engine, cfg))
    before = b.transfer_stats()
    b.start_profile()
    from common.generate import generate
    gen = generate(engine, nb.prompt_ids(engine, cfg.prompt_tokens), cfg.n_for("cuda"), ignore_eos=True)
    b.stop_profile()
    after = b.transfer_stats()
    print(b.profile_table())
    steps = max(after["forwards"] - before["forwards"], 1)
    h2d = (after["h2d_bytes"] - before["h2d_bytes"]) / steps
    d2h = (after["d2h_bytes"] - before["d2h_bytes"]) / steps
    print(f"per forward pass: {h2d:.0f} bytes host->device, {d2h:.0f} bytes device->host; "
          f"device allocations while generating: {after['device_allocs'] - before['device_allocs']}")
    findings["cuda, live"] = (f"TTFT {live[0]['ttft_ms']:.1f} ms, decode {live[0]['decode_ms']:.2f} ms/token; "
                              f"{h2d:.0f} + {d2h:.0f} bytes over PCIe per forward pass; "
                              f"{after['device_allocs'] - before['device_allocs']} allocations while generating")
    del engine
    from common.model import LlamaModel
    from stages import cuda as cs
    mistakes = {}
    for name, switch in (("alloc_per_op", {"alloc_per_op": True}), ("host_embedding", {"host_embedding": True})):
        e = LlamaModel(GGUFFile(nb.model_path()), cs.CudaBackend(**switch))
        e.stage = "cuda"
        e.warmup()
        mistakes[name] = nb.measure(e, cfg)
        del e
    nb.show_table(["cuda stage", "TTFT (ms)", "decode (ms/token)"],
                  [("as it is", f"{live[0]['ttft_ms']:.1f}", f"{live[0]['decode_ms']:.2f}")] +
                  [(f"with {k}", f"{r['ttft_ms']:.1f}", f"{r['decode_ms']:.2f}") for k, r in mistakes.items()])
    findings["the article's mistakes, live"] = ", ".join(
        f"{k}: TTFT {r['ttft_ms'] / live[0]['ttft_ms']:.2f}x" for k, r in mistakes.items())

# %% [markdown]
# ## Recorded results
#
# The cuda stage is measured where a GPU was available, usually not the reader's machine, so
# records from every machine are listed.

# %%
records = nb.find_records("cuda")
if not records:
    nb.md(f"_No recorded cuda run for `{nb.model_path().name}` under `profiles/results/` yet: it is "
          f"recorded by `make report` on a machine with an NVIDIA GPU and PyCUDA (`make setup-cuda`)._")
    findings["recorded"] = "no cuda record for this model yet"
else:
    nb.show_table(["record", "machine", "TTFT (ms)", "decode (ms/token)", "tokens/s"],
                  [(f"`{nb.rel(p)}`", (r.get("machine") or {}).get("cpu", "?"), f"{r.get('ttft_ms', float('nan')):.1f}",
                    f"{r.get('decode_ms', float('nan')):.2f}", f"{r.get('tokens_per_s', float('nan')):.0f}")
                   for p, r in records])
    for p, r in records:
        rows = r.get("profile") or []
        if rows:
            table = [{**row, "op": row.get("op") or row.get("kernel", "?")} for row in rows]
            nb.print_profile(table, f"recorded kernel table ({nb.rel(p)})")
    best = min((r for _, r in records if r.get("decode_ms")), key=lambda r: r["decode_ms"], default=None)
    if best:
        where = (best.get("machine") or {}).get("cpu", "?")
        findings["recorded"] = f"decode {best['decode_ms']:.2f} ms/token on {where}"

# %% [markdown]
# ## Beside the article
#
# The article's GPU made decode 2.8 times faster than its CPU, and its time to first token
# slower. Both compare the cuda stage with the quantized stage on the same machine: live where
# this machine has a GPU, else from the records of a machine that had one (the rows say which).

# %%
rec = nb.recorded()
quantized_rec = rec.get("quantized")
cuda_live = live[0] if live else None
for rid, key in (("cuda_decode_speedup", "decode_ms"), ("cuda_ttft_slower", "ttft_ms")):
    value = quantized_rec[key] / cuda_live[key] if cuda_live and quantized_rec else None
    nb.article.beside(rid, value, "the live cuda run against the recorded quantized one" if value else
                      (missing or "no quantized record to compare with"))
findings["vs the article"] = (f"decode {quantized_rec['decode_ms'] / cuda_live['decode_ms']:.1f}x the quantized "
                              f"stage's" if cuda_live and quantized_rec else f"not measured here: {missing}")

# %%
nb.md(rec.note)
nb.stage_chart(live, rec, ["kv_cache", "quantized", "cuda"], "the CPU's best against the GPU")

# %% [markdown]
# ## The running total
#
# Every stage, from the records `make report` wrote, against this machine's floor (the dashed
# lines: decode can go no faster than reading every weight once, the prompt no faster than its
# multiply-adds at the core's peak). cuda is highlighted; beside each bar, how many times the
# floor it takes.

# %%
findings["running total"] = nb.journey("cuda")

# %%
findings.show()

# %% [markdown]
# ## Your turn
#
# **Write it yourself: the decode matvec of Q4_1 weights as a CUDA kernel, one warp per output
# row.** The starting file, [`exercises/06_cuda/matvec.cu`](../exercises/06_cuda/matvec.cu), holds
# the kernel's signature and a comment with how the check launches it (4 warps per thread block,
# one row each), the block's bytes, what to write and why, and the edges that catch a first
# attempt: a thread block with fewer rows than warps, a row of one block, rows of more blocks than
# a warp has lanes. Edit it, then check it:
#
# ```
# make exercise ch=06
# ```
#
# (or `.venv/bin/python -m exercises.check 06`, or as a test: `.venv/bin/python -m pytest
# exercises/test_yours.py -k 06`). No GPU is needed: the check builds your kernel with g++ around
# the repository's CPU emulator of CUDA ([`app/cuda_emulator/emulator.py`](../app/cuda_emulator/emulator.py)),
# whose threads are CUDA's (warps, shuffles, barriers, memory that starts as garbage), and runs it
# beside the stage's own kernel, `matmul_q4_1_m1` in
# [`stages/kernels/cuda.cu`](../stages/kernels/cuda.cu), on 7 seeded cases, holding yours to the
# stage's within the bound two float32 sums of the same products may differ by. Where your kernel
# races (two threads on the same bytes with no barrier between them), reads memory nothing wrote or
# reaches past an array, the emulator stops the launch and the check names the thread, its warp, its
# row and the array; a GPU would have run on and returned a wrong number, or the right one by luck.
# The first build of each version of your file takes a few seconds. `--solution reference` runs the
# check on the stage's own kernel. Every chapter's exercise:
# [`exercises/README.md`](../exercises/README.md).
#
# The emulator checks what a kernel computes, not how fast it runs: one CPU thread plays every GPU
# thread in turn. So this chapter has no "Try it", and the check times nothing here; on a machine
# with an NVIDIA GPU and PyCUDA (`make setup-cuda`), it times your kernel beside the stage's on the
# GPU, and beside the quantized stage's on one CPU core.
