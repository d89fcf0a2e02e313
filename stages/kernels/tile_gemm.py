"""The prefill stage's matmul on 256-bit registers, for CPUs with AVX2 and no AVX512-VNNI
(stages/prefill.py tells the story; pair_gemm.py is the same stage's kernel where 512-bit
vpdpbusd exists).

The lanes are repack's (repacked.py): a group's 8 weight rows, one per int32 lane; one activation
dword broadcast to all 8; each unpacked 32-byte piece of weights serves the C activation rows of a
tile. Without VNNI a product is vpmaddubsw (16 int16 pair sums), and the products of one scale are
added in int16 (a "run": as many as cannot overflow), then widened, scaled and added in one
vpmaddwd: scaled_dots in vector_ir.py. Repack's kernel writes the same integers as separate sums
per activation row over a list of a sub-block's unpacked pieces (16 registers of pieces before
the first product), and LLVM is free to reassociate each run's adds: compiled for haswell, its
loop over a group block spills runs and pieces to the stack and loads them again (count the
stack operands in its assembly, as chapter 12 counts the pair kernel's). Here the order is fixed:

    for each piece j of a sub-block pair:      load, low nibbles, high nibbles     (3 instructions)
        for each of the tile's C rows:          run_lo[c] += vpmaddubsw(lo, x_c)    (a broadcast
                                                run_hi[c] += vpmaddubsw(hi, x_c')    dword each)
    for each row: isum[c] += vpmaddwd(run_lo[c], sc) + vpmaddwd(run_hi[c], sc')

and every sum passes through an empty inline asm (`_kept`), which LLVM cannot look through, so
it adds each product into its run as it comes (a chain, not a tree), and the 2C runs and the
piece mostly stay in registers. A Q4_K block's 4 sub-block pairs are a loop at run time, not
unrolled: unrolled, the loop over a group block was 4 times longer, and its speed then depended
on the caller (in one process the same kernel ran slower called from inside another loop than
alone, the same instructions at other addresses): the front end, not the vector units, set its pace.

Every (weight row, activation row) pair gets repack's integer sums (exact: no int16 run
overflows: 8 pair sums of at most 2 x 15 x 127) and then repack's float steps in repack's order
(repacked.finish_k4, finish_32): a row's result is repack's bits (tests/test_prefill.py checks it,
compiled for haswell by `make test-avx2`). Q4_0, Q4_1, Q8_0 and Q4_K run here (TILE_TYPES).
Q6_K, whose 6-bit values leave a run of 2 products, timed no faster this way and stays on repack's
kernel; so do the types pair_gemm does not take either. On AVX-VNNI (vpdpbusd on 256-bit
registers, no int16 runs to keep) the stage uses repack's kernel: its product is one instruction.

    tile_gemm(kind, w, off, row_bytes, p32, pk, M, out, col, r0, r1)    repacked.group_gemm's arguments
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils

from stages.kernels import vector_ir
from stages.kernels.repacked import GROUP_AT, _splat_q, finish_32, finish_k4, group_k4_scales, group_tiles, start_32
from stages.kernels.toolkit import Q4_0, Q4_1, Q4_K, Q8_0
from stages.kernels.vector_ir import B32, D8, I32, W16, vector_intrinsic

TILE_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K)
# Activation rows per tile: 2C runs and a piece's two halves in 16 registers (the tile's isums
# spill to L1, touched once per sub-block pair). Of 4, 6 and 8 rows, 6 timed best where this was
# measured (Q4_K, one thread, a matrix streamed from memory); 8 spills the runs.
ROWS_PER_TILE = 6
# Whether the stage takes this kernel: AVX2 with neither AVX-VNNI nor AVX512-VNNI (a constant
# when a kernel is compiled, like vector_ir.ISA).
YMM_TILES = vector_ir.ISA == "avx2"


@njit(cache=True, inline="always")
def tiles_take(kind):
    """Whether tile_gemm takes this type (TILE_TYPES)."""
    return kind == Q4_0 or kind == Q4_1 or kind == Q8_0 or kind == Q4_K


def _kept(g, v):
    """v through an empty inline asm, in a vector register (or, an integer, a general one): LLVM
    cannot see that the result is v, so it adds in the order written (a chain, not a tree), and a
    loop that counts to a kept number is not unrolled."""
    ft = ir.FunctionType(v.type, [v.type])
    where = "=r,0" if isinstance(v.type, ir.IntType) else "=x,0"
    return g.b.call(ir.InlineAsm(ft, "", where, side_effect=False), [v])


class _Run:
    """A run: vpmaddubsw's int16 pair sums of one scale, added as they come."""

    def __init__(self, g):
        self.g, self.v = g, None

    def add(self, u, s):
        p = self.g.pairs(u, s)
        self.v = p if self.v is None else _kept(self.g, self.g.b.add(self.v, p))

    def into(self, isum, both):
        """isum + the run's pairs times both (int16 lanes: the scale in both halves of a dword)."""
        g = self.g
        return _kept(g, g.b.add(isum, g.madd(self.v, both)))


def _both(g, scale):
    """int32 lanes (in int16's range) -> the scale in both int16 halves: vpmaddwd's operand."""
    return g.b.bitcast(g.int16_pair(scale, scale), W16)


def _block_q4k(g, kind, gb, blk, acts, accs):
    """Q4_K: isum = sum_s sc_s (dot of sub-block s); sub-blocks 2ch and 2ch + 1 (the low and high
    nibbles of the same 8 pieces) in two runs per row, a loop over ch at run time (unrolled, the
    block's loop would be 4 times longer); then repack's float steps."""
    b, C = g.b, acts.C
    lay = GROUP_AT[Q4_K]
    sc, mn = group_k4_scales(g, gb)
    both = cgutils.alloca_once(b, ir.ArrayType(W16, 8))         # the 8 sub-blocks' scales, vpmaddwd's operand
    for s in range(8):
        b.store(_both(g, sc[s]), b.gep(both, [ir.Constant(I32, 0), ir.Constant(I32, s)]))
    k = b.mul(blk, g.const(256))
    isum = [g.slot(D8) for _ in range(C)]
    with g.loop(_kept(g, g.const(4))) as ch:
        pieces = g.at(gb, b.add(g.const(lay["qs"]), b.mul(ch, g.const(256))))
        at = b.add(k, b.mul(ch, g.const(64)))
        runs = [[_Run(g), _Run(g)] for _ in range(C)]
        for j in range(8):
            w = g.load(pieces, g.const(32 * j), B32)
            lo, hi = g.nibbles(w, False), g.nibbles(w, True)
            for c in range(C):
                runs[c][0].add(lo, _splat_q(g, acts, c, b.add(at, g.const(4 * j))))
                runs[c][1].add(hi, _splat_q(g, acts, c, b.add(at, g.const(32 + 4 * j))))
        for h in range(2):
            scale = b.load(b.gep(both, [ir.Constant(I32, 0), b.trunc(b.add(b.mul(ch, g.const(2)), g.const(h)), I32)]))
            for c in range(C):
                b.store(runs[c][h].into(b.load(isum[c]), scale), isum[c])
    finish_k4(g, Q4_K, gb, blk, acts, accs, [b.load(v) for v in isum], mn)


def _block_32(g, kind, gb, blk, acts, accs):
    """Q4_0, Q4_1: the block's 8 products per row in one run. Q8_0 (q + 128, up to 255: a pair of
    products would overflow int16) in nibbles, 16 hi + lo: a run of each."""
    b, C = g.b, acts.C
    qs = GROUP_AT[kind]["qs"]
    k = b.mul(blk, g.const(32))
    isum = start_32(g, kind, blk, acts)
    ones = g.splat_const(W16, 1)
    if kind == Q8_0:
        lo_runs, hi_runs = [_Run(g) for _ in range(C)], [_Run(g) for _ in range(C)]
        for j in range(8):
            w = g.load(gb, g.const(qs + 32 * j), B32)
            lo, hi = g.nibbles(w, False), g.nibbles(w, True)
            for c in range(C):
                x = _splat_q(g, acts, c, b.add(k, g.const(4 * j)))
                lo_runs[c].add(lo, x)
                hi_runs[c].add(hi, x)
        sixteen = g.splat_const(W16, 16)
        isum = [hi_runs[c].into(lo_runs[c].into(isum[c], ones), sixteen) for c in range(C)]
    else:
        runs = [_Run(g) for _ in range(C)]
        for j in range(4):
            w = g.load(gb, g.const(qs + 32 * j), B32)
            lo, hi = g.nibbles(w, False), g.nibbles(w, True)
            for c in range(C):
                runs[c].add(lo, _splat_q(g, acts, c, b.add(k, g.const(4 * j))))
                runs[c].add(hi, _splat_q(g, acts, c, b.add(k, g.const(16 + 4 * j))))
        isum = [runs[c].into(isum[c], ones) for c in range(C)]
    finish_32(g, kind, gb, blk, acts, accs, isum)


def _block(g, kind, gb, blk, acts, accs):
    if kind == Q4_K:
        _block_q4k(g, kind, gb, blk, acts, accs)
    else:
        _block_32(g, kind, gb, blk, acts, accs)


@vector_intrinsic
def tile_gemm(typingctx, kind, w, off, row_bytes, p32, pk, M, out, col, r0, r1):
    """Rows r0..r1 of the repacked matrix at w[off:] (r0 a multiple of GROUP) times the M activation
    rows of the 8-bit packs -> out[m, col + r], repack's bits (repacked.group_gemm's arguments)."""
    vector_ir.need_isa("the tile kernel")

    def body(g, a):
        g.switch(a.kind, {k: (lambda k=k: group_tiles(g, a, k, ROWS_PER_TILE, _block)) for k in TILE_TYPES})
        return g.c.get_dummy_value()
    return types.none(kind, w, off, row_bytes, p32, pk, M, out, col, r0, r1), body


__all__ = ["TILE_TYPES", "ROWS_PER_TILE", "YMM_TILES", "tiles_take", "tile_gemm"]
