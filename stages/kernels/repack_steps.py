"""The repack stage's steps of the layer stack (layer_stack.py; stages/repack.py tells the story): a
matrix rearranged into repacked.py's groups of 8 interleaved rows goes through repack's kernel, in
work items of whole groups; every other step is the fused stage's.

    Repacked()       the stage's ops record: no arrays; its type alone selects this stack
    REPACKED         the layout of a rearranged matrix (layer_stack.MATRIX.layout)
    STACK            the fused stage's stack with matmul_chunk and rows_multiple changed
"""

from __future__ import annotations

from collections import namedtuple

from numba import njit

from stages.kernels import layer_stack, repacked
from stages.kernels.layer_stack import matmul_chunk, rows_multiple, rows_of, with_steps

REPACKED = 1                    # layer_stack.ROWS is 0: the file's own order

Repacked = namedtuple("Repacked", "")


@njit(cache=True, inline="always")
def group_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs):
    """A repacked matrix's rows r0..r1 (whole groups) through repack's kernel, every activation row
    m0..m1 sharing each loaded group block; a matrix left as the file stores it (a float one) as the
    fused stage does."""
    if mat.layout == REPACKED:
        p32, pk = rows_of(s.p32, s.pk, m0, m1)
        repacked.group_gemm(mat.kind, blob, mat.offset, mat.row_bytes, p32, pk, m1 - m0, out[m0:m1], col, r0, r1)
    else:
        matmul_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs)


@njit(cache=True, inline="always")
def whole_groups(ops, mat):
    return repacked.GROUP if mat.layout == REPACKED else rows_multiple(ops, mat)


STACK = with_steps(layer_stack.STACK, (Repacked,), matmul_chunk=group_chunk, rows_multiple=whole_groups)
