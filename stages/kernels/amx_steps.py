"""The amx stage's steps of the layer stack (layer_stack.py; stages/amx.py tells the story): STACK
is the prefill stage's stack with these changed.

    matmul_chunk    AMX_ROWS activation rows or more of a matrix with a tile copy (a repacked matrix
                    of a type amx_tiles takes): on the matrix unit (amx_tiles.amx_matmul); fewer rows,
                    and the other matrices, as the prefill stage does
    rows_multiple   whole groups of AMX_TILE (16) rows for a matrix with a tile copy

A matrix's tile copy sits right after its repacked bytes in the stage's one buffer (stages/amx.py
lays them out so): at mat.offset + its repacked bytes, nothing else to look up.

    Amx             the stage's record: the prefill stage's fields (its steps still read them)
"""

from __future__ import annotations

from collections import namedtuple

from numba import njit

from stages.kernels import prefill_steps
from stages.kernels.amx_tiles import AMX_TILE, amx_matmul
from stages.kernels.layer_stack import with_steps
from stages.kernels.prefill_steps import Prefill, pair_chunk
from stages.kernels.repack_steps import REPACKED, whole_groups
from stages.kernels.repacked import GROUP
from stages.kernels.toolkit import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

# The fewest activation rows a matmul work item sends to the matrix unit. A tile product costs the
# same for 1 row as for 16; below a few rows the pair kernel's multiply-adds cost less than the
# tiles' loads, stores and float steps. Reasoned from instruction counts, not yet timed on a CPU with
# AMX: the first one to run the stage should time a verify pass of 2 to 16 rows both ways.
AMX_ROWS = 4

Amx = namedtuple("Amx", Prefill._fields)


@njit(cache=True, inline="always")
def tiled(mat):
    """Whether the matrix has a tile copy: repacked, of a type the matrix unit takes (AMX_TYPES)."""
    k = mat.kind
    return mat.layout == REPACKED and (k == Q4_0 or k == Q4_1 or k == Q8_0 or k == Q4_K or k == Q6_K)


@njit(cache=True, inline="always")
def tile_copy_at(mat):
    """Where the matrix's tile copy starts in the blob: after its repacked bytes (repacked_bytes)."""
    return mat.offset + (mat.rows + GROUP - 1) // GROUP * GROUP * mat.row_bytes


@njit(cache=True, inline="always")
def amx_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs):
    if tiled(mat) and m1 - m0 >= AMX_ROWS:
        amx_matmul(mat.kind, blob, tile_copy_at(mat), mat.row_bytes, s.p32, s.pk, m0, m1, out, col, (r0, r1))
    else:
        pair_chunk(ops, mat, blob, r0, r1, m0, m1, xf, s, out, col, fs)


@njit(cache=True, inline="always")
def tile_groups(ops, mat):
    return AMX_TILE if tiled(mat) else whole_groups(ops, mat)


STACK = with_steps(prefill_steps.STACK, (Amx,), matmul_chunk=amx_chunk, rows_multiple=tile_groups)
