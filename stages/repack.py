"""Stage 10, repack: the same bytes, laid out the way the vector unit reads them.

The lesson: the fused stage's decode tile reads one weight row at a time, so every row pays on
its own for what it shares with its neighbours: the activation loads, the unpacking of its
block scales, the float conversions, and a horizontal add at its end. This stage rearranges
every layer matrix once, when the model loads (stages/kernels/repacked.py draws the layout),
and plugs its kernel into the fused stage's layer stack (stages/kernels/repack_steps.py):

* Rows go in groups of 8 (GROUP). A group's block holds the 8 rows' scales side by side, then
  their packed values in 4-byte pieces taken from the 8 rows in turn. One 32-byte load is the
  same 8 values of all 8 rows; one activation dword, broadcast, multiplies them in one vpdpbusd
  whose 8 int32 lanes are the 8 rows. Each row owns one lane of every accumulator, down to the
  float result: a group's 8 outputs leave in one vector store, with no horizontal add at all.
* Scales load 8 rows at a time (vcvtph2ps of 8 float16); the K-quants' 6-bit scales and mins
  sit in 12 byte planes across the rows, unpacked for all 8 with a handful of byte operations.
  The mins and offsets fold through the activation's block sums, once per block and row lane.
* Threads split a matrix in whole groups; prefill runs the same kernel over 2 to 4 prompt rows
  at a time (each loaded group block serves them all), the integer GEMM for every type, Q6_K
  and the K-quants included.
* K and V are stored as float16 (llama.cpp's default): half the bytes attention reads at long
  contexts. LLM_KV_TYPE=f32 keeps float32, to measure what that buys (chapter 10).

The price: the repacked weights are a private copy, no longer views of the mapped file: loading
does the rearranging (load time), and the copy is resident memory of this process alone, where the
mapped file's pages are shared with the page cache. Once a matrix is copied its file pages are
given back (madvise), so resident memory is about the copy plus the embedding rows read (the
chapter shows both beside the fused stage's and the file's size).

One kernel serves decode and prefill, and computes every (weight row, activation row) pair with
the same instructions in the same order whatever else it computes: a row's logits are the same
bits alone, in a prompt or in a batch (row_block = 1: nothing is padded). Numerics are int8's
(LOGIT_TOLERANCE); only the order of float additions differs from the fused stage.
What limits it: decode still reads every weight once per token; once the kernel keeps up with
memory, the bandwidth floor is the limit, and the roofline chart shows how close it gets.
"""

from __future__ import annotations

import os

import numpy as np

from common.quants import UnsupportedTypeError
from stages.fused import LOGIT_TOLERANCE, FusedBackend
from stages.kernels import repack_steps
from stages.kernels.layer_stack import ROWS
from stages.kernels.repack_steps import REPACKED, Repacked
from stages.kernels.repacked import REPACK_TYPES, repack, repacked_bytes, unpack
from stages.quantized import QuantMatrix

__all__ = ["RepackBackend", "RepackedMatrix", "LOGIT_TOLERANCE", "KV_TYPES"]

KV_TYPES = {"f16": np.float16, "f32": np.float32}


class RepackedMatrix:
    """A weight rearranged in groups of 8 rows (stages/kernels/repacked.py): `data` uint8, a view
    into the stage's one buffer once the model has loaded; `source` the file's rows it came from."""

    def __init__(self, source: QuantMatrix, tensor):
        self.source, self.tensor = source, tensor
        self.name, self.kind, self.shape = source.name, source.kind, source.shape
        self.row_bytes = source.row_bytes
        self.nbytes = repacked_bytes(self.shape[0], self.row_bytes)
        self.data = None

    def rows(self) -> np.ndarray:
        """The file's bytes again (repacked.unpack): what the tests compare with the source."""
        return unpack(self.data, self.kind, self.shape[0], self.row_bytes)


class RepackBackend(FusedBackend):
    name = "repack"
    row_block = 1                        # the kernels give a row the same bits in any batch
    stack = repack_steps.STACK           # fused's, with this stage's kernel for repacked matrices
    kv_dtype = np.float16                # K and V as llama.cpp keeps them (LLM_KV_TYPE=f32: float32)

    def __init__(self, threads: int | None = None, kv_type: str | None = None):
        super().__init__(threads)
        kv_type = kv_type or os.environ.get("LLM_KV_TYPE", "f16")
        if kv_type not in KV_TYPES:
            raise UnsupportedTypeError(f"LLM_KV_TYPE={kv_type!r}: the repack stage stores K and V as "
                                       f"{' or '.join(KV_TYPES)}")
        self.kv_dtype = KV_TYPES[kv_type]
        self.buffer = None               # every repacked matrix, one after another

    def layout_of(self, w) -> int:
        return REPACKED if isinstance(w, RepackedMatrix) else ROWS

    def _ops(self, model, rows, cache):
        """This stage's ops record (stages/kernels/repack_steps.py): no arrays."""
        return Repacked()

    def _head_ops(self, M, K):
        return Repacked()

    # ---- weights: rearranged once, at load ------------------------------------------------------
    def prepare_matrix(self, tensor):
        m = QuantMatrix(tensor)
        return RepackedMatrix(m, tensor) if m.kind in REPACK_TYPES else m      # float matrices stay as they are

    def tie_output(self, embedding, tensor):
        """The output head as its own repacked copy: the embedding lookup keeps the file's rows."""
        return RepackedMatrix(embedding, tensor) if embedding.kind in REPACK_TYPES else embedding

    def finish_load(self, model):
        """Every matrix rearranged into one buffer (the layer stack reads one blob)."""
        matrices = [w for w in model._weights() if isinstance(w, RepackedMatrix)]
        self.buffer = np.empty(sum(m.nbytes for m in matrices), np.uint8)
        o = 0
        for m in matrices:
            m.data = repack(m.source.data, m.kind, self.buffer[o:o + m.nbytes])
            o += m.nbytes
            if m.source is not model.token_embd:        # the lookup still reads the embedding's rows
                model.gguf.release(m.tensor)

    def matmul(self, x, w):
        """The output head: its repacked copy through the same kernel."""
        if isinstance(w, RepackedMatrix):
            return self.matmul_blocks(x, w)
        return super().matmul(x, w)
