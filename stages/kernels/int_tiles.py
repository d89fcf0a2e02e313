"""The fused stage's integer dot-product tiles on ggml's own rows (stages/fused.py tells the story).

Two kernels, each one compiled function for every integer ggml type (a `switch` on the type):

    prefill_tile(kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0)
        R weight rows x C activation rows over the whole row length (the type's TILE shape):
        out[m0 + c, n0 + r] = sum over the row's blocks of (weight block r) . (activation block c)
    decode_rows(kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0, n_rows)
        n_rows weight rows one after another against activation row m0 (one sequential stream
        for the memory prefetchers, and a software prefetch ROW_PREFETCH_BYTES ahead)

w is the whole mapped file (uint8), w_off the byte offset of the first row; the activation rows
are llama.cpp's 8-bit blocks (stages/kernels/q8.py): p32 (Q8Blocks, for Q4_0 Q4_1 Q5_0 Q5_1
Q8_0) and pk (Q8KBlocks, for Q4_K Q5_K Q6_K).

What makes them faster than the int8 stage's helpers is where the sums go. Every block's integer
sum (dpbusd: 32 u8 x s8 products into 8 int32 lanes; or pairs + madd with the K-quants'
sub-block scales) is converted to 8 floats and multiplied, lane by lane, by the block's two
scales into a float vector accumulator that lives across all the blocks of the row: one
horizontal add per row and activation row, where the int8 stage adds horizontally per block.
The offsets ride along: Q4_0/Q5_0's -8/-16 start the integer sum at -sum(q_a) in every lane,
Q6_K's -32 is taken off the integer sum, and the K-quants' mins (a second integer dot product,
of the 8 sub-block mins with the activation's 32-value sums) are folded into the same float
accumulator, and so is Q4_1/Q5_1's offset (m_w times Q8_1's s).

With R x C > 1 each loaded weight block serves C activation rows and each activation block R
weight rows: prefill's register-blocked integer GEMM (R x C accumulators of 8 floats).

Unsigned x signed products: the weights' unsigned values (nibbles 0..15, five bits 0..31, Q6_K's
0..63) are the unsigned operand; Q8_0's signed weights give |w| and move their sign onto the
activation, as llama.cpp does. No 16-bit sum saturates: |2 x 128 x 127| < 2^15.
The instructions come from stages/kernels/vector_ir.py (AVX2 + F16C at least). The scalar code
these are tested against is the int8 stage's loops (tests/test_fused.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types

from stages.kernels import vector_ir
from stages.kernels.int_dot import q6_top_bits
from stages.kernels.toolkit import BLOCK_BYTES, FIELDS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES_K
from stages.kernels.vector_ir import B16, B32, D8, F8, FLOAT, I1, I8, I32, W8, W16, vector_intrinsic

TYPES_32 = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)

# Prefill's tile shapes, R weight rows x C activation rows, the fastest of those timed on the
# machine first measured (Zen 4, SmolLM2's and TinyLlama's matrices, 128 prompt rows): 4 x 4 for
# the 32-value types (16 accumulators); 1 x 8 for the K-quants, whose unpacking is dearer
# (sub-block scales, 6-bit values) and whose integer block sums need registers of their own, so
# one unpacked row serving 8 activation rows beat 2 x 4 and 4 x 4.
TILE = {**{k: (4, 4) for k in TYPES_32}, **{k: (1, 8) for k in TYPES_K}}
ROW_PREFETCH_BYTES = 1024    # decode asks for the weight bytes this far ahead of the block it multiplies


class _TilePointers:
    """Where a kernel reads and writes: the weight rows' pointers, and for each of the C
    activation rows m0 + c a pointer into every array of its pack (pack[field][c])."""

    def __init__(self, g, a, kind, C):
        b = g.b
        self.g, self.a = g, a
        pack = a.pk if kind in TYPES_K else a.p32
        rows = [b.add(a.m0, g.const(c)) for c in range(C)]
        self.act = rows
        self.pack = [[g.at(getattr(pack, f), b.mul(m, g.stride0(pack.arrays[f]))) for m in rows]
                     for f in ("q", "d", pack_fields(kind)[0], pack_fields(kind)[1])]

    def row(self, r):
        b = self.g.b
        return self.g.at(self.a.w, b.add(self.a.w_off, b.mul(r, self.a.row_bytes)))

    def store(self, c, r, value):
        g, b = self.g, self.g.b
        dst = b.add(b.mul(self.act[c], g.stride0(self.a.arrays["out"])), b.mul(b.add(self.a.n0, r), g.const(4)))
        b.store(value, b.bitcast(g.at(self.a.out, dst), FLOAT.as_pointer()))


def pack_fields(kind):
    return ("b16", "b32") if kind in TYPES_K else ("s", "sums")


# ---- 32-value formats ------------------------------------------------------------------------

def _unpack32(g, kind, row, o):
    """The 32 unsigned weight values of the block at row+o as <32 x i8> (Q8_0: the signed bytes),
    in the activation's order (byte j: value j low nibble, value j + 16 high)."""
    b = g.b
    f = FIELDS[kind]
    if kind == Q8_0:
        return g.load(row, b.add(o, g.const(f["qs"][0])), B32)
    packed = g.load(row, b.add(o, g.const(f["qs"][0])), B16)
    u = g.shuffle(g.nibbles(packed, False), g.nibbles(packed, True), range(32))
    if kind in (Q5_0, Q5_1):                                 # bit j of qh is value j's fifth bit
        qh = g.load(row, b.add(o, g.const(f["qh"][0])), I32)
        bits = b.zext(b.bitcast(qh, ir.VectorType(I1, 32)), B32)
        u = b.or_(u, b.shl(bits, g.splat_const(B32, 4)))
    return u


def _tree(b, terms):
    """terms added as a balanced tree: short dependency chains for the out-of-order core."""
    while len(terms) > 1:
        terms = [b.add(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _block32(g, kind, rows, at, blk, accs):
    """One 32-value block of every weight row in `rows` times every activation row of `at`:
    accs[r][c] += float(integer sum) * d_a * d_w, lane by lane; Q4_1/Q5_1's offset m_w * s_a
    rides along as 8 lanes of m_w * (s_a / 8) (exact: a power of two), so no scalar sum waits."""
    b = g.b
    size = BLOCK_BYTES[kind]
    offset = {Q4_0: 1, Q5_0: 2}.get(kind, 0)           # -8 / -16 per value = -1 / -2 x sum(q_a) per lane
    with_m = kind in (Q4_1, Q5_1)
    q_rows, d_rows, s_rows, a_rows = at.pack
    o = b.mul(blk, g.const(size))
    o4 = b.mul(blk, g.const(4))
    avec = [g.load(p, b.mul(blk, g.const(32)), B32) for p in q_rows]
    dav = [g.splat(F8, g.load(p, o4, FLOAT)) for p in d_rows]
    if with_m:
        sav = [g.splat(F8, b.fmul(g.load(p, o4, FLOAT), ir.Constant(FLOAT, 0.125))) for p in s_rows]
    init = [ir.Constant(D8, None)] * len(q_rows)
    if offset:
        init = [g.splat(D8, b.mul(g.load(p, o4, I32), ir.Constant(I32, -offset))) for p in a_rows]
    for r, row in enumerate(rows):
        u = _unpack32(g, kind, row, o)
        dwv = g.half(row, b.add(o, g.const(FIELDS[kind]["d"][0])))
        mv = g.half(row, b.add(o, g.const(FIELDS[kind]["m"][0]))) if with_m else None
        if kind == Q8_0:
            neg = b.icmp_signed("<", u, ir.Constant(B32, None))
            u = b.select(neg, b.neg(u), u)                   # |w|: -128 -> 128 unsigned
        for c in range(len(q_rows)):
            s = b.select(neg, b.neg(avec[c]), avec[c]) if kind == Q8_0 else avec[c]
            isum = g.dpbusd(init[c], u, s)
            scaled = b.fmul(g.to_float(isum), dav[c])
            acc = g.fma(scaled, dwv, b.load(accs[r][c]))
            b.store(g.fma(mv, sav[c], acc) if with_m else acc, accs[r][c])


# ---- the K-quants ----------------------------------------------------------------------------

def row_k4_scales(g, row, o):
    """Q4_K/Q5_K's 12 scale bytes in the block at row+o -> (scales, mins) as <8 x i16> (6 bits each):
    j < 4: sc = b[j] & 63, m = b[j+4] & 63; j >= 4: sc = (b[j+4] & 15) | (b[j-4] >> 6) << 4,
    m = (b[j+4] >> 4) | (b[j] >> 6) << 4 (its scalar twin: common.quants.k4_scale_min)."""
    b = g.b
    v4 = ir.VectorType(I8, 4)
    at = FIELDS[Q4_K]["scales"][0]                     # the same place in a Q5_K block
    lo, mid, hi = (g.load(row, b.add(o, g.const(at + 4 * i)), v4) for i in range(3))
    c = lambda n: g.splat_const(v4, n)
    top = lambda v: b.shl(b.lshr(v, c(6)), c(4))
    sc = g.shuffle(b.and_(lo, c(63)), b.or_(b.and_(hi, c(15)), top(lo)), range(8))
    mn = g.shuffle(b.and_(mid, c(63)), b.or_(b.lshr(hi, c(4)), top(mid)), range(8))
    return b.zext(sc, W8), b.zext(mn, W8)


def _blockK(g, kind, rows, at, blk, accs):
    """One 256-value block of every weight row times every activation row: the integer sums of
    the 8 (Q4_K/Q5_K) or 16 (Q6_K) sub-blocks, each times its scale, added as a tree; then
    accs[r][c] += float(sum) * d_a * d_w (and the mins' term, - d_a * dmin_w * sum m_s b32_s)."""
    b = g.b
    size = BLOCK_BYTES[kind]
    q_rows, d_rows, s16_rows, s32_rows = at.pack
    C = len(q_rows)
    o = b.mul(blk, g.const(size))
    k = b.mul(blk, g.const(256))
    dav = [g.splat(F8, g.load(p, b.mul(blk, g.const(4)), FLOAT)) for p in d_rows]
    for r, row in enumerate(rows):
        terms = [[] for _ in range(C)]
        f = FIELDS[kind]
        if kind == Q6_K:
            scales = b.sext(g.load(row, b.add(o, g.const(f["scales"][0])), B16), W16)
            for half in range(2):
                ql = b.add(o, g.const(f["ql"][0] + 64 * half))
                top = q6_top_bits(g, g.load(row, b.add(o, g.const(f["qh"][0] + 32 * half)), B32))
                lo0 = g.load(row, ql, B32)
                lo1 = g.load(row, b.add(ql, g.const(32)), B32)
                low = [g.nibbles(lo0, False), g.nibbles(lo1, False), g.nibbles(lo0, True), g.nibbles(lo1, True)]
                for i in range(4):
                    u = b.or_(low[i], top[i])
                    s = 8 * half + 2 * i
                    sc = g.shuffle(scales, scales, [s] * 8 + [s + 1] * 8)
                    for c in range(C):
                        av = g.load(q_rows[c], b.add(k, g.const(128 * half + 32 * i)), B32)
                        terms[c].append(g.madd(g.pairs(u, av), sc))
            for c in range(C):                       # the -32 of every value: 32 sum_g sc_g bsum_g
                sums16 = g.load(s16_rows[c], b.mul(blk, g.const(32)), W16)
                isum = b.sub(_tree(b, terms[c]), b.shl(g.madd(scales, sums16), g.splat_const(D8, 5)))
                scaled = b.fmul(g.to_float(isum), dav[c])
                dwv = g.half(row, b.add(o, g.const(f["d"][0])))
                b.store(g.fma(scaled, dwv, b.load(accs[r][c])), accs[r][c])
            continue
        scales, mins = row_k4_scales(g, row, o)
        if kind == Q5_K:
            qh = g.load(row, b.add(o, g.const(f["qh"][0])), B32)
        for ch in range(4):
            packed = g.load(row, b.add(o, g.const(f["qs"][0] + 32 * ch)), B32)
            for high in (0, 1):
                u = g.nibbles(packed, high)
                if kind == Q5_K:
                    bit = b.and_(b.lshr(qh, g.splat_const(B32, 2 * ch + high)), g.splat_const(B32, 1))
                    u = b.or_(u, b.shl(bit, g.splat_const(B32, 4)))
                sc = g.shuffle(scales, scales, [2 * ch + high] * 16)
                for c in range(C):
                    av = g.load(q_rows[c], b.add(k, g.const(64 * ch + 32 * high)), B32)
                    terms[c].append(g.madd(g.pairs(u, av), sc))
        dwv = g.half(row, b.add(o, g.const(f["d"][0])))
        dminv = b.fneg(g.half(row, b.add(o, g.const(f["dmin"][0]))))
        for c in range(C):
            scaled = b.fmul(g.to_float(_tree(b, terms[c])), dav[c])
            acc = g.fma(scaled, dwv, b.load(accs[r][c]))
            sums32 = g.load(s32_rows[c], b.mul(blk, g.const(16)), W8)
            msum = b.fmul(g.to_float(_widen4(g, g.madd(mins, sums32))), dav[c])
            b.store(g.fma(msum, dminv, acc), accs[r][c])


def _widen4(g, v4):
    """<4 x i32> -> <8 x i32> with zeros above (for a float accumulator of 8 lanes)."""
    return g.shuffle(v4, ir.Constant(ir.VectorType(I32, 4), None), list(range(8)))


def _tile_block(g, kind, rows, at, blk, accs):
    (_blockK if kind in TYPES_K else _block32)(g, kind, rows, at, blk, accs)


# ---- the two kernels -------------------------------------------------------------------------

def _tile_body(g, a, kind):
    R, C = TILE[kind]
    at = _TilePointers(g, a, kind, C)
    rows = [at.row(g.const(r)) for r in range(R)]
    accs = [[g.slot(F8) for _ in range(C)] for _ in range(R)]
    with g.loop(a.nb) as blk:
        _tile_block(g, kind, rows, at, blk, accs)
    for r in range(R):
        for c in range(C):
            at.store(c, g.const(r), g.hsum(g.b.load(accs[r][c])))


@vector_intrinsic
def prefill_tile(typingctx, kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0):
    """TILE[kind] = R weight rows (from w_off) x C activation rows (from m0), every block."""
    vector_ir.need_isa("the fused stage's tiles")

    def body(g, a):
        g.switch(a.kind, {k: (lambda k=k: _tile_body(g, a, k)) for k in TILE})
        return g.c.get_dummy_value()
    return types.none(kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0), body


def _rows_body(g, a, kind):
    """Two accumulators take alternate blocks, so consecutive blocks' multiply-adds do not wait
    for each other."""
    b = g.b
    at = _TilePointers(g, a, kind, 1)
    accs = [[[g.slot(F8)]] for _ in range(2)]
    two = g.const(2)
    with g.loop(a.n_rows) as r:
        row = at.row(r)
        for i in range(2):
            b.store(ir.Constant(F8, None), accs[i][0][0])
        with g.loop(b.udiv(a.nb, two)) as pair:
            blk = b.mul(pair, two)
            g.prefetch(row, b.add(b.mul(blk, g.const(BLOCK_BYTES[kind])), g.const(ROW_PREFETCH_BYTES)))
            _tile_block(g, kind, [row], at, blk, accs[0])
            _tile_block(g, kind, [row], at, b.add(blk, g.const(1)), accs[1])
        with b.if_then(b.icmp_unsigned("!=", b.urem(a.nb, two), g.const(0))):
            _tile_block(g, kind, [row], at, b.sub(a.nb, g.const(1)), accs[0])
        at.store(0, r, g.hsum(b.fadd(b.load(accs[0][0][0]), b.load(accs[1][0][0]))))


@vector_intrinsic
def decode_rows(typingctx, kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0, n_rows):
    """n_rows weight rows, one after another, times activation row m0: decode."""
    vector_ir.need_isa("the fused stage's tiles")

    def body(g, a):
        g.switch(a.kind, {k: (lambda k=k: _rows_body(g, a, k)) for k in TILE})
        return g.c.get_dummy_value()
    return types.none(kind, w, w_off, row_bytes, nb, p32, pk, m0, out, n0, n_rows), body
