"""The quantized stage: every kernel against `dequantize` + a float64 matmul, the weights left
in the mapped file, a tiny model of mixed types and the synthetic TinyLlama against the float64
reference, and a clear error for a type without a kernel.

(The default model against the reference, and greedy tokens identical with the other stages,
are checked for every stage, this one included, in tests/test_stages.py.)
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from common import quants as Q
from common import reference
from common.gguf import BLOCK_SIZES, GGMLType, GGUFFile, GGUFWriter, ValueType
from stages import load
from stages.kernels.dequant_dot import CPU_KERNEL_TYPES, MATVEC, matvec_rows
from stages.kernels.toolkit import F16_TO_F32
from stages.quantized import QuantizedBackend, QuantMatrix
from tests.util import lacks, not_x86_reason, tensor_from_raw

TYPES = list(CPU_KERNEL_TYPES)
ACTIVATION_ROWS = (1, 3, 5, 17)          # decode (1), prefill with 4x4 blocks and leftovers


def random_blocks(rng, ggml_type: GGMLType, n_rows: int, n_cols: int) -> np.ndarray:
    """[n_rows, bytes per row] of random blocks: every byte random except the float16 scale
    fields, which get finite values from 1e-3 to 10 (a NaN/inf scale is not a valid block)."""
    if ggml_type in Q.FLOAT_TYPES:
        return Q.quantize(rng.normal(0, 1, (n_rows, n_cols)).astype(np.float32), ggml_type)
    block, size = BLOCK_SIZES[ggml_type]
    n_blocks = n_rows * n_cols // block
    raw = rng.integers(0, 256, n_blocks * size, dtype=np.uint8)
    blocks = raw.view(Q.BLOCK_DTYPES[ggml_type])
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            scale = rng.choice([1e-3, 0.1, 1.0, 10.0], n_blocks)
            blocks[field] = (rng.normal(0, 1, n_blocks) * scale).astype(np.float16)
    return raw.reshape(n_rows, -1)


def n_cols_for(ggml_type: GGMLType) -> int:
    """A row length of a few blocks (3 legacy blocks, 2 super-blocks, 40 plain floats)."""
    return {1: 40, 32: 96, 256: 512}[BLOCK_SIZES[ggml_type][0]]


def check_product(y, x, w64):
    """y ~ x @ w^T, relative to the size of the terms summed (sum |x||w|)."""
    scale = np.abs(x).astype(np.float64) @ np.abs(w64).T
    assert y.shape == scale.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    err = np.abs(y - x.astype(np.float64) @ w64.T) / np.maximum(scale, 1e-30)
    assert err.max() < 2e-6, f"max relative error {err.max():.2e}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [7, 13])
def test_kernels_on_random_blocks(ggml_type, n_rows):
    """Both paths (decode: one activation row, the fused kernel; prefill: several rows, a
    dequantized panel) on random blocks, odd row counts, 1 and many activation rows."""
    rng = np.random.default_rng(100 * int(ggml_type) + n_rows)
    K = n_cols_for(ggml_type)
    raw = random_blocks(rng, ggml_type, n_rows, K)
    w = QuantizedBackend().prepare_matrix(tensor_from_raw(raw, ggml_type, (n_rows, K)))
    w64 = Q.dequantize(raw, ggml_type, (n_rows, K)).astype(np.float64)
    b = QuantizedBackend()
    for m in ACTIVATION_ROWS:
        x = rng.standard_normal((m, K)).astype(np.float32)
        check_product(b.matmul(x, w), x, w64)
    x = rng.standard_normal(K).astype(np.float32)          # the generic decode path too
    check_product(matvec_rows(x, w.data, w.kind, F16_TO_F32)[None], x[None], w64)


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t in Q.QUANTIZE_TYPES and t not in Q.FLOAT_TYPES],
                         ids=lambda t: t.name)
def test_kernels_on_quantized_weights(ggml_type):
    """Blocks made by the reference quantizer from weight-like values (realistic scales)."""
    rng = np.random.default_rng(7 + int(ggml_type))
    K = 2 * n_cols_for(ggml_type)
    raw = Q.quantize(rng.normal(0, 0.02, (11, K)).astype(np.float32), ggml_type)
    w = QuantizedBackend().prepare_matrix(tensor_from_raw(raw, ggml_type, (11, K)))
    w64 = Q.dequantize(raw, ggml_type, (11, K)).astype(np.float64)
    for m in (1, 6):
        x = rng.standard_normal((m, K)).astype(np.float32)
        check_product(QuantizedBackend().matmul(x, w), x, w64)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_embedding_lookup_decodes_the_rows_asked_for(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    K = n_cols_for(ggml_type)
    raw = random_blocks(rng, ggml_type, 9, K)
    table = QuantizedBackend().prepare_embedding(tensor_from_raw(raw, ggml_type, (9, K)))
    ids = np.array([8, 0, 3, 3])
    got = QuantizedBackend().embed(table, ids)
    want = Q.dequantize(raw[ids], ggml_type, (4, K))
    assert np.array_equal(got, want)                        # the same float32 operations, in order


def test_weights_stay_in_the_mapped_file(default_model_path):
    """No float32 copy of any matrix: every weight is a read-only view into the file's mapping,
    the tied output is the embedding itself, and the bytes reported are the mapped blocks."""
    engine = load("quantized", default_model_path)
    g = engine.gguf
    matrices = [engine.token_embd, engine.output]
    for layer in engine.layers:
        matrices += [layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down]
    for w in matrices:
        assert isinstance(w, QuantMatrix)
        assert np.shares_memory(w.data, g.tensors[w.name].data) and not w.data.flags.writeable
    assert engine.output is engine.token_embd                     # SmolLM2 ties them
    mapped = sum(t.nbytes for t in g.tensors.values())
    assert mapped - 1e6 < engine.weight_bytes() <= mapped          # norms: tiny float32 copies
    assert engine.weight_bytes() < g.file_size


@pytest.mark.skipif(not_x86_reason() is not None, reason=str(not_x86_reason()))
@pytest.mark.skipif(lacks("avx2", "fma") is not None, reason=str(lacks("avx2", "fma", then="no packed FMA to find")))
def test_decode_kernels_are_vectorized():
    """The fused Q4_K and Q4_1 decode kernels hold packed FMAs and int->float conversions on
    256/512-bit registers (what makes the unpacking cost a few instructions per 8 values)."""
    rng = np.random.default_rng(0)
    for t in (GGMLType.Q4_K, GGMLType.Q4_1):
        raw = random_blocks(rng, t, 3, n_cols_for(t))
        raw.flags.writeable = False
        x = np.ones(n_cols_for(t), np.float32)
        asm = fresh_asm(MATVEC[int(t)], x, raw, F16_TO_F32)
        assert len(re.findall(r"vfmadd\d+ps\s+.*%?[yz]mm", asm)) >= 2, f"no packed FMA in {t.name}'s kernel"
        assert re.search(r"vcvtdq2ps\s+.*%?[yz]mm", asm), f"no packed int->float in {t.name}'s kernel"


def fresh_asm(dispatcher, *args) -> str:
    """Assembly of the kernel compiled now with its own options (numba cannot show the
    assembly of a kernel it loaded from its on-disk cache)."""
    from numba import njit
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    fn = njit(**options)(dispatcher.py_func)
    fn(*args)
    return "\n".join(fn.inspect_asm().values())


# ---- whole models ---------------------------------------------------------------------------------

def write_tiny_llama(path, types: dict, seed: int = 0, vocab=None, n_ctx: int = 64):
    """A 2-layer llama with 256-wide embeddings whose matrices use the given ggml types
    (tensor role -> type), random weights; no tokenizer (the tests feed token ids), or
    `vocab`'s (a GGUFFile: its tokenizer and chat template, and so its vocabulary size); trained
    on `n_ctx` positions."""
    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head, n_head_kv, n_vocab, n_layer = 256, 512, 4, 2, 64, 2
    if vocab is not None:
        n_vocab = len(vocab.metadata["tokenizer.ggml.tokens"])
    kv = n_embd // n_head * n_head_kv
    w = GGUFWriter(path)
    U32, F32 = ValueType.UINT32, ValueType.FLOAT32
    w.add("general.architecture", "llama")
    for key, value in [("context_length", n_ctx), ("embedding_length", n_embd), ("block_count", n_layer),
                       ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head_kv), ("vocab_size", n_vocab)]:
        w.add(f"llama.{key}", value, U32)
    w.add("llama.attention.layer_norm_rms_epsilon", 1e-5, F32)
    for key, value in (vocab.metadata.items() if vocab is not None else ()):
        if key.startswith("tokenizer."):
            w.add(key, value, vocab.metadata_types[key], vocab.array_types.get(key))

    def matrix(name, role, shape, std):
        t = types.get(role, GGMLType.Q8_0)
        if t in Q.QUANTIZE_TYPES:
            raw = Q.quantize(rng.normal(0, std, shape).astype(np.float32), t)
        else:                                      # Q5_x: random blocks, scales of weight size
            raw = random_blocks(rng, t, *shape)
            blocks = raw.reshape(-1).view(Q.BLOCK_DTYPES[t])
            for field in ("d", "dmin", "m"):
                if field in blocks.dtype.names:
                    blocks[field] = (rng.uniform(0.5, 1.5, len(blocks)) * std / 8).astype(np.float16)
        w.add_tensor(name, raw, t, shape=shape)

    matrix("token_embd.weight", "token_embd", (n_vocab, n_embd), 1.0)
    w.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, n_embd)).astype(np.float32))
    matrix("output.weight", "output", (n_vocab, n_embd), 0.1)
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", (1 + rng.normal(0, 0.1, n_embd)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + rng.normal(0, 0.1, n_embd)).astype(np.float32))
        for role, shape in [("attn_q", (n_embd, n_embd)), ("attn_k", (kv, n_embd)), ("attn_v", (kv, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))]:
            matrix(p + role + ".weight", role, shape, 0.06)
    w.write()
    return path


MIXED_TYPES = {"token_embd": GGMLType.F16, "output": GGMLType.BF16, "attn_q": GGMLType.Q5_0,
               "attn_k": GGMLType.Q5_1, "attn_v": GGMLType.Q8_0, "attn_output": GGMLType.Q4_0,
               "ffn_gate": GGMLType.Q5_K, "ffn_up": GGMLType.Q4_K, "ffn_down": GGMLType.Q6_K}


def stage_logits(engine, tokens, split):
    """Prefill tokens[:split], then one token at a time (both kernel paths, the KV cache)."""
    engine.reset()
    rows = [engine.forward(tokens[:split], 0)]
    rows += [engine.forward(tokens[i:i + 1], i) for i in range(split, len(tokens))]
    engine.reset()
    return np.concatenate(rows)


def test_tiny_model_of_mixed_types_matches_the_reference(tmp_path):
    """Nine weight types in one model, prefill + decode, against the float64 reference; and
    the same greedy choices as the kv_cache stage (which runs on float32 copies)."""
    path = write_tiny_llama(tmp_path / "tiny-mixed.gguf", MIXED_TYPES)
    tokens = [3, 17, 42, 5, 63, 0, 8, 21, 9, 30]
    want = reference.forward(GGUFFile(path), tokens)
    got = stage_logits(load("quantized", path), tokens, split=6)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err < 1e-3 * max(1.0, np.abs(want).max()), f"max |logit - reference| = {err:.2e}"
    eager = stage_logits(load("kv_cache", path), tokens, split=6)
    assert (got.argmax(axis=1) == eager.argmax(axis=1)).all()


def test_type_without_kernel_fails_at_load_naming_tensor_and_type(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny-q3k.gguf", {"ffn_up": GGMLType.Q4_K})
    # rewrite one matrix as Q3_K: a real ggml type with no kernel in this stage
    g = GGUFFile(path)
    w = GGUFWriter(tmp_path / "tiny-with-q3k.gguf")
    for key, value in g.metadata.items():
        w.add(key, value, g.metadata_types[key], g.array_types.get(key))
    for name, t in g.tensors.items():
        if name == "blk.1.ffn_up.weight":
            raw = random_blocks(np.random.default_rng(0), GGMLType.Q3_K, *t.shape)
            w.add_tensor(name, raw, GGMLType.Q3_K, shape=t.shape)
        else:
            w.add_tensor(name, np.array(t.data), t.ggml_type, shape=t.shape)
    w.write()
    with pytest.raises(Q.UnsupportedTypeError, match=r"blk\.1\.ffn_up\.weight.*Q3_K"):
        load("quantized", tmp_path / "tiny-with-q3k.gguf")
    with pytest.raises(ValueError, match="IQ4_NL"):                  # and through the backend directly
        QuantizedBackend().prepare_matrix(tensor_from_raw(np.zeros(2 * 18, np.uint8), GGMLType.IQ4_NL, (2, 32)))
