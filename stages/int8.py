"""Stage 7, int8: activations rounded to 8-bit blocks, as llama.cpp does; integer dot products.

The lesson: llama.cpp does not multiply float activations by its 4-bit weights. Before each
matrix multiply it rounds the activation row to blocks of 8-bit integers with one scale per
block (Q8_0/Q8_1: 32 values, a float16 scale; Q8_K: 256 values, a float32 scale and the sums of
every 16, for the K-quants), so that a block's dot product is a sum of small integer products
and the scales are applied once per block. This stage does the same (stages/int8_kernels.py,
ggml's quantize_row_q8_0/_q8_1/_q8_K_ref and vec_dot formulas). Two findings, measured:

* The compiler will not find llama.cpp's instruction. Written as plain integer loops, the
  sums vectorize: LLVM recognizes a loop of 16-bit products summed into 32 bits and emits
  vpmaddwd, on this VNNI CPU vpdpwssd, 8 products per instruction (on 128-bit registers, or
  on 256-bit ones holding bytes widened to 32 bits), each block ending in a horizontal add.
  llama.cpp's hand-written code multiplies 32 unsigned x signed bytes per instruction:
  vpmaddubsw (AVX2), vpdpbusd (VNNI: 4 products summed into each int32 lane). No rewriting of
  the loops yields it (X86PartialReduction sizes the reduction by its 32-bit accumulator),
  and so written the integer kernels were no faster than the float ones: int8 ran 1.2x
  slower than threads on SmolLM2 and 1.5-2.4x slower on TinyLlama's geometry.
* So name it. numba's `intrinsic` lets a jitted function emit LLVM IR, which can call an x86
  instruction's intrinsic by name: four small helpers (dot_nibbles_16, dot_nibbles_64,
  dot_q6_128, dot_q8_32) load 32 weight and 32 activation bytes as vectors, unpack the
  weights to unsigned bytes as ggml does, and multiply with vpdpbusd (Q4_0/Q4_1/Q8_0) or
  vpmaddubsw + vpmaddwd carrying the sub-block scales (Q4_K/Q6_K); the float16 scales are
  converted by F16C instead of a table. The kernels around them are the loops with the sum
  replaced, the integer sums the same to the bit (tests/test_int8.py also reads the
  instructions back from the assembly). Where a CPU lacks AVX2 + F16C the loops run;
  without VNNI the helpers use vpmaddubsw. Decode kernels, one core, weights per second in
  two runs of `python scripts/bench_vs_llama.py --kernels` (this shared VM moves such figures
  by 30%): against the float kernels of the quantized stage Q4_1 1.17x and 1.18x, Q8_0 1.19x
  and 1.10x, Q4_K 1.49x and 1.40x, Q6_K 1.39x and 1.58x; against the loops Q4_1 1.45x and
  1.40x, Q8_0 0.97x and 1.21x, Q4_K 1.91x and 1.81x, Q6_K 1.20x and 1.34x.

In the whole decode int8 is now faster than threads: in 20 of 24 rounds of two runs of
`--engines threads,int8,int8-auto,llama.cpp --threads 1,2 --rounds 3` (int8-auto: this stage
with the loops), the per-round ratio int8/threads having medians 0.89 (SmolLM2, 1 thread),
0.87 (2 threads), 0.81 (TinyLlama*, 1 thread) and 0.85 (2 threads); the loops took 1.1-1.9x
the named kernels' time on SmolLM2 and 1.3-3.1x on TinyLlama. Still slower than llama.cpp
(1.0-1.6x per round): each helper ends in a horizontal add, per 32 values for the 32-value
formats, where llama.cpp converts a block's 8 lanes to float and keeps them in a vector
accumulator. Prefill: an integer GEMM LLVM builds from such loops ran at 36 GOP/s here,
below the float panels' 60+ GFLOP/s (a register-blocked tile shares each operand between
products, and the pass that forms vpmaddwd accepts single-use operands only), so prefill
multiplies the rounded activations, d * q, with the threads stage's float panels: llama.cpp's
numbers, float arithmetic (and the rounding costs TTFT, left as it is).

                          decode ms/token              TTFT of 128 tokens, ms
                          threads  int8  llama.cpp     threads  int8  llama.cpp
    SmolLM2-135M  1 thr    45.4    27.7    25.6           652    616     949
                  2 thr    20.8    16.7    14.0           326    583     617
    TinyLlama*    1 thr   204.4   141.8   129.7          4802   4312    3144
                  2 thr   109.7    92.6    70.0          2777   3495    1593
    (medians of 3 alternating rounds, `python scripts/bench_vs_llama.py --engines
    threads,int8,int8-auto,llama.cpp --threads 1,2 --rounds 3 --out-dir profiles/bench/int8_named`,
    records in profiles/bench/int8_named/vs_llama_<model>.json;
    * synthetic. The rounds spread: threads@1 on SmolLM2 28.5-45.9 ms. Against llama.cpp at the
    same thread count: decode 1.08x, 1.19x, 1.09x, 1.32x; TTFT 0.65x, 0.94x, 1.37x, 2.19x.)

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
    matvec = staticmethod(matvec_int8)   # the named-instruction kernels where the CPU has them

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
            return self.matvec(q[0], d[0], s[0], sums[0], w.data, w.kind, F16_TO_F32, self.threads)[None, :]
        return super().matmul(dequantize_q8(q, d, qk), w)     # prefill: the float panels, on d * q
