"""The amx stage's layout and kernel: the prompt's matmuls on the CPU's matrix unit (stages/amx.py
tells the story).

AMX (Intel Xeon 4th generation on) has 8 tile registers of up to 16 rows x 64 bytes and one
instruction that multiplies two of them into a third: TDPBSSD C, A, B, for m < rows(A), n < 16,

    C[m][n] += sum over k < K/4, i < 4 of A[m][4k + i] * B[k][4n + i]        (signed bytes, int32 sums)

That is rows(A) by 16 by K multiply-adds per instruction (K <= 64 bytes of A's rows): A holds
activation rows as the 8-bit packs already store them (q8.py: one row after another, tileloadd
with the packs' row stride), B holds 16 weight rows "VNNI-style": row k of B is 4 values
(4k .. 4k + 3) of each of the 16 weight rows in turn. The weights are laid out that way once, at
load, in groups of AMX_TILE (16) rows and one block of ggml's at a time, every value a signed
byte (its offset folded in: Q4_0's q - 8, Q6_K's q - 32):

    type   one block of a 16-row group                                     bytes
    Q4_0   B: 8 x 64 (K = 32) | d[16] f16                                   16 x 34
    Q8_0   B: 8 x 64          | d[16] f16                                   16 x 34
    Q4_1   B: 8 x 64          | d[16] f16 | m[16] f16                       16 x 36
    Q4_K   B: 8 sub-blocks x (8 x 64) | d[16] | dmin[16] | sc[8][16] | m[8][16] u8     16 x 276
    Q6_K   B: 16 sub-blocks x (4 x 64, K = 16) | d[16] | scales[16][16] i8             16 x 274

A tile's product is an exact int32 per (activation row, weight row) for one block (or sub-block),
the integers repack's kernel sums (repacked.py: q - 8 times a is its q times a less 8 times the
block's sum of a; the same integer). Each is stored (tilestored) and the block's float steps run
on it with 512-bit vectors, one activation row at a time across the 16 weight rows: the same
operations in the same order as repack's kernel applies per lane (isum as float, times the
activation's scale, a multiply-add with the weight's scale into the row's accumulator; Q4_1's
m s_a; the K-quants' sub-block scales in int32 first, their mins' sum last). So a row's result
is repack's bits whichever unit computed it.

    tile_layout(raw, kind) / tiled_bytes(rows, row_bytes, kind)     numpy, at load
    amx_gemm(kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, (r0, r1))
        rows r0..r1 (r0 a multiple of AMX_TILE) of the matrix laid out at w[toff:] times activation
        rows m0..m1 of the 8-bit packs -> out[m, col + r], 16 activation rows to a tile
    amx_gemm_emulated(...)   the same kernel with every tile instruction replaced by loops over
                             memory that compute what the instruction computes (Tiles, Emulated):
                             what runs the kernel's checks on a CPU without AMX

Compiling amx_gemm needs a target with AMX (LLVM inserts the tile configuration, LDTILECFG, for
the shapes it sees, and TILERELEASE at the end); running it needs the kernel's permission
(stages/amx.py asks for it, once per process).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import literally, njit, types
from numba.core import cgutils, errors

from common.cpu import simd_features
from common.quants import blocks_of, k4_scale_min
from stages.kernels import vector_ir
from stages.kernels.toolkit import BLOCK_BYTES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, TYPES_K
from stages.kernels.vector_ir import D16, FLOAT, FZ, HALF, I8, I16, I32, I64, Emit, vector_intrinsic

AMX_TILE = 16                 # weight rows per group (B's 16 int32 columns) and activation rows per A tile
AMX_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)
SUB = {Q4_0: 32, Q4_1: 32, Q8_0: 32, Q4_K: 32, Q6_K: 16}     # values per tile product (a block or sub-block)
SUBS = {Q4_0: 1, Q4_1: 1, Q8_0: 1, Q4_K: 8, Q6_K: 16}        # products per ggml block
OFFSET = {Q4_0: 8, Q6_K: 32}                                 # folded into the stored byte: q - offset
B_BYTES = {k: SUB[k] // 4 * 64 for k in AMX_TYPES}           # one B tile: K/4 rows of 64 bytes


def _fields(kind) -> dict:
    """Where each part of a group's block starts (bytes), and the block's size."""
    at, o = {}, SUBS[kind] * B_BYTES[kind]
    parts = {Q4_0: [("d", 32)], Q8_0: [("d", 32)], Q4_1: [("d", 32), ("m", 32)],
             Q4_K: [("d", 32), ("dmin", 32), ("sc", 128), ("m", 128)], Q6_K: [("d", 32), ("scales", 256)]}[kind]
    for name, n in parts:
        at[name], o = o, o + n
    at["size"] = o
    return at


TILE_AT = {k: _fields(k) for k in AMX_TYPES}                  # TILE_AT[Q4_K]["sc"] == 4160


def amx_ready() -> bool:
    """Whether this CPU has the matrix unit's int8 tiles (its /proc/cpuinfo flags)."""
    return {"amx_tile", "amx_int8"} <= set(simd_features())


# ---- the layout, at load (numpy) ------------------------------------------------------------------

def _integers(b, kind) -> np.ndarray:
    """Every value of the blocks b as the signed byte the tiles multiply: [n, values per block]."""
    n = len(b)
    if kind == Q8_0:
        return b["qs"].astype(np.int8)
    if kind in (Q4_0, Q4_1):
        q = np.concatenate([b["qs"] & 15, b["qs"] >> 4], axis=1).astype(np.int16)
    elif kind == Q4_K:
        qs = b["qs"].reshape(n, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 256).astype(np.int16)
    else:                                                       # Q6_K, as common.quants decodes it
        ql, qh = b["ql"].reshape(n, 2, 64), b["qh"].reshape(n, 2, 1, 32)
        low = np.stack([ql & 15, ql >> 4], axis=2)               # [block, half, nibble, byte]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
        q = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).astype(np.int16)
    return (q - OFFSET.get(kind, 0)).astype(np.int8)


def tiled_bytes(rows: int, row_bytes: int, kind: int) -> int:
    """Bytes of a matrix's tile layout: its rows in groups of AMX_TILE (the last padded with zeros)."""
    return -(-rows // AMX_TILE) * (row_bytes // BLOCK_BYTES[kind]) * TILE_AT[kind]["size"]


def tile_layout(raw: np.ndarray, kind: int, out: np.ndarray | None = None) -> np.ndarray:
    """The file's rows raw [rows, row_bytes] uint8 in the tile layout (the module docstring):
    uint8 [tiled_bytes], written into out when given."""
    rows, row_bytes = raw.shape
    n_groups = -(-rows // AMX_TILE)
    size = tiled_bytes(rows, row_bytes, kind)
    out = np.zeros(size, np.uint8) if out is None else out
    out[:] = 0
    b = blocks_of(raw, kind).reshape(rows, -1)                  # [rows, blocks]
    nb = b.shape[1]
    pad = np.zeros((n_groups * AMX_TILE, nb), b.dtype)
    pad[:rows] = b
    b = pad.reshape(n_groups, AMX_TILE, nb)
    groups = out.reshape(n_groups, nb, TILE_AT[kind]["size"])
    q = _integers(b.reshape(-1), kind).reshape(n_groups, AMX_TILE, nb, SUBS[kind], SUB[kind] // 4, 4)
    q.reshape(n_groups * AMX_TILE, -1)[rows:] = 0                  # the padding rows: zeros, not a block's offset
    # B tile of sub-block s: [k, row, 4 values]: row k of B is value group k of the 16 rows in turn
    tiles = q.transpose(0, 2, 3, 4, 1, 5).reshape(n_groups, nb, -1).view(np.uint8)
    groups[:, :, :SUBS[kind] * B_BYTES[kind]] = tiles
    at = TILE_AT[kind]

    def put(name, values):                  # values [groups, AMX_TILE, nb, ...]: the 16 rows side by side
        v = np.ascontiguousarray(np.moveaxis(values, 1, -1))
        groups[:, :, at[name]:at[name] + v[0, 0].nbytes] = v.reshape(n_groups, nb, -1).view(np.uint8)

    for name in ("d", "dmin", "m") if kind != Q4_K else ("d", "dmin"):
        if name in at:
            put(name, b[name].view(np.uint16))              # float16 scales, as stored
    if kind == Q4_K:
        sc, mn = k4_scale_min(b["scales"])                      # [groups, AMX_TILE, nb, 8]
        put("sc", sc.astype(np.uint8))
        put("m", mn.astype(np.uint8))
    if kind == Q6_K:
        put("scales", b["scales"].astype(np.int8))
    return out


# ---- the tile instructions, and their twin -----------------------------------------------------------

class _AMX(ir.Type):
    """LLVM's x86_amx: a tile register's value (llvmlite has no such type)."""

    def _to_string(self):
        return "x86_amx"

    def __eq__(self, other):
        return isinstance(other, _AMX)

    def __hash__(self):
        return hash("x86_amx")


class Tiles:
    """The four tile instructions as LLVM's AMX intrinsics (shapes as operands: LLVM writes the
    configuration). A tile is a value of type x86_amx; `name` is the twin's."""

    AMX = _AMX()

    def __init__(self, g):
        self.g = g

    def _shape(self, rows, colsb):
        return self.g.b.trunc(rows, I16), ir.Constant(I16, colsb)

    def zero(self, name, rows, colsb):
        return self.g.call("llvm.x86.tilezero.internal", self.AMX, *self._shape(rows, colsb))

    def load(self, name, rows, colsb, p, stride):
        return self.g.call("llvm.x86.tileloadd64.internal", self.AMX, *self._shape(rows, colsb), p, stride)

    def dot(self, c, a, bt, rows, k):
        """TDPBSSD: c += a (rows x k bytes) times bt (k/4 x 64 bytes), signed bytes, int32 sums."""
        m, n = self._shape(rows, 64)
        return self.g.call("llvm.x86.tdpbssd.internal", self.AMX, m, n, ir.Constant(I16, k), c, a, bt)

    def store(self, t, rows, colsb, p, stride):
        self.g.call("llvm.x86.tilestored64.internal", ir.VoidType(), *self._shape(rows, colsb), p, stride, t)


class Emulated(Tiles):
    """The same instructions as loops over 1 KiB buffers, one per tile `name`: what they compute,
    for the kernel's checks on a CPU without the unit (slow; never the stage's). Each instruction
    is a function of its own in the module, called, not inlined: unrolled into every block of every
    type, the loops took minutes to compile."""

    def __init__(self, g):
        super().__init__(g)
        self.buffers = {}

    def _buffer(self, name):
        if name not in self.buffers:
            self.buffers[name] = self.g.b.bitcast(cgutils.alloca_once(self.g.b, ir.ArrayType(I8, 1024)),
                                                  I8.as_pointer())
        return self.buffers[name]

    def _function(self, name, params, emit):
        """The module's function `name` (i8* and i64 parameters, params its count of each), its body
        written by emit(g, args) the first time: marked noinline."""
        module = self.g.b.module
        fn = module.globals.get(name)
        if fn is None:
            ptr = I8.as_pointer()
            fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr] * params[0] + [I64] * params[1]), name)
            fn.linkage = "internal"
            fn.attributes.add("noinline")
            builder = ir.IRBuilder(fn.append_basic_block("entry"))
            emit(Emit(self.g.c, builder), fn.args)
            builder.ret_void()
        return fn

    def zero(self, name, rows, colsb):
        def emit(g, args):
            with g.loop(g.const(1024)) as i:
                g.store(args[0], i, ir.Constant(I8, 0))
        self.g.b.call(self._function("amx_twin_zero", (1, 0), emit), [self._buffer(name)])
        return name

    def load(self, name, rows, colsb, p, stride):
        def emit(g, args):
            t, src, rows, colsb, stride = args
            with g.loop(rows) as r, g.loop(colsb) as c:
                g.store(t, g.b.add(g.b.mul(r, g.const(64)), c), g.load(src, g.b.add(g.b.mul(r, stride), c), I8))
        self.g.b.call(self._function("amx_twin_load", (2, 3), emit),
                      [self._buffer(name), p, rows, self.g.const(colsb), stride])
        return name

    def dot(self, c, a, bt, rows, k):
        def emit(g, args):
            tc, ta, tb, rows, k = args
            b = g.b
            with g.loop(rows) as m, g.loop(g.const(16)) as n:
                at = b.add(b.mul(m, g.const(64)), b.mul(n, g.const(4)))
                with g.loop(b.udiv(k, g.const(4))) as kq, g.loop(g.const(4)) as i:
                    x = b.sext(g.load(ta, b.add(b.mul(m, g.const(64)), b.add(b.mul(kq, g.const(4)), i)), I8), I32)
                    y = b.sext(g.load(tb, b.add(b.mul(kq, g.const(64)), b.add(b.mul(n, g.const(4)), i)), I8), I32)
                    g.store(tc, at, b.add(g.load(tc, at, I32), b.mul(x, y)))
        self.g.b.call(self._function("amx_twin_dot", (3, 2), emit),
                      [self._buffer(c), self._buffer(a), self._buffer(bt), rows, self.g.const(k)])
        return c

    def store(self, t, rows, colsb, p, stride):
        def emit(g, args):
            src, dst, rows, colsb, stride = args
            with g.loop(rows) as r, g.loop(colsb) as c:
                g.store(dst, g.b.add(g.b.mul(r, stride), c), g.load(src, g.b.add(g.b.mul(r, g.const(64)), c), I8))
        self.g.b.call(self._function("amx_twin_store", (2, 3), emit),
                      [self._buffer(t), p, rows, self.g.const(colsb), stride])


# ---- the kernel -------------------------------------------------------------------------------------

class _Buffers:
    """A tile's int32 products as stored (cbuf), the K-quants' scaled sums of a block (ibuf) and the
    float accumulators (acc): [16 activation rows][16 weight rows] each, on the stack (in L1)."""

    def __init__(self, g):
        new = lambda: g.b.bitcast(cgutils.alloca_once(g.b, ir.ArrayType(I8, 1024)), I8.as_pointer())
        self.c, self.i, self.acc = new(), new(), new()


def _row(g, m):
    """Byte offset of row m of a [16][16] buffer."""
    return g.b.mul(m, g.const(64))


def _halves16(g, p, off):
    return g.b.fpext(g.load(p, off, ir.VectorType(HALF, AMX_TILE)), FZ)


def _bytes16(g, p, off, signed):
    v = g.load(p, off, ir.VectorType(I8, AMX_TILE))
    return g.b.sext(v, D16) if signed else g.b.zext(v, D16)


def _act(g, pack, name, m, index, ty):
    """pack.name[m, index] (a float32 scale, an int16 sum) as a scalar."""
    return g.load(getattr(pack, name), g.b.add(g.b.mul(m, g.stride0(pack.arrays[name])),
                                             g.b.mul(index, g.const(ty.width // 8 if ty != FLOAT else 4))), ty)


def _product(g, T, pack, qstride, mt, mr, k_at, gb, b_at, k, buf):
    """One tile product: activation rows mt .. mt + mr, bytes k_at .. k_at + k of each, times the B
    tile at gb + b_at (k/4 rows) -> buf (int32 [mr][16])."""
    b = g.b
    a = T.load("a", mr, k, g.at(pack.q, b.add(b.mul(mt, qstride), k_at)), qstride)
    w = T.load("b", g.const(k // 4), 64, g.at(gb, g.const(b_at)), g.const(64))
    T.store(T.dot(T.zero("c", mr, 64), a, w, mr, k), mr, 64, buf, g.const(64))


def _block_32(g, T, a, kind, gb, blk, mt, mr, bufs, qstride):
    """Q4_0, Q4_1, Q8_0: acc += float(isum) * d_a * d_w (+ m_w * s_a), repack's steps per lane."""
    b, at = g.b, TILE_AT[kind]
    _product(g, T, a.p32, qstride, mt, mr, b.mul(blk, g.const(32)), gb, 0, 32, bufs.c)
    dw = _halves16(g, gb, g.const(at["d"]))
    mw = _halves16(g, gb, g.const(at["m"])) if kind == Q4_1 else None
    with g.loop(mr) as m:
        row = b.add(mt, m)
        isum = g.load(bufs.c, _row(g, m), D16)
        acc = g.fma(b.fmul(g.to_float(isum), g.splat(FZ, _act(g, a.p32, "d", row, blk, FLOAT))), dw,
                    g.load(bufs.acc, _row(g, m), FZ))
        if mw is not None:
            acc = g.fma(mw, g.splat(FZ, _act(g, a.p32, "s", row, blk, FLOAT)), acc)
        g.store(bufs.acc, _row(g, m), acc)


def _block_k(g, T, a, kind, gb, blk, mt, mr, bufs, qstride):
    """Q4_K, Q6_K: isum = sum over sub-blocks of scale x (the sub-block's product), in int32 (repack's
    integers); Q4_K's mins: msum = sum of m_s b32_s; acc += float(isum) d_a d_w (- float(msum) d_a dmin)."""
    b, at, k = g.b, TILE_AT[kind], SUB[kind]
    with g.loop(mr) as m:
        g.store(bufs.i, _row(g, m), ir.Constant(D16, None))
    for s in range(SUBS[kind]):
        _product(g, T, a.pk, qstride, mt, mr, b.add(b.mul(blk, g.const(256)), g.const(k * s)), gb,
                 s * B_BYTES[kind], k, bufs.c)
        scale = _bytes16(g, gb, g.const(at["sc" if kind == Q4_K else "scales"] + AMX_TILE * s), kind == Q6_K)
        with g.loop(mr) as m:
            isum = b.add(g.load(bufs.i, _row(g, m), D16), b.mul(g.load(bufs.c, _row(g, m), D16), scale))
            g.store(bufs.i, _row(g, m), isum)
    dw = _halves16(g, gb, g.const(at["d"]))
    if kind == Q4_K:
        dmin = b.fneg(_halves16(g, gb, g.const(at["dmin"])))
        mins = [_bytes16(g, gb, g.const(at["m"] + AMX_TILE * s), False) for s in range(8)]
    with g.loop(mr) as m:
        row = b.add(mt, m)
        da = g.splat(FZ, _act(g, a.pk, "d", row, blk, FLOAT))
        acc = g.fma(b.fmul(g.to_float(g.load(bufs.i, _row(g, m), D16)), da), dw, g.load(bufs.acc, _row(g, m), FZ))
        if kind == Q4_K:
            msum = ir.Constant(D16, None)
            for s in range(8):
                sums = b.sext(_act(g, a.pk, "b32", row, b.add(b.mul(blk, g.const(8)), g.const(s)), I16), I32)
                msum = b.add(msum, b.mul(mins[s], g.splat(D16, sums)))
            acc = g.fma(b.fmul(g.to_float(msum), da), dmin, acc)
        g.store(bufs.acc, _row(g, m), acc)


def _store(g, a, m, n, lanes, value):
    """out[m, n .. n + lanes] = the first `lanes` lanes of value (16: one vector store)."""
    b = g.b
    base = b.add(b.mul(m, g.stride0(a.arrays["out"])), b.mul(n, g.const(4)))
    with b.if_else(b.icmp_unsigned("==", lanes, g.const(AMX_TILE))) as (full, part):
        with full:
            g.store(a.out, base, value)
        with part:
            for i in range(AMX_TILE):
                with b.if_then(b.icmp_unsigned("<", g.const(i), lanes)):
                    g.store(a.out, b.add(base, g.const(4 * i)), b.extract_element(value, ir.Constant(I32, i)))


def _gemm_body(g, a, kind, T):
    """Every group of 16 weight rows of r0..r1, every tile of 16 activation rows of m0..m1 (the last
    one shorter), every block: one tile product (the K-quants: one per sub-block), its float steps
    into the tile's accumulators, then the tile's rows out."""
    b = g.b
    bufs = _Buffers(g)
    qstride = g.stride0((a.pk if kind in TYPES_K else a.p32).arrays["q"])
    size = g.const(TILE_AT[kind]["size"])
    nb = b.udiv(a.row_bytes, g.const(BLOCK_BYTES[kind]))
    r0, r1 = a.rows._0, a.rows._1
    block = _block_k if kind in TYPES_K else _block_32
    with g.loop(b.udiv(b.add(b.sub(r1, r0), g.const(AMX_TILE - 1)), g.const(AMX_TILE))) as gi:
        r = b.add(r0, b.mul(gi, g.const(AMX_TILE)))
        lanes = b.sub(r1, r)
        lanes = b.select(b.icmp_unsigned("<", lanes, g.const(AMX_TILE)), lanes, g.const(AMX_TILE))
        base = g.at(a.w, b.add(a.toff, b.mul(b.udiv(r, g.const(AMX_TILE)), b.mul(nb, size))))
        with g.loop(b.udiv(b.add(b.sub(a.m1, a.m0), g.const(AMX_TILE - 1)), g.const(AMX_TILE))) as ti:
            mt = b.add(a.m0, b.mul(ti, g.const(AMX_TILE)))
            mr = b.sub(a.m1, mt)
            mr = b.select(b.icmp_unsigned("<", mr, g.const(AMX_TILE)), mr, g.const(AMX_TILE))
            with g.loop(mr) as m:
                g.store(bufs.acc, _row(g, m), ir.Constant(FZ, None))
            with g.loop(nb) as blk:
                block(g, T, a, kind, g.at(base, b.mul(blk, size)), blk, mt, mr, bufs, qstride)
            with g.loop(mr) as m:
                _store(g, a, b.add(mt, m), b.add(a.col, r), lanes, g.load(bufs.acc, _row(g, m), FZ))


def _kernel(kind, T):
    """The body for one type (kind a literal: LLVM's tile allocation runs out of registers with four
    types' bodies in one function), or a switch over every type (the twin only)."""
    def body(g, a):
        if isinstance(kind, types.IntegerLiteral):
            _gemm_body(g, a, kind.literal_value, T(g))
        else:
            g.switch(a.kind, {k: (lambda k=k: _gemm_body(g, a, k, T(g))) for k in AMX_TYPES})
        return g.c.get_dummy_value()
    return body


_PROBE = ("declare x86_amx @llvm.x86.tilezero.internal(i16, i16)\n"
          "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)\n"
          "define void @f(ptr %p) {\n  %t = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)\n"
          "  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %p, i64 64, x86_amx %t)\n"
          "  ret void\n}\n")


def target_has_amx() -> bool:
    """Whether the CPU numba compiles for has the tiles: LLVM asked, where numba is told to compile
    for a named CPU (NUMBA_CPU_NAME), else this CPU's flags."""
    from numba.core import config
    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        return amx_ready()
    import llvmlite.binding as llvm
    return vector_ir.target_compiles(config.CPU_NAME or llvm.get_host_cpu_name(), config.CPU_FEATURES or "",
                                     _PROBE, "tilezero")


@vector_intrinsic
def amx_gemm(typingctx, kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows):
    """Rows r0..r1 (rows: the tuple (r0, r1); r0 a multiple of AMX_TILE) of the matrix laid out at
    w[toff:] (tile_layout; row_bytes the file's bytes per row) times activation rows m0..m1 of the
    8-bit packs -> out[m, col + r], on the matrix unit. kind: a literal (amx_matmul passes one)."""
    if not target_has_amx():
        raise errors.TypingError("the matrix-unit kernel needs a CPU with AMX (amx_tile, amx_int8): "
                                 "stages/kernels/amx_tiles.py")
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("amx_gemm compiles one type per function: its kind must be a literal")
    return types.none(kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows), _kernel(kind, Tiles)


@vector_intrinsic
def amx_gemm_emulated(typingctx, kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows):
    """amx_gemm with every tile instruction computed by loops (Emulated): any CPU with AVX2 + F16C
    (the float steps are the kernel's own), for the checks, never for speed."""
    vector_ir.need_isa("the matrix-unit kernel's twin")
    return types.none(kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows), _kernel(kind, Emulated)


PEAK_CHAINS, PEAK_DEPTH = 4, 16      # accumulator tiles (with A and B: 6 of the 8), products chained on each


@vector_intrinsic
def tile_products(typingctx, reps, buf):
    """reps rounds of PEAK_CHAINS x PEAK_DEPTH full tile products (16 x 16 x 64 int8 multiply-adds
    each) on A and B loaded once a round from buf (2 KiB, uint8), every accumulator stored to buf's
    third KiB at the end of a round (so none is dropped): the unit's peak, roofline.amx_peak_gops."""
    if not target_has_amx():
        raise errors.TypingError("the matrix unit's peak needs a CPU with AMX (amx_tile, amx_int8)")

    def body(g, a):
        T, full, stride = Tiles(g), g.const(AMX_TILE), g.const(64)
        with g.loop(a.reps):
            ta = T.load("a", full, 64, a.buf, stride)
            tb = T.load("b", full, 64, g.at(a.buf, g.const(1024)), stride)
            accs = [T.zero(f"c{i}", full, 64) for i in range(PEAK_CHAINS)]
            for _ in range(PEAK_DEPTH):
                accs = [T.dot(c, ta, tb, full, 64) for c in accs]
            for c in accs:
                T.store(c, full, 64, g.at(a.buf, g.const(2048)), stride)
        return g.c.get_dummy_value()
    return types.none(reps, buf), body


@njit(cache=True)
def emulated_rows(kind, w, row_bytes, p32, pk, M, N):
    """The N weight rows laid out in w (tile_layout) times the M activation rows of the packs through
    the twin: float32 [M, N] (what the checks and chapter 13 compare with repack's kernel)."""
    out = np.empty((M, N), np.float32)
    amx_gemm_emulated(kind, w, 0, row_bytes, p32, pk, 0, M, out, 0, (0, N))
    return out


@njit(cache=True)
def _one_type(kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows):
    amx_gemm(literally(kind), w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)


@njit(cache=True, inline="always")
def amx_matmul(kind, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows):
    """amx_gemm for a type known only at run time: a function compiled per type."""
    if kind == Q4_0:
        _one_type(Q4_0, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)
    elif kind == Q4_1:
        _one_type(Q4_1, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)
    elif kind == Q8_0:
        _one_type(Q8_0, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)
    elif kind == Q4_K:
        _one_type(Q4_K, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)
    elif kind == Q6_K:
        _one_type(Q6_K, w, toff, row_bytes, p32, pk, m0, m1, out, col, rows)


__all__ = ["AMX_TILE", "AMX_TYPES", "TILE_AT", "amx_ready", "tile_layout", "tiled_bytes", "amx_gemm", "amx_matmul",
           "amx_gemm_emulated", "emulated_rows", "Tiles", "Emulated", "target_has_amx", "tile_products", "PEAK_CHAINS",
           "PEAK_DEPTH"]
