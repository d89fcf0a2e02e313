"""Activations rounded to llama.cpp's 8-bit blocks: the one definition every integer kernel uses.

    quantize_row_32(x, q, d, s, sums)     one row, Q8_0 / Q8_1 blocks of 32 (ggml's quantize_row_q8_0
                                          and _q8_1): d = float16(amax / 127), q = roundf(x / d),
                                          s = float16(d * sum q) (Q8_1's field), sums = sum q
    quantize_row_k(x, q, d, b16, b32)     one row, Q8_K blocks of 256 (quantize_row_q8_K_ref):
                                          d = 1 / iscale with iscale = -127 / max (the value of
                                          largest magnitude, the first on ties), q = min(127,
                                          nearest_int(iscale * x)), b16 / b32 = sums of 16 / 32 q
    quantize_q8(x, qk)                    rows [M, K] -> (q, d, s, sums) arrays: the int8 stage's form
    Q8Blocks, Q8KBlocks, new_packs(M, K)  the same as named arrays for M rows, both formats at once:
                                          what the fused and repack stages' kernels read
    quantize_row(x, m, K, need32, needk, packs)    row m of both packs, as a matrix's type needs

ggml type -> the activation block its dot product takes (vec_dot_type): ACTIVATION_BLOCK. Compiled
without fastmath: roundf(x * id) must round the float32 product, not a fused multiply-add.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from stages.kernels.toolkit import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, f32_from_bits

f32 = np.float32

# 32 = Q8_0/Q8_1, 256 = Q8_K. Types not listed (F32, F16, BF16) are multiplied in float.
ACTIVATION_BLOCK = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}

# M rows of 8-bit blocks: q int8 [M, K]; 32-value blocks: d, s float32 and sums int32 [M, K/32];
# Q8_K: d float32 [M, K/256], b16 int16 [M, K/16 + 1], b32 int16 [M, K/32] (sums of 16, 32 q).
Q8Blocks = namedtuple("Q8Blocks", "q d s sums")
Q8KBlocks = namedtuple("Q8KBlocks", "q d b16 b32")


@intrinsic
def _through_f16(typingctx, f):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@njit(cache=True, inline="always")
def f16_round(f):
    """The float16 value nearest to float32 f (ties to even), as a float32: what storing a
    scale in a float16 field (GGML_FP32_TO_FP16) and reading it back gives. The conversion's own
    instructions (vcvtps2ph, vcvtph2ps: F16C, on every CPU the stages run on) round so, overflow
    to infinity from 65520 and keep float16's subnormals."""
    return _through_f16(np.float32(f))


@intrinsic
def _magnitude_bits(typingctx, x):
    """The bits of float32 |x| as an int32: for numbers, the order of the magnitudes."""
    def codegen(context, builder, sig, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))
    return types.int32(types.float32), codegen


# The largest magnitude of a block as an integer max of the magnitudes' bits: the same number as a
# float max, and an integer max the CPU does 16 or 8 lanes at a time. Written as LLVM's vector
# reduction over 32 values at once: left as a loop, LLVM unrolled the 32-value block before it
# could vectorize it (32 compares and conditional moves in a chain, about half the time of a row's
# rounding). Only a NaN differs from a float max: it now wins the max and makes the block's scale
# NaN, where the float compare passed over it (a layer that outputs a NaN has no right answer left
# to keep).
_I32x32 = ir.VectorType(ir.IntType(32), 32)


@intrinsic
def _amax32_bits(typingctx, x, k0):
    """max over |x[k0 .. k0 + 31]| of the float32 bits as int32 (x: a contiguous float32 array)."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" and x.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [args[1]])
        v = builder.load(builder.bitcast(at, _I32x32.as_pointer()), align=4)
        v = builder.and_(v, ir.Constant(_I32x32, [0x7FFFFFFF] * 32))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_I32x32]),
                                            "llvm.vector.reduce.smax.v32i32")
        return builder.call(fn, [v])
    return types.int32(x, types.intp), codegen


@njit(cache=True, inline="always")
def _amax_bits(x, k0, n):
    """The largest |x[k0 .. k0 + n - 1]| as float32 bits in an int32 (n a multiple of 32)."""
    top = np.int32(0)
    for j in range(0, n, 32):
        top = max(top, _amax32_bits(x, k0 + j))
    return top


@njit(cache=True, inline="always")
def quantize_row_32(x, q, d, s, sums):
    """Q8_0 / Q8_1 blocks of one row x [K]: q [K], d, s, sums [K/32]."""
    for b in range(x.shape[0] // 32):
        k0 = b * 32
        amax = f32_from_bits(_amax_bits(x, k0, 32))
        dd = amax / f32(127.0)
        inv = f32(1.0) / dd if dd != 0 else f32(0.0)
        total = 0
        for j in range(32):
            v = np.float64(x[k0 + j] * inv)                 # the float32 product, exactly
            r = int(math.floor(abs(v) + 0.5))               # roundf: half away from zero
            r = r if v >= 0 else -r
            q[k0 + j] = r
            total += r
        d[b] = f16_round(dd)
        s[b] = f16_round(f32(f32(total) * dd))
        sums[b] = total


@njit(cache=True, inline="always")
def quantize_row_k(x, q, d, b16, b32):
    """Q8_K blocks of one row x [K]: q [K], d [K/256], the sums of every 16 values (b16) and
    every 32 (b32), int16."""
    for b in range(x.shape[0] // 256):
        k0 = b * 256
        top = _amax_bits(x, k0, 256)
        first = 256                                 # the first value of that magnitude: its sign
        for j in range(256):
            at = j if _magnitude_bits(x[k0 + j]) == top else 256
            first = at if at < first else first
        amax = f32_from_bits(top)
        vmax = x[k0 + first] if first < 256 else f32(0.0)
        if amax == 0:
            d[b] = 0.0
            for j in range(256):
                q[k0 + j] = 0
        else:
            iscale = f32(-127.0) / vmax
            for j in range(256):
                q[k0 + j] = min(127, int(np.rint(f32(iscale * x[k0 + j]))))   # nearest_int: ties to even
            d[b] = f32(1.0) / iscale
        for g in range(16):
            t = 0
            for j in range(16):
                t += q[k0 + 16 * g + j]
            b16[16 * b + g] = t
        for g in range(8):
            b32[8 * b + g] = b16[16 * b + 2 * g] + b16[16 * b + 2 * g + 1]


@njit(cache=True)
def quantize_q8(x, qk):
    """x [M, K] float32 -> (q int8 [M, K], d float32 [M, K/qk], s float32 [M, K/qk],
    sums int32 [M, K/32] for qk = 32, ggml's bsums [M, K/16] for qk = 256; s is 0 there)."""
    M, K = x.shape
    nb = K // qk
    q = np.empty((M, K), dtype=np.int8)
    d = np.empty((M, nb), dtype=np.float32)
    s = np.zeros((M, nb), dtype=np.float32)
    sums = np.zeros((M, K // (32 if qk == 32 else 16)), dtype=np.int32)
    b16 = np.empty(K // 16, dtype=np.int16)
    b32 = np.empty(K // 32, dtype=np.int16)
    for m in range(M):
        if qk == 32:
            quantize_row_32(x[m], q[m], d[m], s[m], sums[m])
        else:
            quantize_row_k(x[m], q[m], d[m], b16, b32)
            for g in range(K // 16):
                sums[m, g] = b16[g]
    return q, d, s, sums


@njit(cache=True)
def dequantize_q8(q, d, qk):
    """The float32 values the 8-bit blocks stand for, d * q: what the int8 stage's prefill multiplies."""
    M, K = q.shape
    out = np.empty((M, K), dtype=np.float32)
    for m in range(M):
        for k in range(K):
            out[m, k] = d[m, k // qk] * np.float32(q[m, k])
    return out


@njit(cache=True)
def pack_arrays(M, K):
    """The arrays of both packs for M rows of length up to K (zeros), Q8Blocks' then Q8KBlocks'.
    (A plain tuple: numba's parallel loops lose track of a named tuple a function returns, so a
    parallel kernel names them itself: Q8Blocks(*a[:4]), Q8KBlocks(*a[4:]).)"""
    k32 = max(1, K // 32)
    kk = max(1, K // 256)
    return (np.zeros((M, K), np.int8), np.zeros((M, k32), np.float32), np.zeros((M, k32), np.float32),
            np.zeros((M, k32), np.int32),
            np.zeros((M, K), np.int8), np.zeros((M, kk), np.float32), np.zeros((M, K // 16 + 1), np.int16),
            np.zeros((M, k32), np.int16))


@njit(cache=True)
def new_packs(M, K):
    """Both packs for M rows of length up to K (zeros): (Q8Blocks, Q8KBlocks)."""
    a = pack_arrays(M, K)
    return Q8Blocks(a[0], a[1], a[2], a[3]), Q8KBlocks(a[4], a[5], a[6], a[7])


@njit(cache=True, inline="always")
def quantize_row(x, m, K, need32, needk, p32, pk):
    """Row m of the packs from x [K]: the formats its consumers take."""
    if need32:
        quantize_row_32(x[:K], p32.q[m, :K], p32.d[m], p32.s[m], p32.sums[m])
    if needk:
        quantize_row_k(x[:K], pk.q[m, :K], pk.d[m], pk.b16[m], pk.b32[m])
