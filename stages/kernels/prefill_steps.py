"""The prefill stage's steps of the layer stack (layer_stack.py; stages/prefill.py tells the story):
STACK is the repack stage's stack with these changed.

    matmul_chunk      two activation rows or more of a type pair_gemm takes: two rows to a 512-bit
                      register (pair_gemm.py), where the CPU has them (vector_ir.ZMM); on AVX2
                      without VNNI, C rows per unpacked 256-bit piece (tile_gemm.py); else repack's
    round_row         each rounded row also into its pair's packs (the pair kernel reads those)
    activation_block  a matmul work item's rows: a block whose 8-bit values stay in L2 (block_rows)
    attend, merge     the tiled attention (tiled_attention.py): query tiles against blocks of keys,
                      a decode row's chunks split between threads and merged in order
    part_shape        no (row, head, chunk) parts: the tiles and the decode rows keep their own

The stage's records, flat (numba's parallel loop takes no tuple inside a tuple), their fields
composed from the records they carry:

    Prefill     a call of the stack: act_bytes (bytes of activation rows a work item takes), tiles
                int64 [n, 2] (first row, rows) of each query tile, decode_rows int64 [k] (the rows
                attended alone), decode_of int64 [M] (a row's index in decode_rows, or -1);
                tiled_attention.Workspace's arrays, one per thread (leading axis); pm, pl, po the
                decode rows' chunk results [k, n_head_kv, chunks, groups, 8 (, hd)]; the pair packs
                (PAIR_FIELDS: pair_gemm.Pairs32's fields + "32", PairsK's + "k")

    head_record(Prefill, M, K)   the same for a call of the output head (STACK.matmul_rows): its
                pair packs, attention's arrays empty (the head's phases read none of them)
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import numpy as np
from numba import njit

from stages.kernels import repack_steps, toolkit
from stages.kernels.layer_ops import chunks_of
from stages.kernels.layer_stack import WO, layer_packs, rows_of, with_steps
from stages.kernels.pair_gemm import Pairs32, PairsK, new_pairs, pair_gemm, pair_row, pairs_take
from stages.kernels.q8 import quantize_row
from stages.kernels.repack_steps import REPACKED, group_chunk
from stages.kernels.sync import next_item
from stages.kernels.tile_gemm import YMM_TILES, tile_gemm, tiles_take
from stages.kernels.tiled_attention import LANES, Workspace, attend_rows, finish_rows, merge_parts, workspace
from stages.kernels.toolkit import per_phase
from stages.kernels.vector_ir import ZMM

PAIR_FIELDS = tuple(f + "32" for f in Pairs32._fields) + tuple(f + "k" for f in PairsK._fields)
Prefill = namedtuple("Prefill", ("act_bytes", "tiles", "decode_rows", "decode_of") + Workspace._fields
                     + ("pm", "pl", "po") + PAIR_FIELDS)


def head_record(record, M: int, K: int):
    """A record of class `record` (Prefill, or a later stage's of the same fields: the stack it
    selects) for the output head's call of M rows of K values."""
    x32, xk = new_pairs(M, K)
    part = np.zeros((0, 1, 1, 1, LANES), np.float32)
    return record(0, np.zeros((0, 2), np.int64), np.zeros(0, np.int64), np.full(M, -1, np.int64),
                  *workspace(1, 1, 1), part, part, np.zeros((*part.shape, 1), np.float32), *x32, *xk)


@njit(cache=True, inline="always")
def _pairs(ops):
    """The record's pair packs, named."""
    return (Pairs32(ops.q32, ops.d32, ops.s32, ops.sums32), PairsK(ops.qk, ops.dk, ops.b32k, ops.b16k))


@njit(cache=True, inline="always")
def _workspace(ops, t):
    """Thread t's arrays of the tiled attention."""
    return Workspace(ops.qs[t], ops.pos[t], ops.kf[t], ops.vf[t], ops.st[t], ops.m[t], ops.l[t],
                     ops.o[t], ops.mc[t], ops.lc[t], ops.oc[t])


# ---- the matmuls: two rows to a register ---------------------------------------------------------

@njit(cache=True, inline="always")
def pair_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs):
    """Two rows or more of a repacked matrix of a type pair_gemm takes: two to a register (a decode
    row alone stays on repack's kernel: the same bits); on AVX2 without VNNI, of a type tile_gemm
    takes, in its tiles; anything else as the repack stage does."""
    if ZMM:                     # a constant: without 512-bit vpdpbusd the pair kernel is not compiled
        if mat.layout == REPACKED and pairs_take(mat.kind) and m1 - m0 > 1:
            x32, xk = _pairs(ops)
            pair_gemm(mat.kind, blob, mat.offset, mat.row_bytes, x32, xk, m0, m1, out, col, (r0, r1))
            return
    if YMM_TILES:               # AVX2 without VNNI: the same rows in tiles on 256-bit registers
        if mat.layout == REPACKED and tiles_take(mat.kind) and m1 - m0 > 1:
            p32, pk = rows_of(s.p32, s.pk, m0, m1)
            tile_gemm(mat.kind, blob, mat.offset, mat.row_bytes, p32, pk, m1 - m0, out[m0:m1], col, r0, r1)
            return
    group_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs)


@njit(cache=True, inline="always")
def round_pair_row(ops, x, m, K, n32, nk, s):
    """Row m of the packs, and of the pair packs (which feed the pair kernel only: two rows or more)."""
    quantize_row(x, m, K, n32, nk, s.p32, s.pk)
    if ZMM and s.xin.shape[0] > 1:
        x32, xk = _pairs(ops)
        pair_row(m, K, n32, nk, s.p32, s.pk, x32, xk)


@njit(cache=True, inline="always")
def block_rows(act_bytes, K, M):
    """Activation rows per matmul work item: all M where act_bytes of their 8-bit values hold them,
    else as many pairs as it holds (a block starts on a pair; only the last block may be odd, and a
    few rows are one block: the weights are read once for all of them)."""
    n = act_bytes // K
    return M if M <= n else max(2, n // 2 * 2)


@njit(cache=True, inline="always")
def l2_block(ops, K, M):
    return block_rows(ops.act_bytes, K, M)


# ---- attention in tiles ------------------------------------------------------------------------

@njit(cache=True, inline="always")
def no_parts(ops, rows):
    return 1, 1                 # the tiled attention keeps its chunks in the record's arrays


@per_phase
def _attend_tiles(il, cache, rows, dims, s, ops, ph, t, nt):
    """Work items (query tile, KV head), each tile's result straight into s.xin; then (decode row,
    KV head, chunk), each chunk's result into ops.pm, pl, po (tiled_attention.py)."""
    Hkv = dims.n_head_kv
    hd = cache.k.shape[2] // Hkv
    G = dims.n_head // Hkv
    w = _workspace(ops, t)
    n_tile_items = ops.tiles.shape[0] * Hkv
    n_chunks = ops.pm.shape[2]
    n_items = n_tile_items + ops.decode_rows.shape[0] * Hkv * n_chunks
    while True:
        item = next_item(s.counters, ph, t, nt, n_items)
        if item < 0:
            break
        if item < n_tile_items:
            m0, n = ops.tiles[item // Hkv, 0], ops.tiles[item // Hkv, 1]
            kvh = item % Hkv
            attend_rows(s.y, m0, n, kvh, 0, chunks_of(rows.positions[m0 + n - 1]), il, cache, rows, dims, w)
            finish_rows(w, m0, n, kvh, G, hd, s.xin)
            continue
        item -= n_tile_items
        k, kvh, c = item // (Hkv * n_chunks), item // n_chunks % Hkv, item % n_chunks
        m = ops.decode_rows[k]
        if c < chunks_of(rows.positions[m]):
            attend_rows(s.y, m, 1, kvh, c, c + 1, il, cache, rows, dims, w)
            groups = (G + LANES - 1) // LANES
            for gi in range(groups):        # element by element: a slice assignment allocates (no NRT here)
                for ln in range(LANES):
                    ops.pm[k, kvh, c, gi, ln] = w.m[gi, ln]
                    ops.pl[k, kvh, c, gi, ln] = w.l[gi, ln]
                    for e in range(hd):
                        ops.po[k, kvh, c, gi, ln, e] = w.o[gi, ln, e]


@per_phase
def _merge_tiles(il, weights, cache, rows, dims, s, ops, ph, t, nt):
    """Each decode row's chunks merged in order (the tiles' rows are done), every row rounded for Wo."""
    M = s.xin.shape[0]
    Hkv = dims.n_head_kv
    hd = cache.k.shape[2] // Hkv
    G = dims.n_head // Hkv
    n32, nk = layer_packs(weights.mats, il, WO, WO + 1)
    w = _workspace(ops, t)
    while True:
        m = next_item(s.counters, ph, t, nt, M)
        if m < 0:
            break
        k = ops.decode_of[m]
        if rows.slots[m] < 0:
            s.xin[m, :dims.n_head * hd] = 0.0           # a padding row: nothing to attend to
        elif k >= 0:
            for kvh in range(Hkv):
                merge_parts(w, ops.pm[k, kvh], ops.pl[k, kvh], ops.po[k, kvh], chunks_of(rows.positions[m]),
                            (G + LANES - 1) // LANES, hd)
                finish_rows(w, m, 1, kvh, G, hd, s.xin)
        round_pair_row(ops, s.xin[m], m, dims.n_head * hd, n32, nk, s)


@njit(cache=True, inline="always")
def attend_tiles(ops, il, weights, cache, rows, dims, s, ph, t, nt):
    _attend_tiles(il, cache, rows, dims, s, ops, ph, t, nt)


@njit(cache=True, inline="always")
def merge_tiles(ops, il, weights, cache, rows, dims, s, ph, t, nt):
    _merge_tiles(il, weights, cache, rows, dims, s, ops, ph, t, nt)


STACK = with_steps(repack_steps.STACK, (Prefill,), matmul_chunk=pair_chunk, round_row=round_pair_row,
                   activation_block=l2_block, attend=attend_tiles, merge=merge_tiles, part_shape=no_parts)

toolkit.guard_cache(__name__, [_attend_tiles, _merge_tiles], sorted(Path(__file__).parent.glob("*.py")))
