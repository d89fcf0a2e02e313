"""A rank's slices of the model file, and nothing more of it.

The quantized stages read a weight through a view into one mapping of the whole file, and the
OS makes resident only the pages a process reads. A rank could do the same, but the kernel maps
pages around each one touched (fault-around) and a slice's neighbours would creep into its
resident memory; so each slice gets a mapping of its own, and only those bytes (rounded out to
whole pages) are ever in the rank's address space:

    map_rows(path, t, r0, r1)       rows r0..r1 of t: contiguous in the file, mapped, nothing copied
    copy_columns(path, t, c0, c1)   columns c0..c1 of every row (a row-parallel slice): strided in
                                    the file, so read once with pread into a private array of
                                    exactly the slice (the whole matrix passes through the page
                                    cache, never through this process's mappings)

Both return a TensorInfo of the slice, which the stage tp builds on prepares as it would any
weight (QuantMatrix for the fused stage: nothing is written to, as with the file's own pages).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from common.gguf import BLOCK_SIZES, GGMLType, TensorInfo

READ_CHUNK = 4 << 20      # bytes of whole rows read per pread while copying a column slice


def _row_bytes(t: TensorInfo) -> int:
    return t.nbytes // (t.n_elements // t.shape[-1])


def map_rows(path, t: TensorInfo, r0: int, r1: int) -> TensorInfo:
    """Rows r0..r1 of a 2-D tensor, as a read-only view of a mapping of just those bytes."""
    rb = _row_bytes(t)
    start, length = t.offset + r0 * rb, (r1 - r0) * rb
    lead = start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), lead + length, access=mmap.ACCESS_READ, offset=start - lead)
    data = np.frombuffer(m, dtype=np.uint8, count=length, offset=lead)     # keeps the mapping alive
    return TensorInfo(t.name, (r1 - r0, *t.shape[1:]), t.ggml_type, start, length, data)


def copy_columns(path, t: TensorInfo, c0: int, c1: int) -> TensorInfo:
    """Columns c0..c1 of every row of a 2-D tensor, copied; c0 and c1 must fall between blocks."""
    values, size = BLOCK_SIZES[GGMLType(t.ggml_type)]
    if c0 % values or c1 % values:
        raise ValueError(f"{t.name}: columns {c0}..{c1} cut a {GGMLType(t.ggml_type).name} block of {values}")
    n_rows, rb = t.shape[0], _row_bytes(t)
    b0, b1 = c0 // values * size, c1 // values * size                     # the slice's bytes in a row
    out = np.empty((n_rows, b1 - b0), dtype=np.uint8)
    per = max(1, READ_CHUNK // rb)
    fd = os.open(path, os.O_RDONLY)
    try:
        for r in range(0, n_rows, per):
            n = min(per, n_rows - r)
            raw = os.pread(fd, n * rb, t.offset + r * rb)
            if len(raw) != n * rb:
                raise OSError(f"{path}: {t.name} ends before its last row (the file is truncated)")
            out[r:r + n] = np.frombuffer(raw, dtype=np.uint8).reshape(n, rb)[:, b0:b1]
    finally:
        os.close(fd)
    out.flags.writeable = False
    return TensorInfo(t.name, (n_rows, c1 - c0), t.ggml_type, t.offset, out.nbytes, out.reshape(-1))
