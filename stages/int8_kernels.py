"""The int8 stage's numba code (stages/int8.py tells the story).

Two halves:

    quantize_q8(x, qk)          activation rows [M, K] float32 -> llama.cpp's 8-bit blocks:
                                qk = 32:  Q8_0 / Q8_1 (d = amax/127 stored as float16,
                                          q = roundf(x/d); Q8_1 adds s = d * sum(q))
                                qk = 256: Q8_K (d = max/-127 as float32, q = nearest_int(x/d)
                                          capped at 127, bsums: sums of 16 q's)
    matvec_int8(...)            decode: the weight's integer values times the activation's,
                                summed in int32, one float multiply per block

The block formulas are ggml's dot products, vec_dot_<weight>_<activation>:

    Q8_0 x Q8_0   d_w d_a * sum(q_w q_a)
    Q4_0 x Q8_0   d_w d_a * (sum(q_w q_a) - 8 sum(q_a))          q_w the unsigned nibble
    Q5_0 x Q8_0   d_w d_a * (sum(q_w q_a) - 16 sum(q_a))
    Q4_1 x Q8_1   d_w d_a * sum(q_w q_a) + m_w s_a               (Q5_1 likewise)
    Q4_K x Q8_K   d_a * (d_w * sum_s sc_s sum(q_w q_a)  -  dmin_w * sum_s m_s bsum_s)   (Q5_K)
    Q6_K x Q8_K   d_a * d_w * sum_s sc_s sum((q_w - 32) q_a)

How the loops are written, and why (timed with `python scripts/bench_vs_llama.py --kernels`,
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
  sub-block of Q4_K on its own instead, no buffer, measured the same.)
* The 32-value formats reduce each block on its own, 16 bytes (32 values) at a time: one
  horizontal add per 32 values, which is what makes them slower than the float kernels here
  (stages/int8.py shows the measurements). ggml's hand-written AVX2 kernels avoid it: they
  keep 8 lanes per block, convert them to float and multiply by the block's scale lane by
  lane. An auto-vectorizer only forms vpmaddwd inside a reduction, which ends in a
  horizontal add.
* Only the activation quantizers are compiled without fastmath: roundf(x * id) must round
  the float32 product, not a fused multiply-add.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from stages import quant_kernels as qk_mod
from stages.quant_kernels import (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _f16, _k4_scale_min,
                                  _q6_values, _u32)
from stages.thread_kernels import guard_cache

FASTMATH = {"reassoc", "contract", "nsz"}
I16, I32, U = np.int16, np.int32, np.uint64
F32 = np.float32

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
    acc = F32(0.0)
    for b in range(nb):
        o, k = U(34 * b + 2), U(32 * b)
        t = I32(0)
        for j in range(qk):
            t = I32(t + I32(I32(row[o + U(j)] ^ 128) * I32(a[k + U(j)])))
        acc += _f16(row, 34 * b, f16) * da[b] * F32(I32(t - I32(128 * asum[b])))
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_x(row, a, da, sa, asum, f16, size, offset):
    """Q4_0 (size 18, offset 8, asum: the activation's block sums) and Q4_1 (size 20, its m
    field times sa, the activation's s). Byte j holds value j (low nibble) and j + 16 (high)."""
    nb = row.shape[0] // size
    half = a.shape[0] // nb // 2                             # 16, not a compile-time constant
    acc = F32(0.0)
    for b in range(nb):
        o, k = U(size * b + size - 16), U(32 * b)
        t = I32(0)
        for j in range(half):
            v = row[o + U(j)]
            t = I32(t + I32(I32(v & 15) * I32(a[k + U(j)])) + I32(I32(v >> 4) * I32(a[k + U(half + j)])))
        d = _f16(row, size * b, f16) * da[b]
        if offset:                                           # Q4_0: value = q - 8
            acc += d * F32(I32(t - I32(offset * asum[b])))
        else:                                                # Q4_1: value = d q + m
            acc += d * F32(t) + _f16(row, size * b + 2, f16) * sa[b]
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q5_x(row, a, da, sa, asum, f16, size, offset):
    """Q5_0 (size 22, offset 16) and Q5_1 (size 24): the nibbles plus bit j of the u32 qh."""
    nb = row.shape[0] // size
    half = a.shape[0] // nb // 2
    acc = F32(0.0)
    for b in range(nb):
        o, k = U(size * b + size - 16), U(32 * b)
        qh = _u32(row, size * b + size - 20)
        t = I32(0)
        for j in range(half):
            v = row[o + U(j)]
            lo = I32(I32(v & 15) | I32(((qh >> j) & 1) << 4))
            hi = I32(I32(v >> 4) | I32(((qh >> (j + 16)) & 1) << 4))
            t = I32(t + I32(lo * I32(a[k + U(j)])) + I32(hi * I32(a[k + U(half + j)])))
        d = _f16(row, size * b, f16) * da[b]
        if offset:
            acc += d * F32(I32(t - I32(offset * asum[b])))
        else:
            acc += d * F32(t) + _f16(row, size * b + 2, f16) * sa[b]
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _block_dot(buf, a, k, n):
    """sum of buf[k..k+n) * a[k..k+n) in int32: the one reduction per K-quant block."""
    t = I32(0)
    for j in range(n):
        t = I32(t + I32(I32(buf[k + U(j)]) * I32(a[k + U(j)])))
    return t


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _fill_k4(row, buf, o, qo, ho, k, run, five):
    """Q4_K/Q5_K block at row[o:]: buf[k + i] = sc_s * q_i (int16) for its 256 values;
    returns sum_s m_s * (sum of the activation over sub-block s) via the caller's bsums."""
    for c in range(4):                                       # 64-value chunk c: sub-blocks 2c, 2c+1
        sc0, m0 = _k4_scale_min(row, o + 4, 2 * c)
        sc1, m1 = _k4_scale_min(row, o + 4, 2 * c + 1)
        s0, s1 = I16(sc0), I16(sc1)
        co, ko = qo + U(32 * c), k + U(64 * c)
        if five:
            for j in range(run):
                v = I16(row[co + U(j)])
                h = I16(I16(row[ho + U(j)]) >> I16(2 * c))
                buf[ko + U(j)] = I16(s0 * I16(I16(v & I16(15)) | I16(I16(h & I16(1)) << I16(4))))
                buf[ko + U(run + j)] = I16(s1 * I16(I16(v >> I16(4)) | I16(I16(h & I16(2)) << I16(3))))
        else:
            for j in range(run):
                v = I16(row[co + U(j)])
                buf[ko + U(j)] = I16(s0 * I16(v & I16(15)))
                buf[ko + U(run + j)] = I16(s1 * I16(v >> I16(4)))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q4_k(row, a, da, bsums, f16, buf, five):
    """Q4_K (five=False, 144-byte blocks) and Q5_K (five=True, 176 bytes: qh[32] before qs).
    buf int16 [K]: this thread's scratch row."""
    size = 176 if five else 144
    nb = row.shape[0] // size
    n = a.shape[0] // nb                                     # 256
    run = n // 8                                             # 32 values per sub-block
    acc = F32(0.0)
    for b in range(nb):
        o = size * b
        k = U(256 * b)
        _fill_k4(row, buf, o, U(o + (48 if five else 16)), U(o + 16), k, run, five)
        t = _block_dot(buf, a, k, n)
        mins = F32(0.0)                                      # sum_s m_s bsum_s: exact in float32
        for sb in range(8):                                  # (at most 8 * 63 * 4064 < 2^24)
            sc, m = _k4_scale_min(row, o + 4, sb)
            mins += m * F32(bsums[16 * b + 2 * sb] + bsums[16 * b + 2 * sb + 1])
        acc += da[b] * (_f16(row, o, f16) * F32(t) - _f16(row, o + 2, f16) * mins)
    return acc


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot_q6_k(row, a, da, f16, buf):
    """Q6_K: (q - 32) * scale (int8) into buf, then one reduction per 256-value block."""
    nb = row.shape[0] // 210
    n = a.shape[0] // nb
    sixteen = n // 16                                        # 16, not a compile-time constant
    acc = F32(0.0)
    for b in range(nb):
        o, k = 210 * b, U(256 * b)
        for h in range(2):                                   # 128-value halves
            for g in range(2):                               # l in 16g..16g+15
                ql, qh = U(o + 64 * h + 16 * g), U(o + 128 + 32 * h + 16 * g)
                ko = k + U(128 * h + 16 * g)
                s = o + 192 + 8 * h + g                      # scale of value 32i + l: scales[8h + 2i + g]
                a0, a1 = I16(np.int8(row[s])), I16(np.int8(row[s + 2]))
                a2, a3 = I16(np.int8(row[s + 4])), I16(np.int8(row[s + 6]))
                for j in range(sixteen):
                    v0, v1, v2, v3 = _q6_values(row, ql, qh, U(j))
                    buf[ko + U(j)] = I16(a0 * I16(v0))
                    buf[ko + U(32 + j)] = I16(a1 * I16(v1))
                    buf[ko + U(64 + j)] = I16(a2 * I16(v2))
                    buf[ko + U(96 + j)] = I16(a3 * I16(v3))
        t = _block_dot(buf, a, k, n)
        acc += da[b] * _f16(row, o + 208, f16) * F32(t)
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
def matvec_int8(a, da, sa, sums, w, kind, f16, n_chunks):
    """Decode: y [N] = W x with x given as one quantized activation row (a int8 [K] and its
    block fields da, sa, sums from quantize_q8). W's rows in n_chunks contiguous ranges, one
    per iteration of the parallel loop, as in stages/thread_kernels.py."""
    N = w.shape[0]
    K = a.shape[0]
    y = np.empty(N, dtype=np.float32)
    per = (N + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        buf = np.empty(K, dtype=np.int16)                    # this thread's scratch row
        for n in range(c * per, min(N, (c + 1) * per)):
            y[n] = _dot_row(kind, w[n], a, da, sa, sums, f16, buf)
    return y


@njit(cache=True)
def dequantize_q8(q, d, qk):
    """The float32 values the 8-bit blocks stand for, d * q: what prefill multiplies."""
    M, K = q.shape
    out = np.empty((M, K), dtype=np.float32)
    for m in range(M):
        for k in range(K):
            out[m, k] = d[m, k // qk] * np.float32(q[m, k])
    return out


__all__ = ["quantize_q8", "dequantize_q8", "matvec_int8", "f16_round", "ACTIVATION_BLOCK"]

guard_cache(__name__, [quantize_q8, matvec_int8, dequantize_q8, f16_round], [qk_mod.__file__])
