"""The prefill stage's matmul: two prompt rows in every 512-bit register (stages/prefill.py tells the
story).

Repack's kernel (repacked.py) gives each of a group's 8 weight rows one lane of a 256-bit register
and broadcasts one activation dword to all 8 lanes. Where the CPU has AVX512-VNNI a 512-bit
vpdpbusd issues as often as a 256-bit one and does twice the multiply-adds (the roofline's
integer peak measures both: app/measure/roofline.py). Here the other 8 lanes take a second prompt
row, so each loaded piece of weights serves two activation rows per instruction:

    a 4-byte piece of the group's 8 rows (32 bytes), in both halves of the register, the upper
    half's rows swapped in pairs:
        lanes 0..7:   r0 r1 r2 r3 r4 r5 r6 r7        lanes 8..15:  r1 r0 r3 r2 r5 r4 r7 r6
    two activation rows x and y, their dwords stored side by side (the pair packs, pair_row),
    one 8-byte broadcast (vpbroadcastq, a load):
        lanes 0..7:   x  y  x  y  x  y  x  y         lanes 8..15:  x  y  x  y  x  y  x  y

so lane l computes (weight row, activation row) = (r_l, x) for even l, (r_l, y) for odd l: each of
the 16 pairs exactly once. The rows' scales go into the lanes the same way (pair_lanes: one
vpermd per group block, shared by every activation row), and at the end two permutes give the 8
results of x and the 8 of y (unpair).

Every (weight row, activation row) pair gets the integer sums of repack's kernel (exact, in any
order) and then the same float operations in the same order per block, so a row's result is
repack's bits: a prompt row here and a decode row through repack's kernel agree (batch
invariance across the two kernels, tests/test_prefill.py). Q4_0, Q4_1, Q8_0, Q4_K and Q6_K run
here (PAIR_TYPES); other types go through repack's kernel. An odd last row rides in the first
half of a pair whose second half is not stored: the weights are read once for all the rows, which
is what a pass of a few rows (a verify pass, a batch of decode rows) needs most.

Why not give the odd row 256-bit lanes of its own, half a 512-bit instruction on a CPU that runs
those as two 256-bit halves (a Zen 4)? It was tried. In a tile of its own the odd row unpacks every
piece again, which costs what the pair's second half saved. Beside the pairs in one tile, on the
lower halves of their unpacked pieces, the compiler first unpacks the odd row's halves again, and
when an empty inline asm stops that, schedules all of the pairs' work before the odd row's and
spills the pieces in between; a second one that makes each piece wait for the odd row's last
product holds them together, and then a pass of 5 rows is only a little faster, for a kernel with
twice the tile shapes that is much slower to compile. Not taken.

    pair_gemm(kind, w, off, row_bytes, x32, xk, m0, m1, out, col, (r0, r1))
        rows r0..r1 (r0 a multiple of GROUP) of the repacked matrix at w[off:] times activation
        rows m0..m1 (m0 even) of the pair packs -> out[m, col + r]
    pair_row(m, K, need32, needk, p32, pk, x32, xk)    row m of the 8-bit packs into the pair packs
    Pairs32(q, d, s, sums), PairsK(q, d, b32, b16), new_pairs(M, K), pair_arrays(M, K), named_pairs(a)
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, types

from stages.kernels import vector_ir
from stages.kernels.int_dot import q6_top_bits
from stages.kernels.repacked import GROUP, GROUP_AT, OFFSETS, _store, group_k4_scales, prefetch_group_block
from stages.kernels.toolkit import BLOCK_BYTES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0
from stages.kernels.vector_ir import B64, D8, D16, FZ, vector_intrinsic

PAIR_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)
PAIR_TYPES_K = (Q4_K, Q6_K)
# Pairs of activation rows per pass over a group block. Each piece of weights is loaded, permuted
# and split into nibbles once per tile and serves every pair in it, so the more pairs the fewer of
# those instructions per vpdpbusd, until the accumulators no longer fit in the 32 zmm registers with
# the pieces: Q4_K keeps 4 per pair (two sub-block sums, isum, the mins' sum), Q6_K 5 (four
# sub-block sums, isum), the 32-value types 2 (isum, the float sum): about 20 accumulators in all.
# Time a width in the stage it runs in (a prompt through the prefill stage, every thread), not
# the kernel alone on one thread: the two have disagreed about Q4_K's best width.
PAIRS_PER_TILE = {Q4_K: 4, Q6_K: 4, Q4_0: 5, Q4_1: 5, Q8_0: 5}

# The 8-bit packs (q8.py) of rows 2p and 2p + 1 side by side, P = M / 2 pairs:
#   q      int8 [P, 2K]    dword i of x, then dword i of y (one 8-byte broadcast: x y x y ...)
#   d, s   float32 [P, 2n] block scale (and Q8_1's s) of x, then of y
#   sums   int32 [P, 2n]   sum of q per 32-value block of x, then of y
#   b32    int16 [P, 2n]   sums of 32 q, two blocks of x (2t, 2t + 1), then the same two of y
#   b16    int32 [P, 2n]   32 x the sum of 16 q (Q6_K's -32 offset), x then y
Pairs32 = namedtuple("Pairs32", "q d s sums")
PairsK = namedtuple("PairsK", "q d b32 b16")


@njit(cache=True)
def pair_arrays(M, K):
    """The arrays of both pair packs for M rows (rounded up to pairs) of length up to K, zeros,
    Pairs32's then PairsK's: a plain tuple, for a parallel kernel (q8.pack_arrays says why)."""
    P, k32, kk = (M + 1) // 2, max(1, K // 32), max(1, K // 256)
    return (np.zeros((P, 2 * K), np.int8), np.zeros((P, 2 * k32), np.float32),
            np.zeros((P, 2 * k32), np.float32), np.zeros((P, 2 * k32), np.int32),
            np.zeros((P, 2 * K), np.int8), np.zeros((P, 2 * kk), np.float32),
            np.zeros((P, 2 * k32), np.int16), np.zeros((P, 2 * (K // 16)), np.int32))


@njit(cache=True, inline="always")
def named_pairs(a):
    """pair_arrays' plain tuple as the two packs, named (inside the function that uses them)."""
    return Pairs32(a[0], a[1], a[2], a[3]), PairsK(a[4], a[5], a[6], a[7])


@njit(cache=True)
def new_pairs(M, K):
    """Both pair packs for M rows (rounded up to pairs) of length up to K, zeros."""
    return named_pairs(pair_arrays(M, K))


@njit(cache=True, inline="always")
def _side_by_side(src, dst, half, group):
    """dst[2 group i + half group + e] = src[group i + e]: one row's values into its pair's array."""
    for i in range(src.shape[0] // group):
        for e in range(group):
            dst[2 * group * i + half * group + e] = src[group * i + e]


@njit(cache=True, inline="always")
def pair_row(m, K, need32, needk, p32, pk, x32, xk):
    """Row m of the 8-bit packs (as q8.quantize_row wrote it) into its pair's arrays."""
    p, half = m // 2, m % 2
    if need32:
        _side_by_side(p32.q[m, :K], x32.q[p], half, 4)
        for src, dst in ((p32.d[m], x32.d[p]), (p32.s[m], x32.s[p])):
            _side_by_side(src[:K // 32], dst, half, 1)
        _side_by_side(p32.sums[m, :K // 32], x32.sums[p], half, 1)
    if needk:
        _side_by_side(pk.q[m, :K], xk.q[p], half, 4)
        _side_by_side(pk.d[m, :K // 256], xk.d[p], half, 1)
        _side_by_side(pk.b32[m, :K // 32], xk.b32[p], half, 2)
        for s in range(K // 16):
            xk.b16[p, 2 * s + half] = np.int32(pk.b16[m, s]) * 32


@njit(cache=True, inline="always")
def pairs_take(kind):
    """Whether pair_gemm takes this type (PAIR_TYPES; its caller also needs vector_ir.ZMM)."""
    return kind == Q4_0 or kind == Q4_1 or kind == Q8_0 or kind == Q4_K or kind == Q6_K


# ---- the kernel (LLVM IR through stages/kernels/vector_ir.py) ------------------------------------

LANE_ROWS = [0, 1, 2, 3, 4, 5, 6, 7, 1, 0, 3, 2, 5, 4, 7, 6]        # the weight row of each lane


def pair_lanes(g, v):
    """8 lanes (one per row of the group) -> 16: rows 0..7, then rows 1 0 3 2 5 4 7 6."""
    return g.shuffle(v, v, LANE_ROWS)


def _piece(g, gb, off):
    """The 32 bytes at gb + off (4 bytes of each of the 8 rows) as 64, in pair_lanes' order."""
    v = g.load(gb, g.const(off), D8)
    return g.b.bitcast(pair_lanes(g, v), B64)


def unpair(g, acc):
    """A pair's 16 results -> (x's 8, y's 8), row order."""
    return g.shuffle(acc, acc, (0, 8, 2, 10, 4, 12, 6, 14)), g.shuffle(acc, acc, (9, 1, 11, 3, 13, 5, 15, 7))


class _PairActs:
    """Pointers into the pair packs for T pairs p0 .. p0 + T - 1."""

    def __init__(self, g, packs, p0, T):
        b = g.b
        pairs = [b.add(p0, g.const(t)) for t in range(T)]
        for name in packs.arrays:
            setattr(self, name, [g.at(getattr(packs, name), b.mul(p, g.stride0(packs.arrays[name]))) for p in pairs])
        self.pairs, self.T = pairs, T


def _q(g, acts, t, value):
    """x's and y's dwords holding values value .. value + 3, in alternate lanes."""
    return g.splat_i64(acts.q[t], g.b.mul(value, g.const(2)), B64)


def _pair_q4k(g, gb, blk, acts, accs):
    """Q4_K: isum = sum_s sc_s (dot of sub-block s), msum = sum_s m_s b32_s, exact; then repack's
    float steps: acc += float(isum) d_a d_w, acc += float(msum) d_a (-dmin_w). The high nibbles
    are multiplied as they sit (16 q, a mask and no shift), the low ones' scales taken 16 times,
    and the sum shifted back once per block: isum = (sum 16 sc lo + sc (16 hi)) >> 4, exact."""
    b, T = g.b, acts.T
    lay = GROUP_AT[Q4_K]
    sc8, mn8 = group_k4_scales(g, gb)
    k = b.mul(blk, g.const(256))
    msum = [ir.Constant(D16, None)] * T
    for u in range(4):                      # sub-blocks 2u, 2u + 1: one multiply-add of int16 pairs
        mins = pair_lanes(g, b.or_(mn8[2 * u], b.shl(mn8[2 * u + 1], g.splat_const(D8, 16))))
        at = b.mul(b.add(b.mul(blk, g.const(4)), g.const(u)), g.const(8))
        for t in range(T):
            msum[t] = g.dpwssd(msum[t], mins, g.splat_i64(acts.b32[t], at, D16))
    isum = [ir.Constant(D16, None)] * T
    high = g.splat_const(B64, 0xF0)
    for ch in range(4):
        lo_acc = [ir.Constant(D16, None)] * T
        hi_acc = [ir.Constant(D16, None)] * T
        for j in range(8):
            w = _piece(g, gb, lay["qs"] + (ch * 8 + j) * 32)
            lo, hi16 = g.nibbles(w, False), b.and_(w, high)
            for t in range(T):
                lo_acc[t] = g.dpbusd(lo_acc[t], lo, _q(g, acts, t, b.add(k, g.const(64 * ch + 4 * j))))
                hi_acc[t] = g.dpbusd(hi_acc[t], hi16, _q(g, acts, t, b.add(k, g.const(64 * ch + 32 + 4 * j))))
        sc_lo = pair_lanes(g, b.shl(sc8[2 * ch], g.splat_const(D8, 4)))
        sc_hi = pair_lanes(g, sc8[2 * ch + 1])
        for t in range(T):
            isum[t] = b.add(isum[t], b.add(b.mul(lo_acc[t], sc_lo), b.mul(hi_acc[t], sc_hi)))
    dw = pair_lanes(g, g.halves(gb, g.const(lay["d"])))
    dmin = b.fneg(pair_lanes(g, g.halves(gb, g.const(lay["dmin"]))))
    for t in range(T):
        da = g.splat_i64(acts.d[t], b.mul(blk, g.const(8)), FZ)
        whole = b.ashr(isum[t], g.splat_const(D16, 4))
        acc = g.fma(b.fmul(g.to_float(whole), da), dw, b.load(accs[t]))
        b.store(g.fma(b.fmul(g.to_float(msum[t]), da), dmin, acc), accs[t])


def _pair_q6k(g, gb, blk, acts, accs):
    """Q6_K: isum = sum_s (dot of sub-block s - 32 b16_s) sc_s, exact; acc += float(isum) d_a d_w."""
    b, T = g.b, acts.T
    lay = GROUP_AT[Q6_K]
    k = b.mul(blk, g.const(256))
    isum = [ir.Constant(D16, None)] * T
    for h in range(2):
        for jh in range(2):                                     # positions l < 16, then l >= 16
            sub = [[ir.Constant(D16, None)] * 4 for _ in range(T)]
            for jj in range(4):
                j = 4 * jh + jj
                qla = _piece(g, gb, lay["ql"] + (h * 16 + j) * 32)
                qlb = _piece(g, gb, lay["ql"] + (h * 16 + 8 + j) * 32)
                top = q6_top_bits(g, _piece(g, gb, lay["qh"] + (h * 8 + j) * 32))
                low = [g.nibbles(qla, False), g.nibbles(qlb, False), g.nibbles(qla, True), g.nibbles(qlb, True)]
                for i in range(4):
                    v = b.or_(low[i], top[i])
                    for t in range(T):
                        sub[t][i] = g.dpbusd(sub[t][i], v, _q(g, acts, t, b.add(k, g.const(128 * h + 32 * i + 4 * j))))
            for i in range(4):
                s = 8 * h + 2 * i + jh
                scale = pair_lanes(g, g.widen_s8(gb, g.const(lay["scales"] + GROUP * s)))
                for t in range(T):
                    off = g.splat_i64(acts.b16[t], b.mul(b.add(b.mul(blk, g.const(16)), g.const(s)), g.const(8)), D16)
                    isum[t] = b.add(isum[t], b.mul(b.sub(sub[t][i], off), scale))
    dw = pair_lanes(g, g.halves(gb, g.const(lay["d"])))
    for t in range(T):
        da = g.splat_i64(acts.d[t], b.mul(blk, g.const(8)), FZ)
        b.store(g.fma(b.fmul(g.to_float(isum[t]), da), dw, b.load(accs[t])), accs[t])


def _pair_32(g, kind, gb, blk, acts, accs):
    """Q4_0, Q4_1, Q8_0: isum (started at -offset sum(q_a)); acc += float(isum) d_a d_w (+ m_w s_a)."""
    b, T = g.b, acts.T
    lay = GROUP_AT[kind]
    offset = OFFSETS.get(kind, 0)
    k = b.mul(blk, g.const(32))
    at8 = b.mul(blk, g.const(8))
    isum = [ir.Constant(D16, None)] * T
    if offset:
        isum = [b.mul(g.splat_i64(acts.sums[t], at8, D16), g.splat_const(D16, -offset)) for t in range(T)]
    pieces = 8 if kind == Q8_0 else 4
    for j in range(pieces):
        w = _piece(g, gb, lay["qs"] + 32 * j)
        if kind == Q8_0:                                        # q + 128: unsigned bytes, vpdpbusd's range
            for t in range(T):
                isum[t] = g.dpbusd(isum[t], w, _q(g, acts, t, b.add(k, g.const(4 * j))))
            continue
        lo, hi = g.nibbles(w, False), g.nibbles(w, True)
        for t in range(T):
            isum[t] = g.dpbusd(isum[t], lo, _q(g, acts, t, b.add(k, g.const(4 * j))))
            isum[t] = g.dpbusd(isum[t], hi, _q(g, acts, t, b.add(k, g.const(16 + 4 * j))))
    dw = pair_lanes(g, g.halves(gb, g.const(lay["d"])))
    mw = pair_lanes(g, g.halves(gb, g.const(lay["m"]))) if kind == Q4_1 else None
    for t in range(T):
        acc = g.fma(b.fmul(g.to_float(isum[t]), g.splat_i64(acts.d[t], at8, FZ)), dw, b.load(accs[t]))
        if mw is not None:
            acc = g.fma(mw, g.splat_i64(acts.s[t], at8, FZ), acc)
        b.store(acc, accs[t])


def _pair_block(g, kind, gb, blk, acts, accs):
    if kind == Q4_K:
        _pair_q4k(g, gb, blk, acts, accs)
    elif kind == Q6_K:
        _pair_q6k(g, gb, blk, acts, accs)
    else:
        _pair_32(g, kind, gb, blk, acts, accs)


def _pair_gemm_body(g, a, kind):
    """Every group of rows r0..r1, every block, T pairs of activation rows at a time, the pairs
    left over in one narrower tile: a group block is unpacked once per tile. Every tile asks for
    the lines ahead as repack's kernel does: the first tile of a group reads them from memory, the
    later ones find them in L1 (one instruction a line). An odd last row is the first half of a
    pair whose second half is never stored."""
    b = g.b
    T = PAIRS_PER_TILE[kind]
    packs = a.xk if kind in PAIR_TYPES_K else a.x32
    gbytes = g.const(GROUP * BLOCK_BYTES[kind])
    nb = b.udiv(a.row_bytes, g.const(BLOCK_BYTES[kind]))
    n_groups = b.udiv(b.add(b.sub(a.rows._1, a.rows._0), g.const(GROUP - 1)), g.const(GROUP))
    p0, n_pairs = b.udiv(a.m0, g.const(2)), b.udiv(b.add(b.sub(a.m1, a.m0), g.const(1)), g.const(2))
    with g.loop(n_groups) as gi:
        r = b.add(a.rows._0, b.mul(gi, g.const(GROUP)))
        lanes = b.sub(a.rows._1, r)
        lanes = b.select(b.icmp_unsigned("<", lanes, g.const(GROUP)), lanes, g.const(GROUP))
        base = g.at(a.w, b.add(a.off, b.mul(r, a.row_bytes)))

        def tile(p, width):
            acts = _PairActs(g, packs, p, width)
            accs = [g.slot(FZ) for _ in range(width)]
            with g.loop(nb) as blk:
                gb = g.at(base, b.mul(blk, gbytes))
                prefetch_group_block(g, gb, kind)
                _pair_block(g, kind, gb, blk, acts, accs)
            for t in range(width):
                x, y = unpair(g, b.load(accs[t]))
                m = b.mul(acts.pairs[t], g.const(2))
                _store(g, a, m, b.add(a.col, r), lanes, x)
                with b.if_then(b.icmp_unsigned("<", b.add(m, g.const(1)), a.m1)):
                    _store(g, a, b.add(m, g.const(1)), b.add(a.col, r), lanes, y)

        full = b.udiv(n_pairs, g.const(T))
        with g.loop(full) as i:
            tile(b.add(p0, b.mul(i, g.const(T))), T)
        left = b.add(p0, b.mul(full, g.const(T)))
        g.switch(b.urem(n_pairs, g.const(T)), {w: (lambda w=w: tile(left, w)) for w in range(1, T)})


@vector_intrinsic
def pair_gemm(typingctx, kind, w, off, row_bytes, x32, xk, m0, m1, out, col, rows):
    """Rows r0..r1 (rows: the tuple (r0, r1)) of the repacked matrix at w[off:] times activation
    rows m0..m1 (m0 even) of the pair packs -> out[m, col + r] (see the module docstring)."""
    vector_ir.need_isa("the pair kernels")
    if not vector_ir.ZMM:
        from numba.core import errors
        raise errors.TypingError("the pair kernels need AVX512-VNNI with BW (stages/kernels/vector_ir.py, ZMM)")

    def body(g, a):
        g.switch(a.kind, {k: (lambda k=k: _pair_gemm_body(g, a, k)) for k in PAIR_TYPES})
        return g.c.get_dummy_value()
    return types.none(kind, w, off, row_bytes, x32, xk, m0, m1, out, col, rows), body


__all__ = ["PAIR_TYPES", "Pairs32", "PairsK", "new_pairs", "pair_arrays", "named_pairs", "pair_row", "pair_gemm",
           "pairs_take"]
