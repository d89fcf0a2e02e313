"""The layer stack in one compiled call (stages/fused.py tells the story; stages/repack.py reuses it).

    run_layers(h, weights, cache, rows, dims, sync, nt, pre)   every op of every layer, in ONE
                                                          parallel region: nt threads (one prange
                                                          iteration each) walk the same ops and meet at
                                                          a barrier between two that depend on each other
    run_phases(..., span, pre, *scratch_for(...))         the phases span.first..span.last-1 only,
                                                          Wo and W_down adding into span.sums (the tp
                                                          stage: it stops after each, to all-reduce)
    matmul_rows(x, blob, mats, nt, pairs)                 one weight matrix (the output head)

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
                                 layers, first a norm (the others read what the phase before left
                                 in the call's scratch); sums [M, D]: where WO and DOWN add their
                                 products (h itself, or a zeroed array that receives them)
    Prefill(...)                 None, or the prefill stage's choices and arrays (stages/prefill.py):
                                 then the matmuls take blocks of rows that fit L2 and run two rows to a
                                 512-bit register where they can (pair_gemm.py), and ATTEND / MERGE are
                                 the tiled attention's (tiled_attention.py: query tiles, decode rows'
                                 chunks); None compiles none of it (numba prunes `pre is None` branches,
                                 as it prunes the pair kernel's on a CPU without it: `if ZMM`)

sync may carry a clock per phase (sync.new_sync(phases=OPS_PER_LAYER)): thread 0's time-stamp
counter at each barrier, summed per phase over the layers (where a call's time went).

A matrix's `layout` says how its rows are stored: ROWS as the file stores them (the fused stage:
stages/kernels/int_tiles.py), REPACKED in interleaved groups (the repack stage:
stages/kernels/repacked.py). Float matrices (F32/F16/BF16) are decoded a row at a time and
multiplied in float; without AVX2 the int8 stage's loops run (ROWS only).

Nothing here depends on the number of threads but who computes what: every value is computed
by the same code whichever thread takes its item, and attention's chunks are fixed, so 1 thread
and N give the same bits.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange

from stages.kernels import (
    dequant_dot,
    int_dot,
    int_tiles,
    layer_ops,
    pair_gemm,
    q8,
    repacked,
    sync,
    tiled_attention,
    toolkit,
    vector_ir,
)
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
from stages.kernels.pair_gemm import Pairs32, PairsK, named_pairs, pair_arrays, pair_row, pairs_take
from stages.kernels.q8 import Q8Blocks, Q8KBlocks, pack_arrays, quantize_row
from stages.kernels.sync import CLOCK, barrier, cycles, next_item
from stages.kernels.tiled_attention import LANES, Workspace, attend_rows, finish_rows, merge_parts
from stages.kernels.toolkit import BF16, F16, F32, Q4_K, Q5_K, Q6_K, block_bytes, block_values, per_phase
from stages.kernels.vector_ir import ZMM

DECODE_WEIGHTS = 65536  # weights per decode work item: a few microseconds, many items per op
PREFILL_ITEM_ROWS = 16  # the fewest weight rows in a prefill work item (times every prompt row, or a block of them)
f32 = np.float32

# How a matrix's rows are stored in the blob.
ROWS, REPACKED = 0, 1
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
# The prefill stage's choices for one call (stages/prefill.py makes it; None elsewhere, and then
# numba compiles none of what reads it):
#   act_bytes    bytes of activation rows one matmul work item takes (a block that stays in L2)
#   tiles        int64 [n, 2]: (first row, rows) of each query tile: consecutive rows of one sequence
#   decode_rows  int64 [k]: the rows attended alone (their chunks split between threads);
#   decode_of    int64 [M]: each row's index in decode_rows, or -1
#   qs .. oc     tiled_attention.Workspace's arrays, one per thread (leading axis)
#   pm, pl, po   the decode rows' chunk results [k, n_head_kv, chunks, groups, 8 (, hd)]
#   q32 .. b16k  the pair packs (pair_gemm.Pairs32, PairsK) of the rows
Prefill = namedtuple("Prefill", "act_bytes tiles decode_rows decode_of qs pos kf vf st m l o mc lc oc pm pl po "
                          "q32 d32 s32 sums32 qk dk b32k b16k")
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


@njit(cache=True, inline="always")
def _rows(p32, pk, m0, m1):
    """Activation rows m0..m1 of both packs."""
    return (Q8Blocks(p32.q[m0:m1], p32.d[m0:m1], p32.s[m0:m1], p32.sums[m0:m1]),
            Q8KBlocks(pk.q[m0:m1], pk.d[m0:m1], pk.b16[m0:m1], pk.b32[m0:m1]))


@njit(cache=True, inline="always")
def _pairs(pre):
    return (Pairs32(pre.q32, pre.d32, pre.s32, pre.sums32), PairsK(pre.qk, pre.dk, pre.b32k, pre.b16k))


@njit(cache=True, inline="always")
def chunk(mat, blob, r0, r1, m0, m1, xf, s, out, col, fs, pre):
    """Rows r0..r1 of one matrix (a MATRIX record) times activation rows m0..m1 into out[m, col..].
    With `pre`, the types pair_gemm takes run there, two rows to a register, when there are two
    rows or more (a decode row alone stays on repack's kernel: the same bits)."""
    if is_float(mat.kind):
        _chunk_float(mat.kind, blob, mat.offset, mat.row_bytes, r0, r1, m0, m1, xf, out, col, fs[:, :xf.shape[1]])
        return
    if pre is not None:
        if ZMM:                         # a constant: without 512-bit vpdpbusd the pair kernel is not compiled
            if mat.layout == REPACKED and pairs_take(mat.kind) and m1 - m0 > 1:
                x32, xk = _pairs(pre)
                pair_gemm.pair_gemm(mat.kind, blob, mat.offset, mat.row_bytes, x32, xk, m0, m1, out, col, (r0, r1))
                return
    p32, pk = _rows(s.p32, s.pk, m0, m1)
    if mat.layout == REPACKED:
        repacked.group_gemm(mat.kind, blob, mat.offset, mat.row_bytes, p32, pk, m1 - m0, out[m0:m1], col, r0, r1)
    else:
        _chunk_ints(mat.kind, blob, mat.offset, mat.row_bytes, r0, r1, m1 - m0, p32, pk, out[m0:m1], col)


@njit(cache=True, inline="always")
def rows_per_item(K, M, multiple):
    """Weight rows per work item: about DECODE_WEIGHTS weight-row products (a few microseconds,
    many items per op), and for rows of a batch at least PREFILL_ITEM_ROWS (a pass of a few rows
    in items of PREFILL_ITEM_ROWS rows would pay a kernel call and a counter for a fraction of a
    microsecond's work on a small model)."""
    if M > 1:
        return max(multiple, max(PREFILL_ITEM_ROWS, DECODE_WEIGHTS // (K * M)) // multiple * multiple)
    return max(multiple, DECODE_WEIGHTS // K // multiple * multiple)


@njit(cache=True, inline="always")
def multiple_of(mat):
    """Work items hold whole groups of a repacked matrix (repacked.GROUP rows), 4 rows otherwise."""
    return repacked.GROUP if mat.layout == REPACKED else 4


# ---- the phases --------------------------------------------------------------------------------

# Every function a thread calls per phase or per work item compiles as toolkit.per_phase (no
# reference counts: toolkit.py says why).

@njit(cache=True, inline="always")
def _needs(mats, j0, j1):
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
def _quantize(x, m, K, n32, nk, s, pre):
    """Row m of the packs (and of the pair packs, with `pre`) from x [K]."""
    quantize_row(x, m, K, n32, nk, s.p32, s.pk)
    if pre is not None:
        if ZMM and s.xin.shape[0] > 1:  # the pair packs feed the pair kernel only: two rows or more
            x32, xk = _pairs(pre)
            pair_row(m, K, n32, nk, s.p32, s.pk, x32, xk)


@per_phase
def _norm_rows(h, il, which, eps, weights, s, ph, t, nt, pre):
    """x = rms_norm(h) * norm `which` of layer il, row by row, rounded for the matrices after it."""
    M, D = h.shape
    base = il * MATS_PER_LAYER
    j0, j1 = (WQ, WO) if which == 0 else (GATE, DOWN)
    n32, nk = _needs(weights.mats, base + j0, base + j1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        rms_norm_row(h[m], weights.norms[il, which], eps, s.xin[m, :D])
        _quantize(s.xin[m], m, D, n32, nk, s, pre)


@per_phase
def _round_f(il, weights, s, ph, t, nt, pre):
    """f = silu(gate) * up, rounded for W_down."""
    M, n_ff = s.fbuf.shape
    j = il * MATS_PER_LAYER + DOWN
    n32, nk = _needs(weights.mats, j, j + 1)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        _quantize(s.fbuf[m], m, n_ff, n32, nk, s, pre)


@njit(cache=True, inline="always")
def block_rows(act_bytes, K, M):
    """Activation rows per matmul work item (with `pre`): all M where act_bytes of their 8-bit
    values hold them, else as many pairs as it holds (a block starts on a pair; only the last
    block may be odd, and a few rows are one block: the weights are read once for all of them)."""
    n = act_bytes // K
    return M if M <= n else max(2, n // 2 * 2)


# error_model="numpy": no check for a zero divisor around silu's division, which otherwise keeps
# LLVM from vectorizing the epilogue (one exp and one division per value, scalar).
@per_phase(error_model="numpy")
def _matmul_op(op, il, sums, weights, cache, rows, dims, s, ph, t, nt, pre):
    """One thread's share of a matmul phase of layer il: work items from counters[ph], each a chunk
    of weight rows times a block of activation rows (all of them without `pre`) into s.y, then
    the phase's epilogue on those rows:

        QKV      Wq | Wk | Wv rows -> y[:, :nq + 2 nkv]; RoPE on q and k, k and v into the cache
        WO_OP    Wo rows -> y, added into sums [M, D] (h itself, or Span.sums)
        GATE_UP  W_gate and W_up rows r0..r1 -> y[:, r], y[:, n_ff + r]; fbuf = silu(gate) * up
        DOWN_OP  W_down rows -> y, added into sums

    One call per phase and thread, and one place that calls the matmul kernels: numba passes every
    array field by value to a function it does not inline, which costs about as much as a work
    item of decode if paid per item."""
    M, D = sums.shape
    kv_dim = cache.k.shape[2]
    hd = kv_dim // dims.n_head_kv
    nq, nkv, n_ff = dims.n_head * hd, kv_dim, dims.n_ff
    base = il * MATS_PER_LAYER
    mats = weights.mats
    y = s.y
    if op == QKV:
        K = D
        per = rows_per_item(D, M, multiple_of(mats[base + WQ]))
        nq_items, nkv_items = (nq + per - 1) // per, (nkv + per - 1) // per
        n_row_items = nq_items + 2 * nkv_items
        xf = s.xin[:, :D]
    else:
        j = WO if op == WO_OP else (GATE if op == GATE_UP else DOWN)
        K = nq if op == WO_OP else (D if op == GATE_UP else n_ff)
        N = n_ff if op == GATE_UP else D
        per = rows_per_item(2 * K if op == GATE_UP else K, M, multiple_of(mats[base + j]))
        n_row_items = (N + per - 1) // per
        xf = s.xin[:, :nq] if op == WO_OP else (s.xin[:, :D] if op == GATE_UP else s.fbuf)
    mb = M if pre is None else block_rows(pre.act_bytes, K, M)
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
            chunk(mats[base + j + part], weights.blob, r0, r1, m0, m1, xf, s, y, col + part * n_ff, s.fs[t], pre)
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
        else:
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
def _merge(il, weights, cache, rows, dims, s, ph, t, nt):
    """Each row's heads: its own chunks merged in order (flash-decoding's reduction), then rounded for Wo."""
    M, H = s.part.shape[0], s.part.shape[1]
    hd = cache.k.shape[2] // dims.n_head_kv
    j = il * MATS_PER_LAYER + WO
    n32, nk = _needs(weights.mats, j, j + 1)
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
        quantize_row(out, m, H * hd, n32, nk, s.p32, s.pk)


@njit(cache=True, inline="always")
def _workspace(pre, t):
    """Thread t's arrays of the tiled attention."""
    return Workspace(pre.qs[t], pre.pos[t], pre.kf[t], pre.vf[t], pre.st[t], pre.m[t], pre.l[t],
                     pre.o[t], pre.mc[t], pre.lc[t], pre.oc[t])


@per_phase
def _attend_tiles(il, cache, rows, dims, s, pre, ph, t, nt):
    """With `pre`: work items (query tile, KV head), each tile's result straight into s.xin; then
    (decode row, KV head, chunk), each chunk's result into pre.pm, pl, po (tiled_attention.py)."""
    Hkv = dims.n_head_kv
    hd = cache.k.shape[2] // Hkv
    G = dims.n_head // Hkv
    w = _workspace(pre, t)
    n_tile_items = pre.tiles.shape[0] * Hkv
    n_chunks = pre.pm.shape[2]
    n_items = n_tile_items + pre.decode_rows.shape[0] * Hkv * n_chunks
    while True:
        item = next_item(s.counters, ph, t, nt, n_items)
        if item < 0:
            break
        if item < n_tile_items:
            m0, n = pre.tiles[item // Hkv, 0], pre.tiles[item // Hkv, 1]
            kvh = item % Hkv
            attend_rows(s.y, m0, n, kvh, 0, chunks_of(rows.positions[m0 + n - 1]), il, cache, rows, dims, w)
            finish_rows(w, m0, n, kvh, G, hd, s.xin)
            continue
        item -= n_tile_items
        k, kvh, c = item // (Hkv * n_chunks), item // n_chunks % Hkv, item % n_chunks
        m = pre.decode_rows[k]
        if c < chunks_of(rows.positions[m]):
            attend_rows(s.y, m, 1, kvh, c, c + 1, il, cache, rows, dims, w)
            groups = (G + LANES - 1) // LANES
            for gi in range(groups):        # element by element: a slice assignment allocates (no NRT here)
                for ln in range(LANES):
                    pre.pm[k, kvh, c, gi, ln] = w.m[gi, ln]
                    pre.pl[k, kvh, c, gi, ln] = w.l[gi, ln]
                    for e in range(hd):
                        pre.po[k, kvh, c, gi, ln, e] = w.o[gi, ln, e]


@per_phase
def _merge_tiles(il, weights, cache, rows, dims, s, pre, ph, t, nt):
    """With `pre`: each decode row's chunks merged in order (the tiles' rows are done), every row
    rounded for Wo."""
    M = s.xin.shape[0]
    Hkv = dims.n_head_kv
    hd = cache.k.shape[2] // Hkv
    G = dims.n_head // Hkv
    j = il * MATS_PER_LAYER + WO
    n32, nk = _needs(weights.mats, j, j + 1)
    w = _workspace(pre, t)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        k = pre.decode_of[m]
        if rows.slots[m] < 0:
            s.xin[m, :dims.n_head * hd] = 0.0           # a padding row: nothing to attend to
        elif k >= 0:
            for kvh in range(Hkv):
                merge_parts(w, pre.pm[k, kvh], pre.pl[k, kvh], pre.po[k, kvh], chunks_of(rows.positions[m]),
                            (G + LANES - 1) // LANES, hd)
                finish_rows(w, m, 1, kvh, G, hd, s.xin)
        _quantize(s.xin[m], m, dims.n_head * hd, n32, nk, s, pre)


@njit(cache=True, inline="always")
def _work(s, p32, pk):
    return Work(s.xin, s.fbuf, s.y, s.part, s.scores, s.fs, s.counters, p32, pk)


@per_phase
def _worker(t, h, weights, cache, rows, dims, scratch, p32, pk, sync, span, pre):
    """Thread t of the nt the scratch was made for: every phase of the span, its share of each, a
    barrier between two; thread 0 adds each phase's cycles to sync[CLOCK + i] where new_sync made
    room."""
    nt = scratch.counters.shape[1]
    s = _work(scratch, p32, pk)
    timed = t == 0 and sync.shape[0] >= CLOCK + OPS_PER_LAYER
    bar = 0
    for ph in range(span.first, span.last):            # ph: also this phase's row of work counters
        start = cycles() if timed else 0
        il, i = ph // OPS_PER_LAYER, ph % OPS_PER_LAYER
        op = _PHASES[i]
        if op == NORM_ATTN or op == NORM_FFN:
            _norm_rows(h, il, 0 if op == NORM_ATTN else 1, dims.eps, weights, s, ph, t, nt, pre)
        elif op == ATTEND:
            if pre is None:
                _attend(il, cache, rows, dims, s, ph, t, nt)
            else:
                _attend_tiles(il, cache, rows, dims, s, pre, ph, t, nt)
        elif op == MERGE:
            if pre is None:
                _merge(il, weights, cache, rows, dims, s, ph, t, nt)
            else:
                _merge_tiles(il, weights, cache, rows, dims, s, pre, ph, t, nt)
        elif op == ROUND_F:
            _round_f(il, weights, s, ph, t, nt, pre)
        else:
            _matmul_op(op, il, span.sums, weights, cache, rows, dims, s, ph, t, nt, pre)
        if ph + 1 < span.last:
            bar += 1
            if not barrier(sync, nt, bar):
                return
        if timed:
            sync[CLOCK + i] += cycles() - start


def run_layers(h, weights, cache, rows, dims, sync, nt, pre=None):
    """Every layer on h [M, D] (changed in place): run_phases over all of them, Wo and W_down
    adding into h itself. pre: None, or the prefill stage's Prefill (its choices and arrays: its
    kernels run)."""
    work = scratch_for(h, weights, cache, rows, dims, nt, pre)
    span = Span(0, len(weights.norms) * OPS_PER_LAYER, h)
    return run_phases(h, weights, cache, rows, dims, sync, nt, span, pre, *work)


@njit(cache=True)
def scratch_for(h, weights, cache, rows, dims, nt, pre):
    """The arrays a call of run_phases works in, for these rows (their positions: attention's
    chunks): (Scratch, Q8Blocks, Q8KBlocks). Made once, they serve every call of a step."""
    M, D = h.shape
    kv_dim = cache.k.shape[2]
    hd = kv_dim // dims.n_head_kv
    n_chunks = 1
    if pre is None:                    # the tiled attention keeps its chunks in pre's arrays
        for m in range(M):
            n_chunks = max(n_chunks, chunks_of(rows.positions[m]))
    H, n_ff, n_layer = dims.n_head, dims.n_ff, weights.norms.shape[0]
    K = max(D, n_ff, H * hd)
    s = Scratch(np.zeros((M, max(D, H * hd)), np.float32), np.zeros((M, n_ff), np.float32),
                np.zeros((M, max(H * hd + 2 * kv_dim, 2 * n_ff, D)), np.float32),
                np.zeros((M if pre is None else 1, H, n_chunks, hd + 2), np.float32),
                np.zeros((nt, CHUNK), np.float32),
                np.zeros((nt, 1, K), np.float32), np.zeros((n_layer * OPS_PER_LAYER, nt), np.int64))
    a = pack_arrays(M, K)
    return s, Q8Blocks(a[0], a[1], a[2], a[3]), Q8KBlocks(a[4], a[5], a[6], a[7])


@njit(cache=True, parallel=True, nogil=True)
def run_phases(h, weights, cache, rows, dims, sync, nt, span, pre, scratch, p32, pk):
    """The phases of span (Span) on h [M, D] (changed in place): row m at rows.positions[m], its K
    and V written into cache slot rows.slots[m]; scratch, p32, pk: scratch_for's (made with the
    same pre). One parallel region of nt iterations: nt must be numba's thread count
    (numba.get_num_threads(), read by the caller: inside a cached kernel it cannot be).
    pre: None, or the prefill stage's Prefill. sync: sync.new_sync(); sync[ARRIVALS] counts the
    barriers' arrivals, sync[ABORT] is 1 if one gave up, and sync[CLOCK + i], where new_sync made
    room (phases=OPS_PER_LAYER), phase i's cycles."""
    scratch.counters[span.first:span.last] = 0
    # np.int64(t): prange's index is signed where numba types the loop and unsigned inside the
    # region, and a bare 0 is a literal: three types would compile _worker (and all it calls) three
    # times over. One type compiles it once.
    if nt == 1:                 # one thread needs no region (its launch costs about as much as a norm)
        _worker(np.int64(0), h, weights, cache, rows, dims, scratch, p32, pk, sync, span, pre)
    else:
        for t in prange(nt):
            _worker(np.int64(t), h, weights, cache, rows, dims, scratch, p32, pk, sync, span, pre)
    return h


# ---- one matrix: the output head ---------------------------------------------------------------

@per_phase
def _head_worker(x, blob, mats, scratch, p32, pk, b, pairs, out, per, t, nt):
    M = x.shape[0]
    mat = mats[0]
    s = _work(scratch, p32, pk)
    x32, xk = named_pairs(b)
    n_items = (mat.rows + per - 1) // per
    while True:
        item = next_item(s.counters, 0, t, nt, n_items)
        if item < 0:
            break
        r0 = item * per
        r1 = min(mat.rows, r0 + per)
        if ZMM:                         # a constant, as in chunk()
            if pairs:
                pair_gemm.pair_gemm(mat.kind, blob, mat.offset, mat.row_bytes, x32, xk, 0, M, out, 0, (r0, r1))
                continue
        chunk(mat, blob, r0, r1, 0, M, x, s, out, 0, s.fs[t], None)


@njit(cache=True)
def _pair_rows(M, K, k, p32, pk, b):
    """Rows 0..M-1 of the packs into the pair packs (the arrays b: pair_gemm.pair_arrays)."""
    x32, xk = named_pairs(b)
    for m in range(M):
        pair_row(m, K, not k, k, p32, pk, x32, xk)


@njit(cache=True, parallel=True, nogil=True)
def matmul_rows(x, blob, mats, nt, pairs):
    """x [M, K] times one weight (mats: one MATRIX record, in blob: read_only) -> [M, N]: the
    activation rounded once, the rows in work items over nt threads (numba's thread count).
    `pairs`, a bool never left out (an omitted argument is another type, another compile): in the
    prefill stage two rows or more of a type pair_gemm takes go there, two to a register, for the
    same bits as repack's kernel."""
    M, K = x.shape
    mat = mats[0]
    a = pack_arrays(M, K)
    p32, pk = Q8Blocks(a[0], a[1], a[2], a[3]), Q8KBlocks(a[4], a[5], a[6], a[7])
    pairs = ZMM and pairs and M > 1 and mat.layout == REPACKED and pairs_take(mat.kind)
    b = pair_arrays(M if pairs else 1, K if pairs else 32)     # a plain tuple: q8.pack_arrays says why
    if not is_float(mat.kind):
        for m in range(M):
            quantize_row(x[m], m, K, not is_k(mat.kind), is_k(mat.kind), p32, pk)
        if pairs:
            _pair_rows(M, K, is_k(mat.kind), p32, pk, b)
    out = np.empty((M, mat.rows), np.float32)
    s = Scratch(x, x, out, np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1), np.float32),
                np.zeros((nt, 1, K), np.float32), np.zeros((1, nt), np.int64))
    per = rows_per_item(K, M, multiple_of(mat))
    for t in prange(nt):
        _head_worker(x, blob, mats, s, p32, pk, b, pairs, out, per, np.int64(t), nt)    # one type: see run_phases
    return out


__all__ = ["run_layers", "run_phases", "scratch_for", "matmul_rows", "matrix_table", "read_only", "Weights", "Cache",
           "Rows", "Dims", "Span", "Prefill", "MATRIX", "ROWS", "REPACKED", "OPS_PER_LAYER", "PHASES", "CHUNK",
           "block_rows"]

toolkit.guard_cache(__name__, [run_phases, scratch_for, matmul_rows, _pair_rows, _worker, _head_worker, _matmul_op,
                               _attend, _merge, _attend_tiles, _merge_tiles, _norm_rows, _round_f, _chunk_float,
                               _chunk_tiles, _chunk_loops],
                    [int_tiles.__file__, int_dot.__file__, dequant_dot.__file__, sync.__file__, toolkit.__file__,
                     q8.__file__, layer_ops.__file__, repacked.__file__, vector_ir.__file__, pair_gemm.__file__,
                     tiled_attention.__file__])
