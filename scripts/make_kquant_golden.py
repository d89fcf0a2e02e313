"""Record ggml's Q4_K / Q6_K reference quantizer output for the test inputs, so CI checks our
quantizer byte for byte without building llama.cpp.

    make llama-cpp && .venv/bin/python scripts/make_kquant_golden.py

Writes tests/golden/ggml_k_quants.json: per type and input tensor (tests/test_quants.py,
k_quant_cases), the sha256 of the float input and one sha256 per quantized row.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.ggml_ref import GGMLUnavailable, ggml_quantizer  # noqa: E402
from tests.test_quants import GOLDEN_K, K_TYPES, k_quant_cases, sha256_rows  # noqa: E402


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
