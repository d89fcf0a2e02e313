"""The assembly LLVM generated for a numba kernel, and what to look for in it: packed FMAs by
register width, scalar ones, and the hot loop."""

from __future__ import annotations

import re
from collections import Counter

from numba import njit


def kernel_asm(dispatcher, *args) -> str:
    """x86/ARM assembly of a numba kernel, compiled now with its own options: numba cannot show
    the assembly of a kernel it loaded from its on-disk cache."""
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    fn = njit(**options)(dispatcher.py_func)
    fn(*args)
    return "\n".join(fn.inspect_asm().values())


PACKED_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ps\b[^\n]*?%?([xyz]mm)\d+")
SCALAR_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ss\b")
SCALAR_MUL_ADD = re.compile(r"\bv?(?:mul|add)ss\b")


def fma_counts(asm: str) -> dict:
    """Float multiply-add instructions in x86 assembly: packed FMAs by register width (xmm 4,
    ymm 8, zmm 16 floats), scalar FMAs, and scalar multiplies and adds (one float each)."""
    packed = Counter(PACKED_FMA.findall(asm))
    return {"packed FMA, zmm (16 floats)": packed.get("zmm", 0), "packed FMA, ymm (8 floats)": packed.get("ymm", 0),
            "packed FMA, xmm (4 floats)": packed.get("xmm", 0), "scalar FMA": len(SCALAR_FMA.findall(asm)),
            "scalar mul / add": len(SCALAR_MUL_ADD.findall(asm))}


def hot_loop(asm: str, max_lines: int = 40, work: str | None = None) -> str:
    """The basic block with the most floating-point multiply-adds (packed or scalar, or plain
    multiplies and adds), or with the most instructions matching `work` (a regular expression,
    e.g. r"vpdpbusd|vpmaddubsw" for the integer kernels): the inner loop, in practice."""
    blocks, current = [], []
    for line in asm.splitlines():
        if re.match(r"^\.?L\w+:", line.strip()) and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    work = re.compile(work or r"\bv?(?:fn?m(?:add|sub)\d+|mul|add)[sp]s\b")
    best = max(blocks, key=lambda b: sum(bool(work.search(x)) for x in b))
    text = "\n".join(x for x in best if x.strip())
    lines = text.splitlines()
    return "\n".join(lines[:max_lines] + ([f"    ... ({len(lines) - max_lines} more lines)"]
                                          if len(lines) > max_lines else []))


def integer_kernel_asm(kind: int, kernel: str = "repacked", rows: int = 1) -> str:
    """The assembly of one integer matmul kernel for ggml type `kind`, compiled now: the repack
    stage's group kernel ("repacked"), the prefill stage's pair kernel ("pairs", AVX512-VNNI) or
    the fused stage's row kernel ("rows"), on `rows` activation rows."""
    import numpy as np

    from stages.kernels import int_tiles, pair_gemm, repacked
    from stages.kernels.q8 import new_packs
    from stages.kernels.toolkit import BLOCK_BYTES, BLOCK_VALUES

    if kernel == "pairs":
        @njit
        def run(kind, w, rb, nb, p32, pk, out):
            x32, xk = pair_gemm.new_pairs(out.shape[0], nb * 256)
            pair_gemm.pair_gemm(kind, w, 0, rb, x32, xk, 0, out.shape[0], out, 0, (0, out.shape[1]))
    elif kernel == "repacked":
        @njit
        def run(kind, w, rb, nb, p32, pk, out):
            repacked.group_gemm(kind, w, 0, rb, p32, pk, out.shape[0], out, 0, 0, out.shape[1])
    else:
        @njit
        def run(kind, w, rb, nb, p32, pk, out):
            int_tiles.decode_rows(kind, w, 0, rb, nb, p32, pk, 0, out, 0, out.shape[1])
    K = 256                                          # one block of every type
    nb = K // BLOCK_VALUES[kind]
    rb = nb * BLOCK_BYTES[kind]
    p32, pk = new_packs(rows, K)
    run(kind, np.zeros(8 * rb, np.uint8), rb, nb, p32, pk, np.zeros((rows, 8), np.float32))
    return "\n".join(run.inspect_asm().values())


def int8_row_kernels() -> dict:
    """{ggml type: kernel} for Q4_1 and Q4_K: matvec_int8_auto's loop without prange, one type
    each (a small function compiles in seconds; the parallel kernel holds every type and takes
    half a minute), to read the integer instructions LLVM chose. Each is called as
    (a, da, sa, sums, w, f16) with quantize_q8's row and the weight rows' bytes."""
    import numpy as np

    from common.gguf import GGMLType
    from stages.kernels.int_dot import _dot_q4_k, _dot_q4_x

    @njit
    def q4_1(a, da, sa, sums, w, f16):
        y = np.empty(w.shape[0], dtype=np.float32)
        for n in range(w.shape[0]):
            y[n] = _dot_q4_x(w[n], a, da, sa, sums, f16, 20, 0)
        return y

    @njit
    def q4_k(a, da, sa, sums, w, f16):
        y = np.empty(w.shape[0], dtype=np.float32)
        buf = np.empty(a.shape[0], dtype=np.int16)
        for n in range(w.shape[0]):
            y[n] = _dot_q4_k(w[n], a, da, sums, f16, buf, False)
        return y

    return {GGMLType.Q4_1: q4_1, GGMLType.Q4_K: q4_k}


# A kernel compiled for a CPU this one need not be (numba's NUMBA_CPU_NAME): the matrix unit's
# kernel for a Sapphire Rapids, in a process of its own (numba reads the target when it starts).
_AMX_ASM = """
import json, sys, numba
from numba import types
from stages.kernels import amx_tiles as A
from stages.kernels.q8 import new_packs
kind = int(sys.argv[1])
p32, pk = new_packs(4, 512)
arr = lambda dt, nd: types.Array(dt, nd, "C")
i64 = types.int64
sig = (types.literal(kind), arr(types.uint8, 1), i64, i64, numba.typeof(p32), numba.typeof(pk), i64, i64,
       arr(types.float32, 2), i64, types.UniTuple(i64, 2))
A._one_type.compile(sig)
print(A._one_type.inspect_asm(sig))
"""


def amx_kernel_asm(kind: int, cpu: str = "sapphirerapids") -> str:
    """The assembly of the amx stage's kernel for ggml type `kind`, compiled for `cpu` (never run
    here: it needs the unit only to run)."""
    import os
    import subprocess
    import sys
    import tempfile

    from notebooks.nb.settings import ROOT
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": cache,
               "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-c", _AMX_ASM, str(kind)], capture_output=True, text=True, env=env,
                           timeout=900)
    if p.returncode:
        raise RuntimeError(f"compiling the matrix unit's kernel for {cpu} failed:\n{p.stderr[-2000:]}")
    return p.stdout
