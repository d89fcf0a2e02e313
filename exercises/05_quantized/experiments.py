"""Chapter 05's experiments (run: make try-it ch=05)."""

from __future__ import annotations

import numpy as np

from common.gguf import GGMLType
from common.quants import dequantize, quantize
from exercises.harness import best_seconds
from exercises.try_it import experiment
from stages.kernels.dequant_dot import matvec_q4_1, matvec_q8_0
from stages.kernels.toolkit import F16_TO_F32
from stages.quantized import QuantizedBackend
from stages.simd import matmul_panels


@experiment("the bytes per weight the decode kernel streams: float32, Q8_0, Q4_1")
def bytes_per_weight(quick):
    """a memory-bound product takes bytes / bandwidth: Q4_1 (0.625 bytes a weight) about a sixth of
    float32's time and Q8_0 (1.0625) about a quarter, if one core decodes as fast as memory
    delivers; where the decoding is slower, the ratios shrink and the GB/s of blocks fall below the
    machine's bandwidth (its roofline chart)"""
    N, K = (4096, 576) if quick else (3 * 30 * 1536, 576)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(K).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    q4 = quantize(w, GGMLType.Q4_1)
    q8 = quantize(w, GGMLType.Q8_0)
    f32 = dequantize(q4, GGMLType.Q4_1, (N, K))
    reps = 3 if quick else 10
    rows = []
    for label, nbytes, run in (("float32 (simd's panels)", f32.nbytes, lambda: matmul_panels(x[None], f32)),
                               ("Q8_0 blocks (8.5 bits)", q8.nbytes, lambda: matvec_q8_0(x, q8, F16_TO_F32)),
                               ("Q4_1 blocks (5 bits)", q4.nbytes, lambda: matvec_q4_1(x, q4, F16_TO_F32))):
        s = best_seconds(run, reps)
        rows.append((f"{label}: {nbytes / 2**20:.0f} MiB", s * 1e3, "ms"))
        rows.append(("  its bytes per second", nbytes / s / 1e9, "GB/s"))
    return {"rows": rows, "note": "if the times follow the bytes, memory sets the pace; if they do not, the "
                                  "decoding does"}


@experiment("the rows multiplied per decoded panel: 1 (decode), 16, 64 (a prompt)")
def prefill_rows(quick):
    """decode decodes every weight for one row; prefill decodes a panel of 64 weight rows once and runs
    all M rows over it with the simd kernel: the time per row falls several times from 1 row to 64"""
    N, K = (1024, 576) if quick else (1536, 576)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)

    class Tensor:                                     # what QuantMatrix reads of a GGUF tensor
        name, ggml_type, shape = "w", GGMLType.Q4_1, (N, K)

        @staticmethod
        def rows():
            return quantize(w, GGMLType.Q4_1)
    from stages.quantized import QuantMatrix
    m = QuantMatrix(Tensor)
    backend = QuantizedBackend()
    rows = []
    for M in (1, 16, 64):
        x = rng.standard_normal((M, K)).astype(np.float32)
        s = best_seconds(lambda: backend.matmul(x, m), 2 if quick else 5)
        rows.append((f"{M} row(s): time per row", s / M * 1e6, "us"))
    return {"rows": rows, "note": "decode (1 row) decodes every block for 2 flops per weight; prefill for 2M"}
