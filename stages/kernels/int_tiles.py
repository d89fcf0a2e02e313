"""The fused stage's integer dot-product tiles, written as LLVM IR (stages/fused.py tells the story).

A tile multiplies R weight rows by C quantized activation rows over the whole row length:

    tile_<type>_<R>x<C>(w, w_off, row_bytes, nb, <activation pack>, m0, out, n0)
        out[m0 + c, n0 + r] = sum over the row's blocks of (weight block r) . (activation block c)
    rows_<type>(..., m0, out, n0, n_rows)
        decode: n_rows rows one after another against activation row m0 (one sequential stream
        for the memory prefetchers, and a software prefetch PREFETCH_BYTES ahead)

w is the whole mapped file (uint8), w_off the byte offset of the first of the R rows; the
activation rows m0 .. m0+C-1 are llama.cpp's 8-bit blocks (stages/kernels/layer_stack.py packs them):

    32-value types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0):  q int8 [M, K], d float32 [M, K/32],
                                                s float32 [M, K/32] (Q8_1's d * sum q), sums int32 [M, K/32]
    K-quants (Q4_K Q5_K Q6_K):                  q int8 [M, K], d float32 [M, K/256],
                                                b16 int16 [M, K/16] and b32 int16 [M, K/32] (sums of q)

What makes them faster than the int8 stage's helpers is where the sums go. Every block's integer
sum (vpdpbusd: 32 u8 x s8 products into 8 int32 lanes; or vpmaddubsw + vpmaddwd with the
K-quants' sub-block scales) is converted to 8 floats and multiplied, lane by lane, by the block's
two scales into a float vector accumulator that lives across all the blocks of the row: one
horizontal add per row and activation row, where the int8 stage adds horizontally per block.
The offsets ride along: Q4_0/Q5_0's -8/-16 start the integer sum at -sum(q_a) in every lane,
Q6_K's -32 is taken off the integer sum, and the K-quants' mins (a second integer dot product,
of the 8 sub-block mins with the activation's 32-value sums) are folded into the same float
accumulator, and so is Q4_1/Q5_1's offset (m_w times Q8_1's s).

With R x C > 1 each loaded weight block serves C activation rows and each activation block R
weight rows: prefill's register-blocked integer GEMM (R x C accumulators of 8 floats; the
shapes, PREFILL_32 and PREFILL_K below, were timed; AVX-512's 32 vector registers hold them,
AVX2's 16 spill some).

Unsigned x signed products: the weights' unsigned values (nibbles 0..15, five bits 0..31, Q6_K's
0..63) are the unsigned operand; Q8_0's signed weights give |w| and move their sign onto the
activation, as llama.cpp does. No 16-bit sum saturates: |2 x 128 x 127| < 2^15.
Needs AVX2 + F16C (stages/kernels/int_dot.py's ISA); 'vnni' uses vpdpbusd, 'avx2' vpmaddubsw +
vpmaddwd for the byte products. The scalar reference these are tested against is the int8
stage's loops (tests/test_fused.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from stages.kernels import int_dot as int8_kernels
from stages.kernels.toolkit import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

ISA = int8_kernels.ISA
TYPES_32 = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
TYPES_K = (Q4_K, Q5_K, Q6_K)
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _F16 = ir.FloatType(), ir.HalfType()
_B32, _B16, _W16, _W8, _D8, _D4 = (ir.VectorType(_I8, 32), ir.VectorType(_I8, 16), ir.VectorType(_I16, 16),
                                   ir.VectorType(_I16, 8), ir.VectorType(_I32, 8), ir.VectorType(_I32, 4))
_F8 = ir.VectorType(_F32, 8)
# The prefetch intrinsic's name carries its pointer type: "ptr" where llvmlite writes opaque
# pointers (LLVM 15 and later), "i8*" before.
_PREFETCH = "llvm.prefetch.p0" if str(_I8.as_pointer()) == "ptr" else "llvm.prefetch.p0i8"


def _need_isa():
    if ISA is None:
        raise errors.TypingError("the fused tiles need AVX2 + F16C (see stages/kernels/int_dot.py, named_isa)")


class _Emit:
    """LLVM IR, a few lines per operation. Pointers are i8* and offsets bytes."""

    def __init__(self, context, builder):
        self.c, self.b = context, builder

    # ---- memory -------------------------------------------------------------------------
    def array(self, ty, value):
        a = self.c.make_array(ty)(self.c, self.b, value)
        return self.b.bitcast(a.data, _I8.as_pointer()), a

    def stride0(self, arr):
        return self.b.extract_value(arr.strides, 0)

    def at(self, p, off):
        return self.b.gep(p, [off])

    def load(self, p, off, ty):
        return self.b.load(self.b.bitcast(self.at(p, off), ty.as_pointer()), align=1)

    def f16x8(self, p, off):
        """The float16 at p+off as 8 float32 lanes: vpbroadcastw from memory, then F16C's
        vcvtph2ps. (A scalar half loaded and converted becomes `vpinsrw` into whatever register
        LLVM picks: a false dependency on its old value, which was the running accumulator, and
        it chained every block to the one before.)"""
        b = self.b
        h = b.insert_element(ir.Constant(ir.VectorType(_I16, 8), None), self.load(p, off, _I16), ir.Constant(_I32, 0))
        h8 = self.shuffle(h, ir.Constant(h.type, None), [0] * 8)
        return b.fpext(b.bitcast(h8, ir.VectorType(_F16, 8)), _F8)

    def prefetch(self, p, off):
        """llvm.prefetch (read, keep in all cache levels) of the line at p+off; never faults."""
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32,
                                                                                         _I32, _I32]),
                                            _PREFETCH)
        self.b.call(fn, [self.at(p, off), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def int64(self, ty, v):
        return self.c.cast(self.b, v, ty, types.int64)

    def const(self, v):
        return ir.Constant(_I64, v)

    # ---- vectors ------------------------------------------------------------------------
    @staticmethod
    def splat_const(ty, v):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)

    def splat(self, ty, scalar):
        v = self.b.insert_element(ir.Constant(ty, None), scalar, ir.Constant(_I32, 0))
        return self.shuffle(v, ir.Constant(ty, None), [0] * ty.count)

    def shuffle(self, a, b, idx):
        return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))

    def call(self, name, ret, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def nibbles(self, v, high):
        return self.b.lshr(v, self.splat_const(v.type, 4)) if high else self.b.and_(v, self.splat_const(v.type, 15))

    def pairs(self, u, s):
        """vpmaddubsw: <16 x i16>, lane i = u[2i] s[2i] + u[2i+1] s[2i+1] (u unsigned, s signed)."""
        return self.call("llvm.x86.avx2.pmadd.ub.sw", _W16, u, s)

    def madd(self, a, b):
        """vpmaddwd: lane i = a[2i] b[2i] + a[2i+1] b[2i+1], as int32 (<16 x i16> -> <8 x i32>)."""
        name = "llvm.x86.avx2.pmadd.wd" if a.type.count == 16 else "llvm.x86.sse2.pmadd.wd"
        return self.call(name, ir.VectorType(_I32, a.type.count // 2), a, b)

    def quads(self, acc, u, s):
        """acc + <8 x i32>, lane i = sum of the 4 products u[4i..4i+3] s[4i..4i+3]."""
        if ISA == "vnni":
            cast = lambda v: self.b.bitcast(v, _D8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", _D8, acc, cast(u), cast(s))
        return self.b.add(acc, self.madd(self.pairs(u, s), self.splat_const(_W16, 1)))

    def fma(self, a, b, c):
        return self.call("llvm.fma.v8f32", _F8, a, b, c)

    def hsum(self, v):
        """The 8 float lanes added as a tree (fixed order: the same bits on any thread)."""
        b = self.b
        s4 = b.fadd(self.shuffle(v, v, range(4)), self.shuffle(v, v, range(4, 8)))
        s2 = b.fadd(self.shuffle(s4, s4, (0, 1)), self.shuffle(s4, s4, (2, 3)))
        return b.fadd(b.extract_element(s2, ir.Constant(_I32, 0)), b.extract_element(s2, ir.Constant(_I32, 1)))

    def widen4(self, v4):
        """<4 x i32> -> <8 x i32> with zeros above (for a float accumulator of 8 lanes)."""
        return self.shuffle(v4, ir.Constant(_D4, None), list(range(8)))

    def acc(self, ty, init):
        slot = cgutils.alloca_once(self.b, ty)
        self.b.store(init, slot)
        return slot


# ---- 32-value formats ------------------------------------------------------------------------

def _unpack32(g, kind, row, o):
    """The 32 unsigned weight values of the block at row+o as <32 x i8> (Q8_0: the signed bytes),
    in the activation's order (byte j: value j low nibble, value j + 16 high)."""
    b = g.b
    if kind == Q8_0:
        return g.load(row, b.add(o, g.const(2)), _B32)
    size = BLOCK_BYTES[kind]
    packed = g.load(row, b.add(o, g.const(size - 16)), _B16)
    u = g.shuffle(g.nibbles(packed, False), g.nibbles(packed, True), range(32))
    if kind in (Q5_0, Q5_1):                                 # bit j of qh is value j's fifth bit
        qh = g.load(row, b.add(o, g.const(size - 20)), _I32)
        bits = b.zext(b.bitcast(qh, ir.VectorType(_I1, 32)), _B32)
        u = b.or_(u, b.shl(bits, g.splat_const(_B32, 4)))
    return u


def _tree(b, terms):
    """terms added as a balanced tree: short dependency chains for the out-of-order core."""
    while len(terms) > 1:
        terms = [b.add(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


class _Args:
    """The tile arguments, parsed: the weight rows' base pointer and sizes, the C activation rows'
    pointers into each array of the pack, and the output."""

    def __init__(self, g, sig, args, C):
        b = g.b
        self.w, _ = g.array(sig.args[0], args[0])
        self.w_off, self.row_bytes, self.nb = (g.int64(sig.args[i], args[i]) for i in (1, 2, 3))
        m0 = g.int64(sig.args[8], args[8])
        self.act = [b.add(m0, g.const(c)) for c in range(C)]
        self.pack = []                                        # [array][c] -> pointer to row m0 + c
        for i in (4, 5, 6, 7):
            p, a = g.array(sig.args[i], args[i])
            self.pack.append([g.at(p, b.mul(m, g.stride0(a))) for m in self.act])
        self.out, self.out_arr = g.array(sig.args[9], args[9])
        self.n0 = g.int64(sig.args[10], args[10])
        self.n_rows = g.int64(sig.args[11], args[11]) if len(args) > 11 else None

    def row(self, g, r):
        return g.at(self.w, g.b.add(self.w_off, g.b.mul(r, self.row_bytes)))

    def store(self, g, c, r, value):
        b = g.b
        dst = b.add(b.mul(self.act[c], g.stride0(self.out_arr)), b.mul(b.add(self.n0, r), g.const(4)))
        b.store(value, b.bitcast(g.at(self.out, dst), _F32.as_pointer()))


def _block32(g, kind, rows, a, blk, accs):
    """One 32-value block of every weight row in `rows` times every activation row of `a`:
    accs[r][c] += float(integer sum) * d_a * d_w, lane by lane; Q4_1/Q5_1's offset m_w * s_a
    rides along as 8 lanes of m_w * (s_a / 8) (exact: a power of two), so no scalar sum waits."""
    b = g.b
    size = BLOCK_BYTES[kind]
    offset = {Q4_0: 1, Q5_0: 2}.get(kind, 0)           # -8 / -16 per value = -1 / -2 x sum(q_a) per lane
    with_m = kind in (Q4_1, Q5_1)
    q_rows, d_rows, s_rows, a_rows = a.pack
    o = b.mul(blk, g.const(size))
    o4 = b.mul(blk, g.const(4))
    avec = [g.load(p, b.mul(blk, g.const(32)), _B32) for p in q_rows]
    dav = [g.splat(_F8, g.load(p, o4, _F32)) for p in d_rows]
    if with_m:
        sav = [g.splat(_F8, b.fmul(g.load(p, o4, _F32), ir.Constant(_F32, 0.125))) for p in s_rows]
    init = [ir.Constant(_D8, None)] * len(q_rows)
    if offset:
        init = [g.splat(_D8, b.mul(g.load(p, o4, _I32), ir.Constant(_I32, -offset))) for p in a_rows]
    for r, row in enumerate(rows):
        u = _unpack32(g, kind, row, o)
        dwv = g.f16x8(row, o)
        mv = g.f16x8(row, b.add(o, g.const(2))) if with_m else None
        if kind == Q8_0:
            neg = b.icmp_signed("<", u, ir.Constant(_B32, None))
            u = b.select(neg, b.neg(u), u)                   # |w|: -128 -> 128 unsigned
        for c in range(len(q_rows)):
            s = b.select(neg, b.neg(avec[c]), avec[c]) if kind == Q8_0 else avec[c]
            isum = g.quads(init[c], u, s)
            scaled = b.fmul(b.sitofp(isum, _F8), dav[c])
            acc = g.fma(scaled, dwv, b.load(accs[r][c]))
            b.store(g.fma(mv, sav[c], acc) if with_m else acc, accs[r][c])


def _k4_scales(g, row, o):
    """Q4_K/Q5_K's 12 scale bytes at row+o+4 -> (scales, mins) as <8 x i16> (6 bits each):
    j < 4: sc = b[j] & 63, m = b[j+4] & 63; j >= 4: sc = (b[j+4] & 15) | (b[j-4] >> 6) << 4,
    m = (b[j+4] >> 4) | (b[j] >> 6) << 4 (common.quants.k4_scale_min)."""
    b = g.b
    v4 = ir.VectorType(_I8, 4)
    lo = g.load(row, b.add(o, g.const(4)), v4)
    mid = g.load(row, b.add(o, g.const(8)), v4)
    hi = g.load(row, b.add(o, g.const(12)), v4)
    c = lambda n: g.splat_const(v4, n)
    top = lambda v: b.shl(b.lshr(v, c(6)), c(4))
    sc = g.shuffle(b.and_(lo, c(63)), b.or_(b.and_(hi, c(15)), top(lo)), range(8))
    mn = g.shuffle(b.and_(mid, c(63)), b.or_(b.lshr(hi, c(4)), top(mid)), range(8))
    return b.zext(sc, _W8), b.zext(mn, _W8)


def _blockK(g, kind, rows, a, blk, accs):
    """One 256-value block of every weight row times every activation row: the integer sums of
    the 8 (Q4_K/Q5_K) or 16 (Q6_K) sub-blocks, each times its scale, added as a tree; then
    accs[r][c] += float(sum) * d_a * d_w (and the mins' term, - d_a * dmin_w * sum m_s b32_s)."""
    b = g.b
    size = BLOCK_BYTES[kind]
    q_rows, d_rows, s16_rows, s32_rows = a.pack
    C = len(q_rows)
    o = b.mul(blk, g.const(size))
    k = b.mul(blk, g.const(256))
    dav = [g.splat(_F8, g.load(p, b.mul(blk, g.const(4)), _F32)) for p in d_rows]
    for r, row in enumerate(rows):
        terms = [[] for _ in range(C)]
        if kind == Q6_K:
            scales = b.sext(g.load(row, b.add(o, g.const(192)), _B16), _W16)
            cst = lambda n: g.splat_const(_B32, n)
            for half in range(2):
                ql = b.add(o, g.const(64 * half))
                qh = g.load(row, b.add(o, g.const(128 + 32 * half)), _B32)
                lo0 = g.load(row, ql, _B32)
                lo1 = g.load(row, b.add(ql, g.const(32)), _B32)
                top = [b.shl(b.and_(qh, cst(3)), cst(4)), b.shl(b.and_(qh, cst(12)), cst(2)),
                       b.and_(qh, cst(48)), b.lshr(b.and_(qh, cst(192)), cst(2))]
                low = [g.nibbles(lo0, False), g.nibbles(lo1, False), g.nibbles(lo0, True), g.nibbles(lo1, True)]
                for i in range(4):
                    u = b.or_(low[i], top[i])
                    s = 8 * half + 2 * i
                    sc = g.shuffle(scales, scales, [s] * 8 + [s + 1] * 8)
                    for c in range(C):
                        av = g.load(q_rows[c], b.add(k, g.const(128 * half + 32 * i)), _B32)
                        terms[c].append(g.madd(g.pairs(u, av), sc))
            for c in range(C):                       # the -32 of every value: 32 sum_g sc_g bsum_g
                sums16 = g.load(s16_rows[c], b.mul(blk, g.const(32)), _W16)
                isum = b.sub(_tree(b, terms[c]), b.shl(g.madd(scales, sums16), g.splat_const(_D8, 5)))
                scaled = b.fmul(b.sitofp(isum, _F8), dav[c])
                dwv = g.f16x8(row, b.add(o, g.const(208)))
                b.store(g.fma(scaled, dwv, b.load(accs[r][c])), accs[r][c])
            continue
        scales, mins = _k4_scales(g, row, o)
        if kind == Q5_K:
            qh = g.load(row, b.add(o, g.const(16)), _B32)
        for ch in range(4):
            packed = g.load(row, b.add(o, g.const((48 if kind == Q5_K else 16) + 32 * ch)), _B32)
            for high in (0, 1):
                u = g.nibbles(packed, high)
                if kind == Q5_K:
                    bit = b.and_(b.lshr(qh, g.splat_const(_B32, 2 * ch + high)), g.splat_const(_B32, 1))
                    u = b.or_(u, b.shl(bit, g.splat_const(_B32, 4)))
                sc = g.shuffle(scales, scales, [2 * ch + high] * 16)
                for c in range(C):
                    av = g.load(q_rows[c], b.add(k, g.const(64 * ch + 32 * high)), _B32)
                    terms[c].append(g.madd(g.pairs(u, av), sc))
        dwv = g.f16x8(row, o)
        dminv = b.fneg(g.f16x8(row, b.add(o, g.const(2))))
        for c in range(C):
            scaled = b.fmul(b.sitofp(_tree(b, terms[c]), _F8), dav[c])
            acc = g.fma(scaled, dwv, b.load(accs[r][c]))
            sums32 = g.load(s32_rows[c], b.mul(blk, g.const(16)), _W8)
            msum = b.fmul(b.sitofp(g.widen4(g.madd(mins, sums32)), _F8), dav[c])
            b.store(g.fma(msum, dminv, acc), accs[r][c])


def _block(g, kind, rows, a, blk, accs):
    if kind in TYPES_K:
        _blockK(g, kind, rows, a, blk, accs)
    else:
        _block32(g, kind, rows, a, blk, accs)


def _tile(kind, R, C):
    """R weight rows x C activation rows, every block: the prefill GEMM's register block."""

    def codegen(context, builder, sig, args):
        g = _Emit(context, builder)
        b = builder
        a = _Args(g, sig, args, C)
        rows = [a.row(g, g.const(r)) for r in range(R)]
        accs = [[g.acc(_F8, ir.Constant(_F8, None)) for _ in range(C)] for _ in range(R)]
        with cgutils.for_range(b, a.nb) as loop:
            _block(g, kind, rows, a, loop.index, accs)
        for r in range(R):
            for c in range(C):
                a.store(g, c, g.const(r), g.hsum(b.load(accs[r][c])))
        return context.get_dummy_value()

    def typer(typingctx, w, w_off, row_bytes, nb, q, d, s, sums, m0, out, n0):
        _need_isa()
        return types.none(w, w_off, row_bytes, nb, q, d, s, sums, m0, out, n0), codegen

    typer.__name__ = f"tile_{kind}_{R}x{C}"
    return intrinsic(typer)


def _rows(kind):
    """n_rows weight rows, one after another (one sequential stream for the prefetchers), times
    one activation row: decode. Two accumulators take alternate blocks, so consecutive blocks'
    multiply-adds do not wait for each other."""

    def codegen(context, builder, sig, args):
        g = _Emit(context, builder)
        b = builder
        a = _Args(g, sig, args, 1)
        accs = [[[g.acc(_F8, ir.Constant(_F8, None))]] for _ in range(2)]
        two = g.const(2)
        with cgutils.for_range(b, a.n_rows) as rows:
            row = a.row(g, rows.index)
            for i in range(2):
                b.store(ir.Constant(_F8, None), accs[i][0][0])
            with cgutils.for_range(b, b.udiv(a.nb, two)) as loop:
                blk = b.mul(loop.index, two)
                g.prefetch(row, b.add(b.mul(blk, g.const(BLOCK_BYTES[kind])), g.const(PREFETCH_BYTES)))
                _block(g, kind, [row], a, blk, accs[0])
                _block(g, kind, [row], a, b.add(blk, g.const(1)), accs[1])
            with b.if_then(b.icmp_unsigned("!=", b.urem(a.nb, two), g.const(0))):
                _block(g, kind, [row], a, b.sub(a.nb, g.const(1)), accs[0])
            a.store(g, 0, rows.index, g.hsum(b.fadd(b.load(accs[0][0][0]), b.load(accs[1][0][0]))))
        return context.get_dummy_value()

    def typer(typingctx, w, w_off, row_bytes, nb, q, d, s, sums, m0, out, n0, n_rows):
        _need_isa()
        return types.none(w, w_off, row_bytes, nb, q, d, s, sums, m0, out, n0, n_rows), codegen

    typer.__name__ = f"rows_{kind}"
    return intrinsic(typer)


# Prefill's tile shapes, R x C, the fastest of those timed on the machine measured (Zen 4,
# SmolLM2's and TinyLlama's matrices, 128 prompt rows): 4 x 4 for the 32-value types (16
# accumulators); 1 x 8 for the K-quants, whose unpacking is dearer (sub-block scales, 6-bit
# values) and whose integer block sums need registers of their own, so one unpacked row serving
# 8 activation rows beat 2 x 4 and 4 x 4. Decode goes one row at a time (_rows).
PREFILL_32 = (4, 4)
PREFILL_K = (1, 8)
PREFETCH_BYTES = 1024        # decode asks for the weight bytes this far ahead of the block it multiplies

q4_0_rows, q4_0_1x1, q4_0_4x4 = _rows(Q4_0), _tile(Q4_0, 1, 1), _tile(Q4_0, 4, 4)
q4_1_rows, q4_1_1x1, q4_1_4x4 = _rows(Q4_1), _tile(Q4_1, 1, 1), _tile(Q4_1, 4, 4)
q5_0_rows, q5_0_1x1, q5_0_4x4 = _rows(Q5_0), _tile(Q5_0, 1, 1), _tile(Q5_0, 4, 4)
q5_1_rows, q5_1_1x1, q5_1_4x4 = _rows(Q5_1), _tile(Q5_1, 1, 1), _tile(Q5_1, 4, 4)
q8_0_rows, q8_0_1x1, q8_0_4x4 = _rows(Q8_0), _tile(Q8_0, 1, 1), _tile(Q8_0, 4, 4)
q4_k_rows, q4_k_1x1, q4_k_1x8 = _rows(Q4_K), _tile(Q4_K, 1, 1), _tile(Q4_K, 1, 8)
q5_k_rows, q5_k_1x1, q5_k_1x8 = _rows(Q5_K), _tile(Q5_K, 1, 1), _tile(Q5_K, 1, 8)
q6_k_rows, q6_k_1x1, q6_k_1x8 = _rows(Q6_K), _tile(Q6_K, 1, 1), _tile(Q6_K, 1, 8)
