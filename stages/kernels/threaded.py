"""The threads stage's numba code (stages/threads.py tells the story).

Three parallel kernels, each a `prange` loop around work the earlier stages already do:

    matvec_parallel(x, w, kind, f16, n_chunks)           decode: the quantized stage's fused
                                                           kernels, each thread on its own rows
    prefill_parallel(x, w, kind, f16, n_chunks, ...)      prefill: the quantized stage's panels
                                                           (decode 64 weight rows, simd's 4 x 4
                                                           kernel over all prompt rows), each
                                                           thread on its own panels
    attention_parallel(q, k, v, n_head, n_head_kv, ...)   attention fused into one kernel, one
                                                           (query row, head) pair per iteration
    attention_paged_parallel(q, k_pages, v_pages, ...)    the same for a batch of sequences, each
                                                           row reading its own sequence's keys and
                                                           values through its page table

The first two call the quantized stage's kernels (stages/kernels/dequant_dot.py) and the simd
stage's matmul: nothing about a block format is written twice. One compiled signature each
serves every weight type (the type id picks the kernel inside), which keeps the cold JIT short.
Because they inline code from those files, `guard_cache` (stages/kernels/toolkit.py) empties
their numba cache when one of those files changes.

Every kernel leaves the number of threads to its caller: `n_chunks` pieces of work go to
numba's thread pool, whose size the backend sets (numba.set_num_threads). Nothing here calls
a parallel kernel from inside another parallel region (numba's workqueue pool is not
re-entrant, and nested OpenMP regions would oversubscribe the cores).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit, prange

from stages.kernels import dequant_dot as quantized_kernels
from stages.kernels import toolkit
from stages.kernels.dequant_dot import dequantize_rows, matvec_any
from stages.kernels.toolkit import FASTMATH, guard_cache
from stages.simd import PANEL, matmul_panels

__all__ = ["matvec_parallel", "prefill_parallel", "attention_parallel", "attention_paged_parallel"]


# ---- decode: one activation row, the weight's rows split between the threads ------------------

@njit(cache=True, parallel=True)
def matvec_parallel(x, w, kind, f16, n_chunks):
    """y [N] = W x for one activation row x [K]; W's rows in n_chunks contiguous ranges, one
    range per iteration of the parallel loop. Each range runs the quantized stage's fused
    kernel for W's type on its rows: a thread streams its own rows' blocks and nothing else,
    so the threads share no data but x (read-only, a few KiB)."""
    N = w.shape[0]
    y = np.empty(N, dtype=np.float32)
    per = (N + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r0 = c * per
        r1 = min(N, r0 + per)
        if r0 < r1:
            y[r0:r1] = matvec_any(x, w[r0:r1], kind, f16)
    return y


# ---- prefill: M activation rows, each thread decoding and using its own weight panels ---------

@njit(cache=True, parallel=True)
def prefill_parallel(x, w, kind, f16, n_chunks, panel_rows, x_chunk):
    """y [M, N] = x [M, K] W^T. W's rows are cut into panels of panel_rows; thread c takes the
    panels of its contiguous range, decodes each once into its own float32 buffer (L2-sized,
    allocated once per call) and runs simd's 4 x 4 kernel over x_chunk rows of x at a time."""
    M, K = x.shape
    N = w.shape[0]
    y = np.empty((M, N), dtype=np.float32)
    n_panels = (N + panel_rows - 1) // panel_rows
    per = (n_panels + n_chunks - 1) // n_chunks
    buffers = np.zeros((n_chunks, panel_rows, K), dtype=np.float32)
    for c in prange(n_chunks):
        panel = buffers[c]
        for p in range(c * per, min(n_panels, (c + 1) * per)):
            n0 = p * panel_rows
            rows = min(panel_rows, N - n0)
            dequantize_rows(kind, w, n0, panel[:rows], f16)
            padded = (rows + PANEL - 1) // PANEL * PANEL          # the kernel takes 4-row panels
            panel[rows:padded] = 0.0
            for m0 in range(0, M, x_chunk):
                m1 = min(M, m0 + x_chunk)
                part = matmul_panels(x[m0:m1], panel[:padded])
                y[m0:m1, n0:n0 + rows] = part[:, :rows]
    return y


# ---- attention: one kernel per layer, query heads spread over the threads ---------------------

@njit(cache=True, fastmath=FASTMATH, inline="always")
def attention_row_head(qh, k_pages, v_pages, table, n_vis, col, scale, o):
    """One query row's head, qh [hd], over the positions 0 .. n_vis - 1 it sees, into o [hd]:
    position t lies in page table[t // P], slot t % P of k_pages, v_pages [n_pages, P, Hkv*hd],
    in the columns col .. col + hd of its KV head. The scores against every visible key (one
    dot product each), their softmax, and the probability-weighted sum of the value rows,
    accumulated row by row so V is read in the order it lies in memory (the inherited
    composite read it through a transposed view). Page by page: a page's slots lie together."""
    hd = qh.shape[0]
    P = k_pages.shape[1]
    scores = np.empty(n_vis, dtype=np.float32)
    mx = np.float32(-np.inf)
    for t0 in range(0, n_vis, P):
        keys = k_pages[table[t0 // P]]
        for slot in range(min(P, n_vis - t0)):
            kt = keys[slot, col:col + hd]                 # row views: contiguous
            s = np.float32(0.0)
            for d in range(hd):
                s += qh[d] * kt[d]
            s *= scale
            scores[t0 + slot] = s
            mx = max(mx, s)
    total = np.float32(0.0)
    for t in range(n_vis):
        e = np.exp(scores[t] - mx)                        # minus the max: exp never overflows
        scores[t] = e
        total += e
    acc = np.zeros(hd, dtype=np.float32)
    for t0 in range(0, n_vis, P):                         # V row by row, as it lies in memory
        values = v_pages[table[t0 // P]]
        for slot in range(min(P, n_vis - t0)):
            p = scores[t0 + slot]
            vt = values[slot, col:col + hd]
            for d in range(hd):
                acc[d] += p * vt[d]
    inv = np.float32(1.0) / total
    for d in range(hd):
        o[d] = acc[d] * inv


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def attention_parallel(q, k, v, n_head, n_head_kv, start_pos, scale):
    """Causal grouped-query attention, fused: q [M, H*hd] at positions start_pos..,
    k, v [T, Hkv*hd] -> [M, H*hd]. One iteration of the parallel loop is one (query row, head)
    pair: attention_row_head over keys 0 .. start_pos + i (causal), K and V being one page."""
    M = q.shape[0]
    hd = q.shape[1] // n_head
    group = n_head // n_head_kv
    T = k.shape[0]
    k_page, v_page, table = k[None], v[None], np.zeros(1, dtype=np.int64)      # one page: all T positions
    out = np.empty((M, n_head * hd), dtype=np.float32)
    for item in prange(M * n_head):
        i = item // n_head
        h = item - i * n_head
        attention_row_head(q[i, h * hd:(h + 1) * hd], k_page, v_page, table, min(T, start_pos + i + 1),
                           h // group * hd, scale, out[i, h * hd:(h + 1) * hd])
    return out


# ---- attention for a batch of sequences, through their page tables (common/paged_kv.py) --------

@njit(cache=True, parallel=True, fastmath=FASTMATH)
def attention_paged_parallel(q, k_pages, v_pages, tables, row_seq, positions, n_rows, n_head, n_head_kv, scale):
    """attention_parallel for rows of many sequences: q [M, H*hd], row i at position
    positions[i] of sequence row_seq[i], whose pages are tables[row_seq[i]] in k_pages,
    v_pages [n_pages, P, Hkv*hd] (one layer of the pool). Rows from n_rows on are padding and
    come back 0. Per (row, head) it is the same attention_row_head, so a row gets the bits it
    would get there."""
    M = q.shape[0]
    hd = q.shape[1] // n_head
    group = n_head // n_head_kv
    out = np.zeros((M, n_head * hd), dtype=np.float32)
    for item in prange(n_rows * n_head):
        i = item // n_head
        h = item - i * n_head
        attention_row_head(q[i, h * hd:(h + 1) * hd], k_pages, v_pages, tables[row_seq[i]], positions[i] + 1,
                           h // group * hd, scale, out[i, h * hd:(h + 1) * hd])
    return out


guard_cache(__name__, [matvec_parallel, prefill_parallel, attention_parallel, attention_paged_parallel],
            [quantized_kernels.__file__, toolkit.__file__, Path(__file__).parents[1] / "simd.py"])
