"""The machine's two ceilings, measured: memory bandwidth and peak FLOP/s.

A kernel that does F floating-point operations while moving B bytes from memory has an
arithmetic intensity of F/B FLOP per byte. It can run no faster than

    min(peak FLOP/s, intensity x bandwidth)

so a plot of achieved FLOP/s against intensity (log-log) shows two lines meeting at the
ridge point, and where each stage sits tells whether it is limited by arithmetic or by
memory traffic. Decode reads every weight once per token for ~2 FLOP per weight: with
float32 weights that is 0.5 FLOP/byte, deep in the memory-bound region on any CPU.

Both ceilings are measured here with small numba kernels, single-threaded and on all cores:
- bandwidth: summing a 512 MiB float32 array (far larger than any cache), vectorized;
- peak: a register-blocked matmul (the simd stage's 4x4 kernel) on data that stays in L1/L2,
  i.e. the best FLOP/s this numba code reaches when memory is not in the way;
- integer peak: the dot-product instruction the prefill stage's matmuls use on this CPU, back to
  back on registers (vpdpbusd on 512-bit registers with AVX512-VNNI, on 256-bit ones with
  AVX-VNNI; vpmaddubsw + vpmaddwd + vpaddd with AVX2 alone): 2 integer ops per multiply-add. The
  int8 stages' FLOP are these integer ops, so it is their ceiling, and `make report` says what
  share of it the prefill stage's prompt reaches (prefill_int_share);
- the matrix unit's peak, where the CPU has one (AMX): TDPBSSD back to back on tiles, 32,768
  integer ops an instruction (amx_peak_gops; absent from the record elsewhere).

Where a stage sits on it: by default its intensity counts the fewest bytes a forward pass can
read (every weight once, plus the KV cache). The textbook loop orders of naive and tiling read
much more where a matrix does not fit the last-level cache: `traffic()` models the bytes their
loop order brings from memory (from the matrix shapes and this machine's L2 and L3 sizes), and
the chart places them by that model, labelled "modelled".
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, parallel_chunksize, prange, set_num_threads, types

from common.cpu import cache_sizes, physical_cores
from stages.kernels import amx_tiles, vector_ir
from stages.kernels.toolkit import FASTMATH
from stages.kernels.vector_ir import B32, B64, D8, D16, I32, vector_intrinsic
from stages.simd import matmul_panels
from stages.tiling import TILE_I

CACHE_LINE = 64
METHOD = ["- bandwidth: summing a 512 MiB float32 array (far larger than any cache), vectorized;",
          "- peak: a register-blocked matmul (the simd stage's 4x4 kernel) on data that stays in L1/L2,",
          "  i.e. the best FLOP/s this numba code reaches when memory is not in the way;",
          "- integer peak: the prefill stage's dot-product instruction back to back on registers",
          "  (int_instruction), 2 ops per multiply-add."]
INT_CHAINS = 12          # independent accumulators: more than the instruction's latency times its issue rate


@njit(cache=True, fastmath=FASTMATH)
def _sum(a):
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def _sum_parallel(a, n_chunks):
    """The same vectorized sum, each thread on its own contiguous chunks. (Written as a scalar
    loop inside the prange body, the sum was not vectorized: it measured the loop, not memory.)"""
    chunk = a.shape[0] // n_chunks
    partial = np.zeros(n_chunks, dtype=np.float32)
    for c in prange(n_chunks):
        partial[c] = _sum(a[c * chunk:(c + 1) * chunk])
    return partial.sum()


@njit(cache=True, parallel=True)
def _peak_parallel(A, W, reps, n_threads):
    out = np.zeros(n_threads, dtype=np.float32)
    for t in prange(n_threads):
        acc = np.float32(0.0)
        for _ in range(reps):
            acc += matmul_panels(A, W)[0, 0]
        out[t] = acc
    return out


def int_instruction() -> str | None:
    """The dot-product instruction the prefill stage's matmuls use here (vector_ir's ISA), or None."""
    if vector_ir.ISA is None:
        return None
    if vector_ir.ISA == "avx2":
        return "vpmaddubsw + vpmaddwd + vpaddd (ymm)"
    return "vpdpbusd (zmm)" if vector_ir.ZMM else "vpdpbusd (ymm)"


@vector_intrinsic
def _int_dots(typingctx, reps):
    """reps rounds of INT_CHAINS dot products (Emit.dpbusd: 4 byte products per int32 lane) on
    registers as wide as the prefill stage's; returns a lane of their sum (so none is dropped)."""
    vector_ir.need_isa("the integer peak")

    def body(g, a):
        b = g.b
        acc_ty, byte_ty = (D16, B64) if vector_ir.ZMM else (D8, B32)
        accs = [g.slot(acc_ty, g.splat_const(acc_ty, i)) for i in range(INT_CHAINS)]
        u = g.slot(acc_ty, g.splat_const(acc_ty, 0x01020304))
        # each chain its own signed bytes: were they the same for all, the AVX2 form's products
        # (vpmaddubsw, vpmaddwd) would be one common subexpression, computed once a round and
        # added to every chain, and the loop would time vpaddd
        ss = [b.bitcast(g.splat_const(acc_ty, 0x05FB07F9 + c), byte_ty) for c in range(INT_CHAINS)]
        with g.loop(a.reps) as i:
            uu = b.add(b.load(u), g.splat(acc_ty, b.trunc(i, I32)))      # a new operand each round
            b.store(uu, u)
            for acc, s in zip(accs, ss):
                b.store(g.dpbusd(b.load(acc), b.bitcast(uu, byte_ty), s), acc)
        total = b.load(accs[0])
        for acc in accs[1:]:
            total = b.add(total, b.load(acc))
        return b.sext(b.extract_element(total, ir.Constant(I32, 0)), ir.IntType(64))
    return types.int64(reps), body


@njit(cache=True)
def _int_peak_one(reps):
    return _int_dots(reps)


@njit(cache=True, parallel=True)
def _int_peak_parallel(reps, n_threads):
    out = np.zeros(n_threads, dtype=np.int64)
    for t in prange(n_threads):
        out[t] = _int_dots(reps)
    return out


@njit(cache=True)
def _amx_peak_one(reps, buf):
    amx_tiles.tile_products(reps, buf)


@njit(cache=True, parallel=True)
def _amx_peak_parallel(reps, bufs):
    for t in prange(bufs.shape[0]):
        amx_tiles.tile_products(reps, bufs[t])


def amx_peak_gops(threads: int = 1, reps: int = 20_000) -> tuple[float, float]:
    """(best, median) integer Gop/s of the matrix unit's TDPBSSD back to back on tiles (amx_tiles.
    tile_products), on that many threads, 2 ops per multiply-add. Only where the amx stage runs
    (the CPU has the unit and Linux granted this process its tiles): elsewhere a tile instruction
    kills the process."""
    from stages import unavailable_reason
    why = unavailable_reason("amx")
    if why:
        raise RuntimeError(f"no matrix unit to measure: {why}")
    ops = 2 * 16 * 16 * 64 * amx_tiles.PEAK_CHAINS * amx_tiles.PEAK_DEPTH * reps * threads
    bufs = np.zeros((threads, 3 * 1024), np.uint8)
    best, med = _best_on(threads, lambda: _amx_peak_one(reps, bufs[0]), lambda: _amx_peak_parallel(reps, bufs))
    return ops / best / 1e9, ops / med / 1e9


def int_peak_gops(threads: int = 1, reps: int = 2_000_000) -> tuple[float, float]:
    """(best, median) integer Gop/s of int_instruction() on that many threads, 2 ops per multiply-add."""
    lanes = 16 if vector_ir.ZMM else 8
    ops = 2 * 4 * lanes * INT_CHAINS * reps * threads
    best, med = _best_on(threads, lambda: _int_peak_one(reps), lambda: _int_peak_parallel(reps, threads))
    return ops / best / 1e9, ops / med / 1e9


def _best(fn, reps: int = 5) -> tuple[float, float]:
    """(fastest, median) of reps runs, in seconds: the ceiling is what the machine can do when
    left alone."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _best_on(threads: int, one, parallel, reps: int = 5) -> tuple[float, float]:
    """_best of `one` on one thread, or of `parallel` with numba's pool at `threads` (set back after)."""
    if threads == 1:
        return _best(one, reps)
    old = get_num_threads()
    set_num_threads(threads)
    try:
        return _best(parallel, reps)
    finally:
        set_num_threads(old)


def bandwidth_gbs(a: np.ndarray, threads: int = 1, reps: int = 5) -> tuple[float, float]:
    """(best, median) GB/s of summing `a` on that many threads: eight contiguous chunks per
    thread, each taken by whichever thread is free."""
    # chunks handed out one at a time as threads come free, not split up front: a thread that
    # loses its core for a while (another process) leaves its chunks to the others
    with parallel_chunksize(1):
        best, med = _best_on(threads, lambda: _sum(a), lambda: _sum_parallel(a, threads * 8), reps)
    return a.nbytes / best / 1e9, a.nbytes / med / 1e9


def measure(threads: int | None = None, size_mib: int = 512) -> dict:
    """{'bandwidth_gbs': {'1': .., 'N': ..}, 'peak_gflops': {...}, 'int_peak_gops': {...}} measured now
    (int_peak_gops empty, int_instruction None, on a CPU without AVX2)."""
    threads = threads or physical_cores()
    a = np.ones(size_mib * 2**20 // 4, dtype=np.float32)
    # 16 rows x 64 outputs x 512: x is 32 KiB (L1), W 128 KiB (L2); each 4-row panel of W
    # (8 KiB) is reused by all 16 rows from L1. Smaller operands measure loop overhead instead.
    A = np.ones((16, 512), dtype=np.float32)
    W = np.ones((64, 512), dtype=np.float32)
    flops_one = 2 * 16 * 64 * 512
    reps = 2000
    out = {"bandwidth_gbs": {}, "peak_gflops": {}, "bandwidth_gbs_median": {}, "peak_gflops_median": {},
           "int_peak_gops": {}, "int_peak_gops_median": {}, "int_instruction": int_instruction(), "method": METHOD}
    if out["int_instruction"]:
        for t in sorted({1, threads}):
            out["int_peak_gops"][str(t)], out["int_peak_gops_median"][str(t)] = int_peak_gops(t)
    from stages import unavailable_reason
    if unavailable_reason("amx") is None:                  # the matrix unit, where there is one
        out["amx_peak_gops"] = {str(t): amx_peak_gops(t)[0] for t in sorted({1, threads})}

    def peak1():
        for _ in range(reps):
            matmul_panels(A, W)
    for t in sorted({1, threads}):
        out["bandwidth_gbs"][str(t)], out["bandwidth_gbs_median"][str(t)] = bandwidth_gbs(a, t)
        best, med = _best_on(t, peak1, lambda: _peak_parallel(A, W, reps, t))
        out["peak_gflops"][str(t)] = flops_one * reps * t / best / 1e9
        out["peak_gflops_median"][str(t)] = flops_one * reps * t / med / 1e9
    return out


# ---- the bytes a loop order really moves ------------------------------------------------------

def matrix_shapes(cfg) -> list[tuple[int, int, int]]:
    """(K inputs, N outputs, rows it multiplies: 'all' = -1 or 'last' = 1) of every matrix of a
    forward pass: the layers' seven, each on every row, and the output matrix on the last row
    only (a greedy step needs one row of logits)."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_dim
    per_layer = [(cfg.n_embd, q), (cfg.n_embd, kv), (cfg.n_embd, kv), (q, cfg.n_embd),
                 (cfg.n_embd, cfg.n_ff), (cfg.n_embd, cfg.n_ff), (cfg.n_ff, cfg.n_embd)]
    return [(k, n, -1) for k, n in per_layer * cfg.n_layer] + [(cfg.n_embd, cfg.n_vocab, 1)]


def loop_order_bytes(stage: str, k: int, n: int, rows: int, caches: dict) -> int | None:
    """Bytes of a float32 [K, N] matrix brought from memory to multiply `rows` rows by it in the
    stage's loop order; None for a stage without a model here (it reads each weight once).

    naive (i, j, k): each row walks every column of B, K cache lines apart. The 16 columns of a
    line reuse it only while the K lines of one walk stay in L2; and the next row finds B in the
    last-level cache only if all of it fits there. Else every row reads B from memory again.
    tiling (i0, j0, k0 blocks): a 64 x 64 tile of B is reused by TILE_I rows from L1, so B is
    read once per TILE_I rows when it does not fit the last-level cache."""
    if stage not in ("naive", "tiling"):
        return None
    nbytes = 4 * k * n
    llc = caches.get("L3") or caches.get("L2") or 0
    passes = 1 if nbytes <= llc else (rows if stage == "naive" else math.ceil(rows / TILE_I))
    per_pass = nbytes
    if stage == "naive" and k * CACHE_LINE > caches.get("L2", 0):
        per_pass = nbytes * (CACHE_LINE // 4)               # each line fetched once per column
    return passes * per_pass


def traffic(stage: str, cfg, prefill_rows: int, decode_rows: int, caches: dict | None = None) -> dict | None:
    """The modelled memory traffic of a prefill and a decode step, for the roofline; None for a
    stage that reads each weight once (the chart then counts the minimum bytes)."""
    caches = cache_sizes() if caches is None else caches
    if loop_order_bytes(stage, 1, 1, 1, caches) is None:
        return None

    def one_pass(rows: int) -> int:
        return sum(loop_order_bytes(stage, k, n, rows if r < 0 else r, caches) for k, n, r in matrix_shapes(cfg))

    return {"method": "modelled", "prefill_bytes": one_pass(prefill_rows), "decode_bytes": one_pass(decode_rows),
            "caches": {k: v for k, v in caches.items() if k in ("L2", "L3")},
            "model": " ".join(loop_order_bytes.__doc__.split("\n\n")[1].split())}
