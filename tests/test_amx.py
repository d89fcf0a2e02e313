"""The amx stage: the tile layout holds every value and scale of the file; the tile instructions'
twin computes what Intel's manual says TDPBSSD computes; the kernel, with the twin in the tiles'
place, gives repack's bits for every type it takes, partial groups and partial tiles included
(a planted layout mistake is caught); the real kernel compiles to tile instructions for a Sapphire
Rapids; the stage says why it cannot run on a CPU without the unit or without the kernel's
permission; and where the unit is, the stage gives the prefill stage's logits bit for bit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

from common.gguf import GGMLType
from common.quants import blocks_of, k4_scale_min
from stages.kernels import amx_tiles as A
from stages.kernels import layer_stack as L
from stages.kernels import repack_steps, repacked
from stages.kernels.repack_steps import REPACKED, Repacked
from tests.test_fused import packs_of
from tests.test_int8 import activations
from tests.test_quantized import random_blocks
from tests.util import expected_isa, lacks

TYPES = [GGMLType(t) for t in A.AMX_TYPES]
NO_ISA = lacks("avx2", "f16c", then="the kernel's float steps need them")
needs_isa = pytest.mark.skipif(expected_isa() is None, reason=str(NO_ISA))
K = 512                                             # two Q4_K / Q6_K blocks, sixteen of the others
ROOT = Path(__file__).resolve().parent.parent


def _group_values(tiles, kind, rows, nb):
    """The signed bytes of a matrix's tile layout back as [rows, nb * values per block] (the B
    tiles undone: row k of a tile is values 4k..4k+3 of the 16 rows in turn)."""
    at, sub, subs = A.TILE_AT[kind], A.SUB[kind], A.SUBS[kind]
    groups = tiles.reshape(-1, nb, at["size"])[:, :, :subs * A.B_BYTES[kind]].view(np.int8)
    g = groups.reshape(len(groups), nb, subs, sub // 4, A.AMX_TILE, 4).transpose(0, 4, 1, 2, 3, 5)
    return g.reshape(len(groups) * A.AMX_TILE, nb * subs * sub)[:rows]


def _group_field(tiles, kind, nb, name, dtype):
    """A field of every group's blocks back as [rows (padding included), nb (, sub-blocks)]: the 16
    rows side by side undone."""
    at = A.TILE_AT[kind]
    ends = sorted(v for k, v in at.items() if v > at[name])
    raw = tiles.reshape(-1, nb, at["size"])[:, :, at[name]:ends[0]].copy().view(dtype)
    per_row = raw.reshape(raw.shape[0], nb, -1, A.AMX_TILE)             # [groups, nb, subs, 16]
    rows = np.moveaxis(per_row, 3, 1).reshape(raw.shape[0] * A.AMX_TILE, nb, -1)
    return rows[..., 0] if rows.shape[-1] == 1 else rows


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_tile_layout_holds_every_value_and_scale(ggml_type):
    """37 rows (two groups of 16 and a part of one): every value is the file's (less its offset),
    every scale the file's, and the padding rows are zeros."""
    kind = int(ggml_type)
    raw = random_blocks(np.random.default_rng(kind), ggml_type, 37, K)
    tiles = A.tile_layout(raw, kind)
    assert tiles.nbytes == A.tiled_bytes(37, raw.shape[1], kind)
    b = blocks_of(raw, kind).reshape(37, -1)
    nb = b.shape[1]
    values = A._integers(b.reshape(-1), kind).reshape(37, -1)
    assert np.array_equal(_group_values(tiles, kind, 37, nb), values)
    assert not _group_values(tiles, kind, 48, nb)[37:].any()
    if kind in (A.Q4_0, A.Q8_0):                 # the stored byte times d is the file's value
        from common.quants import dequantize
        w = dequantize(raw, ggml_type, (37, K)).reshape(37, nb, -1)
        assert np.array_equal(values.reshape(37, nb, -1) * b["d"].astype(np.float32)[..., None], w)
    fields = {"d": np.float16, "m": np.float16, "dmin": np.float16, "sc": np.uint8, "scales": np.int8}
    want = {name: b[name] for name in ("d", "m", "dmin", "scales") if name in b.dtype.names}
    if kind == A.Q4_K:
        want["sc"], want["m"] = k4_scale_min(b["scales"])
        del want["scales"]
    assert set(want) == set(A.TILE_AT[kind]) - {"size"}
    for name, values in want.items():
        got = _group_field(tiles, kind, nb, name, np.uint8 if (kind, name) == (A.Q4_K, "m") else fields[name])
        assert np.array_equal(got[:37], values) and not got[37:].any(), name


# ---- the twin of the tile instructions ------------------------------------------------------------

def _twin_intrinsic():
    """One tile product through Emulated: c (16 x 64 bytes, int32) += a (rows x k bytes) b (k/4 x 64)."""
    from numba import types
    from numba.extending import intrinsic

    from stages.kernels.vector_ir import Emit

    @intrinsic(prefer_literal=True)
    def twin(typingctx, a, b, c, rows, k):
        def codegen(context, builder, sig, args):
            g = Emit(context, builder)
            (pa, _), (pb, _), (pc, _) = (g.array(sig.args[i], args[i]) for i in range(3))
            n, kk, T = g.int64(sig.args[3], args[3]), sig.args[4].literal_value, A.Emulated(g)
            tc = T.dot(T.load("c", n, 64, pc, g.const(64)), T.load("a", n, kk, pa, g.const(64)),
                       T.load("b", g.const(kk // 4), 64, pb, g.const(64)), n, kk)
            T.store(tc, n, 64, pc, g.const(64))
            return context.get_dummy_value()
        return types.none(a, b, c, rows, k), codegen
    return twin


_twin = _twin_intrinsic()


# one function per K (the twin unrolls its loops over K, a constant)
_TWINS = {16: numba.njit(lambda a, b, c, rows: _twin(a, b, c, rows, 16)),
          32: numba.njit(lambda a, b, c, rows: _twin(a, b, c, rows, 32)),
          64: numba.njit(lambda a, b, c, rows: _twin(a, b, c, rows, 64))}


@pytest.mark.parametrize("rows, k", [(16, 64), (5, 32), (16, 16)])
def test_the_tiles_twin_is_tdpbssd(rows, k):
    """What Intel's manual says TDPBSSD does, in numpy: C[m][n] += sum over k < K/4, i < 4 of
    A[m][4k + i] B[k][4n + i], signed bytes, int32 sums; rows of A and C below `rows` only."""
    rng = np.random.default_rng(rows + k)
    a = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    c = rng.integers(-2**20, 2**20, (16, 16), dtype=np.int32)
    want = c.copy()
    want[:rows] += np.einsum("mki,kni->mn", a[:rows, :k].reshape(rows, k // 4, 4).astype(np.int32),
                             b[:k // 4].reshape(k // 4, 16, 4).astype(np.int32))
    _TWINS[k](a, b, c, rows)
    assert np.array_equal(c, want)


# ---- the kernel with the twin in the tiles' place ----------------------------------------------

@numba.njit
def _emulated(kind, w, rb, p32, pk, M, N, col):
    """The twin's kernel into columns col.. of a NaN-filled output (what it must leave alone)."""
    out = np.full((M, N + col), np.nan, np.float32)
    A.amx_gemm_emulated(kind, w, 0, rb, p32, pk, 0, M, out, col, (0, N))
    return out


def _repack_rows(x, raw, kind):
    mat = L.matrix_table([(0, raw.shape[0], raw.shape[1], kind, REPACKED)])
    return repack_steps.STACK.matmul_rows(x, L.read_only(repacked.repack(raw, kind)), mat, 1, Repacked(), np.uint16)


@needs_isa
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_kernel_gives_repacks_bits(ggml_type):
    """16 rows by 16 (whole tiles), 37 by 5 (a part of a group, a short tile), 19 by 21 (a tile and
    a part of one): repack's kernel's bits, and only the asked columns written."""
    kind = int(ggml_type)
    rng = np.random.default_rng(100 + kind)
    for N, M in ((16, 16), (37, 5), (19, 21)):
        raw = random_blocks(rng, ggml_type, N, K)
        x = np.ascontiguousarray(activations(rng, M, K))
        p32, pk = packs_of(x, K)
        got = _emulated(kind, A.tile_layout(raw, kind), raw.shape[1], p32, pk, M, N, 3)
        assert np.isnan(got[:, :3]).all()
        assert np.array_equal(got[:, 3:], _repack_rows(x, raw, kind)), (N, M)


@needs_isa
def test_a_layout_mistake_is_caught():
    """Planted: two weight rows' values swapped in one B tile (as a wrong transpose would): the
    kernel's result is no longer repack's."""
    kind = int(GGMLType.Q4_1)
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, GGMLType.Q4_1, 16, K)
    x = np.ascontiguousarray(activations(rng, 4, K))
    p32, pk = packs_of(x, K)
    tiles = A.tile_layout(raw, kind)
    b_tile = tiles[:A.B_BYTES[kind]].reshape(8, 16, 4)
    b_tile[:, [2, 5]] = b_tile[:, [5, 2]]
    got = A.emulated_rows(kind, tiles, raw.shape[1], p32, pk, 4, 16)
    assert not np.array_equal(got, _repack_rows(x, raw, kind))
    assert np.array_equal(A.emulated_rows(kind, A.tile_layout(raw, kind), raw.shape[1], p32, pk, 4, 16),
                          _repack_rows(x, raw, kind))


# ---- the real kernel, and the stage -----------------------------------------------------------

COMPILE_FOR_SAPPHIRE_RAPIDS = textwrap.dedent("""
    import collections, numba
    from numba import types
    from stages.kernels import amx_tiles as A
    from stages.kernels.q8 import new_packs
    @numba.njit
    def run(kind, w, toff, rb, p32, pk, m0, m1, out, col, r0, r1):
        A.amx_matmul(kind, w, toff, rb, p32, pk, m0, m1, out, col, (r0, r1))
    p32, pk = new_packs(4, 512)
    arr = lambda dt, nd: types.Array(dt, nd, "C")
    i64 = types.int64
    run.compile((i64, arr(types.uint8, 1), i64, i64, numba.typeof(p32), numba.typeof(pk), i64, i64,
                 arr(types.float32, 2), i64, i64, i64))
    for sig in A._one_type.signatures:
        asm = A._one_type.inspect_asm(sig)
        names = collections.Counter(line.split()[0] for line in asm.splitlines() if line.startswith("\\t"))
        print(sig[0].literal_value, *(names[n] for n in ("ldtilecfg", "tileloadd", "tdpbssd", "tilestored",
                                                          "tilerelease")))
""")


def test_the_kernel_compiles_to_tile_instructions_for_sapphire_rapids(tmp_path):
    """numba told to compile for a Sapphire Rapids (NUMBA_CPU_NAME; it never runs the code here):
    every type's function configures the tiles, loads them, multiplies with TDPBSSD, stores and
    releases them."""
    env = {"NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", COMPILE_FOR_SAPPHIRE_RAPIDS], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    counts = {int(line.split()[0]): [int(n) for n in line.split()[1:]] for line in p.stdout.splitlines()}
    assert sorted(counts) == sorted(A.AMX_TYPES)
    for kind, (cfg, loads, dots, stores, release) in counts.items():
        assert cfg >= 1 and dots >= 1 and loads == 2 * dots and stores == dots and release >= 1, (kind, counts)


def test_the_stage_says_why_it_cannot_run(monkeypatch):
    import stages.amx as amx
    monkeypatch.setattr(amx, "amx_ready", lambda: False)
    assert "no matrix unit" in amx.AmxBackend.unavailable_reason()
    monkeypatch.setattr(amx, "amx_ready", lambda: True)
    monkeypatch.setattr(amx, "tile_refusal", lambda: amx.REFUSALS[errno.ENOSPC])
    reason = amx.AmxBackend.unavailable_reason()
    assert "ARCH_REQ_XCOMP_PERM" in reason and "sigaltstack" in reason


def test_a_refused_permission_says_the_kernels_reason(monkeypatch):
    """The syscall's errno named in the stage's words (the permission is asked for once a process:
    a fresh cache, a stand-in C library)."""
    import stages.amx as amx

    class Libc:
        def __init__(self, err):
            self.err = err

        def syscall(self, *args):
            ctypes.set_errno(self.err)
            return -1

    for err, words in ((errno.EOPNOTSUPP, "left AMX off"), (errno.EINVAL, "Linux before 5.16"), (errno.EIO, "EIO")):
        monkeypatch.setattr(amx.ctypes, "CDLL", lambda *a, err=err, **k: Libc(err))
        amx.tile_refusal.cache_clear()
        try:
            assert words in amx.tile_refusal(), err
        finally:
            amx.tile_refusal.cache_clear()


def _no_unit():
    from stages import unavailable_reason
    reason = unavailable_reason("amx")
    return f"no matrix unit: {reason}" if reason else None


@pytest.mark.skipif(_no_unit() is not None, reason=str(_no_unit()))
def test_the_stage_gives_prefills_bits(default_model_path):
    """Where the unit is: a prompt of 40 rows (two tiles and a part of one) and a decode step after
    it, logits bit for bit the prefill stage's, greedy tokens the same."""
    from stages import load
    tokens = list(range(100, 140))
    amx, pre = (load(s, default_model_path, n_ctx=64) for s in ("amx", "prefill"))
    assert np.array_equal(amx.forward(tokens, 0), pre.forward(tokens, 0))
    assert np.array_equal(amx.forward([7], 40), pre.forward([7], 40))
