"""Stage 5, quantized: the weights stay in their ggml blocks; the kernels decode them on the fly.

The lesson: once the KV cache has removed the repeated work, a decode step multiplies one
activation row by every weight matrix once. Each weight is used for a single multiply-add,
so the step costs what it takes to bring the weights from memory to the core, and the way
to make it cheaper is to bring fewer bytes. The file already holds the weights in fewer
bytes: SmolLM2's Q4_1 is 5 bits per weight (20-byte blocks of 32), TinyLlama's Q4_K/Q6_K
4.5/6.6 bits. The stages before this one expanded every weight to a 32-bit float at load
(the RAM balloon: 94 MB of file -> 0.6 GB of float32) and then streamed 32 bits per weight
per token. This stage streams the file's 4.5-8.5 bits instead:

* Nothing is copied at load. A weight is a read-only uint8 view [rows, bytes per row] into
  the mapped file (`QuantMatrix`); the operating system pages the file in as it is read and
  can share those pages with every other process that maps it. The tied output matrix is
  the embedding table itself, and the embedding lookup decodes only the rows of the tokens
  it is given. `weight_bytes` reports the mapped blocks (file-backed, not a private copy).
* Decode (one activation row, M = 1): a fused kernel per format (stages/quant_kernels.py)
  reads each row's blocks once, unpacks the 4-8 bit integers with AND/shift, converts them
  to float and multiplies them into x, 8 lanes at a time, with the block and sub-block
  scales applied per block rather than per value. The float32 value of a weight exists only
  in a register (or, for the 16-byte blocks of the 32-value formats, in a one-row buffer
  that never leaves L1). Arithmetic intensity: 2 flops per weight, i.e. about 3.5 flops per
  byte read for Q4_K against 0.5 for the float32 stages. On this machine the kernels for
  the 4- to 6-bit formats unpack 5-6 billion weights per second on one core, 3.5-4 GB/s of
  blocks, below the ~6 GB/s one core reads from memory here: the unpacking, not memory,
  now limits them (Q8_0: 8 billion/s; `scripts/bench_vs_llama.py --kernels`).
* Prefill (a prompt of M rows): the same weights serve M activation rows, so each is worth
  decoding once and using M times. A panel of PREFILL_ROWS weight rows is decoded into a
  float32 buffer, then the simd stage's 4 x 4 register-blocked kernel runs over all M
  prompt rows with it: decoding costs 1/M of a value's use, and the multiply-adds run at the
  simd stage's 45-70 GFLOP/s. That is the article's point about arithmetic intensity: decode
  does 2 flops per weight fetched, prefill 2M.
* A type without a kernel here (IQ*, Q2_K, Q3_K, ...) stops the load with an error that
  names the tensor and its type.

What stays as it was: the KV cache, attention, norms, RoPE (all inherited from kv_cache).

Measured here (2-core Xeon VM, shared; 1 thread; medians of 3 alternating rounds of
`python scripts/bench_vs_llama.py --model smollm2 --rounds 3` and `--model tinyllama-synthetic`;
figures, settings and per-op profiles in profiles/bench/vs_llama_*.json):

                           decode ms/token, 64-token prompt     TTFT 128 tokens     peak RSS MiB
                           simd  kv_cache quantized llama.cpp  quantized llama.cpp  quantized llama.cpp
    SmolLM2-135M Q4_1       391     51.9     40.2     25.4       1087 ms   1023 ms     411      251
    TinyLlama geometry*    2502    326      212      109         5.4 s     2.2 s      944     1230
    * synthetic random weights; the eager stages ran 3-6 tokens there (4.4 GB of float32)

So: 1.3x (SmolLM2; 1.7x in an earlier run, 53.6 -> 32.1 ms: the rounds of one run spread by
up to 1.5x on this shared VM) and 1.5x (TinyLlama) faster decode than kv_cache, in less than
half its memory (411 vs 918 MiB, most of it the runtime) and a fifth of it on TinyLlama (944
vs 5130 MiB); 1.6-1.9x llama.cpp's decode time. What
separates us from llama.cpp: it multiplies int8 activations by the 4-bit weights with
integer dot-product instructions (64 multiply-adds per instruction), so it is bound by memory
(~6 GB/s here) where these float kernels are bound by the unpacking (~3 GB/s of blocks);
for a 128-token prompt the float32 multiply-adds (near this core's 256-bit FMA peak) and
the inherited per-head attention loop (a quarter of TinyLlama's prompt time) make the gap
2.5x. Of the 411 MiB on SmolLM2, 196 are the interpreter, numpy and numba before any model
(`--child runtime`); the rest is the mapped file (94) and the KV arena (90, resident at
once: numpy asks for 2 MiB pages). Cold JIT of this stage's kernels: ~5 s (cached after).

The logits differ from the float32 stages only in the order floats are summed (the scale
is applied per block instead of per value): against the float64 reference the largest
logit error on SmolLM2 is 4e-5, as for the float32 stages, inside the 5e-3 every stage is
held to.
"""

from __future__ import annotations

import numpy as np

from common.gguf import GGMLType
from common.quants import UnsupportedTypeError
from stages.kv_cache import KVCacheBackend
from stages.quant_kernels import F16_TO_F32, KERNEL_TYPES, MATVEC, dequantize_rows, embed_rows, matvec_rows
from stages.simd import PANEL, matmul_panels

# Prefill: weight rows decoded per panel (a multiple of the simd kernel's PANEL). 64 rows of
# K floats stay within L2 (at most 1.4 MiB, for TinyLlama's 5632-wide ffn_down) and cost
# one Python iteration per 64 rows, about 1% of a prompt's time.
PREFILL_ROWS = 64
X_CHUNK_BYTES = 1 << 20


class QuantMatrix:
    """A weight as the file stores it: data is the [rows, bytes per row] uint8 view into the
    mapped GGUF (read-only; nothing is copied), kind its ggml type id, shape (N, K)."""

    def __init__(self, tensor):
        t = GGMLType(tensor.ggml_type)
        if t not in KERNEL_TYPES or len(tensor.shape) != 2:
            have = ", ".join(x.name for x in KERNEL_TYPES)
            raise UnsupportedTypeError(
                f"tensor '{tensor.name}' is {t.name} {list(tensor.shape)}: the quantized stage has no "
                f"kernel for it (it runs 2-D weights of types {have})")
        data = tensor.rows().view()
        data.flags.writeable = False        # as the file's mapping is: one numba signature for all
        self.name = tensor.name
        self.data = data
        self.kind = int(t)
        self.shape = (int(tensor.shape[0]), int(tensor.shape[1]))
        self.nbytes = int(data.nbytes)


class QuantizedBackend(KVCacheBackend):
    name = "quantized"

    # ---- weights: views into the mapped file ------------------------------------------------
    def prepare_matrix(self, tensor):
        return QuantMatrix(tensor)

    def prepare_embedding(self, tensor):
        return QuantMatrix(tensor)

    def tie_output(self, embedding, tensor):
        return embedding                     # the same mapped blocks serve both

    def weight_bytes(self, weight) -> int:
        """Bytes of the mapped ggml blocks (file-backed pages, resident once read, shared with
        the page cache; no private copy). Norm vectors: their small float32 copies."""
        return int(getattr(weight, "nbytes", 0))

    # ---- the two ops that touch weights -------------------------------------------------------
    def matmul(self, x, w):
        """x [M, K] @ W^T -> [M, N] straight from W's blocks."""
        if not isinstance(w, QuantMatrix):
            return super().matmul(x, w)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[0] == 1:                                       # decode: one fused pass
            fused = MATVEC.get(w.kind)
            y = fused(x[0], w.data, F16_TO_F32) if fused else matvec_rows(x[0], w.data, w.kind, F16_TO_F32)
            return y[None, :]
        return self._prefill(x, w)

    def _prefill(self, x, w):
        """Decode PREFILL_ROWS weight rows once, use them for all M rows of x."""
        M, K = x.shape
        N = w.shape[0]
        # rows of x per kernel call: at most 1 MiB of them (half of L2 here), so they stay in
        # L2 while the kernel sweeps them once per 4-row slice of the panel (measured: 20%
        # off TinyLlama's 5632-wide ffn_down at 128 prompt rows; the others fit whole)
        chunk = max(PANEL, X_CHUNK_BYTES // (4 * K) // PANEL * PANEL)
        y = np.empty((M, N), dtype=np.float32)
        panel = np.zeros((PREFILL_ROWS, K), dtype=np.float32)     # [rows, K] floats, reused
        for n0 in range(0, N, PREFILL_ROWS):
            rows = min(PREFILL_ROWS, N - n0)
            dequantize_rows(w.kind, w.data, n0, panel[:rows], F16_TO_F32)     # once per M rows
            padded = -(-rows // PANEL) * PANEL                    # the kernel takes 4-row panels
            panel[rows:padded] = 0.0
            for m0 in range(0, M, chunk):
                y[m0:m0 + chunk, n0:n0 + rows] = matmul_panels(x[m0:m0 + chunk], panel[:padded])[:, :rows]
        return y

    def embed(self, table, ids):
        """Only the rows of the given token ids are decoded."""
        ids = np.asarray(ids, dtype=np.int64)
        return embed_rows(table.data, table.kind, ids, table.shape[1], F16_TO_F32)
