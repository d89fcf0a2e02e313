"""The quantized stage's per-format kernels (stages/quantized.py tells the story).

For each ggml type with a kernel here there are two functions:

    _row_<type>(row, dst, f16)     one weight row as the file stores it -> its K float32 values
                                   (prefill panels, the embedding lookup, and the decode path of
                                   the 32-value 4/5-bit formats)
    matvec_<type>(x, w, f16)       decode: the activation row x [K] against every row of w,
                                   unpacking and multiplying in the same pass -> y [N]

row is uint8 [bytes per row] and w uint8 [N, bytes per row]: views into the mapped GGUF.
dst is float32 [K]. The block layouts and formulas are the ones common/quants.py documents
(and tests against gguf-py); here they are loops that numba compiles.

How the loops are written, and why (read with `fn.inspect_asm()`; timed per type with
`python -m app bench kernels`, whose record is profiles/bench/kernels.json):

* The loop LLVM must vectorize is the one over a block's packed bytes: load 8 bytes, AND and
  shift out the nibbles, widen to int32, convert to float, multiply-add, 8 floats at a time.
* A 16-iteration loop written with the literal 16 is unrolled completely before the
  vectorizer runs; the vectorizer then takes the loop over *blocks* instead, with gathers
  across 18- to 34-byte strides, several times slower. So the 32-value formats take their
  loop length from the shapes (`half`, 16 at run time), which LLVM cannot unroll away; so
  does Q6_K's 16-value run. The K-quants' 32-byte runs stay loops as written.
* A 16-byte block is too short to end in a vector reduction: summing 8 lanes into one costs
  about as much as the block's multiply-adds. The 4- and 5-bit 32-value formats therefore
  decode a whole row into an L1-resident buffer and take one long dot product with x. Q8_0
  (32 bytes per block) and the K-quants (144 to 210 bytes) multiply as they unpack and apply
  the scale once per block or sub-block, which measured faster than the buffer for them.
* Calls: a numba function that is not inlined costs about as much as decoding a hundred
  values, felt on SmolLM2's 576-value rows. The row decoders are inlined (`inline="always"`)
  into the kernels that loop over rows, and the generic paths decode several rows per call.
* Integers: numba does integer arithmetic in 64 bits. A nibble converted straight from int64
  becomes a 4-lane int64 -> float conversion; casting to int32 first (`np.int32(q & 15)`)
  lets LLVM work on 8 lanes of 32 bits. Q6_K's 6-bit values need the cast at every step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from common.gguf import GGMLType
from stages.kernels import toolkit
from stages.kernels.toolkit import BF16, F16, FASTMATH, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, read_f16

DECODE_ROWS = 8                                 # rows per call in matvec_rows

# The ggml types these kernels decode.
CPU_KERNEL_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1,
                    GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
                    GGMLType.Q6_K)


# ---- 32-value blocks: float16 scale (and offset), then the packed values ---------------------
# Q4_0 18 bytes: d, qs[16]            value j = d*(q_j - 8)     q_j: 4 bits
# Q4_1 20 bytes: d, m, qs[16]         value j = d*q_j + m
# Q5_0 22 bytes: d, qh[4], qs[16]     value j = d*(q_j - 16)    q_j: 4 bits + bit j of qh
# Q5_1 24 bytes: d, m, qh[4], qs[16]  value j = d*q_j + m
# Q8_0 34 bytes: d, qs[32] int8       value j = d*q_j
# In qs, byte j holds value j in its low nibble and value j + 16 in its high nibble.
# The offsets are written as d*q + c (c = m, -8d, -16d): one multiply-add per value.

@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q4_0(row, dst, f16):
    nb = row.shape[0] // 18
    half = dst.shape[0] // nb // 2               # 16, but not a compile-time constant (see top)
    for b in range(nb):
        o, k = 18 * b, 32 * b
        d = read_f16(row, o, f16)
        c = np.float32(-8.0) * d
        for j in range(half):
            q = np.int32(row[o + 2 + j])
            dst[k + j] = d * np.float32(np.int32(q & 15)) + c
            dst[k + 16 + j] = d * np.float32(np.int32(q >> 4)) + c


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q4_1(row, dst, f16):
    nb = row.shape[0] // 20
    half = dst.shape[0] // nb // 2
    for b in range(nb):
        o, k = 20 * b, 32 * b
        d = read_f16(row, o, f16)
        m = read_f16(row, o + 2, f16)
        for j in range(half):
            q = np.int32(row[o + 4 + j])
            dst[k + j] = d * np.float32(np.int32(q & 15)) + m
            dst[k + 16 + j] = d * np.float32(np.int32(q >> 4)) + m


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q5_0(row, dst, f16):
    nb = row.shape[0] // 22
    half = dst.shape[0] // nb // 2
    for b in range(nb):
        o, k = 22 * b, 32 * b
        d = read_f16(row, o, f16)
        c = np.float32(-16.0) * d
        qh = toolkit.read_u32(row, o + 2)
        for j in range(half):
            q = np.int32(row[o + 6 + j])
            lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            dst[k + j] = d * np.float32(np.int32(lo)) + c
            dst[k + 16 + j] = d * np.float32(np.int32(hi)) + c


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q5_1(row, dst, f16):
    nb = row.shape[0] // 24
    half = dst.shape[0] // nb // 2
    for b in range(nb):
        o, k = 24 * b, 32 * b
        d = read_f16(row, o, f16)
        m = read_f16(row, o + 2, f16)
        qh = toolkit.read_u32(row, o + 4)
        for j in range(half):
            q = np.int32(row[o + 8 + j])
            lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            dst[k + j] = d * np.float32(np.int32(lo)) + m
            dst[k + 16 + j] = d * np.float32(np.int32(hi)) + m


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q8_0(row, dst, f16):
    nb = row.shape[0] // 34
    qk = dst.shape[0] // nb
    for b in range(nb):
        o, k = 34 * b, 32 * b
        d = read_f16(row, o, f16)
        for j in range(qk):
            dst[k + j] = d * np.float32(np.int32(np.int8(row[o + 2 + j])))   # int8: wraps as in C


# ---- K-quants: 256-value super-blocks, small integer scales per sub-block ---------------------
# Q4_K 144 bytes: d, dmin, scales[12], qs[128]            8 sub-blocks of 32, 6-bit sc and m
# Q5_K 176 bytes: d, dmin, scales[12], qh[32], qs[128]    as Q4_K + a fifth bit per value
# Q6_K 210 bytes: ql[128], qh[64], scales[16] int8, d     16 sub-blocks of 16
# Q4_K/Q5_K: value = (d*sc)*q - dmin*m; 64-value chunk c reads qs[32c:32c+32], low nibbles
# are sub-block 2c, high nibbles 2c+1; bit s of qh[l] is the fifth bit of value l of sub-block s.

@njit(cache=True, inline="always")
def _k4_scale_min(row, s, j):
    """Q4_K/Q5_K: (scale, min) of sub-block j, 6 bits each, from the 12 bytes at row[s:]
    (packing documented at common.quants.k4_scale_min)."""
    if j < 4:
        sc = np.int32(row[s + j]) & 63
        mn = np.int32(row[s + j + 4]) & 63
    else:
        sc = (np.int32(row[s + j + 4]) & 15) | ((np.int32(row[s + j - 4]) >> 6) << 4)
        mn = (np.int32(row[s + j + 4]) >> 4) | ((np.int32(row[s + j]) >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q4_k(row, dst, f16):
    nb = row.shape[0] // 144
    for b in range(nb):
        o, k = 144 * b, 256 * b
        d = read_f16(row, o, f16)
        dmin = read_f16(row, o + 2, f16)
        for c in range(4):
            sc0, m0 = _k4_scale_min(row, o + 4, 2 * c)
            sc1, m1 = _k4_scale_min(row, o + 4, 2 * c + 1)
            a0, c0, a1, c1 = d * sc0, dmin * m0, d * sc1, dmin * m1
            qo, ko = o + 16 + 32 * c, k + 64 * c
            for l in range(32):
                q = np.int32(row[qo + l])
                dst[ko + l] = a0 * np.float32(np.int32(q & 15)) - c0
                dst[ko + 32 + l] = a1 * np.float32(np.int32(q >> 4)) - c1


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q5_k(row, dst, f16):
    nb = row.shape[0] // 176
    for b in range(nb):
        o, k = 176 * b, 256 * b
        d = read_f16(row, o, f16)
        dmin = read_f16(row, o + 2, f16)
        for c in range(4):
            sc0, m0 = _k4_scale_min(row, o + 4, 2 * c)
            sc1, m1 = _k4_scale_min(row, o + 4, 2 * c + 1)
            a0, c0, a1, c1 = d * sc0, dmin * m0, d * sc1, dmin * m1
            qo, ko = o + 48 + 32 * c, k + 64 * c
            for l in range(32):
                q = np.int32(row[qo + l])
                h = np.int32(np.int32(row[o + 16 + l]) >> (2 * c))
                dst[ko + l] = a0 * np.float32(np.int32(np.int32(q & 15) | np.int32((h & 1) << 4))) - c0
                dst[ko + 32 + l] = a1 * np.float32(np.int32(np.int32(q >> 4) | np.int32((h & 2) << 3))) - c1


@njit(cache=True, inline="always")
def _q6_values(row, ql, qh, j):
    """Q6_K: the four 6-bit values (minus 32) that byte j of a 16-value run holds, as int32.
    For the 128-value half starting at ql (64 bytes) and qh (32 bytes), value 32i + l takes
    its low 4 bits from nibble i//2 of ql[l + 32*(i%2)] and its top 2 bits from bits 2i..2i+1
    of qh[l]. Every step is cast back to int32 so LLVM keeps 8 lanes of 32 bits."""
    q0 = np.int32(row[ql + j])                      # values i=0 (low nibble), i=2 (high)
    q1 = np.int32(row[ql + 32 + j])                 # values i=1, i=3
    h = np.int32(row[qh + j])
    v0 = np.int32(np.int32(q0 & 15) | np.int32(np.int32(h & 3) << 4))
    v1 = np.int32(np.int32(q1 & 15) | np.int32(np.int32(h & 12) << 2))
    v2 = np.int32(np.int32(q0 >> 4) | np.int32(h & 48))
    v3 = np.int32(np.int32(q1 >> 4) | np.int32(np.int32(h & 192) >> 2))
    return np.int32(v0 - 32), np.int32(v1 - 32), np.int32(v2 - 32), np.int32(v3 - 32)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _row_q6_k(row, dst, f16):
    nb = row.shape[0] // 210
    sixteen = dst.shape[0] // nb // 16              # 16, not a compile-time constant
    for b in range(nb):
        o, k = 210 * b, 256 * b
        d = read_f16(row, o + 208, f16)
        for n in range(2):                          # 128-value halves
            for g in range(2):                      # l in 16g..16g+15: one scale per i
                ql, qh, ko = o + 64 * n + 16 * g, o + 128 + 32 * n + 16 * g, k + 128 * n + 16 * g
                s = o + 192 + 8 * n + g             # scale of value 32i + l: scales[8n + 2i + g]
                a0 = d * np.float32(np.int8(row[s]))
                a1 = d * np.float32(np.int8(row[s + 2]))
                a2 = d * np.float32(np.int8(row[s + 4]))
                a3 = d * np.float32(np.int8(row[s + 6]))
                for j in range(sixteen):
                    v0, v1, v2, v3 = _q6_values(row, ql, qh, j)
                    dst[ko + j] = a0 * np.float32(v0)
                    dst[ko + 32 + j] = a1 * np.float32(v1)
                    dst[ko + 64 + j] = a2 * np.float32(v2)
                    dst[ko + 96 + j] = a3 * np.float32(v3)


# ---- plain floats (not what the stage is about, but a model may hold them) -------------------

@njit(cache=True, inline="always")
def _rowread_f16(row, dst, f16):
    for i in range(dst.shape[0]):
        dst[i] = f16[np.int32(row[2 * i]) | (np.int32(row[2 * i + 1]) << 8)]


@njit(cache=True, inline="always")
def _row_bf16(row, dst, f16):
    bits = dst.view(np.uint32)                      # bfloat16 = the top half of a float32
    for i in range(dst.shape[0]):
        bits[i] = (np.uint32(row[2 * i]) << 16) | (np.uint32(row[2 * i + 1]) << 24)


@njit(cache=True, inline="always")
def _row_f32(row, dst, f16):
    bits = dst.view(np.uint32)
    for i in range(dst.shape[0]):
        bits[i] = (np.uint32(row[4 * i]) | (np.uint32(row[4 * i + 1]) << 8)
                   | (np.uint32(row[4 * i + 2]) << 16) | (np.uint32(row[4 * i + 3]) << 24))


@njit(cache=True)
def dequantize_rows(kind, w, n0, out, f16):
    """Rows n0 .. n0+R-1 of a weight of ggml type `kind`: w uint8 [N, bytes per row] ->
    out float32 [R, K]. One compiled function for every type keeps numba's signatures few;
    the branch is taken once per row. Compiled without fastmath (the inlined decoders take
    their caller's flags), the values are common.quants.dequantize's, bit for bit."""
    for r in range(out.shape[0]):
        row, dst = w[n0 + r], out[r]
        if kind == Q4_K:
            _row_q4_k(row, dst, f16)
        elif kind == Q6_K:
            _row_q6_k(row, dst, f16)
        elif kind == Q4_1:
            _row_q4_1(row, dst, f16)
        elif kind == Q8_0:
            _row_q8_0(row, dst, f16)
        elif kind == Q4_0:
            _row_q4_0(row, dst, f16)
        elif kind == Q5_0:
            _row_q5_0(row, dst, f16)
        elif kind == Q5_1:
            _row_q5_1(row, dst, f16)
        elif kind == Q5_K:
            _row_q5_k(row, dst, f16)
        elif kind == F16:
            _rowread_f16(row, dst, f16)
        elif kind == BF16:
            _row_bf16(row, dst, f16)
        else:
            _row_f32(row, dst, f16)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _dot(a, b):
    """a . b for two float32 vectors: one long loop LLVM turns into 4 x 8-lane FMA chains."""
    acc = np.float32(0.0)
    for k in range(a.shape[0]):
        acc += a[k] * b[k]
    return acc


# ---- the generic paths: whole rows as floats -------------------------------------------------

@njit(cache=True, fastmath=FASTMATH)
def matvec_rows(x, w, kind, f16):
    """Decode for the types without a fused kernel (the plain floats): DECODE_ROWS rows at a
    time decoded into an L1/L2-sized buffer, then dotted with x. Also a cross-check of the
    fused kernels in the tests."""
    K, N = x.shape[0], w.shape[0]
    y = np.empty(N, dtype=np.float32)
    rows = np.empty((DECODE_ROWS, K), dtype=np.float32)
    for n0 in range(0, N, DECODE_ROWS):
        r_end = min(DECODE_ROWS, N - n0)
        dequantize_rows(kind, w, n0, rows[:r_end], f16)
        for r in range(r_end):
            y[n0 + r] = _dot(rows[r], x)
    return y


@njit(cache=True)
def embed_rows(w, kind, ids, K, f16):
    """The embedding lookup: only the rows `ids` [M] of the table are decoded -> [M, K]."""
    out = np.empty((ids.shape[0], K), dtype=np.float32)
    for m in range(ids.shape[0]):
        dequantize_rows(kind, w, ids[m], out[m:m + 1], f16)
    return out


# ---- decode: fused unpack-and-multiply, one kernel per format --------------------------------
# The four 32-value formats' kernels below differ only in the row decoder they call, and are
# written out on purpose: the generic matvec_rows, which branches on the type at run time,
# measured slower on the same blocks, and a kernel made by a factory around another jitted
# function is not cached by numba from one process to the next.

@njit(cache=True, fastmath=FASTMATH)
def matvec_q4_0(x, w, f16):
    y = np.empty(w.shape[0], dtype=np.float32)
    buf = np.empty(x.shape[0], dtype=np.float32)      # one row of floats: L1-resident
    for n in range(w.shape[0]):
        _row_q4_0(w[n], buf, f16)
        y[n] = _dot(buf, x)
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q4_1(x, w, f16):
    y = np.empty(w.shape[0], dtype=np.float32)
    buf = np.empty(x.shape[0], dtype=np.float32)
    for n in range(w.shape[0]):
        _row_q4_1(w[n], buf, f16)
        y[n] = _dot(buf, x)
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q5_0(x, w, f16):
    y = np.empty(w.shape[0], dtype=np.float32)
    buf = np.empty(x.shape[0], dtype=np.float32)
    for n in range(w.shape[0]):
        _row_q5_0(w[n], buf, f16)
        y[n] = _dot(buf, x)
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q5_1(x, w, f16):
    y = np.empty(w.shape[0], dtype=np.float32)
    buf = np.empty(x.shape[0], dtype=np.float32)
    for n in range(w.shape[0]):
        _row_q5_1(w[n], buf, f16)
        y[n] = _dot(buf, x)
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q8_0(x, w, f16):
    """y[n] = sum over blocks of d_b * (x_b . q_b): the int8 values are multiplied as they are
    widened, and the scale is applied once per 32 values."""
    K, N = x.shape[0], w.shape[0]
    nb = w.shape[1] // 34
    qk = K // nb
    y = np.empty(N, dtype=np.float32)
    for n in range(N):
        row = w[n]
        acc = np.float32(0.0)
        for b in range(nb):
            o, k = 34 * b, 32 * b
            s = np.float32(0.0)
            for j in range(qk):
                s += x[k + j] * np.float32(np.int32(np.int8(row[o + 2 + j])))
            acc += read_f16(row, o, f16) * s
        y[n] = acc
    return y


@njit(cache=True, fastmath=FASTMATH)
def _subblock_sums(x, size):
    """x [K] -> the sum of every run of `size` values [K // size]: what the K-quants' and
    Q4_1-style offsets multiply (sum_j x_j * (-dmin*m) = -dmin*m * sum_j x_j)."""
    s = np.empty(x.shape[0] // size, dtype=np.float32)
    for i in range(s.shape[0]):
        acc = np.float32(0.0)
        for j in range(size):
            acc += x[size * i + j]
        s[i] = acc
    return s


@njit(cache=True, fastmath=FASTMATH)
def matvec_q4_k(x, w, f16):
    """Per 256-value block: s = sum over the 8 sub-blocks of sc_s * (x_s . q_s), one vector
    reduction per block; y[n] = sum_b d*s - dmin * sum_s m_s * (sum of x over sub-block s)."""
    K, N = x.shape[0], w.shape[0]
    nb = K // 256
    xs = _subblock_sums(x, 32)
    y = np.empty(N, dtype=np.float32)
    for n in range(N):
        row = w[n]
        acc = np.float32(0.0)
        for b in range(nb):
            o, k, t = 144 * b, 256 * b, 8 * b
            sc0, m0 = _k4_scale_min(row, o + 4, 0)
            sc1, m1 = _k4_scale_min(row, o + 4, 1)
            sc2, m2 = _k4_scale_min(row, o + 4, 2)
            sc3, m3 = _k4_scale_min(row, o + 4, 3)
            sc4, m4 = _k4_scale_min(row, o + 4, 4)
            sc5, m5 = _k4_scale_min(row, o + 4, 5)
            sc6, m6 = _k4_scale_min(row, o + 4, 6)
            sc7, m7 = _k4_scale_min(row, o + 4, 7)
            mins = (m0 * xs[t] + m1 * xs[t + 1] + m2 * xs[t + 2] + m3 * xs[t + 3]
                    + m4 * xs[t + 4] + m5 * xs[t + 5] + m6 * xs[t + 6] + m7 * xs[t + 7])
            qo = o + 16
            s = np.float32(0.0)
            for l in range(32):                     # byte l of each 32-byte chunk: 8 values
                q0 = np.int32(row[qo + l])
                q1 = np.int32(row[qo + 32 + l])
                q2 = np.int32(row[qo + 64 + l])
                q3 = np.int32(row[qo + 96 + l])
                s += (sc0 * (x[k + l] * np.float32(np.int32(q0 & 15)))
                      + sc1 * (x[k + 32 + l] * np.float32(np.int32(q0 >> 4)))
                      + sc2 * (x[k + 64 + l] * np.float32(np.int32(q1 & 15)))
                      + sc3 * (x[k + 96 + l] * np.float32(np.int32(q1 >> 4)))
                      + sc4 * (x[k + 128 + l] * np.float32(np.int32(q2 & 15)))
                      + sc5 * (x[k + 160 + l] * np.float32(np.int32(q2 >> 4)))
                      + sc6 * (x[k + 192 + l] * np.float32(np.int32(q3 & 15)))
                      + sc7 * (x[k + 224 + l] * np.float32(np.int32(q3 >> 4))))
            acc += read_f16(row, o, f16) * s - read_f16(row, o + 2, f16) * mins
        y[n] = acc
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q5_k(x, w, f16):
    """As matvec_q4_k, with the fifth bit of every value from qh."""
    K, N = x.shape[0], w.shape[0]
    nb = K // 256
    xs = _subblock_sums(x, 32)
    y = np.empty(N, dtype=np.float32)
    for n in range(N):
        row = w[n]
        acc = np.float32(0.0)
        for b in range(nb):
            o, k, t = 176 * b, 256 * b, 8 * b
            sc0, m0 = _k4_scale_min(row, o + 4, 0)
            sc1, m1 = _k4_scale_min(row, o + 4, 1)
            sc2, m2 = _k4_scale_min(row, o + 4, 2)
            sc3, m3 = _k4_scale_min(row, o + 4, 3)
            sc4, m4 = _k4_scale_min(row, o + 4, 4)
            sc5, m5 = _k4_scale_min(row, o + 4, 5)
            sc6, m6 = _k4_scale_min(row, o + 4, 6)
            sc7, m7 = _k4_scale_min(row, o + 4, 7)
            mins = (m0 * xs[t] + m1 * xs[t + 1] + m2 * xs[t + 2] + m3 * xs[t + 3]
                    + m4 * xs[t + 4] + m5 * xs[t + 5] + m6 * xs[t + 6] + m7 * xs[t + 7])
            qo, ho = o + 48, o + 16
            s = np.float32(0.0)
            for l in range(32):
                h = np.int32(row[ho + l])           # bit s: the fifth bit of sub-block s
                q0 = np.int32(row[qo + l])
                q1 = np.int32(row[qo + 32 + l])
                q2 = np.int32(row[qo + 64 + l])
                q3 = np.int32(row[qo + 96 + l])
                v0 = np.int32(np.int32(q0 & 15) | np.int32((h & 1) << 4))
                v1 = np.int32(np.int32(q0 >> 4) | np.int32((h & 2) << 3))
                v2 = np.int32(np.int32(q1 & 15) | np.int32((h & 4) << 2))
                v3 = np.int32(np.int32(q1 >> 4) | np.int32((h & 8) << 1))
                v4 = np.int32(np.int32(q2 & 15) | np.int32(h & 16))
                v5 = np.int32(np.int32(q2 >> 4) | np.int32((h & 32) >> 1))
                v6 = np.int32(np.int32(q3 & 15) | np.int32((h & 64) >> 2))
                v7 = np.int32(np.int32(q3 >> 4) | np.int32((h & 128) >> 3))
                s += (sc0 * (x[k + l] * np.float32(v0)) + sc1 * (x[k + 32 + l] * np.float32(v1))
                      + sc2 * (x[k + 64 + l] * np.float32(v2)) + sc3 * (x[k + 96 + l] * np.float32(v3))
                      + sc4 * (x[k + 128 + l] * np.float32(v4)) + sc5 * (x[k + 160 + l] * np.float32(v5))
                      + sc6 * (x[k + 192 + l] * np.float32(v6)) + sc7 * (x[k + 224 + l] * np.float32(v7)))
            acc += read_f16(row, o, f16) * s - read_f16(row, o + 2, f16) * mins
        y[n] = acc
    return y


@njit(cache=True, fastmath=FASTMATH)
def matvec_q6_k(x, w, f16):
    """Per 16-value run (4 per 128-value half): four sub-block scales, one reduction."""
    K, N = x.shape[0], w.shape[0]
    nb = K // 256
    sixteen = K // nb // 16                         # 16, not a compile-time constant
    y = np.empty(N, dtype=np.float32)
    for n_ in range(N):
        row = w[n_]
        acc = np.float32(0.0)
        for b in range(nb):
            o, k = 210 * b, 256 * b
            blk = np.float32(0.0)
            for n in range(2):
                for g in range(2):
                    ql, qh, ko = o + 64 * n + 16 * g, o + 128 + 32 * n + 16 * g, k + 128 * n + 16 * g
                    s = o + 192 + 8 * n + g
                    a0 = np.float32(np.int8(row[s]))
                    a1 = np.float32(np.int8(row[s + 2]))
                    a2 = np.float32(np.int8(row[s + 4]))
                    a3 = np.float32(np.int8(row[s + 6]))
                    t = np.float32(0.0)
                    for j in range(sixteen):
                        v0, v1, v2, v3 = _q6_values(row, ql, qh, j)
                        t += (a0 * (x[ko + j] * np.float32(v0)) + a1 * (x[ko + 32 + j] * np.float32(v1))
                              + a2 * (x[ko + 64 + j] * np.float32(v2)) + a3 * (x[ko + 96 + j] * np.float32(v3)))
                    blk += t
            acc += read_f16(row, o + 208, f16) * blk
        y[n_] = acc
    return y


# ggml type id -> its fused decode kernel (the float types use the generic row-then-dot path)
MATVEC = {Q4_0: matvec_q4_0, Q4_1: matvec_q4_1, Q5_0: matvec_q5_0, Q5_1: matvec_q5_1,
          Q8_0: matvec_q8_0, Q4_K: matvec_q4_k, Q5_K: matvec_q5_k, Q6_K: matvec_q6_k}


@njit(cache=True)
def matvec_any(x, w, kind, f16):
    """MATVEC[kind](x, w, f16) for callers inside numba (a jitted function cannot look up a
    dict of functions): every kernel compiled into one function, so call it from Python only
    where all of them are wanted (the threads stage). The default model's types come first."""
    if kind == Q4_K:
        return matvec_q4_k(x, w, f16)
    if kind == Q6_K:
        return matvec_q6_k(x, w, f16)
    if kind == Q4_1:
        return matvec_q4_1(x, w, f16)
    if kind == Q8_0:
        return matvec_q8_0(x, w, f16)
    if kind == Q4_0:
        return matvec_q4_0(x, w, f16)
    if kind == Q5_0:
        return matvec_q5_0(x, w, f16)
    if kind == Q5_1:
        return matvec_q5_1(x, w, f16)
    if kind == Q5_K:
        return matvec_q5_k(x, w, f16)
    return matvec_rows(x, w, kind, f16)


# The kernels inline toolkit's block readers: their cache must notice when that file changes.
toolkit.guard_cache(__name__, [f for f in list(globals().values())
                       if getattr(getattr(f, "py_func", None), "__module__", None) == __name__], [toolkit.__file__])
