"""Stage 7, threads: the quantized kernels on every core.

The lesson: decode reads every weight once per token, so the roofline says it is bound by
memory bandwidth; then what does a second core buy, when the memory is shared? Two answers,
and the measurements say which holds on your machine (`make report`, and the roofline chart's
bandwidth at 1 and N threads):

* if one core already streams memory as fast as the memory delivers, little: the cores queue
  for the same bytes;
* if one core is slower than memory (the quantized stage's kernels spend several instructions
  per weight unpacking it), each added core adds its unpacking, up to the bandwidth floor
  (file bytes / bandwidth per token).

What changes, and nothing else:

* Decode (one activation row): the rows of a weight are split into --threads contiguous
  ranges, one per iteration of a numba `prange`, each running the quantized stage's fused
  kernel for the weight's type (stages/kernels/threaded.py). The threads share nothing but the
  activation row (a few KiB): each streams its own rows' blocks.
* Prefill (M prompt rows): the 64-row panels are split the same way; each thread decodes its
  own panels into its own buffer and runs the simd stage's 4 x 4 kernel on them.
* Attention: the inherited composite loops over heads in Python, four numba calls per head,
  with a scalar dot product and a transposed view of V. One fused kernel per layer replaces
  it, a (query row, head) pair per `prange` iteration, V read row by row as it lies in memory.
  Its twin for a batch of sequences (common/batch.py) reads each row's K and V through its
  sequence's page table, in place.
* `--threads N` (default: the physical cores, at most numba's pool) sizes numba's thread pool
  whenever this backend runs a kernel, and is stated in every run record. Splitting work never
  changes the order of the additions inside one value, so 1 thread and N give the same logits,
  bit for bit (tests/test_threads.py).

What limits it: every matmul is one parallel region, with a fork and a join, and Python runs
between them; on a small model (SmolLM2's matrices are a fraction of a MiB) those costs are a
visible share of a token (the per-op profile's "python overhead"), so it scales less than a
large one. And the kernels still convert every weight to float, where llama.cpp multiplies
8-bit integers: the int8 stage takes that road.
"""

from __future__ import annotations

import numba
import numpy as np

from common.cpu import physical_cores
from stages.kernels.threaded import attention_paged_parallel, attention_parallel, matvec_parallel, prefill_parallel
from stages.kernels.toolkit import F16_TO_F32
from stages.quantized import PANEL_ROWS, X_CHUNK_BYTES, QuantizedBackend, QuantMatrix
from stages.simd import PANEL


def default_threads() -> int:
    """Physical cores this process may use (hyperthreads share a core's load ports and FMA
    units, which decode and prefill keep busy), at most numba's pool size."""
    return max(1, min(physical_cores(), numba.config.NUMBA_NUM_THREADS))


class ThreadsBackend(QuantizedBackend):
    name = "threads"

    def __init__(self, threads: int | None = None):
        super().__init__(threads)
        wanted = threads or default_threads()
        # numba's pool has NUMBA_NUM_THREADS threads (the logical CPUs, unless set): no more
        self.threads = max(1, min(int(wanted), numba.config.NUMBA_NUM_THREADS))

    def _pool(self):
        """Size numba's thread pool for this backend (cheap when it already is: another
        backend in the same process may have asked for a different number)."""
        if numba.get_num_threads() != self.threads:
            numba.set_num_threads(self.threads)

    def matmul(self, x, w):
        if not isinstance(w, QuantMatrix):
            return super().matmul(x, w)
        self._pool()
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[0] == 1:                                   # decode: the rows split
            return matvec_parallel(x[0], w.data, w.kind, F16_TO_F32, self.threads)[None, :]
        K = x.shape[1]                                        # prefill: the panels split
        chunk = max(PANEL, X_CHUNK_BYTES // (4 * K) // PANEL * PANEL)
        return prefill_parallel(x, w.data, w.kind, F16_TO_F32, self.threads, PANEL_ROWS, chunk)

    def attention(self, q, k, v, n_head: int, n_head_kv: int, start_pos: int):
        """One fused kernel per layer instead of four numba calls per head."""
        self._pool()
        hd = q.shape[1] // n_head
        return attention_parallel(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k),
                                  np.ascontiguousarray(v), n_head, n_head_kv, start_pos,
                                  np.float32(1.0 / np.sqrt(hd)))

    def attention_paged(self, q, k, v, n_head: int, n_head_kv: int, layer: int, batch):
        """A batch of sequences (common/batch.py): the same fused kernel, each row reading its
        own sequence's keys and values through its page table, in place."""
        self._pool()
        n, pool = batch.n_rows, batch.pool
        self.store_kv(pool, layer, batch.slots[:n], k[:n], v[:n])
        hd = q.shape[1] // n_head
        return attention_paged_parallel(np.ascontiguousarray(q, dtype=np.float32), pool.k[layer], pool.v[layer],
                                        batch.tables, batch.row_seq, batch.positions, n, n_head, n_head_kv,
                                        np.float32(1.0 / np.sqrt(hd)))
