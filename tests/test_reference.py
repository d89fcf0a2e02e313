"""The float64 reference forward against llama.cpp's logits on the default model.

The golden file (tests/golden/llama_cpp_logits.npz) was written by
scripts/goldens/make_llama_golden.py with llama-cpp-python; it holds, per prompt, llama.cpp's token
ids and, per position, its 16 best tokens with their logits and the logits of a fixed
subset of 1024 vocabulary ids. So CI needs no llama.cpp build.

How close to expect: llama.cpp is not "dequantize, then multiply in float". For Q4_1 and
Q8_0 weights it first rounds every activation row to 8-bit integers (its Q8_1/Q8_0 formats)
and takes integer dot products, which moves each logit by a few percent. Measured on these
prompts: relative RMS difference 0.020-0.031 and max |difference| 0.77-1.25 (logits span
about +-30). The bounds below are 5% RMS and 2.0 absolute.

Top-1 must agree at every position where llama.cpp's own top two are clearly apart
(margin > MARGIN); where they are nearly tied, 8-bit rounding alone can swap them (seen at
2 positions of the chat prompt, margins 0.04 and 0.17), so there the reference's choice
must be one of llama.cpp's top two.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import reference
from common.gguf import GGUFFile
from tests.util import golden_reference, some

GOLDEN = Path(__file__).parent / "golden" / "llama_cpp_logits.npz"
REL_RMS = 0.05
MAX_ABS = 2.0
MARGIN = 0.25


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def gguf(default_model_path):
    return GGUFFile(default_model_path)


def prompts(golden):
    return sorted({k.split("_")[0] for k in golden.files if k.startswith("p")})


def test_golden_has_prompts(golden):
    assert len(prompts(golden)) >= 3


@pytest.mark.parametrize("index", range(4))
def test_reference_agrees_with_llama_cpp(index, golden, default_model_path):
    p = f"p{index}"
    ref = golden_reference(p, str(default_model_path))
    assert np.isfinite(ref).all()

    subset = golden["subset_ids"]
    want = golden[f"{p}_subset_logits"]
    diff = ref[:, subset] - want
    rel_rms = np.sqrt((diff ** 2).mean() / (want ** 2).mean())
    assert rel_rms <= REL_RMS, f"relative RMS {rel_rms:.4f}"
    top_ids, top_logits = golden[f"{p}_top_ids"], golden[f"{p}_top_logits"]
    worst = max(np.abs(diff).max(), np.abs(np.take_along_axis(ref, top_ids, 1) - top_logits).max())
    assert worst <= MAX_ABS, f"max |logit difference| {worst:.3f}"

    ours = ref.argmax(axis=1)
    margin = top_logits[:, 0] - top_logits[:, 1]
    clear = some(margin > MARGIN, what="positions where llama.cpp's top two are clearly apart")
    assert (ours[clear] == top_ids[clear, 0]).all(), \
        f"top-1 differs where llama.cpp's margin is clear: positions {np.where(clear & (ours != top_ids[:, 0]))[0]}"
    near_tie = ~clear
    assert np.isin(ours[near_tie], top_ids[near_tie, :2]).all(), "near a tie, ours is not llama.cpp's top two"


def test_tokenizer_matches_llama_cpp_ids(golden, gguf):
    """Our tokenizer gives llama.cpp's ids for the golden prompts (special tokens parsed)."""
    from common.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(gguf)
    for p in prompts(golden):
        assert tok.encode(str(golden[f"{p}_text"]), parse_special=True) == golden[f"{p}_ids"].tolist()


# ---- the q8 reference: llama.cpp's rounding of the activations, in float64 ------------------------

def _activations(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, max(1, k // 64), replace=False)] *= 30          # a few large channels
    x[0, :32] = 0.0                                                    # an all-zero block: d = 0
    x[0, 32:64] = np.arange(32, dtype=np.float32) + np.float32(0.5)      # d = 1 (max 31.5 * 127 / 31.5): ...
    x[0, 63] = 127.0                                                   # ... every other value a tie, x.5
    return x


@pytest.mark.parametrize("kind", ["q8_0", "q8_1", "q8_k"])
def test_q8_rounding_is_the_int8_stages_blocks(kind):
    """reference.round_q8 (numpy, in the engine) against the int8 stage's quantize_q8 (numba):
    the same blocks, so the same values d * q (exact in float64; q8_k's float32 d times q may
    need more than float32's 24 bits, which the stage's prefill rounds), and for q8_1 the same
    s (float16 of d * sum q)."""
    from stages.kernels.q8 import dequantize_q8, quantize_q8
    rng = np.random.default_rng(1)
    qk = 256 if kind == "q8_k" else 32
    x = _activations(rng, 4, 1024)
    x[1, 256:512] *= -1e-3                                             # small blocks, negative maxima
    values, s_fix = reference.round_q8(x, kind)
    q, d, s, sums = quantize_q8(x, qk)
    d_times_q = np.repeat(d.astype(np.float64), qk, axis=1) * q
    assert np.array_equal(values, d_times_q)
    np.testing.assert_allclose(dequantize_q8(q, d, qk), values, rtol=2 ** -24, atol=0)
    if kind == "q8_1":
        exact = d.astype(np.float64) * q.reshape(4, -1, 32).astype(np.int64).sum(axis=2)
        assert np.array_equal(s_fix, s.astype(np.float64) - exact)
        assert np.abs(s_fix).max() > 0                                 # float16 rounding of s does bite
    else:
        assert s_fix is None


def test_q8_0_rounding_is_ggmls_quantizer():
    """q8_0 values are those of common.quants' Q8_0 blocks (byte-exact with gguf-py)."""
    from common.gguf import GGMLType
    from common.quants import dequantize, quantize
    x = _activations(np.random.default_rng(2), 3, 256)
    want = dequantize(quantize(x, GGMLType.Q8_0), GGMLType.Q8_0, x.shape).astype(np.float64)
    assert np.array_equal(reference.round_q8(x, "q8_0")[0], want)


def test_q8_matmul_is_ggmls_dot_product():
    """reference.matmul with activations="q8" against ggml's dot products written out per block:
    Q4_1 x Q8_1 = d_w d_x sum(q_w q_x) + m_w s_x; Q4_K x Q8_K = the dequantized weights times
    d_x q_x (the bsums make the min term exact); Q8_0 x Q8_0 = d_w d_x sum(q_w q_x)."""
    from common.gguf import GGMLType
    from common.quants import blocks_of, dequantize, quantize
    from tests.util import tensor_from_raw
    rng = np.random.default_rng(3)
    x = _activations(rng, 2, 512)
    for t in (GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q8_0):
        raw = quantize(rng.normal(0, 0.05, (5, 512)).astype(np.float32), t)
        g = type("G", (), {"tensors": {"w": tensor_from_raw(raw, t, (5, 512))}})()
        got = reference.matmul(g, x.astype(np.float64), "w", activations="q8")
        w = dequantize(raw, t, (5, 512)).astype(np.float64)
        if t == GGMLType.Q4_1:
            from stages.kernels.q8 import quantize_q8
            q, d, s, _ = quantize_q8(x, 32)
            blocks = blocks_of(raw, t).reshape(5, 16)
            qw = np.stack([np.concatenate([b["qs"] & 15, b["qs"] >> 4]) for b in blocks.ravel()]).reshape(5, 16, 32)
            dots = np.einsum("nbj,mbj->mnb", qw.astype(np.int64), q.reshape(2, 16, 32).astype(np.int64))
            want = (dots * blocks["d"].astype(np.float64)[None] * d.astype(np.float64)[:, None, :]).sum(axis=2)
            want += s.astype(np.float64) @ blocks["m"].astype(np.float64).T
        else:
            want = reference.round_q8(x, "q8_k" if t == GGMLType.Q4_K else "q8_0")[0] @ w.T
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=t.name)
        assert np.abs(got - x.astype(np.float64) @ w.T).max() > 1e-3        # the rounding is really there


def test_forward_names_the_activation_modes(gguf):
    with pytest.raises(ValueError, match="activations 'int4': one of float, q8"):
        reference.forward(gguf, [1], activations="int4")
