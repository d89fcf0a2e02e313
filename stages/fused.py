"""Stage 9, fused: one compiled call per token; the cost of dispatch.

The lesson: between two small kernels an interpreter and a thread pool spend time the roofline
does not show, the CPU's kernel-launch overhead. The int8 stage pays it at every op: Python
calls each matmul, norm and attention, and each parallel kernel forks numba's pool and joins it
(8 parallel kernels per layer: the 7 matmuls and attention). This stage removes both:

* The layer stack is one call (`forward_layers`, the hook in common/model.py): one numba
  `prange` with one iteration per thread, which stays inside for every op of every layer and
  meets the others at a spin barrier between dependent ops (stages/kernels/sync.py). Per token:
  one fork/join for the layers and one for the output head, instead of one per op; the count
  of barriers is OPS_PER_LAYER per layer (stages/kernels/layer_stack.py lists the ops). The work of
  an op is handed out in items from an atomic counter, so a thread slowed by another process
  takes fewer.
* Fused projections: Wq, Wk, Wv are one list of row chunks over one rounded activation, RoPE
  and the KV cache write on the way out; W_gate and W_up in one pass with silu(gate) * up
  applied as they finish; residual adds folded into Wo and W_down.
* Integer tiles (stages/kernels/int_tiles.py): each block's integer sum is scaled into a float
  vector accumulator, one horizontal add per row (the int8 stage adds per block); prefill runs
  them register-blocked, 4 weight rows x 4 prompt rows (1 x 8 for the K-quants), so each
  loaded block serves several products: an integer GEMM where int8 multiplied floats.
  Without AVX2 + F16C the int8 stage's integer loops run instead (decode and prefill).
* Decode attention is split by chunks of CHUNK positions (flash-decoding): partial softmax sums
  per (head, chunk), merged in order, so a long context keeps every thread busy, and 1 thread
  and N give the same bits. exp is a vectorizable polynomial instead of libm's call.
* numba's threading layer must give each iteration of the region its own thread: OpenMP and
  workqueue do (the entry points ask for them, app.configure_numba); TBB, whose work stealing
  may run two iterations on one thread (a barrier would wait forever), does not, and the stage
  then says it cannot run (BARRIER_LAYERS). A fork/join costs far more than a barrier on either.

Numerics are int8's: the same rounded activations; only the order of float additions differs
(LOGIT_TOLERANCE is int8's). What limits it: decode still streams every weight once per token,
so the bandwidth floor remains; the barriers serialize small ops (norms, rounding) that one
thread does while the others wait; KV stays float32 where llama.cpp keeps float16.
Python's share of a step is measured by `kernel_seconds` (the notebook chapter 09_fused).
"""

from __future__ import annotations

import time

import numba
import numpy as np

from stages.int8 import LOGIT_TOLERANCE, Int8Backend
from stages.kernels import layer_stack
from stages.kernels.layer_stack import OPS_PER_LAYER, ROWS, Cache, Dims, Rows, Weights, matrix_table, read_only
from stages.kernels.sync import ABORT, ARRIVALS, CLOCK, CoreShare, new_sync
from stages.quantized import QuantMatrix

__all__ = ["FusedBackend", "LOGIT_TOLERANCE", "OPS_PER_LAYER", "BARRIER_LAYERS"]

# numba's threading layers that run every iteration of a parallel loop on a thread of its own
BARRIER_LAYERS = ("omp", "workqueue")


def threading_layer() -> str:
    """The layer numba's pool runs on (starting the pool, which fixes it for the process)."""
    numba.set_num_threads(numba.get_num_threads())
    return numba.threading_layer()


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Plan:
    """What the compiled layer stack reads, gathered once per model (layer_stack.Weights): `blob`
    uint8 holding every layer matrix (the buffer they all come from: the mapped file, or the
    repack stage's one buffer; else a copy), `mats` their MATRIX records (wq wk wv wo gate up down
    of each layer), `norms` [n_layer, 2, D] (attn_norm, ffn_norm)."""

    def __init__(self, model, layout_of):
        mats = [m for L in model.layers for m in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)]
        roots = {id(_root(m.data)): _root(m.data) for m in mats}
        root = next(iter(roots.values()))
        if len(roots) == 1 and root.dtype == np.uint8 and root.ndim == 1 and root.flags.c_contiguous:
            blob = root
            offsets = [_address(m.data) - _address(root) for m in mats]
        else:                                   # matrices from several buffers: one copy of them all
            blob = np.concatenate([m.data.reshape(-1) for m in mats])
            offsets = np.cumsum([0] + [m.data.nbytes for m in mats[:-1]]).tolist()
        table = matrix_table([(o, m.shape[0], m.row_bytes, m.kind, layout_of(m)) for o, m in zip(offsets, mats)])
        norms = np.ascontiguousarray(np.stack([np.stack([L.attn_norm, L.ffn_norm]) for L in model.layers]),
                                     dtype=np.float32)
        self.weights = Weights(read_only(blob), table, norms)


def kv_bits(dtype) -> np.dtype:
    """The dtype the kernels read K/V stored as `dtype` in: float32 as it is, float16 as its bits."""
    return np.dtype(np.uint16) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def kv_view(a: np.ndarray) -> np.ndarray:
    """A K/V array as the kernels read it (kv_bits)."""
    return a.view(kv_bits(a.dtype))


class FusedBackend(Int8Backend):
    name = "fused"
    fuses_layers = True
    stack = layer_stack.STACK       # the compiled layer stack (a later stage's has some steps changed)

    @staticmethod
    def unavailable_reason() -> str | None:
        layer = threading_layer()
        if layer not in BARRIER_LAYERS:
            return (f"its barriers need numba's {' or '.join(BARRIER_LAYERS)} threading layer and this process "
                    f"got '{layer}'; start it through `python -m app` (or set NUMBA_THREADING_LAYER=omp before "
                    f"numba loads)")
        return None

    # Rows per padded batch: the prefill tiles take 4 (32-value types) or 8 (K-quants) activation
    # rows, the rows left over another path; a multiple of both sends every row of a batch down the
    # tiles, so a row's bits do not depend on its neighbours (common/backend.py, row_block).
    row_block = 8

    def __init__(self, threads: int | None = None):
        super().__init__(threads)
        self._plan = None
        self._heads = {}                # id(weight) -> (the weight, its blocks as a blob, its one MATRIX record)
        self.kernel_seconds = 0.0       # time inside the compiled calls, for Python's share
        self.cores = CoreShare()        # all threads, or one while the cores are shared
        self.barriers = 0               # barriers crossed in the last call (counted by the threads)
        self.phase_seconds = np.zeros(OPS_PER_LAYER)    # time in each phase (layer_stack.PHASES), summed
        self._layers_dims = None                        # the Dims of the last call of the layers

    def layout_of(self, w) -> int:
        """How a matrix's rows are stored (layer_stack.MATRIX.layout): as the file stores them."""
        return ROWS

    def _threads(self) -> int:
        """The region's iterations: numba's pool size as the backend set it (one thread per
        iteration: the threading layer was checked when the stage loaded)."""
        self._pool()
        return self.cores.threads(numba.get_num_threads())

    def _dims(self, model) -> Dims:
        cfg = model.config
        return Dims(cfg.n_head, cfg.n_head_kv, cfg.n_ff, cfg.eps, np.float32(1.0 / np.sqrt(cfg.head_dim)),
                    model.rope_cos, model.rope_sin)

    def _run(self, model, tokens, cache: Cache, rows: Rows):
        """The layer stack over the rows `tokens` [M]: h [M, D] before the final norm."""
        h = self.embed(model.token_embd, tokens)
        weights, dims, nt = self._compiled(model)
        self._layers_dims = dims            # the head's call takes the same types (matmul_blocks)
        sync = new_sync(phases=OPS_PER_LAYER)
        t0 = time.perf_counter()
        self.stack.run_layers(h, weights, cache, rows, dims, sync, nt, self._ops(model, rows, cache))
        self._ran(sync, nt, t0)
        self.cores.ran(nt, numba.get_num_threads(), len(tokens), time.perf_counter() - t0)
        return h

    def _compiled(self, model):
        """(weights, dims, threads): what the compiled stack takes beside h and the rows."""
        if self._plan is None:
            self._plan = _Plan(model, self.layout_of)
        return self._plan.weights, self._dims(model), self._threads()

    def _ran(self, sync, nt: int, t0: float):
        """After a compiled call begun at t0: its time counted (shared out over the phases as the
        time-stamp counter saw it, where sync has clocks) and its barriers, a barrier that gave up
        raised."""
        seconds = time.perf_counter() - t0
        self.kernel_seconds += seconds
        clock = sync[CLOCK:].astype(np.float64)
        if clock.shape[0] == OPS_PER_LAYER and clock.sum() > 0:
            self.phase_seconds += clock / clock.sum() * seconds
        self.barriers = int(sync[ARRIVALS]) // nt
        if sync[ABORT]:
            raise RuntimeError(f"the {self.name} stage's {nt} threads did not all run (a barrier gave up): "
                               "numba's threading layer must give each parallel iteration its own thread")

    def _ops(self, model, rows: Rows, cache: Cache):
        """The ops record of a call of the layer stack: which stage's steps run and the arrays they
        need (layer_stack.py's hooks); None: this stage's."""
        return None

    def _head_ops(self, M: int, K: int):
        """The same for the output head's call, of M rows of K values."""
        return None

    def forward_layers(self, model, tokens, start_pos: int):
        """One sequence: its arena is one page of n_ctx positions, row m at start_pos + m."""
        kv = model.kv
        positions = np.arange(start_pos, start_pos + len(tokens), dtype=np.int64)
        cache = Cache(kv_view(kv.k), kv_view(kv.v), np.zeros((1, 1), np.int64), kv.k.shape[1])
        return self._run(model, tokens, cache, Rows(positions, positions, np.zeros(len(tokens), np.int64)))

    def forward_layers_batch(self, model, batch):
        """Many sequences (common/batch.py): each row at its own position and cache slot, reading its
        own sequence's pages, all in the same one call."""
        pool = batch.pool
        k, v = (kv_view(a.reshape(pool.n_layer, -1, pool.kv_dim)) for a in (pool.k, pool.v))
        rows = Rows(batch.positions, batch.slots, np.maximum(batch.row_seq, 0))
        return self._run(model, batch.tokens, Cache(k, v, batch.tables, pool.page_size), rows)

    def _head(self, w):
        """The output matrix as a blob and its one MATRIX record. The entry holds the matrix
        itself: were it let go, a later matrix could be given its id and read its record."""
        head = self._heads.get(id(w))
        if head is None or head[0] is not w:
            head = self._heads[id(w)] = (w, read_only(w.data.reshape(-1)),
                                         matrix_table([(0, w.shape[0], w.row_bytes, w.kind, self.layout_of(w))]))
        return head[1:]

    def matmul(self, x, w):
        """The output head (the one matmul the graph still calls): one compiled call."""
        if not isinstance(w, QuantMatrix):
            return super().matmul(x, w)
        return self.matmul_blocks(x, w)

    def matmul_blocks(self, x, w):
        blob, mat = self._head(w)
        x = np.ascontiguousarray(x, dtype=np.float32)
        nt = self._threads()
        t0 = time.perf_counter()
        # the K/V dtype and Dims of the layers' calls (their compiled code), even before the layers ran
        y = self.stack.matmul_rows(x, blob, mat, nt, self._head_ops(*x.shape), kv_bits(self.kv_dtype),
                                   self._layers_dims)
        self.kernel_seconds += time.perf_counter() - t0
        return y
