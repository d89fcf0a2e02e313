"""Stage 7, int8: activations rounded to 8-bit blocks, as llama.cpp does; integer dot products.

The lesson: llama.cpp does not multiply float activations by its 4-bit weights. Before each
matrix multiply it rounds the activation row to blocks of 8-bit integers with one scale per
block (Q8_0/Q8_1: 32 values, a float16 scale; Q8_K: 256 values, a float32 scale and the sums of
every 16, for the K-quants), so that a block's dot product is a sum of small integer products
and the scales are applied once per block. This stage does the same (stages/int8_kernels.py,
ggml's quantize_row_q8_0/_q8_1/_q8_K_ref and vec_dot formulas) and writes the sums as plain
integer loops for LLVM to vectorize. Two findings, measured:

* The instructions are there. LLVM recognizes a loop of 16-bit products summed into 32 bits
  and emits vpmaddwd, and on this VNNI CPU vpdpwssd (tests/test_int8.py reads the assembly).
  But not in the form llama.cpp uses: its hand-written AVX2 code multiplies 32 unsigned x
  signed bytes per vpmaddubsw and keeps each block's 8 lanes to convert and scale in float.
  The auto-vectorizer forms these instructions only inside a reduction (X86PartialReduction),
  with 32-bit accumulators it sizes at 8 lanes, so each does 8 products: vpmaddwd on 128-bit
  registers of 16-bit values (Q4_K), or vpdpwssd on 256-bit ones holding bytes widened to 32
  bits (Q4_1); and every block ends in a horizontal add. Nothing here yields vpdpbusd.
* So the integer kernels are not reliably faster than the float ones here. Decode kernels,
  one core, int8 / quantized in weights per second, two runs of `python
  scripts/bench_vs_llama.py --kernels` (this shared VM moves such figures by 30%): Q4_1
  0.73x and 1.21x, Q8_0 0.85x and 1.20x, Q4_K 1.05x and 0.65x, Q6_K 1.11x and 1.01x. In
  the whole decode, measured side by side in two runs, int8 ran 1.2x slower than threads on
  SmolLM2 (35.0-35.4 vs 28.9-29.6 ms/token, 1 thread; on 2 threads 1.03-1.29x) and 1.5-2.4x
  slower on TinyLlama's geometry (its runs spread widely, 238-451 ms on one thread). Prefill:
  an integer GEMM LLVM builds from such loops ran at 36 GOP/s here, below the float panels'
  60+ GFLOP/s (a register-blocked tile shares each operand between products, and the pass
  that forms vpmaddwd accepts single-use operands only), so prefill multiplies the rounded
  activations, d * q, with the threads stage's float panels: llama.cpp's numbers, float
  arithmetic.

                          decode ms/token              TTFT of 128 tokens, ms
                          threads  int8  llama.cpp     threads  int8  llama.cpp
    SmolLM2-135M  1 thr    28.9    35.0    20.5           472    589     913
                  2 thr    24.2    24.9    13.4           370    469     593
    TinyLlama*    1 thr   160.9   381.2   117.0          3987   4212    2246
                  2 thr    99.7   181.6    60.0          2632   3057    1204
    (medians of 3 alternating rounds, `python scripts/bench_vs_llama.py --rounds 3`,
    profiles/bench/vs_llama_<model>.json; * synthetic. Against llama.cpp at the same thread
    count: decode 1.71x, 1.85x, 3.26x, 3.02x; TTFT 0.65x, 0.79x, 1.88x, 2.54x.)

What the stage does buy is llama.cpp's numerics. Rounding an activation to 8 bits with one
scale per block moves each value by up to half a step of its block's largest value / 127;
through 30 layers that moves SmolLM2's logits (|logit| up to ~30) by 2-4% RMS and at most
~1.7 in logit units against the float64 reference (measured on tests/test_stages.py's prompt:
1.66; the float stages: 4e-5). llama.cpp itself sits 2-3% RMS and 0.8-1.6 at most from that
reference on the same kind of prompts (tests/test_reference.py holds it to 5% and 2.0).
LOGIT_TOLERANCE = 2.0 is that bound: the size of llama.cpp's own departure, about 20% above
the largest one measured here. Greedy decoding follows suit: on the default model this stage
picks another token than the float stages only where their top candidates are nearly tied
(0.15 and 0.09 logits apart on the test prompt, llama.cpp making the second of those picks
too; 0.011 apart at the 29th token of the benchmark's), tests/test_stages.py checks exactly that.
Against llama.cpp's recorded logits (tests/golden) the stage's departure from float64 leans
the way llama.cpp's does (correlation 0.3-0.5) but is not smaller overall: relative RMS
2.1-3.0% against llama.cpp, the float stages 2.0-3.1%. The activation rounding is ggml's to
the bit (tests/test_int8.py), so llama.cpp differs from float64 in more places than this one.

Cold JIT of this stage's kernels: ~22 s the first time (after the threads stage's), cached after.
"""

from __future__ import annotations

import numpy as np

from stages.int8_kernels import ACTIVATION_BLOCK, dequantize_q8, matvec_int8, quantize_q8
from stages.quant_kernels import F16_TO_F32
from stages.quantized import QuantMatrix
from stages.threads import ThreadsBackend

LOGIT_TOLERANCE = 2.0           # logits, max |int8 - float64 reference| per position: see above


class Int8Backend(ThreadsBackend):
    name = "int8"

    def __init__(self, threads: int | None = None):
        super().__init__(threads)
        self._last = None                # (x, block size, its quantized blocks): q, k, v share x

    def quantize_activations(self, x, qk: int):
        """x [M, K] -> llama.cpp's 8-bit blocks (q, d, s, sums), once per input: the graph
        multiplies the same x by Wq, Wk and Wv (and by W_gate and W_up)."""
        last = self._last
        if last is not None and last[0] is x and last[1] == qk:
            return last[2]
        blocks = quantize_q8(x, qk)
        self._last = (x, qk, blocks)
        return blocks

    def matmul(self, x, w):
        if not isinstance(w, QuantMatrix) or w.kind not in ACTIVATION_BLOCK:
            return super().matmul(x, w)                       # float weights stay float
        x = np.ascontiguousarray(x, dtype=np.float32)
        qk = ACTIVATION_BLOCK[w.kind]
        q, d, s, sums = self.quantize_activations(x, qk)
        if x.shape[0] == 1:                                   # decode: integer dot products
            self._pool()
            return matvec_int8(q[0], d[0], s[0], sums[0], w.data, w.kind, F16_TO_F32, self.threads)[None, :]
        return super().matmul(dequantize_q8(q, d, qk), w)     # prefill: the float panels, on d * q
