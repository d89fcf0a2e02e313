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
  i.e. the best FLOP/s this numba code reaches when memory is not in the way.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from common.cpu import physical_cores
from stages.kernels.toolkit import FASTMATH
from stages.simd import matmul_panels


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


def _best(fn, reps: int = 5) -> float:
    """Fastest of reps runs, in seconds: the ceiling is what the machine can do when left alone."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def measure(threads: int | None = None, size_mib: int = 512) -> dict:
    """{'bandwidth_gbs': {'1': .., 'N': ..}, 'peak_gflops': {...}} measured now."""
    threads = threads or physical_cores()
    a = np.ones(size_mib * 2**20 // 4, dtype=np.float32)
    # 16 rows x 64 outputs x 512: x is 32 KiB (L1), W 128 KiB (L2); each 4-row panel of W
    # (8 KiB) is reused by all 16 rows from L1. Smaller operands measure loop overhead instead.
    A = np.ones((16, 512), dtype=np.float32)
    W = np.ones((64, 512), dtype=np.float32)
    flops_one = 2 * 16 * 64 * 512
    reps = 2000
    out = {"bandwidth_gbs": {}, "peak_gflops": {}, "bandwidth_gbs_median": {}, "peak_gflops_median": {},
           "method": __doc__.strip().splitlines()[-3:]}
    best, med = _best(lambda: _sum(a))
    out["bandwidth_gbs"]["1"], out["bandwidth_gbs_median"]["1"] = a.nbytes / best / 1e9, a.nbytes / med / 1e9

    def peak1():
        for _ in range(reps):
            matmul_panels(A, W)
    best, med = _best(peak1, 5)
    out["peak_gflops"]["1"], out["peak_gflops_median"]["1"] = flops_one * reps / best / 1e9, \
        flops_one * reps / med / 1e9
    if threads > 1:
        old = get_num_threads()
        set_num_threads(threads)
        try:
            best, med = _best(lambda: _sum_parallel(a, threads * 8))
            out["bandwidth_gbs"][str(threads)] = a.nbytes / best / 1e9
            out["bandwidth_gbs_median"][str(threads)] = a.nbytes / med / 1e9
            best, med = _best(lambda: _peak_parallel(A, W, reps, threads), 5)
            out["peak_gflops"][str(threads)] = flops_one * reps * threads / best / 1e9
            out["peak_gflops_median"][str(threads)] = flops_one * reps * threads / med / 1e9
        finally:
            set_num_threads(old)
    return out
