"""Stage 6, threads: the quantized kernels on every core.

The lesson: decode reads every weight once per token, so the roofline says it is bound by
memory bandwidth; then what does a second core buy, when the memory is shared? Measured here:
one thread reads 10.7-12.3 GB/s, two read 10.2-11.9 (common/roofline.py: memory is about
saturated by one streaming core), while the peak FLOP/s doubles. But the quantized stage's
kernels do not stream at the memory's speed: they unpack 3.5-6 billion weights a second on
one core, 2.2-4 GB/s of blocks, a third of the bandwidth. Decode on one core is bound by the
unpacking, and that is what a second core adds: TinyLlama's geometry decodes 1.6x faster on
2 threads, to within 1.2-1.6x of the bandwidth floor (file bytes / measured bandwidth); with
more cores the floor, not the cores, would set the time.

What changes, and nothing else:

* Decode (one activation row): the rows of a weight are split in --threads contiguous ranges,
  one per iteration of a numba `prange`, and each range runs the quantized stage's fused
  kernel for the weight's type (stages/thread_kernels.py). The threads share nothing but the
  activation row (a few KiB): each streams its own rows' blocks.
* Prefill (M prompt rows): the 64-row panels are split the same way; each thread decodes its
  own panels into its own buffer and runs the simd stage's 4 x 4 kernel on them.
* Attention: the inherited composite looped over heads in Python, four numba calls per head,
  with a scalar dot product and a transposed view of V: 14% of SmolLM2's decode and a quarter
  of a 128-token TinyLlama prompt on the quantized stage. One fused kernel per layer replaces
  it, a (query row, head) pair per `prange` iteration, V read row by row as it lies in memory:
  SmolLM2 decode 231 -> 30 us per layer (2 threads), TinyLlama's 128-token prefill 1.42 s ->
  0.13 s of attention on one thread.
* `--threads N` (default: the physical cores, common.machine.physical_cores; at most numba's
  pool) sizes numba's thread pool (numba.set_num_threads) whenever this backend runs a kernel,
  and is stated in every run record. Splitting work never changes the order of the additions
  inside one value, so 1 thread and N give the same logits, bit for bit (tests/test_threads.py).

Measured here (2-core Xeon VM, shared, AVX-512/VNNI; medians of 3 alternating rounds of
`python scripts/bench_vs_llama.py --rounds 3`, records in profiles/bench/vs_llama_<model>.json;
in brackets the ratios of an earlier run of the same command: on this machine figures move
by up to 1.6x from run to run, ratios measured side by side less):

                          decode ms/token, 64-token prompt       TTFT of 128 tokens, ms
                          quantized  threads  llama.cpp          quantized  threads  llama.cpp
    SmolLM2-135M  1 thr      40.2      28.7      25.4               1087       483      1023
                  2 thr        -       21.7      13.1                 -        332       600
    TinyLlama*    1 thr     211.8     160.6     109.0               5421      4149      2152
                  2 thr        -      102.4      57.5                 -       2470      1308
    * synthetic: TinyLlama 1.1B's geometry and Q4_K/Q6_K mix, random weights

So against llama.cpp at the same thread count: decode 1.13x [1.41x] (1 thread) and 1.66x
[1.80x] (2) on SmolLM2, 1.47x [1.37x] and 1.78x [1.66x] on TinyLlama; TTFT 0.47x [0.52x]
and 0.55x [0.62x] on SmolLM2 (ahead: llama.cpp's Q4_1 prompt path is its slow one), 1.93x
[1.77x] and 1.89x [2.19x] on TinyLlama. Scaling 1 -> 2 threads: 1.32x [1.19x] (SmolLM2),
1.57x [1.61x] (TinyLlama); llama.cpp's 1.94x and 1.90x. Against the bandwidth floor (637
MiB / the read bandwidth measured in the same run, 10.8 GB/s: 62 ms): TinyLlama on 2
threads 1.65x [1.19x] of it; the floor itself moved from 62 to 84 ms between runs, and
llama.cpp ran below it (0.93x; 0.71x once): this VM's 300 MiB L3 keeps part of the
weights between tokens, so the floor is approximate. What is left:

* the kernels: per core, llama.cpp's hand-written AVX2/AVX-512 kernels multiply 8-bit
  activations by the 4-bit weights with vpmaddubsw, 32 products per instruction; ours convert
  each nibble to float (about 5 instructions per 8 weights). That is the unpacking bound; the
  int8 stage takes llama.cpp's road (8-bit activations, vpdpbusd) and measures what it buys.
* SmolLM2's matrices are small (0.2-0.6 MiB) and its file fits this machine's L3: per token
  there are ~210 parallel regions of a few tens of microseconds, each with a fork/join of
  3-5 us, and ~1.5 ms of Python between them; that is why it scales less than TinyLlama.
* prefill: the float 4 x 4 kernel runs at ~66 GFLOP/s on a core here, near what 256-bit FMAs
  allow; llama.cpp's integer GEMM does ~105 GOP/s on TinyLlama's prompt.

Cold JIT of this stage's three parallel kernels: ~25 s the first time (they compile the
quantized kernels into themselves), cached after.
"""

from __future__ import annotations

import numba
import numpy as np

from stages.quant_kernels import F16_TO_F32
from stages.quantized import PREFILL_ROWS, X_CHUNK_BYTES, QuantizedBackend, QuantMatrix
from stages.simd import PANEL
from stages.thread_kernels import attention_parallel, matvec_parallel, prefill_parallel


def default_threads() -> int:
    """Physical cores this process may use (hyperthreads share a core's load ports and FMA
    units, which decode and prefill keep busy), at most numba's pool size."""
    from common.machine import physical_cores
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
        return prefill_parallel(x, w.data, w.kind, F16_TO_F32, self.threads, PREFILL_ROWS, chunk)

    def attention(self, q, k, v, n_head: int, n_head_kv: int, start_pos: int):
        """One fused kernel per layer instead of four numba calls per head."""
        self._pool()
        hd = q.shape[1] // n_head
        return attention_parallel(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k),
                                  np.ascontiguousarray(v), n_head, n_head_kv, start_pos,
                                  np.float32(1.0 / np.sqrt(hd)))
