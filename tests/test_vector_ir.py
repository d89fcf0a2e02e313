"""stages/kernels/vector_ir.py's helpers against their scalar twins (the module's table): each
emitted once into a tiny kernel, run on random inputs, compared with numpy doing the same sums."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import types

from stages.kernels import vector_ir
from stages.kernels.vector_ir import B32, B64, D8, D16, F8, vector_intrinsic
from tests.util import TARGETS, expected_isa, lacks, not_x86_reason

pytestmark = pytest.mark.isa_paths          # cheap: the AVX2-only run (make test-avx2) takes them all
# skipped by LLVM's view of the CPU numba compiles for (tests/util.py), not by vector_ir's probes
needs_isa = pytest.mark.skipif(expected_isa() is None, reason=str(lacks("avx2", "f16c")))
NO_ZMM = lacks("avx512vnni", "avx512bw", "avx512vl", then="vpdpbusd on 512-bit registers")


def _kernel(op):
    """op(g, a) -> a vector stored to `out`, from arrays x and y (bytes as needed)."""
    @vector_intrinsic
    def k(typingctx, x, y, out):
        vector_ir.need_isa("the test kernel")

        def body(g, a):
            g.store(a.out, g.const(0), op(g, a))
            return g.c.get_dummy_value()
        return types.none(x, y, out), body

    @numba.njit
    def run(x, y, out):
        k(x, y, out)
    return run


@needs_isa
@pytest.mark.parametrize("lanes", [8, 16], ids=["ymm", "zmm"])
def test_dpbusd_and_dpwssd(lanes):
    if lanes == 16 and NO_ZMM:
        pytest.skip(NO_ZMM)
    acc_ty, byte_ty = (D8, B32) if lanes == 8 else (D16, B64)
    rng = np.random.default_rng(lanes)
    u = rng.integers(0, 129, 4 * lanes).astype(np.uint8)            # unsigned up to 128, as the kernels use it
    s = rng.integers(-127, 128, 4 * lanes).astype(np.int8)
    out = np.zeros(lanes, np.int32)
    _kernel(lambda g, a: g.dpbusd(g.splat_const(acc_ty, 7), g.load(a.x, g.const(0), byte_ty),
                                  g.load(a.y, g.const(0), byte_ty)))(u, s, out)
    assert np.array_equal(out, 7 + (u.astype(np.int32) * s).reshape(lanes, 4).sum(axis=1))
    a16 = rng.integers(-3000, 3000, 2 * lanes).astype(np.int16)
    b16 = rng.integers(-3000, 3000, 2 * lanes).astype(np.int16)
    _kernel(lambda g, a: g.dpwssd(g.splat_const(acc_ty, -5), g.load(a.x, g.const(0), acc_ty),
                                  g.load(a.y, g.const(0), acc_ty)))(a16, b16, out)
    assert np.array_equal(out, -5 + (a16.astype(np.int64) * b16).reshape(lanes, 2).sum(axis=1))


@needs_isa
def test_splat_i64_alternates_two_values():
    x = np.array([3, -4], np.int32)
    out = np.zeros(8, np.int32)
    _kernel(lambda g, a: g.splat_i64(a.x, g.const(0), D8))(x, x, out)
    assert out.tolist() == [3, -4] * 4


@needs_isa
def test_exp_fmax_and_the_sums():
    """exp within a few float32 ulps of float64's over softmax's range (and 0 ... 1 exactly where
    it must be: e^0 = 1); fmax; sums8 and hsum the same fixed tree whichever lane."""
    x = np.linspace(-80, 5, 8 * 64).astype(np.float32)
    out = np.zeros(8, np.float32)
    run = _kernel(lambda g, a: g.exp(g.load(a.x, g.const(0), F8)))
    got = np.concatenate([(run(x[i:i + 8], x, out), out.copy())[1] for i in range(0, len(x), 8)])
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 4 * np.spacing(want.astype(np.float32)))
    run(np.zeros(8, np.float32), x, out)
    assert (out == 1.0).all()
    a, b = np.float32([1, -2, np.inf, -np.inf, 0, 5, -1, 3]), np.float32([0, -1, 2, -5, 0, 6, -1, np.nan])
    _kernel(lambda g, v: g.fmax(g.load(v.x, g.const(0), F8), g.load(v.y, g.const(0), F8)))(a, b, out)
    assert out.tolist()[:7] == [1, -1, np.inf, -5, 0, 6, -1]
    vs = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    _kernel(lambda g, v: g.sums8([g.load(v.x, g.const(32 * j), F8) for j in range(8)]))(vs, vs, out)
    tree = ((vs[:, 0] + vs[:, 2]) + (vs[:, 1] + vs[:, 3])) + ((vs[:, 4] + vs[:, 6]) + (vs[:, 5] + vs[:, 7]))
    assert np.array_equal(out, tree)


ZMM_FEATURES = {"avx512vnni", "avx512bw", "avx512vl"}


def test_zmm_is_what_llvm_compiles_for_the_target():
    """ZMM (the pair kernels' 512-bit vpdpbusd) as LLVM's processor definitions say (TARGETS),
    for named CPUs with and without it, and for the CPU numba compiles for now."""
    if not_x86_reason():
        pytest.skip(not_x86_reason())
    for cpu in ("haswell", "skylake-avx512", "icelake-server", "znver4"):
        assert vector_ir.target_has(cpu, "", "zmm") == (ZMM_FEATURES <= TARGETS[cpu]), cpu
    assert vector_ir.ZMM == (NO_ZMM is None and expected_isa() == "vnni")


def test_zmm_check_catches_a_wrong_probe(monkeypatch):
    """Planted: has_zmm told the opposite of this target (host features, or LLVM's answer for a
    named CPU); the check above then differs."""
    if not_x86_reason():
        pytest.skip(not_x86_reason())
    want = NO_ZMM is None and expected_isa() == "vnni"
    monkeypatch.setattr(vector_ir, "simd_features", lambda: ["avx2", "f16c", "avx512vl"] + ([] if want else
                        ["avx512_vnni", "avx512bw", "avx512f"]))
    monkeypatch.setattr(vector_ir, "target_has", lambda cpu, features, what: not want)
    monkeypatch.setattr(vector_ir, "named_isa", lambda: "vnni")
    assert vector_ir.has_zmm() != want
