"""Stage 8, int8: activations rounded to 8-bit blocks, as llama.cpp does; integer dot products.

The lesson: llama.cpp does not multiply float activations by its 4-bit weights. Before each
matrix multiply it rounds the activation row to blocks of 8-bit integers with one scale per
block (Q8_0/Q8_1: 32 values, a float16 scale; Q8_K: 256 values, a float32 scale and the sums
of every 16, for the K-quants), so that a block's dot product is a sum of small integer
products and the scales are applied once per block. This stage does the same
(stages/kernels/int_dot.py: ggml's quantize_row_q8_0/_q8_1/_q8_K_ref and vec_dot formulas).

* The compiler will not find llama.cpp's instruction. Written as plain integer loops, the sums
  vectorize into vpmaddwd (16-bit products, 8 per instruction), each block ending in a
  horizontal add; llama.cpp's hand-written code multiplies 32 unsigned x signed bytes per
  instruction (vpmaddubsw on AVX2, vpdpbusd on VNNI). No rewriting of the loops yields it.
* So name it. numba's `intrinsic` lets a jitted function emit LLVM IR, which can call an x86
  instruction's intrinsic by name: four small helpers load 32 weight and 32 activation bytes
  as vectors, unpack the weights to unsigned bytes as ggml does, and multiply with vpdpbusd
  (Q4_0/Q4_1/Q8_0) or vpmaddubsw + vpmaddwd carrying the sub-block scales (Q4_K/Q6_K). The
  integer sums are the loops' to the bit (tests/test_int8.py also reads the instructions back
  from the assembly). Where a CPU lacks AVX2 + F16C the loops run; without VNNI the helpers use
  vpmaddubsw. The variant `int8-loops` (stages/registry.py) keeps the loops everywhere, so the
  two can be measured side by side: `python -m app bench vs-llama --engines int8,int8-loops`.
* Prefill multiplies the rounded activations, d * q, with the threads stage's float panels
  (plus the Q4_1/Q5_1 offsets times Q8_1's float16 sums, as ggml takes them): llama.cpp's
  numbers, float arithmetic. An integer GEMM built from loops ran slower than the
  float panels (LLVM forms vpmaddwd only from single-use operands, and a register-blocked tile
  shares each operand between products), and the rounding itself costs prefill time.

What limits it: each helper still ends in a horizontal add, per 32 values for the 32-value
formats, where llama.cpp converts a block's lanes to float and keeps them in a vector
accumulator across blocks; and Python plus a fork/join still separate every matmul.

What the stage buys for sure is llama.cpp's numerics. Rounding an activation to 8 bits with one
scale per block moves each value by up to half a step of its block's largest value / 127, and
through 30 layers that moves the logits visibly further from the float64 reference than the
float stages are. LOGIT_TOLERANCE is the bound tests/test_reference.py holds llama.cpp itself
to against that reference: this stage may depart as far as llama.cpp does, and no farther.
Greedy decoding follows suit: it may pick another token than the float stages only where their
top candidates are nearly tied, which tests/test_stages.py checks.
"""

from __future__ import annotations

import numpy as np

from common.gguf import GGMLType
from stages.kernels.int_dot import add_block_offsets, matvec_int8, matvec_int8_auto
from stages.kernels.q8 import ACTIVATION_BLOCK, dequantize_q8, quantize_q8
from stages.kernels.toolkit import F16_TO_F32
from stages.quantized import QuantMatrix
from stages.threads import ThreadsBackend

# ggml types whose blocks carry an offset m after the scale d (value = d * q + m), by block bytes
OFFSET_TYPES = {int(GGMLType.Q4_1): 20, int(GGMLType.Q5_1): 24}
LOGIT_TOLERANCE = 2.0           # logits, max |int8 - float64 reference| per position: see above


class Int8Backend(ThreadsBackend):
    name = "int8"
    logit_tolerance = LOGIT_TOLERANCE
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
        y = super().matmul(dequantize_q8(q, d, qk), w)        # prefill: the float panels, on d * q
        if w.kind in OFFSET_TYPES:
            # a block's offset m multiplies the activation block's sum, which ggml takes from
            # Q8_1's s = float16(d * sum q), not from d * sum q: the decode kernels do, so must this
            add_block_offsets(y, (s - d * sums).astype(np.float32), w.data.reshape(w.shape[0], -1),
                              OFFSET_TYPES[w.kind], F16_TO_F32, self.threads)
        return y


class Int8LoopsBackend(Int8Backend):
    """The variant `int8-loops`: the same stage with the auto-vectorized integer loops on every
    CPU, to measure what naming the instructions buys."""
    name = "int8-loops"
    matvec = staticmethod(matvec_int8_auto)
