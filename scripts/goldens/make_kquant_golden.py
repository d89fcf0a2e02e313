"""Record ggml's Q4_K / Q6_K reference quantizer output for the test inputs, so CI checks our
quantizer byte for byte without building llama.cpp.

    make llama-cpp && .venv/bin/python -m scripts.goldens.make_kquant_golden

Writes tests/golden/ggml_k_quants.json: per type and input tensor (k_quant_cases below, which
tests/test_quants.py quantizes too), the sha256 of the float input and one sha256 per quantized row.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from app import ROOT
from common.gguf import GGMLType
from scripts.goldens.ggml_ref import GGMLUnavailable, ggml_quantizer

K_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K)
GOLDEN_K = ROOT / "tests" / "golden" / "ggml_k_quants.json"


def tricky_rows(rng, n_per_row: int) -> np.ndarray:
    """Rows that exercise the corner cases of every quantizer: zeros, ties, constants, tiny and
    huge magnitudes, one-sided values, outliers, heavy tails, zero sub-blocks in a live row."""
    n = n_per_row
    rows = [
        np.zeros(n),                                                # all zero
        np.full(n, 0.5), np.full(n, -3.0),                          # constant rows
        np.round(rng.normal(0, 1, n) * 4) / 4,                      # many exact ties
        (np.arange(n) % 32 - 16) / 8.0,                             # ties at .5 after scaling
        (np.arange(n) % 3 - 1) * 63.5,                              # three levels
        rng.normal(0, 1, n) * 1e-30,                                # tiny (subnormal f16 scales)
        rng.normal(0, 1, n) * 1e-6,
        rng.normal(0, 1, n) * 1e3,                                  # large (still finite in f16)
        np.abs(rng.normal(0, 1, n)), -np.abs(rng.normal(0, 1, n)),  # one-sided
        rng.standard_t(2, n) * 0.01,                                # heavy tails
        np.where(np.arange(n) % 37 == 0, 40.0, 1.0) * rng.normal(0, 0.02, n),   # outliers
        np.where((np.arange(n) // 16) % 3 == 0, 0.0, rng.normal(0, 1, n)),       # zero sub-blocks
        np.where(np.arange(n) < n // 2, 0.0, rng.normal(0, 1, n)),              # zero blocks
        rng.uniform(-1, 1, n),
    ]
    return np.stack(rows).astype(np.float32)


def k_quant_cases(ggml_type: GGMLType) -> dict:
    """The float tensors the K-quant tests quantize (seeded, so scripts/goldens/make_kquant_golden.py
    can record ggml's output for exactly these)."""
    rng = np.random.default_rng(3000 + int(ggml_type))
    return {
        "tricky rows": tricky_rows(rng, 1024),
        "weights N(0, 0.02)": rng.normal(0, 0.02, (96, 2048)).astype(np.float32),
        "rows of very different scales": (rng.normal(0, 1, (64, 512))
                                          * 10.0 ** rng.uniform(-4, 3, (64, 1))).astype(np.float32),
        "outlier columns": (rng.normal(0, 0.02, (32, 1024))
                            * np.where(rng.random(1024) < 0.01, 30.0, 1.0)).astype(np.float32),
    }


def sha256_rows(a: np.ndarray) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest() for r in a]


def main():
    try:
        quantize = ggml_quantizer()
    except GGMLUnavailable as e:
        sys.exit(str(e))
    out = {}
    for t in K_TYPES:
        out[t.name] = {what: {"input_sha256": hashlib.sha256(x.tobytes()).hexdigest(),
                              "rows": sha256_rows(quantize(x, t))}
                       for what, x in k_quant_cases(t).items()}
    GOLDEN_K.write_text(json.dumps(out, indent=0))
    print(f"wrote {GOLDEN_K.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
