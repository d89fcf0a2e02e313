"""The float64 reference forward against llama.cpp's logits on the default model.

The golden file (tests/golden/llama_cpp_logits.npz) was written by
scripts/make_llama_golden.py with llama-cpp-python; it holds, per prompt, llama.cpp's token
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
def test_reference_agrees_with_llama_cpp(index, golden, gguf):
    p = f"p{index}"
    ids = golden[f"{p}_ids"]
    ref = reference.forward(gguf, ids)
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
    clear = margin > MARGIN
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
