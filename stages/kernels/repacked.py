"""The repack stage's layout and its kernels (stages/repack.py tells the story).

A matrix's rows are taken GROUP (8) at a time and each block of the 8 rows is rewritten as one
"group block": first the 8 rows' scales side by side, then their packed values in 4-byte pieces
taken from the 8 rows in turn,

    row r's block:   [d][m][ q0 q1 q2 q3 | q4 q5 q6 q7 | ... ]          (ggml: one row after another)
    group block:     [d0..d7][m0..m7][ row0 q0..q3 | row1 q0..q3 | ... | row7 q0..q3 | row0 q4..q7 | ... ]

so one 32-byte load holds the same 4 bytes (8 values: 4 low nibbles, 4 high) of all 8 rows, and
one activation dword, broadcast, multiplies all of them in one vpdpbusd whose 8 int32 lanes are
the 8 rows: each row owns one lane of every accumulator, from the integer sums to the float
result, and a group's 8 outputs leave in one vector store (no horizontal add, ever). The scales
of the 8 rows load together too (vcvtph2ps of 8 float16; the K-quants' 6-bit scales as 12 byte
planes across the rows, unpacked with a handful of byte operations for all 8 rows at once). The
same bytes as the file's (a group block is exactly 8 blocks long), rearranged once at load:

    type   group block (8 rows)                                             bytes
    Q4_0   d[8] f16 | qs: 4 pieces x 8 rows x 4 bytes                        8 x 18
    Q4_1   d[8] | m[8] | qs                                                  8 x 20
    Q5_0   d[8] | qh: per piece two 32-bit masks of fifth bits | qs          8 x 22
    Q5_1   d[8] | m[8] | qh | qs                                             8 x 24
    Q8_0   d[8] | qs: 8 pieces x 8 rows x 4 bytes, each byte q + 128          8 x 34
    Q4_K   d[8] | dmin[8] | scales: 12 byte planes x 8 rows | qs: 32 pieces  8 x 144
    Q5_K   d[8] | dmin[8] | scales | qh: 8 pieces x 8 rows x 4 | qs          8 x 176
    Q6_K   d[8] | scales: 16 int8 planes x 8 rows | ql: 32 pieces | qh: 16   8 x 210

Q8_0's signed bytes are stored as q + 128 (unsigned: vpdpbusd's weight operand), and 128 times
the activation block's sum taken off once per block: llama.cpp moves each weight's sign onto the
activation instead, which a broadcast serving 8 rows cannot do.

    repack(raw, kind) / unpack(packed, kind, rows)     numpy, at load; unpack(repack(x)) == x
    group_gemm(kind, blob, off, row_bytes, p32, pk, M, out, col, r0, r1)
        rows r0..r1 (r0 a multiple of GROUP) of the repacked matrix at blob[off:] times the M
        activation rows of the 8-bit packs (stages/kernels/q8.py) -> out[:, col + r0 .. col + r1]
    GROUP_AT[kind][field]                              where a field starts in a group block

One kernel for decode and prefill: C activation rows at a time (TILE_ROWS), every (weight row,
activation row) pair computed by the same instructions in the same order whatever C is, so a row's
result is the same bits alone, in a prefill, or beside other sequences in a batch.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types

from common.cpu import cpuinfo
from stages.kernels import vector_ir
from stages.kernels.int_dot import q6_top_bits
from stages.kernels.toolkit import BLOCK_BYTES, FIELDS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES_K
from stages.kernels.vector_ir import B32, D8, F8, FLOAT, I32, vector_intrinsic

GROUP = 8                                    # rows per group: one int32 or float32 lane each (ymm)
REPACK_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
# what each stored value is short of the signed value (q - 8, q - 16, Q8_0's q + 128 - 128): taken
# off once per block as offset * sum(q_a)
OFFSETS = {Q4_0: 8, Q5_0: 16, Q8_0: 128}


# ---- the layout (numpy) ----------------------------------------------------------------------

def _pieces(q, n):
    """[..., 8 rows, n * 4 bytes] -> [..., n pieces, 8 rows, 4 bytes]: each row's 4-byte pieces
    taken in turn from the 8 rows."""
    return np.swapaxes(q.reshape(*q.shape[:-1], n, 4), -3, -2)


def _unpieces(p):
    """The inverse of _pieces: [..., n, 8, 4] -> [..., 8, n * 4]."""
    s = np.swapaxes(p, -3, -2)
    return s.reshape(*s.shape[:-2], s.shape[-2] * 4)


# A group block's fields, in order: each a field of the ggml block (common/quants.py's BLOCK_DTYPES,
# by name) and how the 8 rows' copies of it are laid out: 'rows' (one row's copy after another),
# 'planes' (byte k of the 8 rows together), 'pieces' (4-byte pieces taken from the rows in turn),
# 'pieces^128' (Q8_0) or 'bits' (Q5_0/Q5_1's fifth bits, see _bits).
GROUP_FIELDS = {
    Q4_0: [("d", "rows"), ("qs", "pieces")],
    Q4_1: [("d", "rows"), ("m", "rows"), ("qs", "pieces")],
    Q5_0: [("d", "rows"), ("qh", "bits"), ("qs", "pieces")],
    Q5_1: [("d", "rows"), ("m", "rows"), ("qh", "bits"), ("qs", "pieces")],
    Q8_0: [("d", "rows"), ("qs", "pieces^128")],
    Q4_K: [("d", "rows"), ("dmin", "rows"), ("scales", "planes"), ("qs", "pieces")],
    Q5_K: [("d", "rows"), ("dmin", "rows"), ("scales", "planes"), ("qh", "pieces"), ("qs", "pieces")],
    Q6_K: [("d", "rows"), ("scales", "planes"), ("ql", "pieces"), ("qh", "pieces")],
}


def _fields(kind):
    """The byte ranges of one ggml block, in group-block order: [(start, end, how)]."""
    return [(*FIELDS[kind][name], how) for name, how in GROUP_FIELDS[kind]]


def _offsets(kind) -> dict:
    """Where each field starts in a group block: after GROUP copies of every field before it."""
    at, o = {}, 0
    for name, _ in GROUP_FIELDS[kind]:
        at[name] = o
        start, end = FIELDS[kind][name]
        o += GROUP * (end - start)
    return at


GROUP_AT = {kind: _offsets(kind) for kind in GROUP_FIELDS}     # GROUP_AT[Q6_K]["qh"] == 1168


def _bits(qh):
    """Q5_0/Q5_1's qh, 8 rows' u32 [..., 8, 4 bytes] -> 8 words of 32 bits [..., 32 bytes]: word
    2j + h holds the fifth bits of piece j's low (h = 0: values 4j..4j+3) or high (h = 1: values
    16+4j..) nibbles, bit 4r + i for row r's value i: the same order as the piece's 32 bytes, so
    one word, as a mask, is the fifth bit of every byte of the piece (vpmovm2b with AVX-512)."""
    u = qh.copy().view("<u4")[..., 0]                                          # [..., 8 rows]
    bits = (u[..., None] >> np.arange(32, dtype=np.uint32)) & 1                # [..., 8, 32]
    j, h, i = np.arange(4)[:, None, None], np.arange(2)[None, :, None], np.arange(4)[None, None, :]
    picked = bits[..., 16 * h + 4 * j + i]                                      # [..., 8 rows, 4 j, 2 h, 4 i]
    order = np.moveaxis(picked, -4, -2)                                        # [..., 4 j, 2 h, 8 rows, 4 i]
    return np.packbits(order.reshape(*order.shape[:-4], 8, 32).astype(np.uint8), axis=-1,
                       bitorder="little").reshape(*order.shape[:-4], 32)


def _unbits(words):
    """The inverse of _bits: [..., 32 bytes] -> [..., 8 rows, 4 bytes] (each row's u32 qh)."""
    bits = np.unpackbits(words.reshape(*words.shape[:-1], 8, 4), axis=-1, bitorder="little")
    order = bits.reshape(*words.shape[:-1], 4, 2, 8, 4)                         # [..., j, h, r, i]
    per_row = np.moveaxis(order, -2, -4)                                       # [..., r, j, h, i]
    value = np.zeros((*words.shape[:-1], 8, 32), np.uint32)
    j, h, i = np.arange(4)[:, None, None], np.arange(2)[None, :, None], np.arange(4)[None, None, :]
    value[..., 16 * h + 4 * j + i] = per_row
    u = (value << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return u.astype("<u4").view(np.uint8).reshape(*words.shape[:-1], 8, 4)


def repack(raw: np.ndarray, kind: int, out: np.ndarray | None = None) -> np.ndarray:
    """raw [N, row_bytes] ggml rows -> the repacked matrix, uint8 [ceil(N / 8) * 8 * row_bytes]
    (rows past N: zeros). Written into `out` when given (a slice of the stage's one buffer)."""
    N, rb = raw.shape
    bb = BLOCK_BYTES[kind]
    nb = rb // bb
    G = -(-N // GROUP)
    rows = np.zeros((G * GROUP, rb), np.uint8)
    rows[:N] = raw
    blocks = rows.reshape(G, GROUP, nb, bb).transpose(0, 2, 1, 3)          # [G, nb, 8 rows, bb]
    parts = []
    for start, end, how in _fields(kind):
        f = blocks[..., start:end]
        if how == "rows":
            parts.append(f.reshape(G, nb, -1))
        elif how == "planes":
            parts.append(np.swapaxes(f, -1, -2).reshape(G, nb, -1))
        elif how == "bits":
            parts.append(_bits(np.ascontiguousarray(f)))
        else:
            p = _pieces(f, (end - start) // 4)
            parts.append((p ^ 128 if how == "pieces^128" else p).reshape(G, nb, -1))
    packed = np.concatenate(parts, axis=-1).reshape(-1)
    if out is None:
        return packed
    out[:] = packed
    return out


def unpack(packed: np.ndarray, kind: int, n_rows: int, row_bytes: int) -> np.ndarray:
    """The inverse of repack: uint8 [n_rows, row_bytes], the file's bytes again."""
    bb = BLOCK_BYTES[kind]
    nb = row_bytes // bb
    G = -(-n_rows // GROUP)
    gblocks = packed.reshape(G, nb, GROUP * bb)
    blocks = np.empty((G, nb, GROUP, bb), np.uint8)
    o = 0
    for start, end, how in _fields(kind):
        n = (end - start) * GROUP
        f = gblocks[..., o:o + n]
        o += n
        if how == "rows":
            blocks[..., start:end] = f.reshape(G, nb, GROUP, end - start)
        elif how == "planes":
            blocks[..., start:end] = np.swapaxes(f.reshape(G, nb, end - start, GROUP), -1, -2)
        elif how == "bits":
            blocks[..., start:end] = _unbits(f)
        else:
            p = f.reshape(G, nb, (end - start) // 4, GROUP, 4)
            blocks[..., start:end] = _unpieces(p ^ 128 if how == "pieces^128" else p)
    return blocks.transpose(0, 2, 1, 3).reshape(G * GROUP, row_bytes)[:n_rows]


def repacked_bytes(n_rows: int, row_bytes: int) -> int:
    return -(-n_rows // GROUP) * GROUP * row_bytes


# ---- the kernels (LLVM IR through stages/kernels/vector_ir.py) --------------------------------

# Activation rows per pass over a group block, by ISA. With VNNI a product is one vpdpbusd, and
# AVX-512's 32 vector registers hold 4 rows' accumulators (2 for Q6_K, which keeps four partial
# sums per row). With AVX2 a product is vpmaddubsw + vpaddw (the int16 run, scaled_dots) while
# unpacking a piece (vpand, vpsrlw + vpand) is shared by the tile's rows: a wider tile spends fewer
# vector instructions per product, and the accumulators that no longer fit in 16 registers are
# spilled to L1, whose loads and stores leave the vector ports to the multiply-adds. Of 2, 4, 6
# and 8 rows, 6 timed best where this was measured (a prompt through the prefill stage, 2 threads;
# time a change there, not the kernel alone).
TILE_ROWS = {"vnni": {Q6_K: 2}, "avx2": {}}
TILE_ROWS_DEFAULT = {"vnni": 4, "avx2": 6}


def tile_rows(kind, isa):
    return TILE_ROWS.get(isa, {}).get(kind, TILE_ROWS_DEFAULT.get(isa, 1))


# Every cache line of a group block is asked for ahead of the block being multiplied (a software
# prefetch): one thread otherwise waits on memory for part of each block. Into which cache and how
# far ahead follow the CPU's maker and the type, each timed on one CPU of the maker (one thread
# streaming a matrix larger than the caches; `python -m app bench prefetch` times the choices on the
# machine at hand, profiles/bench/prefetch/ keeps what it found):
#   Intel (Ice Lake, a 300 MB Q4_K / Q6_K / Q4_1 matrix): into L1 (prefetcht0), 2 to 8 KiB ahead
#       alike, faster than the hardware prefetchers alone (timed before the bench existed: no record
#       of it yet; the bench on such a CPU writes one);
#   AMD (Zen 4): for the K-quants, whose group blocks are 1 to 2 KiB, into L1 was slower than no
#       software prefetch at all and into L2 (prefetcht1) 16 to 64 KiB ahead faster than both,
#       most for Q6_K, whose group block the kernel reads out of order (ql's two halves, then
#       qh); for the 32-value types (group blocks of 144 to 272 bytes) into L1 4 KiB ahead was
#       about as fast as none and faster than into L2.
# {type: (cache level, bytes ahead)}; level 0: none (`python -m app bench prefetch` times that too).
L1_NEAR, L2_FAR = (1, 4096), (2, 32768)


def group_prefetch(info: dict | None = None) -> dict:
    """Each type's prefetch on this CPU (or on the one `info` describes: /proc/cpuinfo's fields)."""
    amd = (cpuinfo() if info is None else info).get("vendor_id") == "AuthenticAMD"
    return {kind: L2_FAR if amd and kind in TYPES_K else L1_NEAR for kind in REPACK_TYPES}


GROUP_PREFETCH = group_prefetch()


def prefetch_group_block(g, gb, kind):
    """Every line of the group block of type `kind` at gb, the type's bytes ahead, into its cache."""
    level, ahead = GROUP_PREFETCH[kind]
    if level:
        for line in range(0, GROUP * BLOCK_BYTES[kind], 64):
            g.prefetch(gb, g.const(ahead + line), level)


class _Acts:
    """Pointers to C activation rows (m0 .. m0 + C - 1) of the pack a type takes."""

    def __init__(self, g, a, kind, m0, C):
        b = g.b
        pack = a.pk if kind in TYPES_K else a.p32
        names = ("q", "d", "b16", "b32") if kind in TYPES_K else ("q", "d", "s", "sums")
        rows = [b.add(m0, g.const(c)) for c in range(C)]
        for name in names:
            setattr(self, name, [g.at(getattr(pack, name), b.mul(m, g.stride0(pack.arrays[name]))) for m in rows])
        self.rows, self.C = rows, C


def _splat_q(g, acts, c, off):
    """Activation row c's int8 q[off .. off + 3] broadcast to 8 lanes (a <32 x i8> for dpbusd)."""
    return g.splat_i32(acts.q[c], off, B32)


def _splat_f32(g, p, index):
    return g.splat(F8, g.load(p, g.b.mul(index, g.const(4)), FLOAT))


def group_k4_scales(g, gb):
    """The 8 rows' 6-bit scales and mins of a Q4_K/Q5_K group block (12 byte planes, plane k =
    byte k of the rows' 12 scale bytes): ([sc_j as <8 x i32>], [m_j]) for j < 8, by ggml's rule
    (common.quants.k4_scale_min) on all 8 rows at once."""
    b = g.b
    at = GROUP_AT[Q4_K]["scales"]                       # the same place in Q5_K's group block
    v0, v1, v2 = (g.load(gb, g.const(at + 32 * i), B32) for i in range(3))     # planes 0-3, 4-7, 8-11
    c = lambda n: g.splat_const(B32, n)
    top = lambda v: b.shl(b.lshr(v, c(6)), c(4))
    sc_lo, mn_lo = b.and_(v0, c(63)), b.and_(v1, c(63))
    sc_hi = b.or_(b.and_(v2, c(15)), top(v0))
    mn_hi = b.or_(b.lshr(v2, c(4)), top(v1))

    def lanes(v, j):                       # bytes 8j .. 8j+7 (one per row) as int32 lanes
        return b.zext(g.shuffle(v, v, range(8 * j, 8 * j + 8)), D8)
    sc = [lanes(sc_lo, j) for j in range(4)] + [lanes(sc_hi, j) for j in range(4)]
    mn = [lanes(mn_lo, j) for j in range(4)] + [lanes(mn_hi, j) for j in range(4)]
    return sc, mn


def _block_k4(g, kind, gb, blk, acts, accs):
    """Q4_K / Q5_K: per row lane, isum = sum_s sc_s * (dot of sub-block s), msum = sum_s m_s * b32_s;
    acc += float(isum) * d_a * d_w - float(msum) * d_a * dmin_w."""
    b, C = g.b, acts.C
    sc, mn = group_k4_scales(g, gb)
    lay = GROUP_AT[kind]
    k = b.mul(blk, g.const(256))
    isum = [ir.Constant(D8, None)] * C
    most = 31 if kind == Q5_K else 15
    for ch in range(4):
        lo, hi = [], []
        for j in range(8):
            w = g.load(gb, g.const(lay["qs"] + (ch * 8 + j) * 32), B32)
            lo.append(g.nibbles(w, False))
            hi.append(g.nibbles(w, True))
            if kind == Q5_K:                                    # bit 2ch (+1) of qh: the fifth bits
                qh = g.load(gb, g.const(lay["qh"] + j * 32), B32)
                one = g.splat_const(B32, 1)
                lo[j] = b.or_(lo[j], b.shl(b.and_(b.lshr(qh, g.splat_const(B32, 2 * ch)), one), g.splat_const(B32, 4)))
                hi[j] = b.or_(hi[j], b.shl(b.and_(b.lshr(qh, g.splat_const(B32, 2 * ch + 1)), one),
                                           g.splat_const(B32, 4)))
        for c in range(C):
            a_lo = [_splat_q(g, acts, c, b.add(k, g.const(64 * ch + 4 * j))) for j in range(8)]
            a_hi = [_splat_q(g, acts, c, b.add(k, g.const(64 * ch + 32 + 4 * j))) for j in range(8)]
            isum[c] = g.scaled_dots(isum[c], lo, a_lo, sc[2 * ch], most)
            isum[c] = g.scaled_dots(isum[c], hi, a_hi, sc[2 * ch + 1], most)
    finish_k4(g, kind, gb, blk, acts, accs, isum, mn)


def finish_k4(g, kind, gb, blk, acts, accs, isum, mn):
    """Q4_K / Q5_K's float steps, per row lane, after the block's isum: msum = sum_s m_s b32_s (mn:
    group_k4_scales' mins), acc += float(isum) * d_a * d_w - float(msum) * d_a * dmin_w."""
    b = g.b
    lay = GROUP_AT[kind]
    dw, dmin = g.halves(gb, g.const(lay["d"])), b.fneg(g.halves(gb, g.const(lay["dmin"])))
    mins = [b.or_(mn[2 * u], b.shl(mn[2 * u + 1], g.splat_const(D8, 16))) for u in range(4)]   # int16 pairs
    for c in range(acts.C):
        msum = ir.Constant(D8, None)
        for u in range(4):                  # sub-blocks 2u, 2u + 1: their b32 side by side, one dpwssd
            b32 = g.splat_i32(acts.b32[c], b.mul(b.add(b.mul(blk, g.const(4)), g.const(u)), g.const(4)))
            msum = g.dpwssd(msum, mins[u], b32)
        da = _splat_f32(g, acts.d[c], blk)
        acc = g.fma(b.fmul(g.to_float(isum[c]), da), dw, b.load(accs[c]))
        b.store(g.fma(b.fmul(g.to_float(msum), da), dmin, acc), accs[c])


def _block_q6(g, gb, blk, acts, accs):
    """Q6_K: 16 sub-blocks of 16 values, int8 scales; acc += float(isum) * d_a * d_w with
    isum = sum_s sc_s (dot of sub-block s) - 32 sum_s sc_s b16_s (the -32 of every stored value;
    b16_s the sum of the activation's 16 values there). The second sum is one multiply-add of int16
    pairs per two sub-blocks (their scales side by side in each row's lane, b16_s and b16_s+1 side
    by side in memory): 8 for the block, where each sub-block took a multiply of its own. Exact
    integers either way (|32 sum| < 2^28), so the same bits."""
    b, C = g.b, acts.C
    lay = GROUP_AT[Q6_K]
    k = b.mul(blk, g.const(256))
    isum = [ir.Constant(D8, None)] * C
    for h in range(2):
        for jh in range(2):                                     # positions l < 16, then l >= 16
            vals = [[], [], [], []]                             # vals[i][jj]: values 128 h + 32 i + 4 j ..
            for jj in range(4):
                j = 4 * jh + jj
                qla = g.load(gb, g.const(lay["ql"] + (h * 16 + j) * 32), B32)
                qlb = g.load(gb, g.const(lay["ql"] + (h * 16 + 8 + j) * 32), B32)
                top = q6_top_bits(g, g.load(gb, g.const(lay["qh"] + (h * 8 + j) * 32), B32))
                low = [g.nibbles(qla, False), g.nibbles(qlb, False), g.nibbles(qla, True), g.nibbles(qlb, True)]
                for i in range(4):
                    vals[i].append(b.or_(low[i], top[i]))
            for i in range(4):
                s = 8 * h + 2 * i + jh
                scale = g.widen_s8(gb, g.const(lay["scales"] + GROUP * s))
                for c in range(C):
                    acts_q = [_splat_q(g, acts, c, b.add(k, g.const(128 * h + 32 * i + 4 * (4 * jh + jj))))
                              for jj in range(4)]
                    isum[c] = g.scaled_dots(isum[c], vals[i], acts_q, scale, 63)
    # the scales loaded again, not kept from the loop: kept, the 16 would hold 16 registers through it
    sc = [g.widen_s8(gb, g.const(lay["scales"] + GROUP * s)) for s in range(16)]
    sc_pairs = [g.int16_pair(sc[2 * u], sc[2 * u + 1]) for u in range(8)]
    dw = g.halves(gb, g.const(lay["d"]))
    for c in range(C):
        offsets = ir.Constant(D8, None)
        for u in range(8):
            b16 = g.splat_i32(acts.b16[c], b.mul(b.add(b.mul(blk, g.const(16)), g.const(2 * u)), g.const(2)))
            offsets = g.dpwssd(offsets, sc_pairs[u], b16)
        isum[c] = b.sub(isum[c], b.shl(offsets, g.splat_const(D8, 5)))
        da = _splat_f32(g, acts.d[c], blk)
        b.store(g.fma(b.fmul(g.to_float(isum[c]), da), dw, b.load(accs[c])), accs[c])


def _fifth_bits(g, gb, off):
    """The 32-bit word at gb + off (see _bits) as the fifth bit (16) of each byte of a piece: the
    word is a mask (bit b for byte b): vpmovm2b with AVX-512, a broadcast and compare with AVX2."""
    b = g.b
    mask = b.bitcast(g.load(gb, g.const(off), I32), ir.VectorType(ir.IntType(1), 32))
    return b.shl(b.zext(mask, B32), g.splat_const(B32, 4))


def _block_32(g, kind, gb, blk, acts, accs):
    """The 32-value types: acc += float(isum) * d_a * d_w (+ m_w * s_a for Q4_1/Q5_1), the
    offsets (-8, -16, Q8_0's -128 of q + 128) started in the integer sum as -offset * sum(q_a)."""
    b, C = g.b, acts.C
    lay = GROUP_AT[kind]
    qh_at, qs = lay.get("qh"), lay["qs"]
    k = b.mul(blk, g.const(32))
    isum = start_32(g, kind, blk, acts)
    if kind == Q8_0:
        for j in range(8):
            w = g.load(gb, g.const(qs + 32 * j), B32)
            for c in range(C):
                isum[c] = g.dpbusd_bytes(isum[c], w, _splat_q(g, acts, c, b.add(k, g.const(4 * j))))
    else:
        values, at = [], []                         # the 4 pieces' low nibbles (values 4j..), then high (16 + 4j..)
        for j in range(4):
            w = g.load(gb, g.const(qs + 32 * j), B32)
            lo, hi = g.nibbles(w, False), g.nibbles(w, True)
            if qh_at:
                lo = b.or_(lo, _fifth_bits(g, gb, qh_at + 8 * j))
                hi = b.or_(hi, _fifth_bits(g, gb, qh_at + 8 * j + 4))
            values += [lo, hi]
            at += [4 * j, 16 + 4 * j]
        for c in range(C):
            isum[c] = g.scaled_dots(isum[c], values, [_splat_q(g, acts, c, b.add(k, g.const(o))) for o in at],
                                    most=31 if qh_at else 15)
    finish_32(g, kind, gb, blk, acts, accs, isum)


def start_32(g, kind, blk, acts):
    """Each activation row's isum at the start of a block of a 32-value type: -offset * sum(q_a)."""
    b, offset = g.b, OFFSETS.get(kind, 0)
    if not offset:
        return [ir.Constant(D8, None)] * acts.C
    return [g.splat(D8, b.mul(g.load(acts.sums[c], b.mul(blk, g.const(4)), I32), ir.Constant(I32, -offset)))
            for c in range(acts.C)]


def finish_32(g, kind, gb, blk, acts, accs, isum):
    """A 32-value type's float steps after the block's isum: acc += float(isum) * d_a * d_w
    (+ m_w * s_a for Q4_1/Q5_1)."""
    b = g.b
    lay = GROUP_AT[kind]
    dw = g.halves(gb, g.const(lay["d"]))
    mw = g.halves(gb, g.const(lay["m"])) if kind in (Q4_1, Q5_1) else None
    for c in range(acts.C):
        acc = g.fma(b.fmul(g.to_float(isum[c]), _splat_f32(g, acts.d[c], blk)), dw, b.load(accs[c]))
        if mw is not None:
            acc = g.fma(mw, _splat_f32(g, acts.s[c], blk), acc)
        b.store(acc, accs[c])


def _group_block(g, kind, gb, blk, acts, accs):
    if kind == Q6_K:
        _block_q6(g, gb, blk, acts, accs)
    elif kind in (Q4_K, Q5_K):
        _block_k4(g, kind, gb, blk, acts, accs)
    else:
        _block_32(g, kind, gb, blk, acts, accs)


def _store(g, a, m, n, lanes, value):
    """out[m, n .. n + lanes] = the first `lanes` lanes of value (all of them: one vector store)."""
    b = g.b
    base = b.add(b.mul(m, g.stride0(a.arrays["out"])), b.mul(n, g.const(4)))
    with b.if_else(b.icmp_unsigned("==", lanes, g.const(value.type.count))) as (full, part):
        with full:
            g.store(a.out, base, value)
        with part:
            for i in range(value.type.count):
                with b.if_then(b.icmp_unsigned("<", g.const(i), lanes)):
                    g.store(a.out, b.add(base, g.const(4 * i)), b.extract_element(value, ir.Constant(I32, i)))


def _group_gemm_body(g, a, kind):
    group_tiles(g, a, kind, tile_rows(kind, g.isa), _group_block)


def group_tiles(g, a, kind, C, block):
    """Every group of rows r0..r1, every block, C activation rows at a time, the rows left over in
    one narrower tile (each tile unpacks the group block once; a group's later tiles find it in L1):
    block(g, kind, gb, blk, acts, accs) emits one group block's work for a tile (a group_gemm's
    arguments in a)."""
    b = g.b
    gbytes = g.const(GROUP * BLOCK_BYTES[kind])
    nb = b.udiv(a.row_bytes, g.const(BLOCK_BYTES[kind]))
    n_groups = b.udiv(b.add(b.sub(a.r1, a.r0), g.const(GROUP - 1)), g.const(GROUP))
    with g.loop(n_groups) as gi:
        r = b.add(a.r0, b.mul(gi, g.const(GROUP)))
        lanes = b.sub(a.r1, r)
        lanes = b.select(b.icmp_unsigned("<", lanes, g.const(GROUP)), lanes, g.const(GROUP))
        base = g.at(a.w, b.add(a.off, b.mul(r, a.row_bytes)))          # a group's 8 rows: 8 x row_bytes

        def tile(m0, width):
            acts = _Acts(g, a, kind, m0, width)
            accs = [g.slot(F8) for _ in range(width)]
            with g.loop(nb) as blk:
                gb = g.at(base, b.mul(blk, gbytes))
                prefetch_group_block(g, gb, kind)
                block(g, kind, gb, blk, acts, accs)
            for c in range(width):
                _store(g, a, acts.rows[c], b.add(a.col, r), lanes, b.load(accs[c]))

        with g.loop(b.udiv(a.M, g.const(C))) as t:
            tile(b.mul(t, g.const(C)), C)
        first = b.mul(b.udiv(a.M, g.const(C)), g.const(C))
        g.switch(b.urem(a.M, g.const(C)), {w: (lambda w=w: tile(first, w)) for w in range(1, C)})


@vector_intrinsic
def group_gemm(typingctx, kind, w, off, row_bytes, p32, pk, M, out, col, r0, r1):
    """Rows r0..r1 of the repacked matrix at w[off:] (r0 a multiple of GROUP; row_bytes the file's
    bytes per row) times the M activation rows -> out[m, col + r]."""
    vector_ir.need_isa("the repacked kernels")

    def body(g, a):
        g.switch(a.kind, {k: (lambda k=k: _group_gemm_body(g, a, k)) for k in REPACK_TYPES})
        return g.c.get_dummy_value()
    return types.none(kind, w, off, row_bytes, p32, pk, M, out, col, r0, r1), body


__all__ = ["GROUP", "REPACK_TYPES", "GROUP_FIELDS", "GROUP_AT", "repack", "unpack", "repacked_bytes", "group_gemm"]
