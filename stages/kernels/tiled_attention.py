"""The prefill stage's attention: a tile of queries against blocks of keys (stages/prefill.py tells
the story).

The repack stage attends one query row and one head at a time (flash-decoding, layer_ops.py): in
a prompt of M rows every row reads and converts its K and V again, and each of the G query heads
that share a KV head reads them again. Here the queries that read the same keys are taken
together: the G heads of a KV head, for R consecutive rows of one sequence (a tile), in groups of
LANES query vectors, one per lane of a vector register:

    group g: lanes 0..7 = query vectors (row r, head j) in order i = r G + j   (i // 8 = g)
    for each chunk c of CHUNK positions, each block of BK keys in it (while a row of the tile can
    see it): K and V rows gathered through the page table and converted to float32 once (kv_rows),
    then for every group that can see the block (attend_block, LLVM IR through vector_ir.py):
        scores S[t] = q . k_t for the 8 lanes at once (8 dot products, summed by sums8; each
        walks hd 16 floats to a multiply-add where the CPU has 512-bit registers, 8 otherwise)
        masked where the key is after the lane's own position (the causal mask), then an online
        softmax update lane by lane: m' = max(m, max_t S), P = exp(S - m'), l = l e^(m - m') + sum P
        o = o e^(m - m') + sum_t P[t] v_t          (16 or 8 float32 values of v per multiply-add)
    at the end of each chunk its (m, l, o) merged into the row's running result (merge_state),
    in chunk order; at the end, o / l.

Blocks after every position of a group are skipped (the causal tiles), and a tile's K and V are
read once for all its R G query vectors. So are the lanes a group does not fill: a decode row of
a model with G = 3 query heads per KV head (SmolLM2) fills 3 of the 8, and its blocks compute 4
dot products and 2 pairs of weighted sums, not 8 and 4. A row alone (decode) is a tile of one
row: its chunks go to different threads (flash-decoding's split), each chunk's (m, l, o) stored,
then merged in order by the same merge_state: one row's lanes see the same operations in the same
order whether it came alone, in a tile, or beside other sequences (a masked key adds an exact
zero; a group skipped is the same as a block all masked; a lane's sums do not read the other
lanes), so its bits do not depend on its neighbours.

    attend_rows(y, m0, n_rows, kvh, c0, c1, il, cache, rows, dims, w)   rows m0.. of one sequence,
                     heads of KV head kvh, chunks c0..c1-1 -> w.m, w.l, w.o (per group and lane)
    merge_parts(w, pm, pl, po, n_chunks, groups, hd)     a row's stored chunks, merged in order
    finish_rows(w, m0, n_rows, kvh, G, hd, out)                          out[row, head] = o / l
    Workspace / workspace(nt, groups, hd)                                one thread's arrays
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, types

from stages.kernels import vector_ir
from stages.kernels.layer_ops import CHUNK
from stages.kernels.toolkit import per_phase
from stages.kernels.vector_ir import F8, FLOAT, FZ, I64, vector_intrinsic

LANES = 8               # query vectors per group: one lane each of an 8-float register
BK = 32                 # keys per block: K and V as float32 [BK, hd] stay in L1 (16 KiB at hd 64)
_V8 = ir.VectorType(I64, 8)

# One thread's arrays (g: groups of a tile): qs [g, 8, hd] the scaled queries, pos [g, 8] each
# lane's position (-1: an unused lane), kf / vf [BK, hd] a block's K and V in float32, st [BK, 8]
# its scores then probabilities; m, l [g, 8] and o [g, 8, hd] the running result, mc, lc, oc a
# chunk's.
Workspace = namedtuple("Workspace", "qs pos kf vf st m l o mc lc oc")


def workspace(nt: int, groups: int, hd: int) -> Workspace:
    """Every thread's arrays (leading axis: the thread)."""
    f = lambda *shape: np.zeros((nt, *shape), np.float32)
    return Workspace(f(groups, LANES, hd), np.zeros((nt, groups, LANES), np.int64), f(BK, hd), f(BK, hd),
                     f(BK, LANES), f(groups, LANES), f(groups, LANES), f(groups, LANES, hd),
                     f(groups, LANES), f(groups, LANES), f(groups, LANES, hd))


# ---- the block: 8 query vectors against up to BK keys (LLVM IR) --------------------------------

def _dims(g, a):
    """How a row of hd floats is walked: (n wide vectors, their type, the 8-float vectors after
    them, or None). Where the CPU has 512-bit registers (vector_ir.ZMM) a row is 16 floats to a
    vector (hd / 16 of them, an 8-float one for the rest), else 8 to a vector (no rest)."""
    b = g.b
    if vector_ir.ZMM:
        return b.udiv(a.hd, g.const(16)), FZ, b.udiv(b.urem(a.hd, g.const(16)), g.const(8))
    return b.udiv(a.hd, g.const(8)), F8, None


def _halves(g, v):
    """A 16-float vector's halves added: 8 floats (an 8-float one as it is)."""
    if v.type.count == 8:
        return v
    return g.b.fadd(g.shuffle(v, v, range(8)), g.shuffle(v, v, range(8, 16)))


def _lanes_in_use(g, a):
    """1 + the last lane with a position (>= 0), as an int64: 8 - the leading zeros of the 8-bit
    mask of lanes in use (_start fills a group's lanes from the first)."""
    b = g.b
    used = b.icmp_signed(">=", g.load(a.pos, g.const(0), _V8), ir.Constant(_V8, None))
    mask = b.bitcast(used, ir.IntType(8))
    zeros = g.call("llvm.ctlz.i8", ir.IntType(8), mask, ir.Constant(ir.IntType(1), 0))
    return b.sub(g.const(LANES), b.zext(zeros, I64))


def _scores(g, a, row):
    """st[t] = the 8 lanes' q . k_t, masked (-inf) where t0 + t is after the lane's position. A
    group with at most 4 lanes in use (a decode row of a model with G <= 4 query heads per KV
    head) computes 4 dot products, not 8; lanes 4..7 sum to 0 and are masked."""
    with g.b.if_else(g.b.icmp_unsigned("<=", a.lanes, g.const(4))) as (few, every):
        with few:
            _scores_of(g, a, row, 4)
        with every:
            _scores_of(g, a, row, LANES)


def _scores_of(g, a, row, used):
    """_scores with lanes 0..used-1 computed: each lane's dot product and its place in sums8's
    tree are the same whatever the other lanes hold, so a lane's score has the same bits in a
    group of 4 lanes as in one of 8."""
    b = g.b
    wide, ty, rest = _dims(g, a)
    step = 4 * ty.count
    accs = [g.slot(ty) for _ in range(used)]
    tails = [g.slot(F8) for _ in range(used)] if rest is not None else []
    pos = g.load(a.pos, g.const(0), _V8)
    neg_inf = g.splat_const(F8, float("-inf"))
    with g.loop(a.n) as t:
        for acc in accs:
            b.store(ir.Constant(ty, None), acc)
        for tail in tails:
            b.store(ir.Constant(F8, None), tail)
        with g.loop(wide) as dv:
            k = g.load(a.kf, b.add(b.mul(t, row), b.mul(dv, g.const(step))), ty)
            for j, acc in enumerate(accs):
                q = g.load(a.qs, b.add(b.mul(g.const(j), row), b.mul(dv, g.const(step))), ty)
                b.store(g.fma(q, k, b.load(acc)), acc)
        dots = [_halves(g, b.load(acc)) for acc in accs]
        if tails:                                                # hd not a multiple of the wide vector
            with g.loop(rest) as dv:
                at = b.add(b.mul(wide, g.const(step)), b.mul(dv, g.const(32)))
                k = g.load(a.kf, b.add(b.mul(t, row), at), F8)
                for j, tail in enumerate(tails):
                    q = g.load(a.qs, b.add(b.mul(g.const(j), row), at), F8)
                    b.store(g.fma(q, k, b.load(tail)), tail)
            dots = [b.fadd(d, b.load(tail)) for d, tail in zip(dots, tails)]
        s = g.sums8(dots + [ir.Constant(F8, None)] * (LANES - used))
        after = b.icmp_signed(">", g.splat(_V8, b.add(a.t0, t)), pos)
        g.store(a.st, b.mul(t, g.const(32)), b.select(after, neg_inf, s))


def _softmax(g, a):
    """The online softmax update of m and l over the block's scores; st[t] becomes P[t]. Returns
    alpha = e^(m_old - m_new) per lane (0 where nothing was seen yet)."""
    b = g.b
    neg_inf = g.splat_const(F8, float("-inf"))
    zero = ir.Constant(F8, None)
    top = g.slot(F8, neg_inf)
    with g.loop(a.n) as t:
        b.store(g.fmax(b.load(top), g.load(a.st, b.mul(t, g.const(32)), F8)), top)
    m_old = g.load(a.m, g.const(0), F8)
    m_new = g.fmax(m_old, b.load(top))
    alpha = b.select(b.fcmp_ordered("==", m_old, neg_inf), zero, g.exp(b.fsub(m_old, m_new)))
    total = g.slot(F8)
    with g.loop(a.n) as t:
        s = g.load(a.st, b.mul(t, g.const(32)), F8)
        p = b.select(b.fcmp_ordered("==", s, neg_inf), zero, g.exp(b.fsub(s, m_new)))
        g.store(a.st, b.mul(t, g.const(32)), p)
        b.store(b.fadd(b.load(total), p), total)
    g.store(a.l, g.const(0), b.fadd(b.fmul(g.load(a.l, g.const(0), F8), alpha), b.load(total)))
    g.store(a.m, g.const(0), m_new)
    return alpha


def _weighted_sum(g, a, row, alpha):
    """o[j] = o[j] alpha[j] + sum_t P[t, j] v_t, two lanes and 4 vectors of v per pass (8 sums in
    flight, each v loaded once for both lanes), then one vector at a time."""
    b = g.b
    wide, ty, rest = _dims(g, a)
    step = 4 * ty.count
    for j0 in range(0, LANES, 2):
        with b.if_then(b.icmp_unsigned("<", g.const(j0), a.lanes)):       # lanes not in use: o stays 0
            _weighted_pair(g, a, row, alpha, (j0, j0 + 1), wide, ty, rest, step)


def _weighted_pair(g, a, row, alpha, lanes, wide, ty, rest, step):
    """_weighted_sum for two lanes."""
    b = g.b
    scale = {j: b.extract_element(alpha, ir.Constant(ir.IntType(32), j)) for j in lanes}

    def span(at0, width, ty):
        offs = [b.add(at0, g.const(4 * ty.count * w)) for w in range(width)]
        at = {j: [b.add(b.mul(g.const(j), row), o) for o in offs] for j in lanes}
        acc = {j: [g.slot(ty, b.fmul(g.load(a.o, o, ty), g.splat(ty, scale[j]))) for o in at[j]] for j in lanes}
        with g.loop(a.n) as t:
            p = {j: g.splat(ty, g.load(a.st, b.add(b.mul(t, g.const(32)), g.const(4 * j)), FLOAT)) for j in lanes}
            for w in range(width):
                v = g.load(a.vf, b.add(b.mul(t, row), offs[w]), ty)
                for j in lanes:
                    b.store(g.fma(p[j], v, b.load(acc[j][w])), acc[j][w])
        for j in lanes:
            for o, slot in zip(at[j], acc[j]):
                g.store(a.o, o, b.load(slot))

    with g.loop(b.udiv(wide, g.const(4))) as d4:
        span(b.mul(d4, g.const(4 * step)), 4, ty)
    with g.loop(b.urem(wide, g.const(4))) as d1:
        span(b.mul(b.add(b.mul(b.udiv(wide, g.const(4)), g.const(4)), d1), g.const(step)), 1, ty)
    if rest is not None:
        with g.loop(rest) as d1:
            span(b.add(b.mul(wide, g.const(step)), b.mul(d1, g.const(32))), 1, F8)


@vector_intrinsic
def attend_block(typingctx, qs, kf, vf, n, t0, hd, pos, st, m, l, o):
    """One group of 8 query vectors qs [8, hd] against the block's first n keys (kf, vf [BK, hd],
    positions t0..): the group's running m, l [8], o [8, hd] updated (see the module docstring).
    The lanes after the last one with a position (>= 0) hold no query: their sums are skipped."""
    vector_ir.need_isa("the tiled attention")

    def body(g, a):
        row = g.b.mul(a.hd, g.const(4))
        a.lanes = _lanes_in_use(g, a)
        _scores(g, a, row)
        _weighted_sum(g, a, row, _softmax(g, a))
        return g.c.get_dummy_value()
    return types.none(qs, kf, vf, n, t0, hd, pos, st, m, l, o), body


@vector_intrinsic
def merge_state(typingctx, m, l, o, mc, lc, oc, hd):
    """A chunk's (mc, lc, oc) into the running (m, l, o), lane by lane: the larger max, each side
    scaled by e^(its max - the larger), an empty side (max -inf) adding nothing."""
    vector_ir.need_isa("the tiled attention")

    def body(g, a):
        b = g.b
        neg_inf = g.splat_const(F8, float("-inf"))
        zero = ir.Constant(F8, None)
        m0, m1 = g.load(a.m, g.const(0), F8), g.load(a.mc, g.const(0), F8)
        top = g.fmax(m0, m1)
        w0 = b.select(b.fcmp_ordered("==", m0, neg_inf), zero, g.exp(b.fsub(m0, top)))
        w1 = b.select(b.fcmp_ordered("==", m1, neg_inf), zero, g.exp(b.fsub(m1, top)))
        l = b.fadd(b.fmul(g.load(a.l, g.const(0), F8), w0), b.fmul(g.load(a.lc, g.const(0), F8), w1))
        g.store(a.l, g.const(0), l)
        g.store(a.m, g.const(0), top)
        row = b.mul(a.hd, g.const(4))
        for j in range(LANES):
            i32 = ir.Constant(ir.IntType(32), j)
            a0, a1 = g.splat(F8, b.extract_element(w0, i32)), g.splat(F8, b.extract_element(w1, i32))
            with g.loop(b.udiv(a.hd, g.const(8))) as dv:
                at = b.add(b.mul(g.const(j), row), b.mul(dv, g.const(32)))
                g.store(a.o, at, b.fadd(b.fmul(g.load(a.o, at, F8), a0), b.fmul(g.load(a.oc, at, F8), a1)))
        return g.c.get_dummy_value()
    return types.none(m, l, o, mc, lc, oc, hd), body


@vector_intrinsic
def row_f32(typingctx, src, s, dst, d, n):
    """dst.flat[d .. d + n - 1] = src.flat[s .. s + n - 1] as float32, 8 values at a time (n a
    multiple of 8; both arrays contiguous): float16 bits through vcvtph2ps, float32 copied."""
    if not all(isinstance(x, types.Array) and x.layout == "C" for x in (src, dst)) or dst.dtype != types.float32:
        return None
    half = src.dtype == types.uint16

    def body(g, a):
        b = g.b
        with g.loop(b.udiv(a.n, g.const(8))) as i:
            at = b.mul(b.add(a.s, b.mul(i, g.const(8))), g.const(2 if half else 4))      # bytes
            v = g.halves(a.src, at) if half else g.load(a.src, at, F8)
            g.store(a.dst, b.mul(b.add(a.d, b.mul(i, g.const(8))), g.const(4)), v)
        return g.c.get_dummy_value()
    return types.none(src, s, dst, d, n), body


# ---- the rows: numba around the blocks ---------------------------------------------------------

# error_model="numpy" on the loops below: without it numba checks every divisor for zero, and a
# loop with a check LLVM cannot vectorize. kv_rows converts each row with row_f32: left to LLVM,
# each row of hd values was a vectorized loop behind a run-time test of overlap between the two
# arrays, with a scalar remainder, which cost more than the conversion itself.
@per_phase(error_model="numpy")
def kv_rows(src, table, page_size, lo, hd, t0, n, dst):
    """dst[t] = float32 of columns lo..lo+hd of the cache row holding position t0 + t, t < n; a
    page's run of positions at a time (one division per page, not two per position)."""
    t = 0
    while t < n:
        page, first = (t0 + t) // page_size, (t0 + t) % page_size
        run = min(page_size - first, n - t)
        slot = table[page] * page_size + first
        for i in range(run):
            row_f32(src, (slot + i) * src.shape[1] + lo, dst, (t + i) * dst.shape[1], hd)
        t += run


@per_phase(error_model="numpy")
def _start(y, m0, n_rows, kvh, rows, dims, hd, w):
    """The tile's queries into w.qs (times the softmax scale), lane positions, empty running
    results; returns (groups, the last position any row sees)."""
    G = dims.n_head // dims.n_head_kv
    n_q = n_rows * G
    groups = (n_q + LANES - 1) // LANES
    last = -1
    for i in range(groups * LANES):
        g, lane = i // LANES, i % LANES
        if i < n_q:
            m, j = m0 + i // G, i % G
            col = (kvh * G + j) * hd
            for d in range(hd):
                w.qs[g, lane, d] = y[m, col + d] * dims.scale
            w.pos[g, lane] = rows.positions[m]
            last = max(last, rows.positions[m])
        else:
            w.qs[g, lane, :] = 0.0
            w.pos[g, lane] = -1
        w.m[g, lane] = -np.inf
        w.l[g, lane] = 0.0
        w.o[g, lane, :] = 0.0
    return groups, last


@njit(cache=True, inline="always")
def _latest(pos):
    """The largest of a group's positions (a loop: an array method needs numba's runtime, NRT)."""
    top = pos[0]
    for i in range(1, pos.shape[0]):
        top = max(top, pos[i])
    return top


@per_phase
def attend_rows(y, m0, n_rows, kvh, c0, c1, il, cache, rows, dims, w):
    """Rows m0 .. m0 + n_rows - 1 (one sequence, queries in y) for the query heads of KV head kvh,
    over chunks c0 .. c1 - 1 of their positions: the merged result in w.m, w.l, w.o."""
    hd = cache.k.shape[2] // dims.n_head_kv
    groups, last = _start(y, m0, n_rows, kvh, rows, dims, hd, w)
    table = cache.tables[rows.seq[m0]]
    kc, vc, lo = cache.k[il], cache.v[il], kvh * hd
    for c in range(c0, c1):
        w.mc[:groups] = -np.inf
        w.lc[:groups] = 0.0
        w.oc[:groups] = 0.0
        end = min((c + 1) * CHUNK, last + 1)
        for t0 in range(c * CHUNK, end, BK):
            n = min(BK, end - t0)
            kv_rows(kc, table, cache.page_size, lo, hd, t0, n, w.kf)
            kv_rows(vc, table, cache.page_size, lo, hd, t0, n, w.vf)
            for g in range(groups):
                if _latest(w.pos[g]) >= t0:              # else every key is after every lane: skipped
                    attend_block(w.qs[g], w.kf, w.vf, n, t0, hd, w.pos[g], w.st, w.mc[g], w.lc[g], w.oc[g])
        for g in range(groups):
            merge_state(w.m[g], w.l[g], w.o[g], w.mc[g], w.lc[g], w.oc[g], hd)


@per_phase
def merge_parts(w, pm, pl, po, n_chunks, groups, hd):
    """w's running result = the chunks' stored results pm, pl [c, groups, 8], po [c, groups, 8, hd]
    merged in chunk order (a row alone: its chunks came from attend_rows over one chunk each)."""
    for g in range(groups):
        w.m[g] = -np.inf
        w.l[g] = 0.0
        w.o[g] = 0.0
        for c in range(n_chunks):
            merge_state(w.m[g], w.l[g], w.o[g], pm[c, g], pl[c, g], po[c, g], hd)


@per_phase(error_model="numpy")
def finish_rows(w, m0, n_rows, kvh, G, hd, out):
    """out[row, columns of head (kvh G + j)] = o / l for the rows' lanes."""
    for i in range(n_rows * G):
        g, lane = i // LANES, i % LANES
        m, col = m0 + i // G, (kvh * G + i % G) * hd
        total, o, dst = w.l[g, lane], w.o[g, lane], out[m, col:col + hd]
        for d in range(hd):
            dst[d] = o[d] / total


__all__ = ["LANES", "BK", "Workspace", "workspace", "attend_rows", "merge_parts", "finish_rows", "merge_state",
           "attend_block"]
