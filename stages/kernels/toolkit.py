"""What the numba kernel files share: compiler flags, ggml type ids, float16 scales, the
block readers every format's kernel calls, and a guard for numba's on-disk cache.

    FASTMATH        the floating-point liberties the kernels take (the simd stage's lesson)
    Q4_0 ... BF16   ggml type ids as plain ints (numba compiles them in as constants); TYPES_K
    BLOCK_BYTES, BLOCK_VALUES, block_bytes(kind), block_values(kind)
                    bytes and values of one block of each type (common/gguf.py's table, the one
                    definition), as dicts for IR and as compiled lookups for jitted code
    FIELDS          where each field of a block starts and ends, by name (common/quants.py's
                    BLOCK_DTYPES, the one definition): FIELDS[Q6_K]["scales"] == (192, 208)
    F16_TO_F32      every float16 bit pattern -> its float32 value: how a kernel reads a scale
    f32_from_bits(i)                 the float32 whose bits are int32 i (a bitcast, no conversion)
    read_f16(row, o, table), read_u32(row, o)    little-endian fields inside a block
    per_phase       njit for what a thread calls per phase or per work item: cached, no reference counts
    guard_cache     empty a module's cached kernels when a file they call into has changed
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from common.gguf import BLOCK_SIZES, GGMLType
from common.quants import BLOCK_DTYPES

# Reassociation (so a sum may be split across the lanes of a vector register), contraction
# into fused multiply-adds, and ignoring the sign of zero: what vectorizing a sum needs, and
# nothing more. NaN and Inf keep their meaning (no 'nnan', 'ninf').
FASTMATH = {"reassoc", "contract", "nsz"}


# per_phase: every function a thread of the layer stack (layer_stack.py) calls per phase or per
# work item, and the ones they call (sync.py, tiled_attention.py, layer_ops.py), compiles without
# numba's runtime (NRT), which counts the references to each array a function is given: an atomic
# add on entry and another on exit, on counters in the arrays' parents, which both threads share.
# A call that took the prefill stage's Prefill (two dozen arrays) beside the scratch paid some
# hundred atomic operations on cache lines the other core was writing too, a fixed cost per call
# that made prefill's decode step slower than repack's with the same kernels. These functions
# allocate nothing (where one would, the compiler refuses: "NRT required but not enabled"), so
# they need no counts.  @per_phase, or @per_phase(error_model="numpy", ...)
per_phase = partial(njit, cache=True, _nrt=False)


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen

F32, F16, BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0),
                                int(GGMLType.Q5_1), int(GGMLType.Q8_0))
Q4_K, Q5_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)
TYPES_K = (Q4_K, Q5_K, Q6_K)          # the K-quants: 256-value blocks, activations in Q8_K

BLOCK_VALUES = {int(t): v for t, (v, _) in BLOCK_SIZES.items()}
BLOCK_BYTES = {int(t): n for t, (_, n) in BLOCK_SIZES.items()}
FIELDS = {int(t): {name: (off, off + dt.fields[name][0].itemsize) for name, (_, off) in dt.fields.items()}
          for t, dt in BLOCK_DTYPES.items() if dt.fields}
# indexed by type id (a global array is a constant to numba)
_BLOCK_VALUES = np.zeros(max(BLOCK_VALUES) + 1, np.int64)
_BLOCK_BYTES = np.zeros(max(BLOCK_BYTES) + 1, np.int64)
for _t in BLOCK_VALUES:
    _BLOCK_VALUES[_t], _BLOCK_BYTES[_t] = BLOCK_VALUES[_t], BLOCK_BYTES[_t]

# numba has no float16: a field's two bytes index this 65536-entry table (exact, subnormals
# included), passed to the kernels as an argument rather than compiled in as a 256 KiB constant.
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, inline="always")
def block_bytes(kind):
    return _BLOCK_BYTES[kind]


@njit(cache=True, inline="always")
def block_values(kind):
    return _BLOCK_VALUES[kind]


@njit(cache=True, inline="always")
def read_f16(row, o, table):
    """The little-endian float16 at row[o:o+2] (a block's scale), as float32."""
    return table[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(cache=True, inline="always")
def read_u32(row, o):
    """The little-endian uint32 at row[o:o+4] (the Q5 formats' fifth bits), as int64."""
    return (np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16)
            | (np.int64(row[o + 3]) << 24))


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def guard_cache(module_name: str, kernels, depends_on):
    """numba's on-disk cache of a function records only the file the function is written in,
    so a cached kernel that inlined code from another file would not notice that file change.
    This keeps a digest of `depends_on` beside the cache (<module>.deps) and empties the cache
    of `kernels` when the digest differs."""
    caches = [getattr(k, "_cache", None) for k in kernels]
    caches = [c for c in caches if c is not None and hasattr(c, "_cache_path")]
    if not caches:
        return
    folder = Path(caches[0]._cache_path)
    stamp = folder / f"{module_name}.deps"
    digest = _digest(depends_on)
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for c in caches:
            c.flush()
        folder.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass                                 # a read-only cache folder: numba will not write either
