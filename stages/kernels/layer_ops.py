"""The small ops of the one-call layer stack (stages/kernels/layer_stack.py): per row, inlined
into the phase that calls them (all but rms_norm_row: its comment says why).

    rms_norm_row(x, w, eps, out)              out = x / sqrt(mean(x^2) + eps) * w
    rope_rows(y, r0, r1, hd, cos, sin, pos, m0, m1)    columns r0..r1 of rows m0..m1 of y
                                              rotated, row m at pos[m]
    silu_mul(g, u), fast_exp(x)               the FFN gate; exp in plain arithmetic
    attend_chunk(...)                         one head of one query row over one chunk of
                                              positions: flash-decoding's partial result
    merge_chunks(parts, n, hd, out)           the chunks of one head merged (online softmax)
    kv_value(x, cache), as_f32(v)             a K/V value as the cache holds it (float32, or
                                              float16 bits: uint16) and back (F16C)

Attention reads the K/V cache through a page table: position t of a sequence lives at slot
tables[seq, t // page_size] * page_size + t % page_size of the cache's [n_slots, kv_dim] rows.
One sequence's arena is the case of one page of n_ctx positions. Chunks are fixed ranges of
CHUNK positions, [c CHUNK, (c+1) CHUNK), merged in order, whichever thread computed them and
whatever other rows were in the step: a row's numbers depend on its own positions only.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from stages.kernels.toolkit import FASTMATH, f32_from_bits, per_phase

CHUNK = 256             # positions per attention work item (flash-decoding's split)
i32, f32 = np.int32, np.float32


@njit(cache=True, fastmath=FASTMATH, inline="always")
def fast_exp(x):
    """exp(x) in plain arithmetic LLVM can vectorize, where libm's expf is one call per value:
    Cephes' expf (x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent bits), x
    clamped to [-87, 88] (softmax's x - max is <= 0; silu's -g either side). Its error against
    float64 exp: tests/test_fused.py."""
    x = min(max(x, f32(-87.0)), f32(88.0))
    n = np.floor(x * f32(1.44269504088896341) + f32(0.5))
    r = x - n * f32(0.693359375) + n * f32(2.12194440e-4)
    p = f32(1.9875691500e-4)
    p = p * r + f32(1.3981999507e-3)
    p = p * r + f32(8.3334519073e-3)
    p = p * r + f32(4.1665795894e-2)
    p = p * r + f32(1.6666665459e-1)
    p = p * r + f32(5.0000001201e-1)
    y = p * r * r + r + f32(1.0)
    return y * f32_from_bits(i32((i32(n) + i32(127)) << i32(23)))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def silu_mul(g, u):
    return g / (f32(1.0) + fast_exp(-g)) * u


# Not inlined by numba: a function numba inlines ("always") is compiled with its caller's flags,
# and a phase compiled without FASTMATH made this sum one add after another (a chain of dependent
# float64 adds, several times the time of the vector sum). Called, it keeps its own flags, and
# LLVM may still inline it.
@per_phase(fastmath=FASTMATH)
def rms_norm_row(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, the sum of squares in float64 (naive's rms_norm)."""
    ss = 0.0
    for j in range(x.shape[0]):
        ss += np.float64(x[j]) * x[j]
    r = f32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for j in range(x.shape[0]):
        out[j] = x[j] * r * w[j]


@njit(cache=True, fastmath=FASTMATH, inline="always")
def rope_rows(y, r0, r1, hd, cos, sin, pos, m0, m1):
    """Rotate the adjacent pairs of columns r0..r1 of rows m0..m1 of y, row m at position pos[m]."""
    for m in range(m0, m1):
        p = pos[m]
        for r in range(r0, r1, 2):
            i = (r % hd) // 2
            x0, x1 = y[m, r], y[m, r + 1]
            c, s = cos[p, i], sin[p, i]
            y[m, r] = x0 * c - x1 * s
            y[m, r + 1] = x0 * s + x1 * c


# ---- K/V values as the cache holds them ------------------------------------------------------

@intrinsic
def as_f32(typingctx, v):
    """A cache value as float32: itself, or float16 bits (uint16) through vcvtph2ps (exact)."""
    def codegen(context, builder, sig, args):
        if sig.args[0] == types.float32:
            return args[0]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(v), codegen


@intrinsic
def kv_value(typingctx, x, cache):
    """float32 x as the cache array stores it: float32, or float16 bits (uint16), rounded to
    nearest even (vcvtps2ph: numpy's astype(float16))."""
    def codegen(context, builder, sig, args):
        if sig.return_type == types.float32:
            return args[0]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return cache.dtype(x, cache), codegen


# ---- attention over pages --------------------------------------------------------------------

@njit(cache=True, inline="always")
def slot_of(table, t, page_size):
    """The cache slot of position t of the sequence whose page table is `table`."""
    return table[t // page_size] * page_size + t % page_size


@per_phase(fastmath=FASTMATH)
def attend_chunk(q, kc, vc, table, page_size, kvh, hd, t0, t1, scale, scores, part):
    """One head's query q [hd] against positions t0..t1-1 of one sequence (kc, vc [n_slots,
    kv_dim] this layer's cache, read through its page table): part = (max, sum of exp, sum of
    exp * V [hd]) over the chunk."""
    lo, hi = kvh * hd, (kvh + 1) * hd
    mx = f32(-np.inf)
    for t in range(t0, t1):
        k = kc[slot_of(table, t, page_size), lo:hi]
        s = f32(0.0)
        for d in range(hd):
            s += q[d] * as_f32(k[d])
        s *= scale
        scores[t - t0] = s
        mx = max(mx, s)
    total = f32(0.0)
    for t in range(t1 - t0):
        e = fast_exp(scores[t] - mx)
        scores[t] = e
        total += e
    acc = part[2:]
    acc[:] = 0.0
    t = t0
    while t + 4 <= t1:                  # 4 value rows per pass over acc: a quarter of its loads and stores
        p0, p1, p2, p3 = scores[t - t0], scores[t + 1 - t0], scores[t + 2 - t0], scores[t + 3 - t0]
        v0, v1 = vc[slot_of(table, t, page_size), lo:hi], vc[slot_of(table, t + 1, page_size), lo:hi]
        v2, v3 = vc[slot_of(table, t + 2, page_size), lo:hi], vc[slot_of(table, t + 3, page_size), lo:hi]
        for d in range(hd):
            acc[d] += (p0 * as_f32(v0[d]) + p1 * as_f32(v1[d])) + (p2 * as_f32(v2[d]) + p3 * as_f32(v3[d]))
        t += 4
    while t < t1:
        p = scores[t - t0]
        v = vc[slot_of(table, t, page_size), lo:hi]
        for d in range(hd):
            acc[d] += p * as_f32(v[d])
        t += 1
    part[0] = mx
    part[1] = total


@njit(cache=True, fastmath=FASTMATH, inline="always")
def merge_chunks(parts, n, hd, out):
    """out [hd] = the softmax-weighted sum over n chunks' partial results, in chunk order."""
    mx = parts[0, 0]
    for c in range(1, n):
        mx = max(mx, parts[c, 0])
    total = f32(0.0)
    out[:] = 0.0
    for c in range(n):
        wgt = fast_exp(parts[c, 0] - mx)
        total += wgt * parts[c, 1]
        for d in range(hd):
            out[d] += wgt * parts[c, 2 + d]
    inv = f32(1.0) / total
    for d in range(hd):
        out[d] *= inv


@njit(cache=True, inline="always")
def chunks_of(position):
    """Chunks of CHUNK positions a query at `position` attends over (0 .. position)."""
    return (position + CHUNK) // CHUNK
