"""The int8 stage's numba code (stages/int8.py tells the story).

The activations arrive as llama.cpp's 8-bit blocks (stages/kernels/q8.py rounds them);

    matvec_int8(...)            decode: the weight's integer values times the activation's,
                                summed in int32, one float multiply per block. Two versions:
                                matvec_int8_named (the x86 instructions asked for by name,
                                where the CPU has AVX2 + F16C) and matvec_int8_auto (plain
                                loops for LLVM's auto-vectorizer: every other CPU, and Q5_x)

The block formulas are ggml's dot products, vec_dot_<weight>_<activation>:

    Q8_0 x Q8_0   d_w d_a * sum(q_w q_a)
    Q4_0 x Q8_0   d_w d_a * (sum(q_w q_a) - 8 sum(q_a))          q_w the unsigned nibble
    Q5_0 x Q8_0   d_w d_a * (sum(q_w q_a) - 16 sum(q_a))
    Q4_1 x Q8_1   d_w d_a * sum(q_w q_a) + m_w s_a               (Q5_1 likewise)
    Q4_K x Q8_K   d_a * (d_w * sum_s sc_s sum(q_w q_a)  -  dmin_w * sum_s m_s bsum_s)   (Q5_K)
    Q6_K x Q8_K   d_a * d_w * sum_s sc_s sum((q_w - 32) q_a)

How the loops are written, and why (timed with `python -m app bench kernels`,
read with `fn.inspect_asm()`; tests/test_int8.py checks the instructions):

* The integer sums are reductions LLVM recognizes: `acc = int32(acc + int32(w) * int32(a))`
  over a loop whose length is known only at run time. Its X86PartialReduction pass turns
  such a loop of 16-bit (or smaller) products into vpmaddwd (16-bit multiplies, adjacent
  pairs added into 32-bit lanes), and on CPUs with VNNI the add folds in: vpdpwssd. It sizes
  the loop by its 32-bit accumulator, 8 lanes, so each instruction does 8 products (on 128-bit
  registers, or on 256-bit ones with the bytes widened to 32 bits). Q5_0/Q5_1's fifth bits
  are still shifted in 64 bits (no model here uses them; they are correct, not tuned).
  Every product and sum is cast back to int32: numba computes in 64 bits otherwise, and a
  64-bit multiply (vpmuldq, 4 lanes) is what LLVM then emits.
* Indices are unsigned (np.uint64). numba handles a negative index by adding the length, a
  select per element that stops LLVM from vectorizing whenever it cannot prove the index
  non-negative; with an unsigned index there is nothing to check. (Mixing uint64 and int64
  in numba gives float64: every term of an index is cast.)
* K-quants: each 256-value block is first unpacked into an int16 buffer holding sc_s * q
  (the sub-block scale folded in, at most 63 * 31 or 128 * 32 in size), then it is one
  reduction of 256 products: one horizontal add per block. (Reducing each 32-value
  sub-block of Q4_K on its own instead, no buffer, measured no faster.)
* The 32-value formats reduce each block on its own, 16 bytes (32 values) at a time: one
  horizontal add per 32 values. ggml's hand-written AVX2 kernels avoid it: they keep 8 lanes
  per block, convert them to float and multiply by the block's scale lane by lane. An
  auto-vectorizer only forms vpmaddwd inside a reduction, which ends in a horizontal add.
* So the loops above never become llama.cpp's instructions, and matvec_int8_named asks for
  them by name: numba's `intrinsic` lets a jitted function emit LLVM IR, and LLVM IR can call
  x86 intrinsics (llvm.x86.avx512.vpdpbusd.256, llvm.x86.avx2.pmadd.ub.sw, ...pmadd.wd). Four
  small helpers each load 32 weight bytes and 32 activation bytes as vectors, unpack the
  weights to unsigned bytes (nibbles 0..15, Q6_K's 0..63, Q8_0's |q| with the sign moved to
  the activation, as llama.cpp does) and multiply: vpdpbusd on VNNI CPUs (32 u8 x s8
  products, 4 summed into each int32 lane, for Q4_0/Q4_1/Q8_0), vpmaddubsw (2 per int16
  lane) then vpmaddwd with the sub-block scales for Q4_K/Q6_K (ggml's form: the scales ride
  on the 16-bit step; LLVM folds the adds into vpdpwssd). Each helper still ends in one
  horizontal add: per 32 values (Q4_0/Q4_1/Q8_0), 64 (Q4_K) or 128 (Q6_K). The float16
  scale fields are converted by F16C (f16_at) instead of the 256 KiB table, which does not fit
  in L1. The integer sums are the loops' sums exactly (tests/test_int8.py: the same float32
  results, bit for bit). Their throughput per type, against the loops and against the
  quantized stage's float kernels: profiles/bench/kernels.md (`python -m app bench kernels`).
  numba's cache key holds the CPU's features, so a cache never carries these kernels to a CPU
  without them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types

from stages.kernels import dequant_dot as quantized_kernels
from stages.kernels import toolkit, vector_ir
from stages.kernels.dequant_dot import _k4_scale_min, _q6_values
from stages.kernels.toolkit import FASTMATH, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0, read_f16
from stages.kernels.vector_ir import B16, B32, D8, I8, I16, W8, W16, Emit, vector_intrinsic

# numba computes integers in 64 bits unless every step is cast back: these are the casts.
i16, i32, u64, f32 = np.int16, np.int32, np.uint64, np.float32

# ---- the integer dot products, one weight row at a time -------------------------------------------

@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q8_0(row, a, da, asum, f16):
    """Q8_0 x Q8_0. The weight's int8 is read as the unsigned byte q + 128 (its sign bit
    flipped) and 128 * sum(q_a) taken off per block: unsigned 8-bit times signed 8-bit is a
    product vpmaddwd can take; two signed values would need 32-bit multiplies (vpmulld)."""
    nb = row.shape[0] // 34
    qk = a.shape[0] // nb                                    # 32, not a compile-time constant
    acc = f32(0.0)
    for b in range(nb):
        o, k = u64(34 * b + 2), u64(32 * b)
        t = i32(0)
        for j in range(qk):
            t = i32(t + i32(i32(row[o + u64(j)] ^ 128) * i32(a[k + u64(j)])))
        acc += read_f16(row, 34 * b, f16) * da[b] * f32(i32(t - i32(128 * asum[b])))
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_x(row, a, da, sa, asum, f16, size, offset):
    """Q4_0 (size 18, offset 8, asum: the activation's block sums) and Q4_1 (size 20, its m
    field times sa, the activation's s). Byte j holds value j (low nibble) and j + 16 (high)."""
    nb = row.shape[0] // size
    half = a.shape[0] // nb // 2                             # 16, not a compile-time constant
    acc = f32(0.0)
    for b in range(nb):
        o, k = u64(size * b + size - 16), u64(32 * b)
        t = i32(0)
        for j in range(half):
            v = row[o + u64(j)]
            t = i32(t + i32(i32(v & 15) * i32(a[k + u64(j)])) + i32(i32(v >> 4) * i32(a[k + u64(half + j)])))
        d = read_f16(row, size * b, f16) * da[b]
        if offset:                                           # Q4_0: value = q - 8
            acc += d * f32(i32(t - i32(offset * asum[b])))
        else:                                                # Q4_1: value = d q + m
            acc += d * f32(t) + read_f16(row, size * b + 2, f16) * sa[b]
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q5_x(row, a, da, sa, asum, f16, size, offset):
    """Q5_0 (size 22, offset 16) and Q5_1 (size 24): the nibbles plus bit j of the u32 qh."""
    nb = row.shape[0] // size
    half = a.shape[0] // nb // 2
    acc = f32(0.0)
    for b in range(nb):
        o, k = u64(size * b + size - 16), u64(32 * b)
        qh = toolkit.read_u32(row, size * b + size - 20)
        t = i32(0)
        for j in range(half):
            v = row[o + u64(j)]
            lo = i32(i32(v & 15) | i32(((qh >> j) & 1) << 4))
            hi = i32(i32(v >> 4) | i32(((qh >> (j + 16)) & 1) << 4))
            t = i32(t + i32(lo * i32(a[k + u64(j)])) + i32(hi * i32(a[k + u64(half + j)])))
        d = read_f16(row, size * b, f16) * da[b]
        if offset:
            acc += d * f32(i32(t - i32(offset * asum[b])))
        else:
            acc += d * f32(t) + read_f16(row, size * b + 2, f16) * sa[b]
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _block_dot(buf, a, k, n):
    """sum of buf[k..k+n) * a[k..k+n) in int32: the one reduction per K-quant block."""
    t = i32(0)
    for j in range(n):
        t = i32(t + i32(i32(buf[k + u64(j)]) * i32(a[k + u64(j)])))
    return t


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _fill_k4(row, buf, o, qo, ho, k, run, five):
    """Q4_K/Q5_K block at row[o:]: buf[k + i] = sc_s * q_i (int16) for its 256 values;
    returns sum_s m_s * (sum of the activation over sub-block s) via the caller's bsums."""
    for c in range(4):                                       # 64-value chunk c: sub-blocks 2c, 2c+1
        sc0, m0 = _k4_scale_min(row, o + 4, 2 * c)
        sc1, m1 = _k4_scale_min(row, o + 4, 2 * c + 1)
        s0, s1 = i16(sc0), i16(sc1)
        co, ko = qo + u64(32 * c), k + u64(64 * c)
        if five:
            for j in range(run):
                v = i16(row[co + u64(j)])
                h = i16(i16(row[ho + u64(j)]) >> i16(2 * c))
                buf[ko + u64(j)] = i16(s0 * i16(i16(v & i16(15)) | i16(i16(h & i16(1)) << i16(4))))
                buf[ko + u64(run + j)] = i16(s1 * i16(i16(v >> i16(4)) | i16(i16(h & i16(2)) << i16(3))))
        else:
            for j in range(run):
                v = i16(row[co + u64(j)])
                buf[ko + u64(j)] = i16(s0 * i16(v & i16(15)))
                buf[ko + u64(run + j)] = i16(s1 * i16(v >> i16(4)))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_k(row, a, da, bsums, f16, buf, five):
    """Q4_K (five=False, 144-byte blocks) and Q5_K (five=True, 176 bytes: qh[32] before qs).
    buf int16 [K]: this thread's scratch row."""
    size = 176 if five else 144
    nb = row.shape[0] // size
    n = a.shape[0] // nb                                     # 256
    run = n // 8                                             # 32 values per sub-block
    acc = f32(0.0)
    for b in range(nb):
        o = size * b
        k = u64(256 * b)
        _fill_k4(row, buf, o, u64(o + (48 if five else 16)), u64(o + 16), k, run, five)
        t = _block_dot(buf, a, k, n)
        mins = f32(0.0)                                      # sum_s m_s bsum_s: exact in float32
        for sb in range(8):                                  # (at most 8 * 63 * 4064 < 2^24)
            sc, m = _k4_scale_min(row, o + 4, sb)
            mins += m * f32(bsums[16 * b + 2 * sb] + bsums[16 * b + 2 * sb + 1])
        acc += da[b] * (read_f16(row, o, f16) * f32(t) - read_f16(row, o + 2, f16) * mins)
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q6_k(row, a, da, f16, buf):
    """Q6_K: (q - 32) * scale (int8) into buf, then one reduction per 256-value block."""
    nb = row.shape[0] // 210
    n = a.shape[0] // nb
    sixteen = n // 16                                        # 16, not a compile-time constant
    acc = f32(0.0)
    for b in range(nb):
        o, k = 210 * b, u64(256 * b)
        for h in range(2):                                   # 128-value halves
            for g in range(2):                               # l in 16g..16g+15
                ql, qh = u64(o + 64 * h + 16 * g), u64(o + 128 + 32 * h + 16 * g)
                ko = k + u64(128 * h + 16 * g)
                s = o + 192 + 8 * h + g                      # scale of value 32i + l: scales[8h + 2i + g]
                a0, a1 = i16(np.int8(row[s])), i16(np.int8(row[s + 2]))
                a2, a3 = i16(np.int8(row[s + 4])), i16(np.int8(row[s + 6]))
                for j in range(sixteen):
                    v0, v1, v2, v3 = _q6_values(row, ql, qh, u64(j))
                    buf[ko + u64(j)] = i16(a0 * i16(v0))
                    buf[ko + u64(32 + j)] = i16(a1 * i16(v1))
                    buf[ko + u64(64 + j)] = i16(a2 * i16(v2))
                    buf[ko + u64(96 + j)] = i16(a3 * i16(v3))
        t = _block_dot(buf, a, k, n)
        acc += da[b] * read_f16(row, o + 208, f16) * f32(t)
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_row(kind, row, a, da, sa, sums, f16, buf):
    if kind == Q4_K:
        return _dot_q4_k(row, a, da, sums, f16, buf, False)
    if kind == Q6_K:
        return _dot_q6_k(row, a, da, f16, buf)
    if kind == Q4_1:
        return _dot_q4_x(row, a, da, sa, sums, f16, 20, 0)
    if kind == Q8_0:
        return _dot_q8_0(row, a, da, sums, f16)
    if kind == Q4_0:
        return _dot_q4_x(row, a, da, sa, sums, f16, 18, 8)
    if kind == Q5_0:
        return _dot_q5_x(row, a, da, sa, sums, f16, 22, 16)
    if kind == Q5_1:
        return _dot_q5_x(row, a, da, sa, sums, f16, 24, 0)
    return _dot_q4_k(row, a, da, sums, f16, buf, True)     # Q5_K


@njit(cache=True, parallel=True)
def matvec_int8_auto(a, da, sa, sums, w, kind, f16, n_chunks):
    """Decode: y [N] = W x with x given as one quantized activation row (a int8 [K] and its
    block fields da, sa, sums from quantize_q8). W's rows in n_chunks contiguous ranges, one
    per iteration of the parallel loop, as in stages/kernels/threaded.py."""
    N = w.shape[0]
    K = a.shape[0]
    y = np.empty(N, dtype=np.float32)
    per = (N + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        buf = np.empty(K, dtype=np.int16)                    # this thread's scratch row
        for n in range(c * per, min(N, (c + 1) * per)):
            y[n] = _dot_row(kind, w[n], a, da, sa, sums, f16, buf)
    return y



@njit(cache=True, parallel=True, fastmath=FASTMATH)
def add_block_offsets(y, c, w, size, f16, n_chunks):
    """Prefill's share of ggml's m_w * s_a term for Q4_1/Q5_1: y [M, N] += c [M, K/32] m.T,
    m the float16 offset at bytes 2:4 of each block of W (w [N, K/32 * size] bytes) and
    c = s - d * sum(q) per activation block. In numba, not numpy's matmul: BLAS threads left
    spinning after a call take the cores that the next parallel kernel's threads wait for."""
    M, B = c.shape
    N = y.shape[1]
    per = (N + n_chunks - 1) // n_chunks
    for t in prange(n_chunks):
        m = np.empty(B, dtype=np.float32)                    # one weight row's offsets
        for n in range(t * per, min(N, (t + 1) * per)):
            row = w[n]
            for b in range(B):
                m[b] = read_f16(row, b * size + 2, f16)
            for i in range(M):
                acc = np.float32(0.0)
                for b in range(B):
                    acc += c[i, b] * m[b]
                y[i, n] += acc


# ---- the same dot products with the instructions named (where the CPU has them) -----------------
#
# LLVM's auto-vectorizer never forms vpdpbusd / vpmaddubsw from the loops above (see the module
# docstring), so each helper below asks for them through stages/kernels/vector_ir.py (the one
# place that writes vector instructions; its docstring lists each helper with the scalar code it
# stands for and the instructions it becomes). Each loads 32 weight bytes and 32 activation bytes
# as vectors, unpacks the weights to unsigned bytes, multiplies with dpbusd (Q4_0/Q4_1/Q8_0) or
# pairs + madd carrying the sub-block scales (Q4_K/Q6_K), and ends in one horizontal add
# (returning an int32). The unpacking is ggml's, the instruction choice llama.cpp's hand-written
# AVX2/VNNI code's. Q5_0/Q5_1/Q5_K keep the loops above (no model here uses them).


@vector_intrinsic
def f16_at(typingctx, w, o):
    """The little-endian float16 at w[o:o+2] as float32, converted by the CPU (F16C's
    vcvtph2ps: LLVM's half -> float) instead of looked up in the 256 KiB F16_TO_F32 table,
    which does not fit in L1 and costs two loads per scale field. Exact, as the table is."""
    vector_ir.need_isa("f16_at")

    def body(g, a):
        return g.b.fpext(g.load(a.w, a.o, vector_ir.HALF), vector_ir.FLOAT)
    return types.float32(w, o), body


@vector_intrinsic
def dot_q8_32(typingctx, w, wo, a, ao):
    """sum_{j<32} int8(w[wo+j]) * a[ao+j]: Q8_0's block. Both signed, so llama.cpp's trick:
    |w| as the unsigned operand, a with w's sign as the signed one (|w| <= 128, |a| <= 127)."""
    vector_ir.need_isa("dot_q8_32")

    def body(g, x):
        builder = g.b
        wv, av = g.load(x.w, x.wo, B32), g.load(x.a, x.ao, B32)
        neg = builder.icmp_signed("<", wv, ir.Constant(B32, None))
        u = builder.select(neg, builder.neg(wv), wv)                       # |w|: -128 -> 128 unsigned
        s = builder.select(neg, builder.neg(av), av)                       # a * sign(w) (w = 0: u = 0)
        return g.isum(g.dpbusd(ir.Constant(D8, None), u, s))
    return types.int32(w, wo, a, ao), body


@vector_intrinsic
def dot_nibbles_16(typingctx, w, wo, a, ao):
    """Q4_0/Q4_1's block: the 16 bytes at w[wo:] hold values j (low nibble) and j + 16 (high),
    0..15; their products with the 32 int8 at a[ao:], summed."""
    vector_ir.need_isa("dot_nibbles_16")

    def body(g, x):
        packed = g.load(x.w, x.wo, B16)
        u = g.shuffle(g.nibbles(packed, False), g.nibbles(packed, True), range(32))
        return g.isum(g.dpbusd(ir.Constant(D8, None), u, g.load(x.a, x.ao, B32)))
    return types.int32(w, wo, a, ao), body


@vector_intrinsic
def dot_nibbles_64(typingctx, w, wo, a, ao, sc0, sc1):
    """Q4_K's 64-value chunk: the 32 bytes at w[wo:] hold sub-block 2c (low nibbles, times the
    activations a[ao:ao+32]) and 2c+1 (high, times a[ao+32:ao+64]); returns
    sc0 * (the first sum) + sc1 * (the second). ggml's AVX2 form: pairs (vpmaddubsw), then madd
    (vpmaddwd) with the scales."""
    vector_ir.need_isa("dot_nibbles_64")

    def body(g, x):
        builder = g.b
        packed = g.load(x.w, x.wo, B32)
        total = None
        for high, off, sc in ((False, 0, x.sc0), (True, 32, x.sc1)):
            scale = g.splat(W16, builder.trunc(sc, I16))
            part = g.madd(g.pairs(g.nibbles(packed, high), g.load(x.a, builder.add(x.ao, g.const(off)), B32)), scale)
            total = part if total is None else builder.add(total, part)
        return g.isum(total)
    return types.int32(w, wo, a, ao, sc0, sc1), body


@vector_intrinsic
def dot_q6_128(typingctx, w, ql, qh, sc, a, ao):
    """Q6_K's 128-value half: value 32i + l (i < 4, l < 32) has its low 4 bits in nibble i // 2
    of w[ql + 32 (i % 2) + l] and its top 2 in bits 2i, 2i+1 of w[qh + l], 0..63; values of
    16 share the int8 scale w[sc + (32i + l) // 16]. Returns sum scale * value * a[ao + 32i + l]
    (the -32 of ggml's q - 32 is the caller's, through the activation's 16-value sums)."""
    vector_ir.need_isa("dot_q6_128")

    def body(g, x):
        builder = g.b
        lo0, lo1 = g.load(x.w, x.ql, B32), g.load(x.w, builder.add(x.ql, g.const(32)), B32)
        hi = g.load(x.w, x.qh, B32)
        scales = builder.sext(g.load(x.w, x.sc, ir.VectorType(I8, 8)), W8)
        top, low = q6_top_bits(g, hi), [g.nibbles(lo0, False), g.nibbles(lo1, False),
                                       g.nibbles(lo0, True), g.nibbles(lo1, True)]
        total = None
        for i in range(4):
            av = g.load(x.a, builder.add(x.ao, g.const(32 * i)), B32)
            scale = g.shuffle(scales, scales, [2 * i] * 8 + [2 * i + 1] * 8)
            part = g.madd(g.pairs(builder.or_(low[i], top[i]), av), scale)
            total = part if total is None else builder.add(total, part)
        return g.isum(total)
    return types.int32(w, ql, qh, sc, a, ao), body


def q6_top_bits(g: Emit, qh):
    """Q6_K's top 2 bits of the four values a byte of qh serves, each moved to bit 4-5 of its
    own byte: (qh & 3) << 4, (qh & 12) << 2, qh & 48, (qh & 192) >> 2 (ggml's dequantize_row_q6_K)."""
    b, c = g.b, lambda v: g.splat_const(qh.type, v)
    return [b.shl(b.and_(qh, c(3)), c(4)), b.shl(b.and_(qh, c(12)), c(2)),
            b.and_(qh, c(48)), b.lshr(b.and_(qh, c(192)), c(2))]


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q8_0_named(row, a, da, f16):
    nb = row.shape[0] // 34
    acc = f32(0.0)
    for b in range(nb):
        acc += f16_at(row, 34 * b) * da[b] * f32(dot_q8_32(row, 34 * b + 2, a, 32 * b))
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_x_named(row, a, da, sa, asum, f16, size, offset):
    nb = row.shape[0] // size
    acc = f32(0.0)
    for b in range(nb):
        t = dot_nibbles_16(row, size * b + size - 16, a, 32 * b)
        d = f16_at(row, size * b) * da[b]
        if offset:
            acc += d * f32(i32(t - i32(offset * asum[b])))
        else:
            acc += d * f32(t) + f16_at(row, size * b + 2) * sa[b]
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_k_named(row, a, da, bsums, f16):
    nb = row.shape[0] // 144
    acc = f32(0.0)
    for b in range(nb):
        o, k = 144 * b, 256 * b
        t = i32(0)
        mins = f32(0.0)
        for c in range(4):
            sc0, m0 = _k4_scale_min(row, o + 4, 2 * c)
            sc1, m1 = _k4_scale_min(row, o + 4, 2 * c + 1)
            t = i32(t + dot_nibbles_64(row, o + 16 + 32 * c, a, k + 64 * c, i32(sc0), i32(sc1)))
            mins += m0 * f32(bsums[16 * b + 4 * c] + bsums[16 * b + 4 * c + 1])
            mins += m1 * f32(bsums[16 * b + 4 * c + 2] + bsums[16 * b + 4 * c + 3])
        acc += da[b] * (f16_at(row, o) * f32(t) - f16_at(row, o + 2) * mins)
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q6_k_named(row, a, da, bsums, f16):
    nb = row.shape[0] // 210
    acc = f32(0.0)
    for b in range(nb):
        o, k = 210 * b, 256 * b
        t = i32(dot_q6_128(row, o, o + 128, o + 192, a, k) + dot_q6_128(row, o + 64, o + 160, o + 200, a, k + 128))
        off = i32(0)                                         # sum_g scale_g * bsum_g: the -32
        for g in range(16):
            off = i32(off + i32(i32(np.int8(row[o + 192 + g])) * bsums[16 * b + g]))
        acc += da[b] * f16_at(row, o + 208) * f32(i32(t - i32(32 * off)))
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_row_named(kind, row, a, da, sa, sums, f16, buf):
    if kind == Q4_K:
        return _dot_q4_k_named(row, a, da, sums, f16)
    if kind == Q6_K:
        return _dot_q6_k_named(row, a, da, sums, f16)
    if kind == Q4_1:
        return _dot_q4_x_named(row, a, da, sa, sums, f16, 20, 0)
    if kind == Q8_0:
        return _dot_q8_0_named(row, a, da, f16)
    if kind == Q4_0:
        return _dot_q4_x_named(row, a, da, sa, sums, f16, 18, 8)
    return _dot_row(kind, row, a, da, sa, sums, f16, buf)    # Q5_0, Q5_1, Q5_K: the loops above


@njit(cache=True, parallel=True)
def matvec_int8_named(a, da, sa, sums, w, kind, f16, n_chunks):
    """matvec_int8_auto with the named instructions for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K."""
    N = w.shape[0]
    K = a.shape[0]
    y = np.empty(N, dtype=np.float32)
    per = (N + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        buf = np.empty(K, dtype=np.int16)
        for n in range(c * per, min(N, (c + 1) * per)):
            y[n] = _dot_row_named(kind, w[n], a, da, sa, sums, f16, buf)
    return y


# What the stage calls: the named instructions where this CPU has them, else the loops above.
matvec_int8 = matvec_int8_named if vector_ir.ISA else matvec_int8_auto


__all__ = ["matvec_int8", "matvec_int8_auto", "matvec_int8_named", "add_block_offsets"]

toolkit.guard_cache(__name__, [matvec_int8_auto, matvec_int8_named],
                    [quantized_kernels.__file__, toolkit.__file__, vector_ir.__file__])
