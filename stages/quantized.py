"""Stage 5, quantized: the weights stay in their ggml blocks; the kernels decode them on the fly.

The lesson: once the KV cache has removed the repeated work, a decode step multiplies one
activation row by every weight matrix once. Each weight serves a single multiply-add, so the
step costs what it takes to bring the weights from memory to the core, and the way to make it
cheaper is to bring fewer bytes. The file already holds them in fewer bytes (SmolLM2's Q4_1:
5 bits per weight, 20-byte blocks of 32; TinyLlama's Q4_K/Q6_K: 4.5 and 6.6 bits), but the
stages before this one expanded every weight to a 32-bit float at load and streamed 32 bits per
weight per token. This stage streams the file's bits instead:

* Nothing is copied at load. A weight is a read-only uint8 view [rows, bytes per row] into the
  mapped file (`QuantMatrix`); the OS pages the file in as it is read and shares those pages
  with every process that maps it. The tied output matrix is the embedding table itself, and
  the embedding lookup decodes only the rows of the tokens it is given.
* Decode (M = 1): a fused kernel per format (stages/kernels/dequant_dot.py) reads each row's
  blocks once, unpacks the 4-8 bit integers with AND/shift, converts them to float and
  multiplies them into x, 8 lanes at a time, applying the block scales once per block. A
  weight's float32 value exists only in a register (or a one-row buffer that stays in L1).
  Intensity: 2 flops per weight, about 3.5 flops per byte for Q4_K against 0.5 for float32.
* Prefill (M prompt rows): each weight serves M rows, so it is worth decoding once: a panel of
  PANEL_ROWS weight rows is decoded into a float32 buffer and the simd stage's 4 x 4 kernel
  runs all M rows over it. Decode does 2 flops per weight fetched, prefill 2M: the article's
  point about arithmetic intensity.
* A type without a kernel (IQ*, Q2_K, Q3_K, ...) stops the load with an error naming the tensor.

What limits it: converting each nibble to float takes several instructions per 8 weights, so
one core may unpack the blocks more slowly than memory delivers them, and then the unpacking,
not the bandwidth, sets the pace (compare the GB/s of blocks in profiles/bench/kernels.md with
the machine's bandwidth on the roofline chart).
The next stages attack that with more cores (threads) and with integer arithmetic (int8).
The logits differ from the float32 stages only in the order floats are summed.
"""

from __future__ import annotations

import numpy as np

from common.gguf import GGMLType
from common.quants import UnsupportedTypeError
from stages.kernels.dequant_dot import CPU_KERNEL_TYPES, MATVEC, dequantize_rows, embed_rows, matvec_rows
from stages.kernels.toolkit import F16_TO_F32
from stages.kv_cache import KVCacheBackend
from stages.simd import PANEL, matmul_panels

# Prefill: weight rows decoded per panel (a multiple of the simd kernel's PANEL). 64 rows of
# K floats stay within L2 (at most 1.4 MiB, for TinyLlama's 5632-wide ffn_down) and cost
# one Python iteration per 64 rows, small next to the panel's arithmetic.
PANEL_ROWS = 64
X_CHUNK_BYTES = 1 << 20


class QuantMatrix:
    """A weight as the file stores it: data is the [rows, bytes per row] uint8 view into the
    mapped GGUF (read-only; nothing is copied), kind its ggml type id, shape (N, K)."""

    def __init__(self, tensor):
        t = GGMLType(tensor.ggml_type)
        if t not in CPU_KERNEL_TYPES or len(tensor.shape) != 2:
            have = ", ".join(x.name for x in CPU_KERNEL_TYPES)
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

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])


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
        """Decode PANEL_ROWS weight rows once, use them for all M rows of x."""
        M, K = x.shape
        N = w.shape[0]
        # rows of x per kernel call: at most 1 MiB of them (half of a 2 MiB L2), so they stay
        # in L2 while the kernel sweeps them once per 4-row slice of the panel (it matters for
        # TinyLlama's 5632-wide ffn_down at long prompts; the other matrices fit whole)
        chunk = max(PANEL, X_CHUNK_BYTES // (4 * K) // PANEL * PANEL)
        y = np.empty((M, N), dtype=np.float32)
        panel = np.zeros((PANEL_ROWS, K), dtype=np.float32)     # [rows, K] floats, reused
        for n0 in range(0, N, PANEL_ROWS):
            rows = min(PANEL_ROWS, N - n0)
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
