"""The layer stack in one compiled call (stages/fused.py tells the story; later stages change steps of it).

    STACK.run_layers(h, weights, cache, rows, dims, sync, nt, ops)
            every op of every layer, in ONE parallel region: nt threads (one prange iteration
            each) walk the same ops and meet at a barrier between two that depend on each other
    STACK.run_phases(..., span, ops, *STACK.scratch_for(...))
            the phases span.first..span.last-1 only, Wo and W_down adding into span.sums (the tp
            stage: it stops after each, to all-reduce)
    STACK.matmul_rows(x, blob, mats, nt, ops, kv, dims)     one weight matrix (the output head): the
            phases after the last layer, in a call of run_phases of their own

The ops of one layer are the table PHASES (OPS_PER_LAYER of them, a barrier after each; the
region's fork and join once per call). Each is split into work items that the threads take from
counters (stages/kernels/sync.py's next_item: each thread its own contiguous range first):

    NORM_ATTN  rows of h -> x = rms_norm(h) * attn_norm, rounded to 8-bit blocks
    QKV        row chunks of Wq, Wk, Wv (one list): integer tiles, then RoPE on the chunk's pairs,
               k and v written straight into the cache
    ATTEND     (query row, head, chunk of CHUNK positions) -> the chunk's max, sum of exp and
               weighted sum of V: flash-decoding's partial results
    MERGE      rows: the chunks of each head merged (online softmax), rounded for Wo
    WO         row chunks of Wo, added into h (the residual)
    NORM_FFN   rows of h -> x = rms_norm(h) * ffn_norm, rounded
    GATE_UP    row chunks of W_gate and W_up together: f = silu(gate) * up on the way out
    ROUND_F    rows of f, rounded for W_down
    DOWN       row chunks of W_down, added into h

After the last layer's phases come the output head's two (HEAD_PHASES: its rows rounded, then
its matrix, straight into Span.sums [M, vocab]). matmul_rows runs them alone, in a call of
run_phases whose weights are the head's matrix (no layers): the layers' compiled code, not a
parallel function of its own (each is one more compile of every kernel it calls).

The rows of a call belong to one sequence or to many (a batched step, common/batch.py): every row
has its own position, cache slot and sequence, and attends over its own sequence's positions
through its page table (stages/kernels/layer_ops.py). One sequence's arena is one page.

What it reads, as named records (numba compiles named tuples of arrays):

    Weights(blob, mats, norms)   blob uint8, read-only (read_only): every layer matrix (the mapped
                                 file itself when they all come from it); mats: MATRIX records,
                                 WQ..DOWN of each layer;
                                 norms float32 [n_layer, 2, D] (attn_norm, ffn_norm)
    Cache(k, v, tables, page_size)      k, v [n_layer, n_slots, kv_dim]: float32, or float16 bits
                                 (uint16); tables int64 [S, pages]: each sequence's pages
    Rows(positions, slots, seq)  int64 [M] each: a row's position, cache slot (-1: a padding row,
                                 not stored, not attended) and sequence (its row of tables)
    Dims(n_head, n_head_kv, n_ff, eps, scale, cos, sin)   the model's shape, RoPE's tables
    Span(first, last, sums)      phases first..last-1, numbered il * OPS_PER_LAYER + i across the
                                 layers, first a norm or the head's rounding (the others read what
                                 the phase before left in the call's scratch); sums [M, D]: where
                                 WO and DOWN add their products (h itself, or a zeroed array that
                                 receives them); the head's output [M, vocab]
sync may carry a clock per phase (sync.new_sync(phases=OPS_PER_LAYER)): thread 0's time-stamp
counter at each barrier, summed per phase over the layers (where a call's time went).

Later stages change a few steps of the stack, never the stack. The steps are functions of this
file the stack calls by name (STEPS: matmul_chunk, rows_multiple, round_row, activation_block,
attend, merge, part_shape), and a stage that changes some writes its own in its own kernel file
and makes its stack in one line: `STACK = with_steps(<the stack it builds on>, <its ops records>,
matmul_chunk=..., ...)`. Its calls pass its **ops record**, a namedtuple of the arrays its steps
need (numba types every namedtuple class apart: a record serves one stack). This stage's stack is
STACK, its record None. The repack stage changes matmul_chunk and rows_multiple
(stages/kernels/repack_steps.py), the prefill stage its matmuls, rounding and attention
(stages/kernels/prefill_steps.py): this file knows neither.

A matrix's `layout` says how its rows are stored: ROWS as the file stores them (this stage:
stages/kernels/int_tiles.py); a later stage numbers its own (repack_steps.REPACKED). Float
matrices (F32/F16/BF16) are decoded a row at a time and multiplied in float; without AVX2 the
int8 stage's loops run.

Nothing here depends on the number of threads but who computes what: every value is computed
by the same code whichever thread takes its item, and attention's chunks are fixed, so 1 thread
and N give the same bits.
"""

from __future__ import annotations

import dis
import inspect
from collections import namedtuple
from pathlib import Path
from types import FunctionType

import numpy as np
from numba import jit, njit, prange
from numba.core.dispatcher import Dispatcher

from stages.kernels import int_tiles, toolkit, vector_ir
from stages.kernels.dequant_dot import dequantize_rows
from stages.kernels.int_dot import _dot_row
from stages.kernels.layer_ops import (
    CHUNK,
    attend_chunk,
    chunks_of,
    kv_value,
    merge_chunks,
    rms_norm_row,
    rope_rows,
    silu_mul,
)
from stages.kernels.q8 import Q8Blocks, Q8KBlocks, pack_arrays, quantize_row
from stages.kernels.sync import CLOCK, barrier, cycles, new_sync, next_item
from stages.kernels.toolkit import BF16, F16, F32, Q4_K, Q5_K, Q6_K, block_bytes, block_values, per_phase

DECODE_WEIGHTS = 65536  # weights per decode work item: a few microseconds, many items per op
PREFILL_ITEM_ROWS = 16  # the fewest weight rows in a prefill work item (times every prompt row, or a block of them)
f32 = np.float32

# How a matrix's rows are stored in the blob: as the file stores them (a later stage numbers its own).
ROWS = 0
# One matrix: where it starts in the blob, its rows (N), bytes per row, ggml type, layout.
MATRIX = np.dtype([("offset", np.int64), ("rows", np.int64), ("row_bytes", np.int64), ("kind", np.int64),
                   ("layout", np.int64)])
# The seven matrices of a layer, in mats order.
WQ, WK, WV, WO, GATE, UP, DOWN = range(7)
MATS_PER_LAYER = 7

Weights = namedtuple("Weights", "blob mats norms")
Cache = namedtuple("Cache", "k v tables page_size")
Rows = namedtuple("Rows", "positions slots seq")
Dims = namedtuple("Dims", "n_head n_head_kv n_ff eps scale cos sin")
Span = namedtuple("Span", "first last sums")
# A call's scratch arrays, and the same with the rounded activations (numba's parallel loop takes
# no tuple inside a tuple, so the packs join inside each thread's call).
Scratch = namedtuple("Scratch", "xin fbuf y part scores fs counters")
Work = namedtuple("Work", "xin fbuf y part scores fs counters p32 pk")

# The phases of one layer, in order; the op each runs (and, for the norms, which norm vector).
NORM_ATTN, QKV, ATTEND, MERGE, WO_OP, NORM_FFN, GATE_UP, ROUND_F, DOWN_OP = range(9)
PHASES = (NORM_ATTN, QKV, ATTEND, MERGE, WO_OP, NORM_FFN, GATE_UP, ROUND_F, DOWN_OP)
OPS_PER_LAYER = len(PHASES)
_PHASES = np.array(PHASES, dtype=np.int64)
# After the last layer's: the output head's phases, numbered on from the layers' (n_layer *
# OPS_PER_LAYER + 0, + 1), and their ops: its rows rounded, its matrix (_matmul_op).
HEAD_ROUND, HEAD_OP = OPS_PER_LAYER, OPS_PER_LAYER + 1
HEAD_PHASES = 2


def matrix_table(entries) -> np.ndarray:
    """MATRIX records from (offset, rows, row_bytes, kind, layout) tuples."""
    return np.array([tuple(int(v) for v in e) for e in entries], dtype=MATRIX)


def read_only(blob: np.ndarray) -> np.ndarray:
    """The weights as the compiled calls take them (Weights.blob, matmul_rows' blob): a read-only
    view. numba types a read-only array apart from a writable one, and compiles a function and
    everything it calls once for each: the mapped file is read-only and the repack stage's buffer
    is not, so without this the fused and repack stages compiled the same stack and head twice (the
    slowest things here to compile)."""
    view = blob.view()
    view.flags.writeable = False
    return view


# ---- one chunk of weight rows times every activation row ---------------------------------------

@njit(cache=True, inline="always")
def is_k(kind):
    return kind == Q4_K or kind == Q5_K or kind == Q6_K


@njit(cache=True, inline="always")
def is_float(kind):
    return kind == F32 or kind == F16 or kind == BF16


@njit(cache=True)
def _chunk_tiles(kind, w, off, rb, r0, r1, M, p32, pk, out, col):
    """out[m, col + r] = (row r of the matrix at w[off:]) . (activation row m), r0 <= r < r1:
    prefill in int_tiles.TILE shapes, decode and the edges a row at a time. (Decode reads one row
    after another: 4 rows interleaved, as a 4 x 1 tile would read them, streamed from memory at
    less than half the rate on the machine first measured: a row is a short stream, and the
    prefetchers lose track of four at once. The repack stage's layout is the answer to that.)"""
    nb = rb // block_bytes(kind)
    r = r0
    if M > 1:
        R, C = (1, 8) if is_k(kind) else (4, 4)         # int_tiles.TILE
        while r + R <= r1:
            m = 0
            while m + C <= M:
                int_tiles.prefill_tile(kind, w, off + r * rb, rb, nb, p32, pk, m, out, col + r)
                m += C
            while m < M:
                int_tiles.decode_rows(kind, w, off + r * rb, rb, nb, p32, pk, m, out, col + r, R)
                m += 1
            r += R
    if r < r1:
        for m in range(M):
            int_tiles.decode_rows(kind, w, off + r * rb, rb, nb, p32, pk, m, out, col + r, r1 - r)


@njit(cache=True)
def _chunk_loops(kind, w, off, rb, r0, r1, M, p32, pk, out, col):
    """The same products with the int8 stage's integer loops, row by row (CPUs without AVX2)."""
    K = rb // block_bytes(kind) * block_values(kind)
    buf = np.empty(K, dtype=np.int16)
    f16 = toolkit.F16_TO_F32
    for r in range(r0, r1):
        row = w[off + r * rb: off + (r + 1) * rb]
        for m in range(M):
            if is_k(kind):
                out[m, col + r] = _dot_row(kind, row, pk.q[m, :K], pk.d[m], pk.d[m], pk.b16[m], f16, buf)
            else:
                out[m, col + r] = _dot_row(kind, row, p32.q[m, :K], p32.d[m], p32.s[m], p32.sums[m], f16, buf)


_chunk_ints = _chunk_tiles if vector_ir.ISA else _chunk_loops


@njit(cache=True)
def _chunk_float(kind, w, off, rb, r0, r1, m0, m1, xf, out, col, fbuf):
    """Float weights (F32/F16/BF16): each row decoded once, dotted with float rows m0..m1 of xf."""
    K = fbuf.shape[1]
    w2 = w[off + r0 * rb: off + r1 * rb].reshape((r1 - r0, rb))
    for r in range(r1 - r0):
        dequantize_rows(kind, w2, r, fbuf, toolkit.F16_TO_F32)
        for m in range(m0, m1):
            acc = f32(0.0)
            for k in range(K):
                acc += fbuf[0, k] * xf[m, k]
            out[m, col + r0 + r] = acc


# ---- the steps a later stage may change ----------------------------------------------------------
#
# The stack below calls these by name; they are this stage's. A later stage makes its own stack with
# some of them changed (with_steps, at the end of this file).

@njit(cache=True, inline="always")
def rows_of(p32, pk, m0, m1):
    """Activation rows m0..m1 of both packs."""
    return (Q8Blocks(p32.q[m0:m1], p32.d[m0:m1], p32.s[m0:m1], p32.sums[m0:m1]),
            Q8KBlocks(pk.q[m0:m1], pk.d[m0:m1], pk.b16[m0:m1], pk.b32[m0:m1]))


@njit(cache=True, inline="always")
def matmul_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs):
    """Rows r0..r1 of one matrix (a MATRIX record, its bytes in blob) times activation rows m0..m1
    into out[m, col + r]: xf [M, K] the rows in float32, s the call's Work (their 8-bit packs, p32
    and pk), fs [1, K] float32 a thread's own row. Float matrices a row at a time; the others in
    integer tiles on their rows as the file stores them (ROWS)."""
    if is_float(mat.kind):
        _chunk_float(mat.kind, blob, mat.offset, mat.row_bytes, r0, r1, m0, m1, xf, out, col, fs[:, :xf.shape[1]])
        return
    p32, pk = rows_of(s.p32, s.pk, m0, m1)
    _chunk_ints(mat.kind, blob, mat.offset, mat.row_bytes, r0, r1, m1 - m0, p32, pk, out[m0:m1], col)


@njit(cache=True, inline="always")
def rows_multiple(ops, mat):
    """A matmul work item's weight rows are a multiple of this: a decode tile's 4 (int_tiles.decode_rows)."""
    return 4


@njit(cache=True, inline="always")
def round_row(ops, x, m, K, n32, nk, s):
    """Row m of the 8-bit packs (s.p32 if n32, s.pk if nk) from x [K] float32."""
    quantize_row(x, m, K, n32, nk, s.p32, s.pk)


@njit(cache=True, inline="always")
def activation_block(ops, K, M):
    """Activation rows a matmul work item takes, of the call's M (rows of length K): all of them,
    each weight chunk read once for every row."""
    return M


@njit(cache=True, inline="always")
def part_shape(ops, rows):
    """(rows, chunks) of s.part, where attend leaves each (row, head, chunk)'s partial result."""
    n_chunks = 1
    for m in range(rows.positions.shape[0]):
        n_chunks = max(n_chunks, chunks_of(rows.positions[m]))
    return rows.positions.shape[0], n_chunks


@njit(cache=True, inline="always")
def rows_per_item(K, M, multiple):
    """Weight rows per work item: about DECODE_WEIGHTS weight-row products (a few microseconds,
    many items per op), and for rows of a batch at least PREFILL_ITEM_ROWS (a pass of a few rows
    in items of PREFILL_ITEM_ROWS rows would pay a kernel call and a counter for a fraction of a
    microsecond's work on a small model)."""
    if M > 1:
        return max(multiple, max(PREFILL_ITEM_ROWS, DECODE_WEIGHTS // (K * M)) // multiple * multiple)
    return max(multiple, DECODE_WEIGHTS // K // multiple * multiple)



# ---- the phases --------------------------------------------------------------------------------

# Every function a thread calls per phase or per work item compiles as toolkit.per_phase (no
# reference counts: toolkit.py says why).

@njit(cache=True, inline="always")
def packs_needed(mats, j0, j1):
    """(any integer matrix of j0..j1-1 takes Q8_0/Q8_1 blocks, any takes Q8_K)."""
    n32, nk = False, False
    for j in range(j0, j1):
        kind = mats[j].kind
        if not is_float(kind):
            if is_k(kind):
                nk = True
            else:
                n32 = True
    return n32, nk


@njit(cache=True, inline="always")
def layer_packs(mats, il, j0, j1):
    """packs_needed for matrices j0..j1-1 of layer il (WQ .. DOWN)."""
    return packs_needed(mats, il * MATS_PER_LAYER + j0, il * MATS_PER_LAYER + j1)


@per_phase
def _norm_rows(h, il, which, eps, weights, s, ph, t, nt, ops):
    """x = rms_norm(h) * norm `which` of layer il, row by row, rounded for the matrices after it."""
    M, D = h.shape
    j0, j1 = (WQ, WO) if which == 0 else (GATE, DOWN)
    n32, nk = layer_packs(weights.mats, il, j0, j1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        rms_norm_row(h[m], weights.norms[il, which], eps, s.xin[m, :D])
        round_row(ops, s.xin[m], m, D, n32, nk, s)


@per_phase
def _round_f(il, weights, s, ph, t, nt, ops):
    """f = silu(gate) * up, rounded for W_down."""
    M, n_ff = s.fbuf.shape
    n32, nk = layer_packs(weights.mats, il, DOWN, DOWN + 1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        round_row(ops, s.fbuf[m], m, n_ff, n32, nk, s)


@per_phase
def _round_head(h, weights, s, ph, t, nt, ops):
    """The output head's rows h [M, D] (the final norm's output) into s.xin, rounded for its matrix
    (the one after the layers')."""
    M, D = h.shape
    n32, nk = layer_packs(weights.mats, weights.norms.shape[0], WQ, WQ + 1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        for k in range(D):                  # element by element: a slice assignment allocates (no NRT here)
            s.xin[m, k] = h[m, k]
        round_row(ops, s.xin[m], m, D, n32, nk, s)


# error_model="numpy": no check for a zero divisor around silu's division, which otherwise keeps
# LLVM from vectorizing the epilogue (one exp and one division per value, scalar).
@per_phase(error_model="numpy")
def _matmul_op(op, il, sums, weights, cache, rows, dims, s, ops, ph, t, nt):
    """One thread's share of a matmul phase of layer il: work items from counters[ph], each a chunk
    of weight rows times a block of activation rows (activation_block: all of them, unless a later
    stage's ops cut them in blocks) into s.y, then
    the phase's epilogue on those rows:

        QKV      Wq | Wk | Wv rows -> y[:, :nq + 2 nkv]; RoPE on q and k, k and v into the cache
        WO_OP    Wo rows -> y, added into sums [M, D] (h itself, or Span.sums)
        GATE_UP  W_gate and W_up rows r0..r1 -> y[:, r], y[:, n_ff + r]; fbuf = silu(gate) * up
        DOWN_OP  W_down rows -> y, added into sums
        HEAD_OP  the output head's rows (the matrix after layer il - 1's) -> sums [M, vocab]

    One call per phase and thread, and one place that calls the matmul kernels: numba passes every
    array field by value to a function it does not inline, which costs about as much as a work
    item of decode if paid per item."""
    M, D = sums.shape[0], weights.norms.shape[2]
    kv_dim = cache.k.shape[2]
    hd = kv_dim // dims.n_head_kv
    nq, nkv, n_ff = dims.n_head * hd, kv_dim, dims.n_ff
    base = il * MATS_PER_LAYER
    mats = weights.mats
    y = s.y
    if op == QKV:
        K = D
        per = rows_per_item(D, M, rows_multiple(ops, mats[base + WQ]))
        nq_items, nkv_items = (nq + per - 1) // per, (nkv + per - 1) // per
        n_row_items = nq_items + 2 * nkv_items
        xf = s.xin[:, :D]
    elif op == HEAD_OP:                     # the output head, the matrix after the layers': into sums itself
        j, K, N = WQ, D, mats[base].rows
        per = rows_per_item(K, M, rows_multiple(ops, mats[base]))
        n_row_items = (N + per - 1) // per
        xf = s.xin[:, :D]
        y = sums
    else:
        j = WO if op == WO_OP else (GATE if op == GATE_UP else DOWN)
        K = nq if op == WO_OP else (D if op == GATE_UP else n_ff)
        N = n_ff if op == GATE_UP else D
        per = rows_per_item(2 * K if op == GATE_UP else K, M, rows_multiple(ops, mats[base + j]))
        n_row_items = (N + per - 1) // per
        xf = s.xin[:, :nq] if op == WO_OP else (s.xin[:, :D] if op == GATE_UP else s.fbuf)
    mb = M if op == HEAD_OP else activation_block(ops, K, M)     # the head's few rows: one block
    n_items = n_row_items * ((M + mb - 1) // mb)
    while True:
        item = next_item(s.counters, ph, t, nt, n_items)
        if item < 0:
            break
        ri, m0 = item % n_row_items, item // n_row_items * mb          # a block's items one after another
        m1 = min(M, m0 + mb)
        if op == QKV:
            if ri < nq_items:
                j, r0, n, col = WQ, ri * per, nq, 0
            elif ri < nq_items + nkv_items:
                j, r0, n, col = WK, (ri - nq_items) * per, nkv, nq
            else:
                j, r0, n, col = WV, (ri - nq_items - nkv_items) * per, nkv, nq + nkv
        else:
            r0, n, col = ri * per, N, 0
        r1 = min(n, r0 + per)
        for part in range(2 if op == GATE_UP else 1):
            matmul_chunk(ops, mats[base + j + part], weights.blob, r0, r1, m0, m1, xf, s, y, col + part * n_ff,
                         s.fs[t])
        if op == QKV:
            if j != WV:
                rope_rows(y, col + r0, col + r1, hd, dims.cos, dims.sin, rows.positions, m0, m1)
            if j != WQ:
                dst = cache.k if j == WK else cache.v
                for m in range(m0, m1):
                    slot = rows.slots[m]
                    if slot >= 0:
                        for r in range(r0, r1):
                            dst[il, slot, r] = kv_value(y[m, col + r], dst)
        elif op == GATE_UP:
            for m in range(m0, m1):
                gate, up, f = y[m, r0:r1], y[m, n_ff + r0:n_ff + r1], s.fbuf[m, r0:r1]
                for r in range(r1 - r0):
                    f[r] = silu_mul(gate[r], up[r])
        elif op != HEAD_OP:
            for m in range(m0, m1):
                for r in range(r0, r1):
                    sums[m, r] += y[m, r]


@per_phase
def _attend(il, cache, rows, dims, s, ph, t, nt):
    """Work items (query row m, head, chunk c of its positions 0..positions[m]) -> s.part[m, head, c]."""
    M, H, n_chunks = s.part.shape[0], s.part.shape[1], s.part.shape[2]
    kv_dim = cache.k.shape[2]
    hd = kv_dim // dims.n_head_kv
    group = H // dims.n_head_kv
    scores = s.scores[t]
    kc, vc = cache.k[il], cache.v[il]
    while True:
        item = next_item(s.counters, ph, t, nt, M * H * n_chunks)
        if item < 0:
            break
        m = item // (H * n_chunks)
        rest = item - m * H * n_chunks
        hh, c = rest // n_chunks, rest % n_chunks
        t0, t1 = c * CHUNK, min(rows.positions[m] + 1, (c + 1) * CHUNK)
        if rows.slots[m] >= 0 and t0 < t1:
            attend_chunk(s.y[m, hh * hd:(hh + 1) * hd], kc, vc, cache.tables[rows.seq[m]], cache.page_size,
                         hh // group, hd, t0, t1, dims.scale, scores, s.part[m, hh, c])


@per_phase
def _merge(il, weights, cache, rows, dims, s, ops, ph, t, nt):
    """Each row's heads: its own chunks merged in order (flash-decoding's reduction), then rounded for Wo."""
    M, H = s.part.shape[0], s.part.shape[1]
    hd = cache.k.shape[2] // dims.n_head_kv
    n32, nk = layer_packs(weights.mats, il, WO, WO + 1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        out = s.xin[m]
        if rows.slots[m] < 0:
            out[:H * hd] = 0.0                      # a padding row: nothing to attend to
        else:
            n = chunks_of(rows.positions[m])
            for hh in range(H):
                merge_chunks(s.part[m, hh], n, hd, out[hh * hd:(hh + 1) * hd])
        round_row(ops, out, m, H * hd, n32, nk, s)


@njit(cache=True, inline="always")
def attend(ops, il, weights, cache, rows, dims, s, ph, t, nt):
    """Thread t's share of layer il's attention (phase ph): the queries in s.y, each (row, head,
    chunk)'s partial result into s.part."""
    _attend(il, cache, rows, dims, s, ph, t, nt)


@njit(cache=True, inline="always")
def merge(ops, il, weights, cache, rows, dims, s, ph, t, nt):
    """Thread t's share of what attention leaves: every row's heads in s.xin, rounded for Wo."""
    _merge(il, weights, cache, rows, dims, s, ops, ph, t, nt)


@njit(cache=True, inline="always")
def _work(s, p32, pk):
    return Work(s.xin, s.fbuf, s.y, s.part, s.scores, s.fs, s.counters, p32, pk)


@per_phase
def _worker(t, h, weights, cache, rows, dims, scratch, p32, pk, sync, span, ops):
    """Thread t of the nt the scratch was made for: every phase of the span, its share of each, a
    barrier between two; thread 0 adds each phase's cycles to sync[CLOCK + i] where new_sync made
    room."""
    nt = scratch.counters.shape[1]
    n_layer = weights.norms.shape[0]
    s = _work(scratch, p32, pk)
    timed = t == 0 and sync.shape[0] >= CLOCK + OPS_PER_LAYER
    bar = 0
    for ph in range(span.first, span.last):            # ph: also this phase's row of work counters
        start = cycles() if timed else 0
        il, i = ph // OPS_PER_LAYER, ph % OPS_PER_LAYER
        # after the last layer, the output head's. (One int64 op for every call of _matmul_op: a
        # literal op would compile it a second time, kernels and all.)
        op = _PHASES[i] if il < n_layer else HEAD_ROUND + i
        if op == NORM_ATTN or op == NORM_FFN:
            _norm_rows(h, il, 0 if op == NORM_ATTN else 1, dims.eps, weights, s, ph, t, nt, ops)
        elif op == ATTEND:
            attend(ops, il, weights, cache, rows, dims, s, ph, t, nt)
        elif op == MERGE:
            merge(ops, il, weights, cache, rows, dims, s, ph, t, nt)
        elif op == ROUND_F:
            _round_f(il, weights, s, ph, t, nt, ops)
        elif op == HEAD_ROUND:
            _round_head(h, weights, s, ph, t, nt, ops)
        else:
            _matmul_op(op, il, span.sums, weights, cache, rows, dims, s, ops, ph, t, nt)
        if ph + 1 < span.last:
            bar += 1
            if not barrier(sync, nt, bar):
                return
        if timed:
            sync[CLOCK + i] += cycles() - start


@njit(cache=True)
def scratch_for(h, weights, cache, rows, dims, nt, ops):
    """The arrays a call of run_phases works in, for these rows (their positions: attention's
    chunks): (Scratch, Q8Blocks, Q8KBlocks). Made once, they serve every call of a step."""
    M, D = h.shape
    kv_dim = cache.k.shape[2]
    hd = kv_dim // dims.n_head_kv
    H, n_ff, n_layer = dims.n_head, dims.n_ff, weights.norms.shape[0]
    K = max(D, n_ff, H * hd)
    part_rows, n_chunks = part_shape(ops, rows)
    s = Scratch(np.zeros((M, max(D, H * hd)), np.float32), np.zeros((M, n_ff), np.float32),
                np.zeros((M, max(H * hd + 2 * kv_dim, 2 * n_ff, D)), np.float32),
                np.zeros((part_rows, H, n_chunks, hd + 2), np.float32),
                np.zeros((nt, CHUNK), np.float32),
                np.zeros((nt, 1, K), np.float32), np.zeros((n_layer * OPS_PER_LAYER + HEAD_PHASES, nt), np.int64))
    a = pack_arrays(M, K)
    return s, Q8Blocks(a[0], a[1], a[2], a[3]), Q8KBlocks(a[4], a[5], a[6], a[7])


@njit(cache=True, parallel=True, nogil=True)
def run_phases(h, weights, cache, rows, dims, sync, nt, span, ops, scratch, p32, pk):
    """The phases of span (Span) on h [M, D] (changed in place): row m at rows.positions[m], its K
    and V written into cache slot rows.slots[m]; scratch, p32, pk: scratch_for's (made with the
    same ops). One parallel region of nt iterations: nt must be numba's thread count
    (numba.get_num_threads(), read by the caller: inside a cached kernel it cannot be).
    ops: the stage's ops record (None: this stage's steps). sync: sync.new_sync(); sync[ARRIVALS]
    counts the barriers' arrivals, sync[ABORT] is 1 if one gave up, and sync[CLOCK + i], where
    new_sync made room (phases=OPS_PER_LAYER), phase i's cycles."""
    scratch.counters[span.first:span.last] = 0
    # np.int64(t): prange's index is signed where numba types the loop and unsigned inside the
    # region, and a bare 0 is a literal: three types would compile _worker (and all it calls) three
    # times over. One type compiles it once.
    if nt == 1:                 # one thread needs no region (its launch costs about as much as a norm)
        _worker(np.int64(0), h, weights, cache, rows, dims, scratch, p32, pk, sync, span, ops)
    else:
        for t in prange(nt):
            _worker(np.int64(t), h, weights, cache, rows, dims, scratch, p32, pk, sync, span, ops)
    return h


# ---- a stage's stack: this one, or one with some steps changed -----------------------------------

STEPS = ("matmul_chunk", "rows_multiple", "round_row", "activation_block", "attend", "merge", "part_shape")


class Stack:
    """One stage's layer stack: its compiled functions (by name, as the stack calls them) and the
    ops records its calls pass (a record's type chooses the compiled code: each stack its own).

        run_layers(h, weights, cache, rows, dims, sync, nt, ops)     every layer on h, in one call
        run_phases(h, weights, cache, rows, dims, sync, nt, span, ops, *scratch_for(...))
        scratch_for(h, weights, cache, rows, dims, nt, ops)          (Scratch, Q8Blocks, Q8KBlocks)
        matmul_rows(x, blob, mats, nt, ops, kv, dims)                one matrix (the output head)
    """

    def __init__(self, functions: dict, records: tuple):
        self.functions, self.records = functions, records

    def _check(self, ops):
        if type(ops) not in self.records:
            raise TypeError(f"this layer stack takes {' or '.join(r.__name__ for r in self.records)} as its ops "
                            f"record, not {type(ops).__name__}: each stage's stack compiles for its own")

    def run_layers(self, h, weights, cache, rows, dims, sync, nt, ops):
        """Every layer on h [M, D] (changed in place): run_phases over all of them, Wo and W_down
        adding into h itself."""
        work = self.scratch_for(h, weights, cache, rows, dims, nt, ops)
        span = Span(0, len(weights.norms) * OPS_PER_LAYER, h)
        return self.run_phases(h, weights, cache, rows, dims, sync, nt, span, ops, *work)

    def run_phases(self, h, weights, cache, rows, dims, sync, nt, span, ops, *work):
        """work: scratch_for's (scratch, p32, pk)."""
        self._check(ops)
        return self.functions["run_phases"](h, weights, cache, rows, dims, sync, nt, span, ops, *work)

    def scratch_for(self, h, weights, cache, rows, dims, nt, ops):
        self._check(ops)
        return self.functions["scratch_for"](h, weights, cache, rows, dims, nt, ops)

    def matmul_rows(self, x, blob, mats, nt, ops, kv=np.float32, dims=None):
        """x [M, K] times one matrix (mats: its one MATRIX record, its bytes in blob: read_only) ->
        [M, N], the activation rounded once: the output head. It runs as the phases after the last
        layer in a call of run_phases whose weights are that matrix alone, so it is the layers'
        compiled code when its arguments have their types: kv the dtype of the layers' K/V arrays
        (float32, or uint16: float16's bits) and dims their Dims (its values are not read). Other
        types compile run_phases anew."""
        self._check(ops)
        M, K = x.shape
        weights = Weights(blob, mats, np.zeros((0, 2, K), np.float32))      # no layers: the head's phases are 0, 1
        cache = Cache(np.zeros((1, 1, 1), kv), np.zeros((1, 1, 1), kv), np.zeros((1, 1), np.int64), 1)
        rows = Rows(np.zeros(M, np.int64), np.full(M, -1, np.int64), np.zeros(M, np.int64))
        if dims is None:
            dims = Dims(1, 1, 1, 1e-5, np.float32(1.0), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))
        out = np.empty((M, int(mats[0]["rows"])), np.float32)
        work = self.scratch_for(x, weights, cache, rows, dims, nt, ops)
        self.run_phases(x, weights, cache, rows, dims, new_sync(), nt, Span(0, HEAD_PHASES, out), ops, *work)
        return out


STACK = Stack(dict(globals()), (type(None),))       # this stage's: its ops record is None
_TAKEN = {type(None)}                               # records that have a stack: one each


def _globals_read(dispatcher) -> set:
    return {i.argval for i in dis.get_instructions(dispatcher.py_func) if i.opname == "LOAD_GLOBAL"}


def with_steps(base: Stack, records: tuple, **steps) -> Stack:
    """A later stage's stack: base's with `steps` changed (names from STEPS; compiled functions
    with the same parameters), for calls whose ops record is one of `records` (namedtuple classes of
    the stage's own). Every function of the stack that calls a changed step, directly or through
    another, is copied with the new steps in its globals and compiled anew; numba's cache keeps the
    copies apart from the originals by the ops record's type, which is why a record serves one
    stack. (The copies are what a reader does not see: a later stage's kernel file holds its steps
    and this one line.)"""
    for name, step in steps.items():
        if name not in STEPS:
            raise ValueError(f"{name} is not a step of the layer stack; the steps: {', '.join(STEPS)}")
        if inspect.signature(step.py_func) != inspect.signature(STACK.functions[name].py_func):
            raise TypeError(f"{step.__name__} replaces {name}: its parameters must be "
                            f"{inspect.signature(STACK.functions[name].py_func)}")
    if _TAKEN & set(records):
        raise ValueError(f"{', '.join(r.__name__ for r in records)}: a record serves one stack (numba's cache "
                         f"tells the stacks apart by it)")
    _TAKEN.update(records)
    functions = dict(base.functions, **steps)
    ours = {n: f for n, f in base.functions.items()
            if isinstance(f, Dispatcher) and f.py_func.__module__ == __name__ and n not in STEPS}
    changed, copy = set(steps), set()
    while True:
        more = {n for n, f in ours.items() if n not in copy and _globals_read(f) & changed}
        if not more:
            break
        copy |= more
        changed |= more
    for name in copy:
        f = ours[name].py_func
        clone = FunctionType(f.__code__, functions, f.__name__, f.__defaults__, f.__closure__)
        clone.__qualname__, clone.__module__ = f.__qualname__, f.__module__
        functions[name] = jit(cache=True, **ours[name].targetoptions)(clone)
    return Stack(functions, records)


__all__ = ["Stack", "STACK", "STEPS", "with_steps", "matrix_table", "read_only", "Weights", "Cache", "Rows", "Dims",
           "Span", "Scratch", "Work", "MATRIX", "ROWS", "OPS_PER_LAYER", "PHASES", "HEAD_PHASES", "CHUNK",
           "matmul_chunk", "rows_multiple", "round_row", "activation_block", "attend", "merge", "part_shape", "rows_of",
           "packs_needed", "layer_packs", "is_k", "is_float", "rows_per_item"]

# A later stage's steps compile into these functions (with_steps): every kernel file of this folder
# is one they may inline.
toolkit.guard_cache(__name__, [run_phases, scratch_for, _worker, _matmul_op, _attend, _merge, _norm_rows, _round_f,
                               _round_head, _chunk_float, _chunk_tiles, _chunk_loops],
                    sorted(Path(__file__).parent.glob("*.py")))
