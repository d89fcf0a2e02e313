"""The int8 stage's numba code (stages/int8.py tells the story).

Two halves:

    quantize_q8(x, qk)          activation rows [M, K] float32 -> llama.cpp's 8-bit blocks:
                                qk = 32:  Q8_0 / Q8_1 (d = amax/127 stored as float16,
                                          q = roundf(x/d); Q8_1 adds s = d * sum(q))
                                qk = 256: Q8_K (d = max/-127 as float32, q = nearest_int(x/d)
                                          capped at 127, bsums: sums of 16 q's)
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

How the loops are written, and why (timed with `python scripts/bench_kernels.py`,
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
  quantized stage's float kernels: profiles/bench/kernels.md (`python scripts/bench_kernels.py`).
  numba's cache key holds the CPU's features, so a cache never carries these kernels to a CPU
  without them.
* Only the activation quantizers are compiled without fastmath: roundf(x * id) must round
  the float32 product, not a fused multiply-add.
"""

from __future__ import annotations

import math
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config, errors
from numba.extending import intrinsic

from common.cpu import simd_features
from stages.kernels import dequant_dot as quantized_kernels
from stages.kernels import toolkit
from stages.kernels.dequant_dot import _k4_scale_min, _q6_values
from stages.kernels.toolkit import FASTMATH, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, read_f16

# numba computes integers in 64 bits unless every step is cast back: these are the casts.
i16, i32, u64, f32 = np.int16, np.int32, np.uint64, np.float32

# ggml type id -> the activation block its dot product takes (vec_dot_type): 32 = Q8_0/Q8_1,
# 256 = Q8_K. Types not listed (F32, F16, BF16) are multiplied in float.
ACTIVATION_BLOCK = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}


# ---- activations: float32 rows -> 8-bit blocks (ggml's quantize_row_q8_0/_q8_1/_q8_K_ref) ------

@njit(cache=True)
def f16_round(f):
    """The float16 value nearest to float32 f (ties to even), as a float32: what storing a
    scale in a float16 field (GGML_FP32_TO_FP16) and reading it back gives."""
    a = abs(np.float64(f))
    if a == 0.0 or a != a:
        return np.float32(f)
    if a >= 65520.0:                                     # beyond the largest float16, 65504
        return np.float32(math.copysign(np.inf, f))
    if a < 6.103515625e-05:                              # float16 subnormals: multiples of 2^-24
        return np.float32(math.copysign(np.rint(a * 16777216.0) / 16777216.0, f))
    m, e = math.frexp(a)                                 # a = m * 2^e, 0.5 <= m < 1
    return np.float32(math.copysign(math.ldexp(np.rint(m * 2048.0), e - 11), f))   # 11 bits


@njit(cache=True)
def quantize_q8(x, qk):
    """x [M, K] float32 -> (q int8 [M, K], d float32 [M, K/qk], s float32 [M, K/qk],
    sums int32 [M, K/16 or K/32]).

    qk = 32: Q8_0/Q8_1 blocks; d is the float16 value of amax/127, q = roundf(x / d)
    (computed as x * (1/d) in float32, rounding half away from zero), s = float16(d * sum q)
    (Q8_1's field, used by Q4_1/Q5_1), sums = sum q per block (Q4_0/Q5_0's offsets).
    qk = 256: Q8_K blocks; d = 1/iscale with iscale = -127/max (max: the value of largest
    magnitude, the first one on ties), q = min(127, nearest_int(iscale * x)) (ties to even),
    sums = ggml's bsums: the sums of every 16 q's."""
    M, K = x.shape
    nb = K // qk
    q = np.empty((M, K), dtype=np.int8)
    d = np.empty((M, nb), dtype=np.float32)
    s = np.zeros((M, nb), dtype=np.float32)
    group = 32 if qk == 32 else 16
    sums = np.zeros((M, K // group), dtype=np.int32)
    for m in range(M):
        for b in range(nb):
            k0 = b * qk
            if qk == 32:
                amax = np.float32(0.0)
                for j in range(32):
                    amax = max(amax, abs(x[m, k0 + j]))
                dd = amax / np.float32(127.0)
                inv = np.float32(1.0) / dd if dd != 0 else np.float32(0.0)
                total = 0
                for j in range(32):
                    v = np.float64(x[m, k0 + j] * inv)              # the float32 product, exactly
                    r = int(math.floor(abs(v) + 0.5))               # roundf: half away from zero
                    r = r if v >= 0 else -r
                    q[m, k0 + j] = r
                    total += r
                d[m, b] = f16_round(dd)
                s[m, b] = f16_round(np.float32(np.float32(total) * dd))
                sums[m, b] = total
            else:
                amax = np.float32(0.0)
                vmax = np.float32(0.0)
                for j in range(qk):
                    v = x[m, k0 + j]
                    if abs(v) > amax:
                        amax = abs(v)
                        vmax = v
                if amax == 0:
                    d[m, b] = 0.0
                    for j in range(qk):
                        q[m, k0 + j] = 0
                    continue
                iscale = np.float32(-127.0) / vmax
                for j in range(qk):
                    r = int(np.rint(np.float32(iscale * x[m, k0 + j])))   # nearest_int: ties to even
                    q[m, k0 + j] = min(127, r)
                for g in range(qk // 16):
                    t = 0
                    for j in range(16):
                        t += q[m, k0 + 16 * g + j]
                    sums[m, b * (qk // 16) + g] = t
                d[m, b] = np.float32(1.0) / iscale
    return q, d, s, sums


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
    per iteration of the parallel loop, as in stages/kernels/parallel.py."""
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
# docstring). numba's `intrinsic` lets a jitted function emit LLVM IR itself, and LLVM IR can call
# the x86 intrinsics by name. Each helper below loads 32 weight bytes and 32 activation bytes as
# vectors, unpacks the weights to unsigned bytes, and multiplies them with one of:
#
#   u8 x s8 -> int32  vpdpbusd  (AVX-VNNI / AVX512-VNNI)  32 products, 4 summed per int32 lane
#   u8 x s8 -> int16  vpmaddubsw (AVX2)                    32 products, 2 summed per int16 lane
#   s16 x s16 -> int32 vpmaddwd (AVX2)                     then pairs of those, times the
#                                                          sub-block scales or times 1
#
# and ends in one horizontal add (returning an int32). The unpacking is ggml's, the instruction
# choice llama.cpp's hand-written AVX2/VNNI code's. Q5_0/Q5_1/Q5_K keep the loops above (no
# model here uses them).

def named_isa():
    """'vnni' (vpdpbusd), 'avx2' (vpmaddubsw + vpmaddwd) or None (the auto-vectorized kernels):
    what this CPU offers numba's code generator (AVX2 and F16C at least; AVX-VNNI, or
    AVX512-VNNI with AVX512VL, for vpdpbusd on 256-bit registers). numba compiles for the host
    CPU unless told otherwise (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, e.g. for a portable
    cache): then None."""
    if platform.machine() not in ("x86_64", "AMD64") or config.CPU_NAME or config.CPU_FEATURES:
        return None
    f = set(simd_features())
    if not {"avx2", "f16c"} <= f:
        return None
    return "vnni" if "avx_vnni" in f or {"avx512_vnni", "avx512vl"} <= f else "avx2"


ISA = named_isa()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_B32, _W16, _D8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)


class _IR:
    """A few lines of LLVM IR per operation, for the intrinsics below. `isa` is read when a
    kernel is compiled (numba's cache key includes the CPU's features)."""

    def __init__(self, context, builder, isa):
        self.c, self.b, self.isa = context, builder, isa

    def call(self, name, ret, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def bytes(self, arrty, arr, offset, n=32):
        """<n x i8> at element `offset` of a uint8/int8 array (no alignment assumed)."""
        data = self.c.make_array(arrty)(self.c, self.b, arr).data
        p = self.b.gep(data, [offset])
        return self.b.load(self.b.bitcast(p, ir.VectorType(_I8, n).as_pointer()), align=1)

    @staticmethod
    def splat(ty, value):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)

    def nibbles(self, v, high):
        """The low or high 4 bits of each byte."""
        b = self.b
        return b.lshr(v, self.splat(v.type, 4)) if high else b.and_(v, self.splat(v.type, 15))

    def pairs(self, u, s):
        """vpmaddubsw: <16 x i16>, lane i = u[2i] s[2i] + u[2i+1] s[2i+1] (u unsigned, s signed;
        saturating, which none of the products here reach: |sum| <= 2 * 128 * 127)."""
        return self.call("llvm.x86.avx2.pmadd.ub.sw", _W16, u, s)

    def scaled(self, w16, scale16):
        """vpmaddwd: <8 x i32>, lane i = w16[2i] scale16[2i] + w16[2i+1] scale16[2i+1]."""
        return self.call("llvm.x86.avx2.pmadd.wd", _D8, w16, scale16)

    def quads(self, u, s):
        """<8 x i32>, lane i = the sum of the 4 products u[4i..4i+3] s[4i..4i+3]."""
        if self.isa == "vnni":      # vpdpbusd (the <8 x i32> operand form: LLVM 15 to 22 accept it)
            cast = lambda v: self.b.bitcast(v, _D8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", _D8, ir.Constant(_D8, None), cast(u), cast(s))
        return self.scaled(self.pairs(u, s), self.splat(_W16, 1))

    def hsum(self, v):
        return self.call("llvm.vector.reduce.add.v8i32", _I32, v)

    def i64(self, ty, v):
        return self.c.cast(self.b, v, ty, types.int64)


def _need_isa():
    if ISA is None:
        raise errors.TypingError("the named-instruction kernels need AVX2 (see stages/kernels/int_dot.py, named_isa)")


@intrinsic
def f16_at(typingctx, w, o):
    """The little-endian float16 at w[o:o+2] as float32, converted by the CPU (F16C's
    vcvtph2ps: LLVM's half -> float) instead of looked up in the 256 KiB F16_TO_F32 table,
    which does not fit in L1 and costs two loads per scale field. Exact, as the table is."""
    _need_isa()

    def codegen(context, builder, sig, args):
        g = _IR(context, builder, ISA)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.bitcast(builder.gep(data, [g.i64(sig.args[1], args[1])]), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(p, align=1), ir.FloatType())
    return types.float32(w, o), codegen


@intrinsic
def dot_q8_32(typingctx, w, wo, a, ao):
    """sum_{j<32} int8(w[wo+j]) * a[ao+j]: Q8_0's block. Both signed, so llama.cpp's trick:
    |w| as the unsigned operand, a with w's sign as the signed one (|w| <= 128, |a| <= 127)."""
    _need_isa()

    def codegen(context, builder, sig, args):
        g = _IR(context, builder, ISA)
        wv = g.bytes(sig.args[0], args[0], g.i64(sig.args[1], args[1]))
        av = g.bytes(sig.args[2], args[2], g.i64(sig.args[3], args[3]))
        neg = builder.icmp_signed("<", wv, ir.Constant(_B32, None))
        u = builder.select(neg, builder.neg(wv), wv)                       # |w|: -128 -> 128 unsigned
        s = builder.select(neg, builder.neg(av), av)                       # a * sign(w) (w = 0: u = 0)
        return g.hsum(g.quads(u, s))
    return types.int32(w, wo, a, ao), codegen


@intrinsic
def dot_nibbles_16(typingctx, w, wo, a, ao):
    """Q4_0/Q4_1's block: the 16 bytes at w[wo:] hold values j (low nibble) and j + 16 (high),
    0..15; their products with the 32 int8 at a[ao:], summed."""
    _need_isa()

    def codegen(context, builder, sig, args):
        g = _IR(context, builder, ISA)
        packed = g.bytes(sig.args[0], args[0], g.i64(sig.args[1], args[1]), 16)
        u = builder.shuffle_vector(g.nibbles(packed, False), g.nibbles(packed, True),
                                   ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        av = g.bytes(sig.args[2], args[2], g.i64(sig.args[3], args[3]))
        return g.hsum(g.quads(u, av))
    return types.int32(w, wo, a, ao), codegen


@intrinsic
def dot_nibbles_64(typingctx, w, wo, a, ao, sc0, sc1):
    """Q4_K's 64-value chunk: the 32 bytes at w[wo:] hold sub-block 2c (low nibbles, times the
    activations a[ao:ao+32]) and 2c+1 (high, times a[ao+32:ao+64]); returns
    sc0 * (the first sum) + sc1 * (the second). ggml's AVX2 form: vpmaddubsw, then vpmaddwd
    with the scales."""
    _need_isa()

    def codegen(context, builder, sig, args):
        g = _IR(context, builder, ISA)
        packed = g.bytes(sig.args[0], args[0], g.i64(sig.args[1], args[1]))
        k = g.i64(sig.args[3], args[3])
        a0 = g.bytes(sig.args[2], args[2], k)
        a1 = g.bytes(sig.args[2], args[2], builder.add(k, ir.Constant(_I64, 32)))
        total = None
        for high, a_half, sc, sc_ty in ((False, a0, args[4], sig.args[4]), (True, a1, args[5], sig.args[5])):
            s16 = builder.trunc(g.i64(sc_ty, sc), _I16)
            scale = builder.shuffle_vector(builder.insert_element(ir.Constant(_W16, None), s16, ir.Constant(_I32, 0)),
                                           ir.Constant(_W16, None), ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            part = g.scaled(g.pairs(g.nibbles(packed, high), a_half), scale)
            total = part if total is None else builder.add(total, part)
        return g.hsum(total)
    return types.int32(w, wo, a, ao, sc0, sc1), codegen


@intrinsic
def dot_q6_128(typingctx, w, ql, qh, sc, a, ao):
    """Q6_K's 128-value half: value 32i + l (i < 4, l < 32) has its low 4 bits in nibble i // 2
    of w[ql + 32 (i % 2) + l] and its top 2 in bits 2i, 2i+1 of w[qh + l], 0..63; values of
    16 share the int8 scale w[sc + (32i + l) // 16]. Returns sum scale * value * a[ao + 32i + l]
    (the -32 of ggml's q - 32 is the caller's, through the activation's 16-value sums)."""
    _need_isa()

    def codegen(context, builder, sig, args):
        g = _IR(context, builder, ISA)
        wt, at = sig.args[0], sig.args[4]
        lo0 = g.bytes(wt, args[0], g.i64(sig.args[1], args[1]))
        lo1 = g.bytes(wt, args[0], builder.add(g.i64(sig.args[1], args[1]), ir.Constant(_I64, 32)))
        hi = g.bytes(wt, args[0], g.i64(sig.args[2], args[2]))
        scales = builder.sext(g.bytes(wt, args[0], g.i64(sig.args[3], args[3]), 8), ir.VectorType(_I16, 8))
        k = g.i64(sig.args[5], args[5])
        c = lambda v: g.splat(_B32, v)
        top = [builder.shl(builder.and_(hi, c(3)), c(4)), builder.shl(builder.and_(hi, c(12)), c(2)),
               builder.and_(hi, c(48)), builder.lshr(builder.and_(hi, c(192)), c(2))]
        low = [g.nibbles(lo0, False), g.nibbles(lo1, False), g.nibbles(lo0, True), g.nibbles(lo1, True)]
        total = None
        for i in range(4):
            q = builder.or_(low[i], top[i])
            av = g.bytes(at, args[4], builder.add(k, ir.Constant(_I64, 32 * i)))
            scale = builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(_I32, 16),
                                                                       [2 * i] * 8 + [2 * i + 1] * 8))
            part = g.scaled(g.pairs(q, av), scale)
            total = part if total is None else builder.add(total, part)
        return g.hsum(total)
    return types.int32(w, ql, qh, sc, a, ao), codegen


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
matvec_int8 = matvec_int8_named if ISA else matvec_int8_auto


@njit(cache=True)
def dequantize_q8(q, d, qk):
    """The float32 values the 8-bit blocks stand for, d * q: what prefill multiplies."""
    M, K = q.shape
    out = np.empty((M, K), dtype=np.float32)
    for m in range(M):
        for k in range(K):
            out[m, k] = d[m, k // qk] * np.float32(q[m, k])
    return out


__all__ = ["quantize_q8", "dequantize_q8", "matvec_int8", "matvec_int8_auto", "matvec_int8_named", "ISA",
           "f16_round", "ACTIVATION_BLOCK"]

toolkit.guard_cache(__name__, [quantize_q8, matvec_int8_auto, matvec_int8_named, dequantize_q8, f16_round],
            [quantized_kernels.__file__, toolkit.__file__])
