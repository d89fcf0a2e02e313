"""A SYNTHETIC stand-in for TinyLlama 1.1B Chat v1.0 Q4_K_M: the article's model, minus its weights.

Where the real file cannot be downloaded, this one has everything a benchmark can see: the same
metadata, the same 201 tensors with the same shapes, the same mix of ggml types that llama.cpp's
Q4_K_M recipe gives TinyLlama, the same file size (~636 MiB), and the real Llama SentencePiece
vocabulary. Only the weights are random, so it is NOT a language model: it runs at TinyLlama's
speed and prints nonsense. general.name says so.

How it is made quickly: quantizing 1.1 billion random values with the reference K-quant quantizer
(common.quants) would take tens of minutes in numpy. Instead a pool of a few thousand blocks of
each type is quantized once from N(0, 0.02) values, and every tensor is filled with blocks drawn
from that pool by a seeded RNG. Each block is a genuine Q4_K / Q6_K block of N(0, 0.02) values,
so per-block statistics (scales, mins, code histograms) are realistic; rows share blocks, which
a benchmark cannot see. Same seed, same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType, type_nbytes
from common.model import LlamaConfig
from common.quants import quantize

SEED = 20231231          # the date TinyLlama-1.1B-Chat-v1.0 was released
WEIGHT_STD = 0.02        # the usual init scale of llama-family linear layers
NORM_STD = 0.02          # RMSNorm weights: 1 + N(0, NORM_STD)
POOL_BLOCKS = 4096       # distinct quantized blocks per type

NAME = "TinyLlama-1.1B-Chat geometry (SYNTHETIC random weights)"

# TinyLlama's chat template (Zephyr style), as in the tokenizer config of TinyLlama-1.1B-Chat-v1.0.
CHAT_TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}\n"
)


# TinyLlama 1.1B's geometry in the engine's own terms: what LlamaConfig.from_gguf reads from its file.
TINYLLAMA = LlamaConfig(n_layer=22, n_embd=2048, n_ff=5632, n_head=32, n_head_kv=4, head_dim=64, n_rot=64,
                        rope_base=10000.0, rope_freq_scale=1.0, eps=1e-5, n_ctx_train=2048, n_vocab=32000)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down get Q6_K
    in a Q4_K_M file: the first and last eighth of the layers, and every third one between.
    For 22 layers: 0, 1, 4, 7, 10, 13, 16, 19, 20, 21."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensor_plan(g: LlamaConfig = TINYLLAMA) -> list[tuple[str, tuple, GGMLType]]:
    """(name, numpy shape, ggml type) of every tensor, in file order, as Q4_K_M lays them out:
    F32 norms, Q6_K output.weight, Q6_K attn_v / ffn_down where use_more_bits, Q4_K the rest."""
    kv = g.kv_dim
    plan = [("token_embd.weight", (g.n_vocab, g.n_embd), GGMLType.Q4_K)]
    for i in range(g.n_layer):
        more = GGMLType.Q6_K if use_more_bits(i, g.n_layer) else GGMLType.Q4_K
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (g.n_embd,), GGMLType.F32),
            (p + "attn_q.weight", (g.n_embd, g.n_embd), GGMLType.Q4_K),
            (p + "attn_k.weight", (kv, g.n_embd), GGMLType.Q4_K),
            (p + "attn_v.weight", (kv, g.n_embd), more),
            (p + "attn_output.weight", (g.n_embd, g.n_embd), GGMLType.Q4_K),
            (p + "ffn_norm.weight", (g.n_embd,), GGMLType.F32),
            (p + "ffn_gate.weight", (g.n_ff, g.n_embd), GGMLType.Q4_K),
            (p + "ffn_up.weight", (g.n_ff, g.n_embd), GGMLType.Q4_K),
            (p + "ffn_down.weight", (g.n_embd, g.n_ff), more),
        ]
    plan += [("output_norm.weight", (g.n_embd,), GGMLType.F32),
             ("output.weight", (g.n_vocab, g.n_embd), GGMLType.Q6_K)]
    return plan


def _block_pool(ggml_type: GGMLType, seed: int) -> np.ndarray:
    """POOL_BLOCKS quantized blocks of N(0, WEIGHT_STD) values: [POOL_BLOCKS, bytes per block]."""
    rng = np.random.default_rng([seed, int(ggml_type)])
    values = rng.normal(0.0, WEIGHT_STD, (POOL_BLOCKS, 256)).astype(np.float32)
    return quantize(values, ggml_type)


def _tensor_bytes(index: int, shape: tuple, ggml_type: GGMLType, pools: dict, seed: int):
    """A callable producing tensor number `index`'s raw bytes (its own RNG stream, so the
    bytes do not depend on the order tensors are generated in)."""
    def make():
        rng = np.random.default_rng([seed, 1000 + index])
        if ggml_type == GGMLType.F32:                       # a norm weight
            return (1.0 + rng.normal(0.0, NORM_STD, shape)).astype(np.float32)
        pool = pools[ggml_type]
        n_blocks = type_nbytes(ggml_type, shape) // pool.shape[1]
        return pool[rng.integers(0, len(pool), n_blocks)]
    return make


def _metadata(w: GGUFWriter, vocab: GGUFFile, g: LlamaConfig):
    """TinyLlama 1.1B Chat v1.0 Q4_K_M's keys, in its order; the tokenizer from `vocab`."""
    U32, F32 = ValueType.UINT32, ValueType.FLOAT32
    w.add("general.architecture", "llama")
    w.add("general.name", NAME)
    w.add("general.description", "SYNTHETIC: TinyLlama 1.1B Chat v1.0 shapes, metadata and Q4_K_M "
          "type mix with random weights (for benchmarking; it is not a language model)")
    w.add("llama.context_length", g.n_ctx_train, U32)
    w.add("llama.embedding_length", g.n_embd, U32)
    w.add("llama.block_count", g.n_layer, U32)
    w.add("llama.feed_forward_length", g.n_ff, U32)
    w.add("llama.rope.dimension_count", g.n_rot, U32)
    w.add("llama.attention.head_count", g.n_head, U32)
    w.add("llama.attention.head_count_kv", g.n_head_kv, U32)
    w.add("llama.attention.layer_norm_rms_epsilon", g.eps, F32)
    w.add("llama.rope.freq_base", g.rope_base, F32)
    w.add("general.file_type", 15, U32)                     # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for key, value in vocab.metadata.items():
        if key.startswith("tokenizer."):
            w.add(key, value, vocab.metadata_types[key], vocab.array_types.get(key))
    if "tokenizer.ggml.padding_token_id" not in w.kv:
        w.add("tokenizer.ggml.padding_token_id", 2, U32)    # TinyLlama pads with </s>
    if "tokenizer.chat_template" not in w.kv:
        w.add("tokenizer.chat_template", CHAT_TEMPLATE)
    w.add("general.quantization_version", 2, U32)


def write_tinyllama_synthetic(path, llama_spm_vocab_path, seed: int = SEED, progress: bool = True) -> Path:
    """Write the synthetic TinyLlama GGUF to `path` (through path.part); returns the path.

    llama_spm_vocab_path: llama.cpp's models/ggml-vocab-llama-spm.gguf (the Llama 2
    SentencePiece vocabulary, which TinyLlama uses unchanged).
    """
    path = Path(path)
    g = TINYLLAMA
    with GGUFFile(llama_spm_vocab_path) as vocab:
        n_tokens = len(vocab.metadata.get("tokenizer.ggml.tokens", []))
        if vocab.metadata.get("tokenizer.ggml.model") != "llama" or n_tokens != g.n_vocab:
            raise ValueError(f"{llama_spm_vocab_path}: expected the 32000-token 'llama' (SentencePiece) "
                             f"vocabulary, found {vocab.metadata.get('tokenizer.ggml.model')!r} with {n_tokens} tokens")
        w = GGUFWriter(path)
        _metadata(w, vocab, g)

    plan = tensor_plan(g)
    pools = {t: _block_pool(t, seed) for t in (GGMLType.Q4_K, GGMLType.Q6_K)}
    for i, (name, shape, ggml_type) in enumerate(plan):
        w.add_tensor(name, _tensor_bytes(i, shape, ggml_type, pools, seed), ggml_type, shape=shape)

    total = sum(type_nbytes(t, s) for _, s, t in plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name,
              file=sys.stderr, dynamic_ncols=True, mininterval=0.5, disable=not progress) as bar:
        w.write(progress=bar.update)
    return path
