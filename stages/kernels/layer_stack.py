"""The fused stage's numba code (stages/fused.py tells the story).

    run_layers(h, blob, mats, norms, ...)      the whole layer stack, every op, in ONE parallel
                                                region: nt threads (one prange iteration each)
                                                walk the same sequence of ops and meet at a
                                                barrier between two ops that depend on each other
    matmul_rows(x, w, kind, ...)               one weight matrix (the output head) the same way

The ops of one layer, each split into work items that the threads take from counters
(stages/kernels/sync.py's next_item: each thread its own contiguous range first), with a barrier
after each (9 per layer; the region's fork and join once per call):

    norm      rows of h -> x = rms_norm(h) * attn_norm, rounded to 8-bit blocks
    qkv       row chunks of Wq, Wk, Wv (one list): integer tiles, then RoPE on the chunk's
              pairs, k and v written straight into the KV cache
    attend    (query row, head, chunk of CHUNK positions) -> the chunk's max, sum of exp and
              weighted sum of V: flash-decoding's partial results
    merge     rows: the chunks of each head merged (online softmax), rounded for Wo
    wo        row chunks of Wo, added into h (the residual)
    norm      rows of h -> x = rms_norm(h) * ffn_norm, rounded
    gate_up   row chunks of W_gate and W_up together: f = silu(gate) * up on the way out
    round_f   rows of f, rounded for W_down
    down      row chunks of W_down, added into h

Weights: `blob` is the mapped file (uint8), `mats` [n_layer * 7, 4] the byte offset, rows, bytes
per row and ggml type of wq wk wv wo gate up down per layer. Integer types run the tiles of
stages/kernels/int_tiles.py (where the CPU has AVX2; else the int8 stage's loops, row by row);
float types (F32/F16/BF16) are decoded a row at a time and multiplied in float.

Nothing here depends on the number of threads but who computes what: every value is computed
by the same code whichever thread takes its item, and the attention chunks are fixed
(CHUNK positions, merged in order), so 1 thread and N give the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from stages.kernels import dequant_dot, int_dot, int_tiles, sync, toolkit
from stages.kernels import int_tiles as T
from stages.kernels.dequant_dot import dequantize_rows
from stages.kernels.int_dot import _dot_row, f16_round
from stages.kernels.sync import barrier, next_item
from stages.kernels.toolkit import BF16, F16, F32, FASTMATH, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

CHUNK = 256             # positions per attention work item in decode (flash-decoding's split)
OPS_PER_LAYER = 9       # work phases per layer, each ending in a barrier
DECODE_WEIGHTS = 65536  # weights per decode work item: a few microseconds, many items per op
PREFILL_ROWS = 16       # weight rows per prefill work item (times every prompt row)
WQ, WK, WV, WO, GATE, UP, DOWN = range(7)
i32, f32 = np.int32, np.float32


# ---- activations: float rows -> llama.cpp's 8-bit blocks (the int8 stage's numerics) -----------

@njit(cache=True, inline="always")
def quantize_row_32(x, q, d, s, sums):
    """Q8_0 / Q8_1 blocks of one row x [K] (int8's quantize_q8 with qk = 32)."""
    for b in range(x.shape[0] // 32):
        k0 = b * 32
        amax = f32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[k0 + j]))
        dd = amax / f32(127.0)
        inv = f32(1.0) / dd if dd != 0 else f32(0.0)
        total = 0
        for j in range(32):
            v = np.float64(x[k0 + j] * inv)
            r = int(np.floor(abs(v) + 0.5))
            r = r if v >= 0 else -r
            q[k0 + j] = r
            total += r
        d[b] = f16_round(dd)
        s[b] = f16_round(f32(f32(total) * dd))
        sums[b] = total


@njit(cache=True, inline="always")
def quantize_row_k(x, q, d, b16, b32):
    """Q8_K blocks of one row x [K] (int8's quantize_q8 with qk = 256), with the sums of every 16
    values (b16) and every 32 (b32) as int16."""
    for b in range(x.shape[0] // 256):
        k0 = b * 256
        amax = f32(0.0)
        vmax = f32(0.0)
        for j in range(256):
            v = x[k0 + j]
            if abs(v) > amax:
                amax = abs(v)
                vmax = v
        if amax == 0:
            d[b] = 0.0
            for j in range(256):
                q[k0 + j] = 0
        else:
            iscale = f32(-127.0) / vmax
            for j in range(256):
                q[k0 + j] = min(127, int(np.rint(f32(iscale * x[k0 + j]))))
            d[b] = f32(1.0) / iscale
        for g in range(16):
            t = 0
            for j in range(16):
                t += q[k0 + 16 * g + j]
            b16[16 * b + g] = t
        for g in range(8):
            b32[8 * b + g] = b16[16 * b + 2 * g] + b16[16 * b + 2 * g + 1]


@njit(cache=True, inline="always")
def quantize_row(x, m, K, need32, needk, P32, PK):
    """Row m of the activation packs from x [K]: the formats its consumers take."""
    if need32:
        quantize_row_32(x[:K], P32[0][m, :K], P32[1][m], P32[2][m], P32[3][m])
    if needk:
        quantize_row_k(x[:K], PK[0][m, :K], PK[1][m], PK[2][m], PK[3][m])


# ---- one chunk of weight rows times every activation row ---------------------------------------

@njit(cache=True, inline="always")
def _is_k(kind):
    return kind == Q4_K or kind == Q5_K or kind == Q6_K


@njit(cache=True, inline="always")
def _rows(kind, w, off, rb, nb, P32, PK, m, out, n, n_rows):
    """n_rows consecutive weight rows times activation row m (int_tiles' rows_<type>)."""
    if kind == Q4_1:
        T.q4_1_rows(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n, n_rows)
    elif kind == Q4_K:
        T.q4_k_rows(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n, n_rows)
    elif kind == Q6_K:
        T.q6_k_rows(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n, n_rows)
    elif kind == Q8_0:
        T.q8_0_rows(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n, n_rows)
    elif kind == Q4_0:
        T.q4_0_rows(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n, n_rows)
    elif kind == Q5_0:
        T.q5_0_rows(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n, n_rows)
    elif kind == Q5_1:
        T.q5_1_rows(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n, n_rows)
    else:
        T.q5_k_rows(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n, n_rows)


@njit(cache=True, inline="always")
def _tile_prefill(kind, w, off, rb, nb, P32, PK, m, out, n):
    """int_tiles' PREFILL_32 tile (4 weight rows x 4 activation rows) for the 32-value types,
    PREFILL_K (1 x 8) for the K-quants."""
    if kind == Q4_1:
        T.q4_1_4x4(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n)
    elif kind == Q4_K:
        T.q4_k_1x8(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n)
    elif kind == Q6_K:
        T.q6_k_1x8(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n)
    elif kind == Q8_0:
        T.q8_0_4x4(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n)
    elif kind == Q4_0:
        T.q4_0_4x4(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n)
    elif kind == Q5_0:
        T.q5_0_4x4(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n)
    elif kind == Q5_1:
        T.q5_1_4x4(w, off, rb, nb, P32[0], P32[1], P32[2], P32[3], m, out, n)
    else:
        T.q5_k_1x8(w, off, rb, nb, PK[0], PK[1], PK[2], PK[3], m, out, n)


@njit(cache=True, inline="always")
def block_bytes(kind):
    if kind == Q4_1:
        return 20
    if kind == Q4_K:
        return 144
    if kind == Q6_K:
        return 210
    if kind == Q8_0:
        return 34
    if kind == Q4_0:
        return 18
    if kind == Q5_0:
        return 22
    if kind == Q5_1:
        return 24
    return 176                                      # Q5_K


@njit(cache=True, inline="always")
def _chunk_tiles(kind, w, off, rb, r0, r1, M, P32, PK, out, col, f16):
    """out[m, col + r] = (row r of the matrix at w[off:]) . (activation row m), r0 <= r < r1:
    prefill in R x C tiles (int_tiles' PREFILL_32 / PREFILL_K), decode and the edges a row at a
    time. (Decode reads one row after another: 4 rows interleaved, as a 4 x 1 tile would read
    them, streamed from memory at less than half the rate on the machine measured: a row is a
    short stream, and the prefetchers lose track of four at once.)"""
    nb = rb // block_bytes(kind)
    r = r0
    if M > 1:
        R, C = (T.PREFILL_K if _is_k(kind) else T.PREFILL_32)
        while r + R <= r1:
            m = 0
            while m + C <= M:
                _tile_prefill(kind, w, off + r * rb, rb, nb, P32, PK, m, out, col + r)
                m += C
            while m < M:
                _rows(kind, w, off + r * rb, rb, nb, P32, PK, m, out, col + r, R)
                m += 1
            r += R
    if r < r1:
        for m in range(M):
            _rows(kind, w, off + r * rb, rb, nb, P32, PK, m, out, col + r, r1 - r)


@njit(cache=True)
def _chunk_loops(kind, w, off, rb, r0, r1, M, P32, PK, out, col, f16):
    """The same products with the int8 stage's integer loops, row by row (CPUs without AVX2)."""
    K = rb // block_bytes(kind) * (256 if _is_k(kind) else 32)
    buf = np.empty(K, dtype=np.int16)
    for r in range(r0, r1):
        row = w[off + r * rb: off + (r + 1) * rb]
        for m in range(M):
            if _is_k(kind):
                out[m, col + r] = _dot_row(kind, row, PK[0][m, :K], PK[1][m], PK[1][m], PK[2][m], f16, buf)
            else:
                out[m, col + r] = _dot_row(kind, row, P32[0][m, :K], P32[1][m], P32[2][m], P32[3][m], f16, buf)


_chunk_int = _chunk_tiles if int_tiles.ISA else _chunk_loops


@njit(cache=True)
def _chunk_float(kind, w, off, rb, r0, r1, M, xf, out, col, fbuf, f16):
    """Float weights (F32/F16/BF16): each row decoded once, dotted with every float row of xf."""
    K = fbuf.shape[1]
    w2 = w[off + r0 * rb: off + r1 * rb].reshape((r1 - r0, rb))
    for r in range(r1 - r0):
        dequantize_rows(kind, w2, r, fbuf, f16)
        for m in range(M):
            acc = f32(0.0)
            for k in range(K):
                acc += fbuf[0, k] * xf[m, k]
            out[m, col + r0 + r] = acc


@njit(cache=True, inline="always")
def is_float(kind):
    return kind == F32 or kind == F16 or kind == BF16


# ---- small ops --------------------------------------------------------------------------------

@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


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
    return y * _f32_from_bits(i32((i32(n) + i32(127)) << i32(23)))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def rms_norm_row(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, the sum of squares in float64 (naive's rms_norm)."""
    ss = 0.0
    for j in range(x.shape[0]):
        ss += np.float64(x[j]) * x[j]
    r = f32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for j in range(x.shape[0]):
        out[j] = x[j] * r * w[j]


@njit(cache=True, fastmath=FASTMATH, inline="always")
def rope_rows(y, r0, r1, hd, cos, sin, p0, M):
    """Rotate the adjacent pairs of columns r0..r1 of y [M, *] by their positions p0 + m."""
    for m in range(M):
        for r in range(r0, r1, 2):
            i = (r % hd) // 2
            x0, x1 = y[m, r], y[m, r + 1]
            c, s = cos[p0 + m, i], sin[p0 + m, i]
            y[m, r] = x0 * c - x1 * s
            y[m, r + 1] = x0 * s + x1 * c


@njit(cache=True, fastmath=FASTMATH)
def attend_chunk(q, kc, vc, kvh, hd, t0, t1, scale, scores, part):
    """One head's query q [hd] against positions t0..t1-1: part = (max, sum of exp, sum of
    exp * V [hd]) over the chunk."""
    mx = f32(-np.inf)
    for t in range(t0, t1):
        k = kc[t, kvh * hd:(kvh + 1) * hd]
        s = f32(0.0)
        for d in range(hd):
            s += q[d] * k[d]
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
        v0, v1 = vc[t, kvh * hd:(kvh + 1) * hd], vc[t + 1, kvh * hd:(kvh + 1) * hd]
        v2, v3 = vc[t + 2, kvh * hd:(kvh + 1) * hd], vc[t + 3, kvh * hd:(kvh + 1) * hd]
        for d in range(hd):
            acc[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])
        t += 4
    while t < t1:
        p = scores[t - t0]
        v = vc[t, kvh * hd:(kvh + 1) * hd]
        for d in range(hd):
            acc[d] += p * v[d]
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


@njit(cache=True)
def attend_item(item, H, n_chunks, p0, y, kc, vc, group, hd, scale, scores, part):
    """Work item `item` of the attend op: query row m, head h, chunk c of its visible positions
    0 .. p0 + m (chunks of CHUNK when n_chunks > 1, else all of them) -> part[m, h, c]. q is
    y[m, h*hd : (h+1)*hd]; kc, vc [n_ctx, Hkv*hd] this layer's cache."""
    m = item // (H * n_chunks)
    rest = item - m * H * n_chunks
    hh, c = rest // n_chunks, rest % n_chunks
    visible = p0 + m + 1
    t0 = c * CHUNK if n_chunks > 1 else 0
    t1 = min(visible, t0 + CHUNK) if n_chunks > 1 else visible
    if t0 < t1:
        attend_chunk(y[m, hh * hd:(hh + 1) * hd], kc, vc, hh // group, hd, t0, t1, scale, scores, part[m, hh, c])
    else:
        part[m, hh, c, 0] = -np.inf
        part[m, hh, c, 1] = 0.0


@njit(cache=True)
def merge_row(part, n_chunks, hd, out):
    """One query row's attention output [H*hd] from its heads' partial results part [H, n_chunks,
    hd + 2] (flash-decoding's reduction, chunks in order)."""
    for hh in range(part.shape[0]):
        merge_chunks(part[hh], n_chunks, hd, out[hh * hd:(hh + 1) * hd])


@njit(cache=True, fastmath=FASTMATH, inline="always")
def silu_mul(g, u):
    return g / (f32(1.0) + fast_exp(-g)) * u


# ---- the layer stack ---------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _needs(mats, j0, j1):
    """(any integer matrix of j0..j1-1 takes Q8_0/Q8_1 blocks, any takes Q8_K)."""
    n32, nk = False, False
    for j in range(j0, j1):
        kind = mats[j, 3]
        if not is_float(kind):
            if _is_k(kind):
                nk = True
            else:
                n32 = True
    return n32, nk


@njit(cache=True, inline="always")
def _rows_per_item(K, M, multiple):
    if M > 1:
        return PREFILL_ROWS
    return max(multiple, DECODE_WEIGHTS // K // multiple * multiple)


OP_QKV, OP_WO, OP_GATE_UP, OP_DOWN = range(4)


@njit(cache=True)
def _matmul_op(op, il, M, blob, mats, P32, PK, xf, y, h, fbuf, kc, vc, cos, sin, p0, hd, nq, nkv, counters, ph,
               t, nt, fs, f16):
    """One thread's share of a matmul op of layer il: work items from counters[ph], each a chunk
    of weight rows times every activation row (xf and its packs) into y, then the op's epilogue:

        OP_QKV      Wq | Wk | Wv rows -> y[:, :nq + 2 nkv]; RoPE on q and k, k and v into the cache
        OP_WO       Wo rows -> y, added into h
        OP_GATE_UP  W_gate and W_up rows r0..r1 -> y[:, r], y[:, n_ff + r]; fbuf = silu(gate) * up
        OP_DOWN     W_down rows -> y, added into h

    One call per op and thread, and one place that calls the tiles: numba passes every array
    field by value to a function it does not inline, which costs about as much as a work item of
    decode if paid per item."""
    D = h.shape[1]
    n_ff = fbuf.shape[1]
    base = il * 7
    if op == OP_QKV:
        per = _rows_per_item(D, M, 4)
        nq_items, nkv_items = (nq + per - 1) // per, (nkv + per - 1) // per
        n_items = nq_items + 2 * nkv_items
    else:
        K = nq if op == OP_WO else (D if op == OP_GATE_UP else n_ff)
        N = n_ff if op == OP_GATE_UP else D
        per = _rows_per_item(2 * K if op == OP_GATE_UP else K, M, 4)
        n_items = (N + per - 1) // per
    while True:
        item = next_item(counters, ph, t, nt, n_items)
        if item < 0:
            break
        if op == OP_QKV:
            if item < nq_items:
                j, r0, rows, col = WQ, item * per, nq, 0
            elif item < nq_items + nkv_items:
                j, r0, rows, col = WK, (item - nq_items) * per, nkv, nq
            else:
                j, r0, rows, col = WV, (item - nq_items - nkv_items) * per, nkv, nq + nkv
        else:
            j = WO if op == OP_WO else (GATE if op == OP_GATE_UP else DOWN)
            r0, rows, col = item * per, N, 0
        r1 = min(rows, r0 + per)
        for part in range(2 if op == OP_GATE_UP else 1):
            jj = j + part
            off, rb, kind = mats[base + jj, 0], mats[base + jj, 2], mats[base + jj, 3]
            c = col + part * n_ff
            if is_float(kind):
                _chunk_float(kind, blob, off, rb, r0, r1, M, xf, y, c, fs[:, :xf.shape[1]], f16)
            else:
                _chunk_int(kind, blob, off, rb, r0, r1, M, P32, PK, y, c, f16)
        if op == OP_QKV:
            if j != WV:
                rope_rows(y, col + r0, col + r1, hd, cos, sin, p0, M)
            if j != WQ:
                cache = kc if j == WK else vc
                for m in range(M):
                    for r in range(r0, r1):
                        cache[il, p0 + m, r] = y[m, col + r]
        elif op == OP_GATE_UP:
            for m in range(M):
                for r in range(r0, r1):
                    fbuf[m, r] = silu_mul(y[m, r], y[m, n_ff + r])
        else:
            for m in range(M):
                for r in range(r0, r1):
                    h[m, r] += y[m, r]


@njit(cache=True)
def _worker(t, nt, h, blob, mats, norms, eps, cos, sin, p0, kc, vc, H, Hkv, scale,
            xin, fbuf, y, part, n_chunks, P32, PK, scores, fscratch, sync, counters, f16):
    """Thread t of nt: every op of every layer, its share of each, a barrier after each."""
    M, D = h.shape
    hd = kc.shape[2] // Hkv
    nq, nkv, n_ff = H * hd, Hkv * hd, fbuf.shape[1]
    group = H // Hkv
    n_layer = norms.shape[0]
    fs = fscratch[t]
    sc = scores[t]
    bar = 0
    for il in range(n_layer):
        base = il * 7
        ph = il * OPS_PER_LAYER
        # -- norm: x = rms_norm(h) * attn_norm, rounded for Wq, Wk, Wv
        n32, nk = _needs(mats, base + WQ, base + WO)
        while True:
            m = next_item(counters, ph, t, nt, M)
            if m < 0:
                break
            rms_norm_row(h[m], norms[il, 0], eps, xin[m])
            quantize_row(xin[m], m, D, n32, nk, P32, PK)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- qkv: three matrices as one list of row chunks; RoPE and the KV cache on the way out
        _matmul_op(OP_QKV, il, M, blob, mats, P32, PK, xin[:, :D], y, h, fbuf, kc, vc, cos, sin, p0, hd, nq, nkv,
                   counters, ph + 1, t, nt, fs, f16)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- attend: (row, head, chunk of positions) -> partial softmax sums
        while True:
            item = next_item(counters, ph + 2, t, nt, M * H * n_chunks)
            if item < 0:
                break
            attend_item(item, H, n_chunks, p0, y, kc[il], vc[il], group, hd, scale, sc, part)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- merge: each head's chunks, then the row rounded for Wo
        n32, nk = _needs(mats, base + WO, base + WO + 1)
        while True:
            m = next_item(counters, ph + 3, t, nt, M)
            if m < 0:
                break
            merge_row(part[m], n_chunks, hd, xin[m])
            quantize_row(xin[m], m, nq, n32, nk, P32, PK)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- wo, added into h
        _matmul_op(OP_WO, il, M, blob, mats, P32, PK, xin[:, :nq], y, h, fbuf, kc, vc, cos, sin, p0, hd, nq, nkv,
                   counters, ph + 4, t, nt, fs, f16)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- norm: x = rms_norm(h) * ffn_norm, rounded for W_gate, W_up
        n32, nk = _needs(mats, base + GATE, base + DOWN)
        while True:
            m = next_item(counters, ph + 5, t, nt, M)
            if m < 0:
                break
            rms_norm_row(h[m], norms[il, 1], eps, xin[m])
            quantize_row(xin[m], m, D, n32, nk, P32, PK)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- gate and up in one pass; f = silu(gate) * up
        _matmul_op(OP_GATE_UP, il, M, blob, mats, P32, PK, xin[:, :D], y, h, fbuf, kc, vc, cos, sin, p0, hd, nq,
                   nkv, counters, ph + 6, t, nt, fs, f16)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- round f for W_down
        n32, nk = _needs(mats, base + DOWN, base + DOWN + 1)
        while True:
            m = next_item(counters, ph + 7, t, nt, M)
            if m < 0:
                break
            quantize_row(fbuf[m], m, n_ff, n32, nk, P32, PK)
        bar += 1
        if not barrier(sync, nt, bar):
            return
        # -- down, added into h
        _matmul_op(OP_DOWN, il, M, blob, mats, P32, PK, fbuf, y, h, fbuf, kc, vc, cos, sin, p0, hd, nq, nkv,
                   counters, ph + 8, t, nt, fs, f16)
        if il + 1 < n_layer:
            bar += 1
            if not barrier(sync, nt, bar):
                return


@njit(cache=True)
def new_packs(M, K):
    k32 = max(1, K // 32)
    kk = max(1, K // 256)
    P32 = (np.zeros((M, K), np.int8), np.zeros((M, k32), np.float32), np.zeros((M, k32), np.float32),
           np.zeros((M, k32), np.int32))
    PK = (np.zeros((M, K), np.int8), np.zeros((M, kk), np.float32), np.zeros((M, K // 16 + 1), np.int16),
          np.zeros((M, k32), np.int16))
    return P32, PK


@njit(cache=True, parallel=True)
def run_layers(h, blob, mats, norms, eps, cos, sin, p0, kc, vc, H, Hkv, n_ff, scale, sync, f16, nt):
    """Every layer on h [M, D] (changed in place) at positions p0.., K and V written into kc, vc
    [n_layer, n_ctx, Hkv*hd]. One parallel region of nt iterations: nt must be numba's thread
    count (numba.get_num_threads(), read by the caller: inside a cached kernel it cannot be).
    sync: sync.new_sync(); sync[1] is 1 afterwards if a barrier gave up."""
    M, D = h.shape
    hd = kc.shape[2] // Hkv
    K = max(D, n_ff, H * hd)
    n_chunks = (p0 + M + CHUNK - 1) // CHUNK if M == 1 else 1
    P32, PK = new_packs(M, K)
    xin = np.zeros((M, max(D, H * hd)), np.float32)
    fbuf = np.zeros((M, n_ff), np.float32)
    y = np.zeros((M, max(H * hd + 2 * kc.shape[2], 2 * n_ff, D)), np.float32)
    part = np.zeros((M, H, n_chunks, hd + 2), np.float32)
    scores = np.zeros((nt, CHUNK if n_chunks > 1 else p0 + M), np.float32)
    fscratch = np.zeros((nt, 1, K), np.float32)
    counters = np.zeros((norms.shape[0] * OPS_PER_LAYER, nt), np.int64)
    for t in prange(nt):
        _worker(t, nt, h, blob, mats, norms, eps, cos, sin, p0, kc, vc, H, Hkv, scale, xin, fbuf, y, part, n_chunks,
                P32, PK, scores, fscratch, sync, counters, f16)
    return h


@njit(cache=True)
def _head_worker(x, blob, mat, P32, PK, out, per, fs, counters, t, nt, f16):
    M = x.shape[0]
    off, N, rb, kind = mat[0, 0], mat[0, 1], mat[0, 2], mat[0, 3]
    n_items = (N + per - 1) // per
    while True:
        item = next_item(counters, 0, t, nt, n_items)
        if item < 0:
            break
        r0 = item * per
        if is_float(kind):
            _chunk_float(kind, blob, off, rb, r0, min(N, r0 + per), M, x, out, 0, fs, f16)
        else:
            _chunk_int(kind, blob, off, rb, r0, min(N, r0 + per), M, P32, PK, out, 0, f16)


@njit(cache=True, parallel=True)
def matmul_rows(x, blob, mat, f16, nt):
    """x [M, K] times one weight (mat [1, 4]: offset, rows, bytes per row, type in blob) -> [M, N]:
    the activation rounded once, the rows in work items over nt threads (numba's thread count)."""
    M, K = x.shape
    N = mat[0, 1]
    kind = mat[0, 3]
    P32, PK = new_packs(M, K)
    if not is_float(kind):
        for m in range(M):
            quantize_row(x[m], m, K, not _is_k(kind), _is_k(kind), P32, PK)
    out = np.empty((M, N), np.float32)
    per = _rows_per_item(K, M, 4)
    fscratch = np.zeros((nt, 1, K), np.float32)
    counters = np.zeros((1, nt), np.int64)
    for t in prange(nt):
        _head_worker(x, blob, mat, P32, PK, out, per, fscratch[t], counters, t, nt, f16)
    return out


__all__ = ["run_layers", "matmul_rows", "quantize_row_32", "quantize_row_k", "new_packs", "fast_exp",
           "CHUNK", "OPS_PER_LAYER"]

toolkit.guard_cache(__name__, [run_layers, matmul_rows, _worker, _head_worker, _matmul_op, _chunk_float, new_packs],
                    [int_tiles.__file__, int_dot.__file__, dequant_dot.__file__, sync.__file__, toolkit.__file__])
