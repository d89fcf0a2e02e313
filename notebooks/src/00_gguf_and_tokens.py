# Source of notebooks/00_gguf_and_tokens.ipynb (build with: python notebooks/build.py).

# %% [markdown]
# # 00 · GGUF and tokens: what is in the file
#
# Before any arithmetic, an inference engine has to read two things from the model file: the
# **weights** (a few hundred tensors, most of them stored as small integers in blocks with a
# shared scale) and the **tokenizer** (the vocabulary and merge rules that turn text into ids).
# A GGUF file carries both, back to back:
#
# | part | what it holds |
# |---|---|
# | header | the magic `GGUF`, a version, the number of tensors and of metadata entries |
# | metadata | key → value pairs: the model's shape (`llama.block_count`, ...), the tokenizer, the chat template |
# | tensor table | per tensor: name, shape, ggml type, offset into the data section |
# | data | the tensors' bytes, each aligned, in the ggml block formats |
#
# This chapter walks those parts with the project's reader (`common/gguf.py`), shows why opening a
# model costs almost nothing (the file is *mapped*, not read), decodes two quantized blocks by
# hand, and tokenizes a sentence.

# %%
import struct

import numpy as np

from app.inspect_gguf import summary
from common.gguf import BLOCK_SIZES, GGMLType, GGUFFile

findings = nb.Findings()
path = nb.model_path()
g = GGUFFile(path)
g

# %% [markdown]
# ## The header, by hand and by the reader
#
# The first 24 bytes are the header: 4 bytes of magic, a `u32` version, and two `u64` counts,
# all little-endian. Reading them with `struct` gives the same numbers as the parser.

# %%
with open(path, "rb") as f:
    head = f.read(24)
magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
print("bytes 0..23:", head.hex(" "))
print(f"by hand:    magic={magic!r} version={version} tensors={n_tensors} metadata entries={n_kv}")
print(f"the reader: version={g.version} tensors={len(g.tensors)} metadata entries={len(g.metadata)}")
assert (version, n_tensors, n_kv) == (g.version, len(g.tensors), len(g.metadata))
findings["header"] = f"GGUF v{g.version}, {len(g.tensors)} tensors, {len(g.metadata)} metadata entries"

# %% [markdown]
# ## Metadata
#
# `python -m app inspect MODEL` prints the same summary; here it is as a table (long arrays,
# such as the 49k-entry vocabulary, abbreviated).

# %%
s = summary(g)
nb.show_table(["key", "type", "value"],
              [(k, v["type"], str(v["value"])[:110]) for k, v in s["metadata"].items()])

# %% [markdown]
# ## The tensor table
#
# Each entry says where a tensor's bytes start in the data section and how to read them. Shapes
# are in numpy order: a weight `[out, in]` has `out` rows of `in` values, and quantization blocks
# always run along a row.

# %%
rows = s["tensors"]
nb.show_table(["name", "shape", "type", "offset", "bytes"],
              [(t["name"], tuple(t["shape"]), t["type"], f"{t['offset']:,}", nb.human_bytes(t["bytes"]))
               for t in rows[:12]])
print(f"... and {len(rows) - 12} more; data section starts at byte {g.data_offset:,} "
      f"(alignment {g.alignment})")

# %%
# How the file's bytes split by ggml type, and what each type costs per weight.
nb.show_table(["type", "tensors", "bytes", "share of file", "block", "bits per weight"],
              [(k, v["tensors"], nb.human_bytes(v["bytes"]), f"{v['bytes'] / g.file_size:.1%}",
                f"{BLOCK_SIZES[GGMLType[k]][0]} values in {BLOCK_SIZES[GGMLType[k]][1]} bytes",
                f"{8 * BLOCK_SIZES[GGMLType[k]][1] / BLOCK_SIZES[GGMLType[k]][0]:.2f}")
               for k, v in s["type_mix"].items()])
findings["parameters"] = f"{s['parameters'] / 1e6:.1f} M in a {nb.human_bytes(g.file_size)} file " \
                         f"({8 * g.file_size / s['parameters']:.2f} bits per weight on average)"

# %% [markdown]
# ## Beside the article: what float32 would cost
#
# The article's model, TinyLlama 1.1B in Q4_K_M, is a file of about 700 MB that its engine turned
# into float32 at load, 2.8 GB by its account. Its own arithmetic does not add up: 1.1 billion
# weights at 4 bytes each are 4.4 GB. The same arithmetic for this file, before loading anything
# (chapter 01 measures what a stage really holds):

# %%
float32_bytes = 4 * s["parameters"]
print(f"{s['parameters']:,} weights x 4 bytes = {nb.human_bytes(float32_bytes)} as float32, "
      f"{float32_bytes / g.file_size:.1f}x the {nb.human_bytes(g.file_size)} file")
nb.article.beside("ram_balloon", float32_bytes / g.file_size, "parameters x 4 bytes / file size (arithmetic)")
findings["float32 would be"] = (f"{nb.human_bytes(float32_bytes)}, {float32_bytes / g.file_size:.1f}x the file "
                                f"(the article's 2.8 GB from 700 MB is 4x; its 1.1 B weights x 4 bytes are 4.4 GB)")

# %% [markdown]
# ## Opening is free: the file is mapped, not read
#
# The reader maps the whole file into memory (`mmap`) and hands every tensor out as a view of
# those bytes. Nothing is read until a byte is touched; the first touch of a page makes the CPU
# raise a *page fault*, and the kernel maps the page (from its page cache when the file was read
# recently: a *minor* fault; from disk: a *major* one). So we can watch the cost move: count the
# faults when the file is opened, then when one tensor's bytes are summed.

# %%
before = nb.memory_now()
g2 = GGUFFile(path)                                   # a fresh mapping: none of its pages touched yet
opened = nb.memory_now()
big = max(g2.tensors.values(), key=lambda t: t.nbytes)
total = int(big.data.sum(dtype=np.uint64))            # read every byte of the largest tensor
touched = nb.memory_now()

nb.show_table(["step", "page faults", "resident memory grew by"],
              [("open: parse header, metadata (the vocabulary becomes Python strings), tensor table",
                f"{nb.faults_between(before, opened):,}", f"{opened['rss_mb'] - before['rss_mb']:.1f} MiB"),
               (f"read every byte of {big.name} ({nb.human_bytes(big.nbytes)})",
                f"{nb.faults_between(opened, touched):,}", f"{touched['rss_mb'] - opened['rss_mb']:.1f} MiB")])
pages = big.nbytes / 4096
print(f"{pages:,.0f} pages of 4 KiB were read for {nb.faults_between(opened, touched):,} faults: "
      f"{big.nbytes / max(nb.faults_between(opened, touched), 1) / 1024:.0f} KiB mapped per fault")
findings["mmap"] = (f"opening cost {nb.faults_between(before, opened):,} page faults (building the metadata); "
                    f"reading all of {big.name} ({nb.human_bytes(big.nbytes)}) cost "
                    f"{nb.faults_between(opened, touched):,}")

# %% [markdown]
# The faults at open are the parser's own allocations (tens of thousands of vocabulary strings),
# not the weights. If reading the tensor took far fewer faults than pages, that is the kernel's
# *fault-around*: on a fault in a file mapping, Linux maps the neighbouring pages that are already
# in its page cache too (64 KiB by default). Either way, the cost of a tensor is paid when it is
# first used, not when the file is opened, and pages the engine never touches never cost memory.
# The eager stages throw this away by converting every weight to float32 at load (chapter 01);
# the quantized stage keeps it (chapter 05).

# %% [markdown]
# ## A Q4_1 block, decoded by hand
#
# Q4_1 stores 32 weights in 20 bytes: a float16 scale `d`, a float16 minimum `m`, then 16 bytes
# of 4-bit codes `q`. Each weight is `d * q + m`. Byte `j` of the codes holds weight `j` in its
# low nibble and weight `j + 16` in its high nibble (halves, not neighbours: a SIMD kernel unpacks
# 16 weights with one AND and 16 with one shift).

# %%
from common.quants import BLOCK_DTYPES, dequantize, k4_scale_min, quantize

t = next((t for t in g.tensors.values() if t.ggml_type == GGMLType.Q4_1), None)
if t is not None:
    raw, where = t.data[:20], f"`{t.name}`"            # the first block of the tensor
else:                                                  # a model without Q4_1 weights: make a block
    raw = quantize(np.random.default_rng(0).normal(0, 0.02, 32).astype(np.float32), GGMLType.Q4_1)
    where = "a random row quantized by common.quants.quantize (this model has no Q4_1 tensor)"
print(f"{where}, first block: {raw.tobytes().hex(' ')}")
d = np.frombuffer(raw[0:2].tobytes(), "<f2")[0]
m = np.frombuffer(raw[2:4].tobytes(), "<f2")[0]
qs = raw[4:20]
q = np.concatenate([qs & 0x0F, qs >> 4])               # weights 0..15, then 16..31
by_hand = np.float32(d) * q.astype(np.float32) + np.float32(m)
print(f"d = {d}, m = {m}")
print("codes q:", q.tolist())
reference = dequantize(raw, GGMLType.Q4_1, (32,))
print("by hand:", np.round(by_hand[:8], 5), "...")
print("equal to common.quants.dequantize:", np.array_equal(by_hand, reference))
assert np.array_equal(by_hand, reference)
# The same fields, named: the structured dtype common/quants.py reads every block with.
print("BLOCK_DTYPES view:", np.frombuffer(raw.tobytes(), BLOCK_DTYPES[GGMLType.Q4_1])[0])
findings["Q4_1 block"] = f"decoded by hand from its 20 bytes ({where}); identical to `dequantize` " \
                         f"({8 * 20 / 32:.0f} bits per weight)"

# %% [markdown]
# ## A Q4_K block, decoded by hand
#
# The K-quants (TinyLlama Q4_K_M, the article's model, is mostly Q4_K) group 256 weights in a
# *super-block* of 144 bytes: float16 `d` and `dmin`, 12 bytes holding eight 6-bit scales and
# eight 6-bit minimums, then 128 bytes of 4-bit codes. Weight `i` of sub-block `s` (32 weights
# each) is `d * sc[s] * q - dmin * m[s]`. The small integer scales cost 12 bytes per 256 weights
# instead of a float16 pair per 32: 4.5 bits per weight instead of Q4_1's 5.
#
# We take a block from the synthetic TinyLlama file if it is on disk
# (`make model name=tinyllama-synthetic`), else quantize a random row ourselves.

# %%
from app.models import TINYLLAMA_SYNTHETIC

if TINYLLAMA_SYNTHETIC.path.exists():
    tg = GGUFFile(TINYLLAMA_SYNTHETIC.path)
    tk = next(t for t in tg.tensors.values() if t.ggml_type == GGMLType.Q4_K)
    raw_k, where = tk.data[:144], f"`{tk.name}` in {TINYLLAMA_SYNTHETIC.filename} (synthetic weights)"
else:
    row = np.random.default_rng(0).normal(0, 0.02, 256).astype(np.float32)
    raw_k, where = quantize(row, GGMLType.Q4_K), "a random row quantized by common.quants.quantize"
print(f"the first Q4_K block of {where}")

dk = np.float32(np.frombuffer(raw_k[0:2].tobytes(), "<f2")[0])
dmin = np.float32(np.frombuffer(raw_k[2:4].tobytes(), "<f2")[0])
sb = raw_k[4:16].astype(np.uint8)                      # the 12 scale bytes
# bytes 0-3: scales 0-3 (low 6 bits); bytes 4-7: mins 0-3; bytes 8-11: low nibbles of scales 4-7,
# high nibbles of mins 4-7, whose top 2 bits sit in the top 2 bits of bytes 0-3 / 4-7.
sc = [sb[s] & 63 for s in range(4)] + [(sb[8 + s] & 15) | ((sb[s] >> 6) << 4) for s in range(4)]
mn = [sb[4 + s] & 63 for s in range(4)] + [(sb[8 + s] >> 4) | ((sb[4 + s] >> 6) << 4) for s in range(4)]
codes = raw_k[16:144]
vals = np.empty(256, np.float32)
for c in range(4):                                     # 4 chunks of 32 bytes = 64 weights each
    chunk = codes[32 * c:32 * c + 32]
    for half, qq in ((0, chunk & 15), (1, chunk >> 4)):    # low nibbles: sub-block 2c, high: 2c+1
        s = 2 * c + half
        vals[32 * s:32 * s + 32] = (dk * np.float32(sc[s])) * qq.astype(np.float32) - dmin * np.float32(mn[s])
print("d =", dk, " dmin =", dmin)
print("scales:", [int(x) for x in sc], " mins:", [int(x) for x in mn])
ref_sc, ref_m = k4_scale_min(sb)
assert ref_sc.tolist() == [int(x) for x in sc] and ref_m.tolist() == [int(x) for x in mn]
reference_k = dequantize(raw_k, GGMLType.Q4_K, (256,))
print("equal to common.quants.dequantize:", np.array_equal(vals, reference_k))
assert np.array_equal(vals, reference_k)
findings["Q4_K block"] = f"decoded by hand from its 144 bytes ({where}); identical to `dequantize` " \
                         f"({8 * 144 / 256:.1f} bits per weight)"

# %% [markdown]
# ## Tokens
#
# The model never sees text, only ids. The tokenizer (`common/tokenizer/tokenizer.py`) is rebuilt from the
# metadata alone (`tokenizer.ggml.*`): SmolLM2 uses byte-level BPE, where a word's UTF-8 bytes
# are spelled in a printable alphabet (`Ġ` is a space) and merged pair by pair, most frequent
# pair first. Common words become one token; rare ones split into pieces.

# %%
from common.tokenizer import Tokenizer

tok = Tokenizer.from_gguf(g)
sentence = "The quick brown fox tokenizes naïvely: 1234 ÷ 7!"
ids = tok.encode(sentence)
nb.show_table(["#", "id", "piece (vocabulary spelling)", "bytes"],
              [(i, t_id, f"`{tok.token_text(t_id)}`", tok.token_piece(t_id)) for i, t_id in enumerate(ids)])
print(tok)
print(f"{len(sentence)} characters -> {len(ids)} tokens; decode(encode(text)) == text:",
      tok.decode(ids) == sentence)
kind = "byte-level BPE" if tok.model == "gpt2" else "SentencePiece"
findings["tokenizer"] = f"'{tok.model}' ({kind}): {len(sentence)} characters " \
                        f"-> {len(ids)} tokens, round trip exact: {tok.decode(ids) == sentence}"

# %% [markdown]
# A chat model expects its own template around the user's words; it is part of the metadata too
# (`tokenizer.chat_template`, a Jinja template):

# %%
chat = tok.apply_chat_template([{"role": "user", "content": "What is a token?"}])
print(chat)
print(f"-> {len(tok.encode(chat, parse_special=True))} tokens (the markers are single special tokens)")

# %%
findings.show()
