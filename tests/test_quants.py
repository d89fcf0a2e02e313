"""common.quants against the oracles: gguf-py (dequantize, legacy quantize) and ggml's reference
quantizers through llama-cpp-python's shared library (Q4_K, Q6_K); plus the synthetic TinyLlama."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common import quants as Q
from common.gguf import BLOCK_SIZES, GGMLType, GGUFError, GGUFFile, type_nbytes
from scripts.goldens.ggml_ref import GGMLUnavailable, ggml_quantizer
from scripts.goldens.make_kquant_golden import GOLDEN_K, K_TYPES, k_quant_cases, sha256_rows, tricky_rows

gguf = pytest.importorskip("gguf", reason="gguf-py (requirements-test.txt) is the dequantization oracle")
from gguf import quants as gguf_quants  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("LLM_MODELS_DIR", ROOT / "models"))
DEFAULT_MODEL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SPM_VOCAB = MODELS / "vocab" / "ggml-vocab-llama-spm.gguf"

LEGACY_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1)


def gguf_dequantize(raw, ggml_type, shape):
    rows = np.ascontiguousarray(raw).reshape(-1, type_nbytes(ggml_type, (shape[-1],)))
    return gguf_quants.dequantize(rows, gguf.GGMLQuantizationType(int(ggml_type))).reshape(shape)


def gguf_quantize(x, ggml_type):
    out = gguf_quants.quantize(x, gguf.GGMLQuantizationType(int(ggml_type)))
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[:-1] + (-1,))


def test_block_dtypes_match_ggml_block_sizes():
    for t, dt in Q.BLOCK_DTYPES.items():
        assert dt.itemsize == BLOCK_SIZES[t][1], t.name


# ---- dequantize --------------------------------------------------------------------------------

@pytest.mark.needs("model")
def test_dequantize_default_model_bit_exact_with_gguf_py():
    with GGUFFile(DEFAULT_MODEL) as f:
        types = Counter(t.ggml_type for t in f.tensors.values())
        assert {GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32} <= set(types)
        mismatched = []
        for t in f.tensors.values():
            ours = Q.dequantize_tensor(t)
            assert ours.dtype == np.float32 and ours.shape == t.shape, t.name
            if not np.array_equal(ours, gguf_dequantize(t.data, t.ggml_type, t.shape)):
                mismatched.append(f"{t.name} ({t.ggml_type.name})")
        assert not mismatched, f"differ from gguf-py: {mismatched}"


@pytest.mark.needs("model")
def test_dequantize_rows_equals_rows_of_the_whole_tensor():
    with GGUFFile(DEFAULT_MODEL) as f:
        emb = f.tensors["token_embd.weight"]
        whole = Q.dequantize_tensor(emb)
        ids = np.array([0, 1, 17, 4242, emb.shape[0] - 1, 17])
        assert np.array_equal(Q.dequantize_rows(emb, ids), whole[ids])
        assert np.array_equal(Q.dequantize_rows(emb, 4242), whole[4242])
        assert np.array_equal(Q.dequantize_rows(emb, [[1, 2], [3, 4]]), whole[[[1, 2], [3, 4]]])
        with pytest.raises(IndexError):
            Q.dequantize_rows(emb, [emb.shape[0]])


def random_blocks(rng, ggml_type: GGMLType, n_blocks: int) -> np.ndarray:
    """Random bytes, except that the float16 scale fields get finite values (a NaN/inf scale is
    not a valid block and would make every comparison meaningless)."""
    if ggml_type in Q.FLOAT_TYPES:
        values = rng.normal(0, 1, n_blocks).astype(np.float32)
        return Q.quantize(values, ggml_type)
    raw = rng.integers(0, 256, n_blocks * BLOCK_SIZES[ggml_type][1], dtype=np.uint8)
    blocks = raw.view(Q.BLOCK_DTYPES[ggml_type])
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            scale = rng.choice([1e-6, 1e-3, 1.0, 100.0], n_blocks)   # subnormal to large f16
            blocks[field] = (rng.normal(0, 1, n_blocks) * scale).astype(np.float16)
    return raw


@pytest.mark.parametrize("ggml_type", Q.DEQUANTIZE_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_bit_exact_with_gguf_py(ggml_type):
    rng = np.random.default_rng(1000 + int(ggml_type))
    block = BLOCK_SIZES[ggml_type][0]
    n_blocks = 4096 if block > 1 else 3 * 4096
    raw = random_blocks(rng, ggml_type, n_blocks)
    shape = (3, n_blocks * block // 3) if block == 1 else (4, n_blocks // 4 * block)
    ours = Q.dequantize(raw.reshape(shape[0], -1), ggml_type, shape)   # raw given as rows
    theirs = gguf_dequantize(raw, ggml_type, shape)
    assert ours.shape == shape and ours.dtype == np.float32
    assert np.isfinite(ours).all()
    assert np.array_equal(ours, theirs)


def test_block_fields_decode_by_hand_as_documented():
    """The layout comments in quants.py, followed literally one value at a time, give what
    dequantize gives: a notebook reader can trust them."""
    rng = np.random.default_rng(7)
    # Q4_K: y = d*sc*q - dmin*m, value 64c + 32h + l from nibble h of qs[32c + l]
    raw = random_blocks(rng, GGMLType.Q4_K, 1)
    b = raw.view(Q.BLOCK_DTYPES[GGMLType.Q4_K])[0]
    sc, m = Q.k4_scale_min(b["scales"])
    d, dmin = np.float32(b["d"]), np.float32(b["dmin"])
    by_hand = [d * np.float32(sc[e // 32])
               * np.float32((b["qs"][32 * (e // 64) + e % 32] >> (4 * ((e // 32) % 2))) & 15)
               - dmin * np.float32(m[e // 32]) for e in range(256)]
    assert np.array_equal(np.array(by_hand, np.float32), Q.dequantize(raw, GGMLType.Q4_K, (256,)))
    # Q6_K: value 128n + 32k + l: low nibble from ql (k=0: ql[l] lo, 1: ql[l+32] lo, 2: ql[l] hi,
    # 3: ql[l+32] hi, in the half's 64 bytes), two high bits 2k.. of qh[32n + l]
    raw = random_blocks(rng, GGMLType.Q6_K, 1)
    b = raw.view(Q.BLOCK_DTYPES[GGMLType.Q6_K])[0]
    by_hand = []
    for e in range(256):
        n, k, l = e // 128, (e % 128) // 32, e % 32
        low = (b["ql"][64 * n + l + 32 * (k % 2)] >> (4 * (k // 2))) & 15
        high = (b["qh"][32 * n + l] >> (2 * k)) & 3
        q = int(low) | (int(high) << 4)
        by_hand.append(np.float32(b["d"]) * np.float32(b["scales"][e // 16]) * np.float32(q - 32))
    assert np.array_equal(np.array(by_hand, np.float32), Q.dequantize(raw, GGMLType.Q6_K, (256,)))
    # Q4_0: value j from the low nibble of qs[j], value j + 16 from its high nibble
    raw = random_blocks(rng, GGMLType.Q4_0, 1)
    b = raw.view(Q.BLOCK_DTYPES[GGMLType.Q4_0])[0]
    by_hand = [np.float32(b["d"]) * np.float32(((b["qs"][j % 16] >> (4 * (j // 16))) & 15) - 8.0)
               for j in range(32)]
    assert np.array_equal(np.array(by_hand, np.float32), Q.dequantize(raw, GGMLType.Q4_0, (32,)))


# ---- quantize: legacy formats and floats against gguf-py -----------------------------------------

@pytest.mark.parametrize("ggml_type", LEGACY_TYPES + Q.FLOAT_TYPES, ids=lambda t: t.name)
def test_quantize_byte_exact_with_gguf_py(ggml_type):
    rng = np.random.default_rng(2000 + int(ggml_type))
    x = np.concatenate([tricky_rows(rng, 512),
                        rng.normal(0, 0.02, (64, 512)).astype(np.float32),
                        np.full((1, 512), -0.0, np.float32)])
    ours = Q.quantize(x, ggml_type)
    assert ours.dtype == np.uint8 and ours.shape == (len(x), type_nbytes(ggml_type, (512,)))
    assert np.array_equal(ours, gguf_quantize(x, ggml_type))


def test_quantize_accepts_any_leading_shape():
    x = np.random.default_rng(3).normal(0, 1, (2, 3, 256)).astype(np.float32)
    for t in LEGACY_TYPES + K_TYPES:
        raw = Q.quantize(x, t)
        assert raw.shape == (2, 3, type_nbytes(t, (256,)))
        assert np.array_equal(raw.reshape(6, -1), Q.quantize(x.reshape(6, 256), t))


# ---- quantize: K-quants against ggml's reference quantizers ---------------------------------------

@pytest.fixture(scope="module")
def ggml_quantize_chunk():
    """ggml's own quantizer (from llama-cpp-python's ggml library); see scripts/goldens/ggml_ref.py."""
    try:
        return ggml_quantizer()
    except GGMLUnavailable as e:
        pytest.skip(str(e))


def mismatched_rows(ours, theirs):
    return np.nonzero((ours != theirs).any(axis=1))[0].tolist()


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_k_quantize_byte_exact_with_ggml_reference(ggml_type, ggml_quantize_chunk):
    for what, x in k_quant_cases(ggml_type).items():
        bad = mismatched_rows(Q.quantize(x, ggml_type), ggml_quantize_chunk(x, ggml_type))
        assert not bad, f"{what}: rows {bad} differ from ggml's quantize_row_{ggml_type.name.lower()}_ref"


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_k_quantize_matches_recorded_ggml_output(ggml_type):
    """The same check without llama.cpp: ggml's output for these inputs, recorded by
    scripts/goldens/make_kquant_golden.py as one sha256 per quantized row."""
    golden = json.loads(GOLDEN_K.read_text())[ggml_type.name]
    for what, x in k_quant_cases(ggml_type).items():
        assert hashlib.sha256(x.tobytes()).hexdigest() == golden[what]["input_sha256"], \
            f"{what}: the seeded inputs changed (a numpy RNG change?); regenerate the golden file"
        ours = sha256_rows(Q.quantize(x, ggml_type))
        bad = [i for i, (a, b) in enumerate(zip(ours, golden[what]["rows"])) if a != b]
        assert len(ours) == len(golden[what]["rows"]) and not bad, \
            f"{what}: rows {bad} differ from ggml's quantize_row_{ggml_type.name.lower()}_ref"


@pytest.mark.parametrize("ggml_type", LEGACY_TYPES, ids=lambda t: t.name)
def test_legacy_quantize_agrees_with_ggml_too(ggml_type, ggml_quantize_chunk):
    # gguf-py (and so ours) and ggml differ in one corner: a Q4_0 block of only -0.0 gets
    # d = +0 from gguf-py and d = -0 from ggml. Such a block is left out here.
    rng = np.random.default_rng(4000 + int(ggml_type))
    x = np.concatenate([tricky_rows(rng, 512), rng.normal(0, 0.02, (64, 512)).astype(np.float32)])
    assert not mismatched_rows(Q.quantize(x, ggml_type), ggml_quantize_chunk(x, ggml_type))


# ---- round trips -------------------------------------------------------------------------------

def per_block(a, size):
    return a.reshape(-1, size)


def test_round_trip_error_bounds():
    """dequantize(quantize(x)) against x, with each type's stated error bound."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(0, 1, (64, 1024)), rng.standard_t(3, (16, 1024)),
                        rng.uniform(-5, 5, (16, 1024))]).astype(np.float32)
    f16_rel = 2.0 ** -11                                    # float16 rounding of a stored scale
    err = {t: Q.dequantize(Q.quantize(x, t), t, x.shape) - x for t in LEGACY_TYPES + K_TYPES + Q.FLOAT_TYPES}

    # F32 is exact; F16 / BF16 round each value to 11 / 8 significant bits (F16 below 2**-14
    # is subnormal, with a fixed spacing of 2**-24)
    assert np.array_equal(err[GGMLType.F32], np.zeros_like(x))
    assert np.all(np.abs(err[GGMLType.F16]) <= np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25))
    assert np.all(np.abs(err[GGMLType.BF16]) <= np.abs(x) * 2.0 ** -8)

    xb = per_block(x, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    # Q8_0: half a step d = amax/127, plus the f16 rounding of d times |q| <= 127
    assert np.all(np.abs(per_block(err[GGMLType.Q8_0], 32)) <= amax * (0.5 / 127 + f16_rel) * 1.0001)
    # Q4_0: steps of amax/8; values opposite the extreme can clamp a full step (q = 16 -> 15)
    assert np.all(np.abs(per_block(err[GGMLType.Q4_0], 32)) <= amax * (1 / 8 + 16 * f16_rel) * 1.0001)
    # Q4_1: half a step (max - min)/15, plus the f16 rounding of d (times 15) and of m
    lo, hi = xb.min(axis=1, keepdims=True), xb.max(axis=1, keepdims=True)
    bound = (hi - lo) * (0.5 / 15 + f16_rel) + np.abs(lo) * f16_rel
    assert np.all(np.abs(per_block(err[GGMLType.Q4_1], 32)) <= bound * 1.0001)

    # K-quants fit their grids by least squares, so there is no tidy worst case; stated here:
    # the worst value is within one grid step of its super-block's largest magnitude A (Q4_K:
    # 16 levels over at most [-A, A], step 2A/15; Q6_K: 64 levels, step A/32), and the RMS error
    # of a super-block is a small fraction of its RMS value. Measured on these rows: max error
    # 0.087 A (Q4_K), 0.019 A (Q6_K); RMS ratio mean 0.072 / worst 0.11 (Q4_K), 0.018 / 0.032 (Q6_K).
    xk = per_block(x, 256)
    rms, big = np.sqrt((xk ** 2).mean(axis=1)), np.abs(xk).max(axis=1)
    for t, step, rel_rms in ((GGMLType.Q4_K, 2 / 15, 0.15), (GGMLType.Q6_K, 1 / 32, 0.05)):
        e = per_block(err[t], 256)
        assert np.all(np.abs(e).max(axis=1) <= step * big), t.name
        assert np.all(np.sqrt((e ** 2).mean(axis=1)) <= rel_rms * rms), t.name


def test_quantize_zeros_gives_zeros():
    z = np.zeros((2, 256), np.float32)
    for t in LEGACY_TYPES + K_TYPES + Q.FLOAT_TYPES:
        assert np.array_equal(Q.dequantize(Q.quantize(z, t), t, z.shape), z), t.name
    assert not Q.quantize(z, GGMLType.Q6_K).any()          # ggml writes an all-zero Q6_K block


# ---- errors ------------------------------------------------------------------------------------

def test_unsupported_types_raise_naming_the_type():
    raw = np.zeros(66, np.uint8)
    with pytest.raises(Q.UnsupportedTypeError, match="IQ2_XXS"):
        Q.dequantize(raw, GGMLType.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="Q8_K"):           # a ValueError as well as a GGUFError
        Q.dequantize(np.zeros(292, np.uint8), GGMLType.Q8_K, (256,))
    with pytest.raises(GGUFError, match="Q5_K"):
        Q.quantize(np.zeros(256, np.float32), GGMLType.Q5_K)
    with pytest.raises(Q.UnsupportedTypeError, match="IQ4_NL"):
        Q.quantize(np.zeros(32, np.float32), int(GGMLType.IQ4_NL))
    with pytest.raises(Q.UnsupportedTypeError, match=r"\b4\b"):   # Q4_2, long removed from ggml
        Q.dequantize(raw, 4, (32,))
    with pytest.raises(Q.UnsupportedTypeError, match="99"):
        Q.quantize(np.zeros(32, np.float32), 99)


def test_bad_sizes_raise():
    with pytest.raises(GGUFError, match="bytes"):
        Q.dequantize(np.zeros(19, np.uint8), GGMLType.Q4_1, (32,))
    with pytest.raises(GGUFError, match="multiple"):
        Q.dequantize(np.zeros(20, np.uint8), GGMLType.Q4_1, (31,))
    with pytest.raises(ValueError, match="multiple"):
        Q.quantize(np.zeros(100, np.float32), GGMLType.Q8_0)


# ---- the synthetic TinyLlama ---------------------------------------------------------------------

Q6K_LAYERS = {0, 1, 4, 7, 10, 13, 16, 19, 20, 21}   # llama.cpp's use_more_bits for 22 layers


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    if not LLAMA_SPM_VOCAB.exists():                           # the vocab folder is there (needs), this file not
        pytest.fail(f"{LLAMA_SPM_VOCAB.name} is missing from {LLAMA_SPM_VOCAB.parent}: run `make vocab` again",
                    pytrace=False)
    from app.synthetic import write_tinyllama_synthetic
    path = tmp_path_factory.mktemp("synthetic") / "tinyllama-synthetic.gguf"
    write_tinyllama_synthetic(path, LLAMA_SPM_VOCAB, progress=False)
    yield path
    path.unlink(missing_ok=True)                             # 636 MiB: do not leave it in /tmp


@pytest.mark.needs("vocab")
def test_synthetic_metadata(synthetic):
    with GGUFFile(synthetic) as f, GGUFFile(LLAMA_SPM_VOCAB) as vocab:
        md = f.metadata
        assert "SYNTHETIC" in md["general.name"]
        expected = {"general.architecture": "llama", "llama.block_count": 22,
                    "llama.context_length": 2048, "llama.embedding_length": 2048,
                    "llama.feed_forward_length": 5632, "llama.attention.head_count": 32,
                    "llama.attention.head_count_kv": 4, "llama.rope.dimension_count": 64,
                    "general.file_type": 15, "tokenizer.ggml.model": "llama",
                    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                    "tokenizer.ggml.padding_token_id": 2, "general.quantization_version": 2}
        assert {k: md.get(k) for k in expected} == expected
        assert md["llama.rope.freq_base"] == 10000.0
        assert md["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
        assert md["tokenizer.ggml.tokens"] == vocab.metadata["tokenizer.ggml.tokens"]
        assert len(md["tokenizer.ggml.tokens"]) == 32000
        assert np.array_equal(md["tokenizer.ggml.scores"], vocab.metadata["tokenizer.ggml.scores"])
        assert np.array_equal(md["tokenizer.ggml.token_type"], vocab.metadata["tokenizer.ggml.token_type"])
        assert "<|assistant|>" in md["tokenizer.chat_template"]


@pytest.mark.needs("vocab")
def test_synthetic_tensors_shapes_and_type_mix(synthetic):
    with GGUFFile(synthetic) as f:
        t = f.tensors
        assert len(t) == 201
        assert Counter(x.ggml_type.name for x in t.values()) == {"F32": 45, "Q4_K": 135, "Q6_K": 21}
        assert t["token_embd.weight"].shape == (32000, 2048) and t["token_embd.weight"].ggml_type == GGMLType.Q4_K
        assert t["output.weight"].shape == (32000, 2048) and t["output.weight"].ggml_type == GGMLType.Q6_K
        assert t["output_norm.weight"].shape == (2048,)
        shapes = {"attn_norm": (2048,), "ffn_norm": (2048,), "attn_q": (2048, 2048),
                  "attn_k": (256, 2048), "attn_v": (256, 2048), "attn_output": (2048, 2048),
                  "ffn_gate": (5632, 2048), "ffn_up": (5632, 2048), "ffn_down": (2048, 5632)}
        for i in range(22):
            for part, shape in shapes.items():
                x = t[f"blk.{i}.{part}.weight"]
                assert x.shape == shape, x.name
                want = (GGMLType.F32 if part.endswith("norm") else
                        GGMLType.Q6_K if part in ("attn_v", "ffn_down") and i in Q6K_LAYERS else GGMLType.Q4_K)
                assert x.ggml_type == want, x.name
        assert 636 * 2**20 <= synthetic.stat().st_size < 637 * 2**20


@pytest.mark.needs("vocab")
def test_synthetic_opens_with_gguf_py_and_weights_have_the_intended_scale(synthetic):
    reader = gguf.GGUFReader(synthetic)
    assert len(reader.tensors) == 201
    assert reader.fields["general.name"].contents().endswith("(SYNTHETIC random weights)")
    by_name = {t.name: t for t in reader.tensors}
    with GGUFFile(synthetic) as f:
        for name in ("blk.0.attn_v.weight", "blk.2.attn_v.weight", "blk.21.ffn_down.weight",
                     "blk.5.attn_q.weight", "output_norm.weight"):
            ours = Q.dequantize_tensor(f.tensors[name])
            theirs = gguf_quants.dequantize(by_name[name].data, by_name[name].tensor_type)
            assert np.array_equal(ours, theirs.reshape(ours.shape)), name
            if name.endswith("norm.weight"):
                assert abs(ours.mean() - 1) < 0.01 and 0.01 < ours.std() < 0.03
            else:
                assert abs(ours.mean()) < 1e-3 and 0.018 < ours.std() < 0.022, (name, ours.std())
        emb = Q.dequantize_rows(f.tensors["token_embd.weight"], np.arange(0, 32000, 97))
        assert 0.018 < emb.std() < 0.022
        out = Q.dequantize_rows(f.tensors["output.weight"], np.arange(5, 32000, 101))
        assert 0.018 < out.std() < 0.022


@pytest.mark.needs("vocab")
def test_synthetic_is_deterministic(synthetic, tmp_path):
    from app.synthetic import write_tinyllama_synthetic
    again = write_tinyllama_synthetic(tmp_path / "again.gguf", LLAMA_SPM_VOCAB, progress=False)
    try:
        assert filecmp.cmp(synthetic, again, shallow=False)
    finally:
        again.unlink()
