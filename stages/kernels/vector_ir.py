"""The one place that writes vector instructions by hand: LLVM IR, a few lines per operation.

numba compiles Python loops; where LLVM's auto-vectorizer will not find the instruction a kernel
needs (stages/int8.py says why), a kernel asks for it by name: numba's `intrinsic` lets a
jitted function emit LLVM IR, and LLVM IR can call x86 intrinsics. Every kernel that does
(stages/kernels/int_dot.py, int_tiles.py, repacked.py) builds its IR with `Emit` below, so each
trick is named once, here, with the scalar code it stands for (its twin: what the tests compare
it with, tests/test_vector_ir.py) and the instructions it becomes:

    helper             twin (per lane i)                         x86
    dpbusd(acc, u, s)  acc[i] + sum_j<4 u[4i+j] s[4i+j]          vpdpbusd (VNNI; ymm, or zmm for 16
                       (u unsigned up to 128; s signed bytes)   lanes); else vpmaddubsw, vpmaddwd
                                                                 with ones, vpaddd (AVX2)
    dpwssd(acc, a, b)  acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1]    vpdpwssd (VNNI); else vpmaddwd,
                       (int16 pairs)                             vpaddd
    scaled_dots(acc, us, ss, scale, most)                        VNNI: a vpdpbusd chain, one vpmulld;
                       acc[i] + scale[i] sum_j dpbusd(us[j], ss[j])[i]   AVX2: vpmaddubsw summed in int16
                       (us[j] unsigned up to most)               while none can overflow, one vpmaddwd
                                                                 with the scale per run (no vpmulld)
    dpbusd_bytes       the same for u up to 255                  vpdpbusd; AVX2: u in nibbles
    pairs(u, s)        u[2i] s[2i] + u[2i+1] s[2i+1] (int16)     vpmaddubsw
    madd(a, b)         a[2i] b[2i] + a[2i+1] b[2i+1] (int32)     vpmaddwd
    nibbles(v, high)   v[i] & 15, or v[i] >> 4                   vpand / vpsrlw + vpand
    splat_i32(p, o)    the int32 at p+o in every lane            vpbroadcastd (often folded into
                                                                 vpdpbusd's memory operand {1to8})
    splat_i64(p, o)    the 8 bytes at p+o in every 64-bit lane   vpbroadcastq (a load, no shuffle)
    halves(p, o, n)    n float16 at p+o as float32               vcvtph2ps (F16C)
    half(p, o)         one float16 at p+o in every lane          vpbroadcastw + vcvtph2ps
    fma(a, b, c)       a[i] * b[i] + c[i], one rounding          vfmadd231ps
    fmax(a, b)         a[i] > b[i] ? a[i] : b[i]                 vmaxps
    exp(v)             e^v[i] (layer_ops.fast_exp's polynomial)  vroundps, vfmadd231ps, vpslld
    hsum(v)            v[0] + ... + v[7], as a fixed tree        vextractf128, vaddps, vhaddps
    sums8(vs)          [sum of vs[j]'s 8 lanes for j < 8]:       vunpcklps/hps, vaddps, vperm2f128
                       8 horizontal sums at once

ISA is what numba's code generator targets: 'vnni' (AVX2 + F16C + AVX512-VNNI with VL, or
AVX-VNNI: vpdpbusd on 256-bit registers), 'avx2' (AVX2 + F16C), or None (the kernels that need
these then refuse to compile, and their callers take the plain loops); ZMM, whether vpdpbusd
runs on 512-bit registers too (AVX512-VNNI + BW). By default that is this
CPU (its /proc/cpuinfo flags); where numba is told to compile for another CPU (NUMBA_CPU_NAME,
NUMBA_CPU_FEATURES: `NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=` compiles for an AVX2-only CPU
on any x86 machine), LLVM itself is asked what that target has (target_isa), so the other
CPU's path is the one compiled and run. It is read when a kernel is compiled: numba's cache
key includes the target's name and features, so a cache never carries these kernels to a CPU
without them. Pointers are i8* and offsets bytes throughout.
"""

from __future__ import annotations

import functools
import inspect
import platform
import subprocess
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils, config, errors
from numba.extending import intrinsic

from common.cpu import simd_features

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
HALF, FLOAT = ir.HalfType(), ir.FloatType()
B32, B16 = ir.VectorType(I8, 32), ir.VectorType(I8, 16)             # 32 / 16 bytes
W16, W8 = ir.VectorType(I16, 16), ir.VectorType(I16, 8)             # 16 / 8 int16
D8, D4 = ir.VectorType(I32, 8), ir.VectorType(I32, 4)               # 8 / 4 int32
F8 = ir.VectorType(FLOAT, 8)                                        # 8 float32: one ymm register
B64, W32, D16 = ir.VectorType(I8, 64), ir.VectorType(I16, 32), ir.VectorType(I32, 16)    # one zmm register
FZ = ir.VectorType(FLOAT, 16)                                       # 16 float32: one zmm register
# The prefetch intrinsic's name carries its pointer type: "ptr" where llvmlite writes opaque
# pointers (LLVM 15 and later), "i8*" before.
_PREFETCH = "llvm.prefetch.p0" if str(I8.as_pointer()) == "ptr" else "llvm.prefetch.p0i8"


def named_isa():
    """'vnni', 'avx2' or None for the CPU numba compiles for (see the module docstring)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        import llvmlite.binding as llvm
        return target_isa(config.CPU_NAME or llvm.get_host_cpu_name(), config.CPU_FEATURES or "")
    f = set(simd_features())
    if not {"avx2", "f16c"} <= f:
        return None
    return "vnni" if "avx_vnni" in f or {"avx512_vnni", "avx512vl"} <= f else "avx2"


# Each probe: a module whose instruction selection needs the feature (LLVM stops the process
# with "Cannot select" where the target lacks it, hence a process of its own), and the assembly
# text that proves the instruction was chosen (a half -> float conversion compiles everywhere,
# as a library call where F16C is missing).
_PROBES = {
    "avx2": ("declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)\n"
             "define <16 x i16> @f(<32 x i8> %a, <32 x i8> %b) {\n"
             "  %r = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %a, <32 x i8> %b)\n"
             "  ret <16 x i16> %r\n}\n", "vpmaddubsw"),
    "f16c": ("define <8 x float> @f(<8 x half> %h) {\n  %r = fpext <8 x half> %h to <8 x float>\n"
             "  ret <8 x float> %r\n}\n", "vcvtph2ps"),
    "vnni": ("declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, <8 x i32>, <8 x i32>)\n"
             "define <8 x i32> @f(<8 x i32> %a, <8 x i32> %b, <8 x i32> %c) {\n"
             "  %r = call <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32> %a, <8 x i32> %b, <8 x i32> %c)\n"
             "  ret <8 x i32> %r\n}\n", "vpdpbusd"),
    "zmm": ("declare <16 x i32> @llvm.x86.avx512.pmaddw.d.512(<32 x i16>, <32 x i16>)\n"
            "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)\n"
            "define <16 x i32> @f(<16 x i32> %a, <32 x i16> %b, <16 x i32> %c) {\n"
            "  %w = call <16 x i32> @llvm.x86.avx512.pmaddw.d.512(<32 x i16> %b, <32 x i16> %b)\n"
            "  %r = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> %a, <16 x i32> %w, <16 x i32> %c)\n"
            "  ret <16 x i32> %r\n}\n", "vpdpbusd"),
}
_COMPILE = ("import sys, llvmlite.binding as llvm\n"
            "llvm.initialize_native_target(); llvm.initialize_native_asmprinter()\n"
            "cpu, features, text = sys.argv[1:4]\n"
            "tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features)\n"
            "print(tm.emit_assembly(llvm.parse_assembly(text)))\n")


def target_has(cpu: str, features: str, what: str) -> bool:
    """Whether LLVM, compiling for CPU `cpu` with `features`, emits the instruction of probe `what`."""
    return target_compiles(cpu, features, *_PROBES[what])


@functools.lru_cache(maxsize=None)
def target_compiles(cpu: str, features: str, text: str, instruction: str) -> bool:
    """Whether LLVM, compiling the module `text` for CPU `cpu` with `features`, emits `instruction`
    (in a process of its own: a target without it stops the process)."""
    p = subprocess.run([sys.executable, "-c", _COMPILE, cpu, features, text], capture_output=True, text=True,
                       timeout=120)
    return p.returncode == 0 and instruction in p.stdout


def target_isa(cpu: str, features: str = "") -> str | None:
    """'vnni', 'avx2' or None for an LLVM target (a CPU name, e.g. 'haswell', and a feature string,
    '' for that CPU's own). The answer is kept beside numba's cache (the probes take a second)."""
    import hashlib
    import json
    from pathlib import Path

    import llvmlite
    key = hashlib.sha256(f"{cpu}|{features}|{llvmlite.__version__}".encode()).hexdigest()[:16]
    kept = Path(config.CACHE_DIR or ".") / f"target-isa-{key}.json" if config.CACHE_DIR else None
    if kept is not None and kept.exists():
        return json.loads(kept.read_text())["isa"]
    if not (target_has(cpu, features, "avx2") and target_has(cpu, features, "f16c")):
        isa = None
    else:
        isa = "vnni" if target_has(cpu, features, "vnni") else "avx2"
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps({"cpu": cpu, "features": features, "isa": isa}))
    return isa


def has_zmm() -> bool:
    """vpdpbusd on 512-bit registers (AVX512-VNNI with BW): 16 int32 lanes per instruction, which
    the prefill stage's pair kernels use (stages/kernels/pair_gemm.py); for a named target, LLVM's
    answer (probe 'zmm')."""
    if named_isa() != "vnni":
        return False
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        import llvmlite.binding as llvm
        return target_has(config.CPU_NAME or llvm.get_host_cpu_name(), config.CPU_FEATURES or "", "zmm")
    return {"avx512_vnni", "avx512bw", "avx512vl"} <= set(simd_features())


ISA = named_isa()
ZMM = has_zmm()


def need_isa(what: str):
    """At typing time: refuse to compile a hand-written kernel on a CPU without AVX2 + F16C."""
    if ISA is None:
        raise errors.TypingError(f"{what} needs AVX2 + F16C (stages/kernels/vector_ir.py, named_isa)")


def vector_intrinsic(typer):
    """numba's @intrinsic for a kernel written with Emit: `typer(typingctx, <args>)` returns
    (signature, body) and `body(g, a)` emits the IR, with g an Emit and a the arguments by name
    (Args): a kernel reads its arguments as its signature names them, not by position."""
    names = list(inspect.signature(typer).parameters)[1:]             # after typingctx

    @functools.wraps(typer)
    def typed(typingctx, *argtys):
        sig, body = typer(typingctx, *argtys)

        def codegen(context, builder, sig, args):
            g = Emit(context, builder)
            return body(g, Args(g, names, sig, args))
        return sig, codegen
    return intrinsic(typed)


class Args:
    """An intrinsic's arguments by name: `a.w` is the data pointer (i8*) of array argument w, an
    int64 for an integer argument, the value itself otherwise (a tuple, a float); `a.arrays['w']`
    numba's struct of array w (for its strides)."""

    def __init__(self, emit: "Emit", names, sig, args):
        self.arrays = {}
        for name, ty, value in zip(names, sig.args, args):
            if isinstance(ty, types.BaseTuple):             # a named tuple of arrays: a.pack.q ...
                fields = getattr(ty, "fields", None) or [f"_{i}" for i in range(len(ty.types))]
                members = [emit.b.extract_value(value, i) for i in range(len(ty.types))]
                setattr(self, name, Args(emit, fields, types.none(*ty.types), members))
            elif isinstance(ty, types.Array):
                ptr, arr = emit.array(ty, value)
                self.arrays[name] = arr
                setattr(self, name, ptr)
            elif isinstance(ty, types.Integer):
                setattr(self, name, emit.int64(ty, value))
            else:
                setattr(self, name, value)


class Emit:
    """LLVM IR for one kernel being compiled: `b` is llvmlite's builder."""

    def __init__(self, context, builder, isa=None):
        self.c, self.b = context, builder
        self.isa = ISA if isa is None else isa

    # ---- scalars and memory ---------------------------------------------------------------------
    def const(self, v):
        return ir.Constant(I64, v)

    def int64(self, ty, v):
        return self.c.cast(self.b, v, ty, types.int64)

    def array(self, ty, value):
        """(i8* to the first element, numba's array struct) of an array argument."""
        a = self.c.make_array(ty)(self.c, self.b, value)
        return self.b.bitcast(a.data, I8.as_pointer()), a

    def stride0(self, arr):
        return self.b.extract_value(arr.strides, 0)

    def at(self, p, off):
        return self.b.gep(p, [off])

    def load(self, p, off, ty):
        """A value of type ty at byte offset off (no alignment assumed: vmovdqu)."""
        return self.b.load(self.b.bitcast(self.at(p, off), ty.as_pointer()), align=1)

    def store(self, p, off, value):
        self.b.store(value, self.b.bitcast(self.at(p, off), value.type.as_pointer()), align=1)

    def prefetch(self, p, off, level: int = 1):
        """llvm.prefetch (a read) of the line at p+off into the level-1 cache (prefetcht0) or only
        as far as level 2 (prefetcht1); never faults."""
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), _PREFETCH)
        locality = {1: 3, 2: 2}[level]                      # llvm's locality: 3 keeps it in every level
        self.b.call(fn, [self.at(p, off), ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])

    def slot(self, ty, init=None):
        """A stack slot (an accumulator LLVM keeps in a register), zero unless init is given."""
        slot = cgutils.alloca_once(self.b, ty)
        self.b.store(init if init is not None else ir.Constant(ty, None), slot)
        return slot

    def call(self, name, ret, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def switch(self, value, bodies: dict):
        """One compiled function for several cases: `switch value` over {case: emit()}, each body
        emitted in its own block (how one kernel serves every ggml type: no ladder of calls)."""
        b = self.b
        done = b.append_basic_block("done")
        sw = b.switch(value, done)
        for case, emit in bodies.items():
            block = b.append_basic_block(f"case_{case}")
            sw.add_case(ir.Constant(value.type, case), block)
            b.position_at_end(block)
            emit()
            b.branch(done)
        b.position_at_end(done)

    def loop(self, n):
        """`with g.loop(n) as i:` a counted loop, i = 0 .. n-1 (int64)."""
        return _Loop(self.b, n)

    # ---- building vectors -----------------------------------------------------------------------
    @staticmethod
    def splat_const(ty, v):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)

    def shuffle(self, a, b, idx):
        return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))

    def splat(self, ty, scalar):
        """scalar in every lane of ty."""
        v = self.b.insert_element(ir.Constant(ty, None), scalar, ir.Constant(I32, 0))
        return self.shuffle(v, ir.Constant(ty, None), [0] * ty.count)

    def splat_i64(self, p, off, ty):
        """The 8 bytes at p+off in every 64-bit lane of ty (vpbroadcastq from memory: a load, no
        shuffle): two int32 (or float) side by side, alternating across the lanes."""
        n = ty.count * (32 if ty.element == FLOAT else ty.element.width) // 64
        v = self.splat(ir.VectorType(I64, n), self.load(p, off, I64))
        return self.b.bitcast(v, ty)

    def splat_i32(self, p, off, ty=D8):
        """The int32 at p+off in every lane; as a byte vector (ty=B32) for dpbusd's signed operand.
        x86: vpbroadcastd ymm, m32 (a load; LLVM folds it into vpdpbusd's {1to8} operand)."""
        v = self.splat(D8, self.load(p, off, I32))
        return v if ty == D8 else self.b.bitcast(v, ty)

    def half(self, p, off, n=8):
        """The float16 at p+off as n float32 lanes: vpbroadcastw from memory, then vcvtph2ps. (A scalar
        half loaded and converted becomes vpinsrw into whatever register LLVM picks: a false
        dependency on its old value, which chained every block of a kernel to the one before.)"""
        h = self.b.insert_element(ir.Constant(ir.VectorType(I16, n), None), self.load(p, off, I16),
                                  ir.Constant(I32, 0))
        hn = self.shuffle(h, ir.Constant(h.type, None), [0] * n)
        return self.b.fpext(self.b.bitcast(hn, ir.VectorType(HALF, n)), ir.VectorType(FLOAT, n))

    def halves(self, p, off, n=8):
        """n consecutive float16 at p+off as float32 lanes (vcvtph2ps ymm, m128): one scale per row
        of a repacked group."""
        return self.b.fpext(self.load(p, off, ir.VectorType(HALF, n)), ir.VectorType(FLOAT, n))

    def widen_u8(self, p, off, n=8):
        """n unsigned bytes at p+off as int32 lanes (vpmovzxbd ymm, m64)."""
        return self.b.zext(self.load(p, off, ir.VectorType(I8, n)), ir.VectorType(I32, n))

    def widen_s8(self, p, off, n=8):
        """n signed bytes at p+off as int32 lanes (vpmovsxbd ymm, m64)."""
        return self.b.sext(self.load(p, off, ir.VectorType(I8, n)), ir.VectorType(I32, n))

    # ---- integer products -----------------------------------------------------------------------
    def nibbles(self, v, high):
        """The low (v & 15) or high (v >> 4) 4 bits of every byte: vpand, or a byte shift, which x86
        does not have: LLVM writes vpsrlw (the word shift pulls the next byte's bits in) + vpand."""
        if high:
            return self.b.lshr(v, self.splat_const(v.type, 4))
        return self.b.and_(v, self.splat_const(v.type, 15))

    def pairs(self, u, s):
        """vpmaddubsw: <16 x i16>, lane i = u[2i] s[2i] + u[2i+1] s[2i+1] (u unsigned, s signed;
        saturating, which none of the products here reach: |sum| <= 2 * 128 * 127 < 2^15)."""
        return self.call("llvm.x86.avx2.pmadd.ub.sw", W16, u, s)

    def madd(self, a, b):
        """vpmaddwd: lane i = a[2i] b[2i] + a[2i+1] b[2i+1], as int32 (<16 x i16> -> <8 x i32>,
        <8 x i16> -> <4 x i32>, <32 x i16> -> <16 x i32>)."""
        name = {16: "llvm.x86.avx2.pmadd.wd", 8: "llvm.x86.sse2.pmadd.wd", 32: "llvm.x86.avx512.pmaddw.d.512"}
        return self.call(name[a.type.count], ir.VectorType(I32, a.type.count // 2), a, b)

    def dpbusd(self, acc, u, s):
        """acc + <8 x i32> (or <16 x i32>), lane i += the sum of the 4 products u[4i..4i+3]
        s[4i..4i+3] (u unsigned bytes, s signed bytes). VNNI: vpdpbusd ymm_acc, ymm_u, ymm_s (zmm
        for 16 lanes; one instruction; the i32 operand form: LLVM 15 to 22 accept it). AVX2:
        vpmaddubsw, vpmaddwd with ones, vpaddd (the same sums: no 16-bit pair sum of |u| <= 128,
        |s| <= 127 saturates)."""
        n = acc.type.count
        if self.isa == "vnni":
            cast = lambda v: self.b.bitcast(v, acc.type)
            return self.call(f"llvm.x86.avx512.vpdpbusd.{32 * n}", acc.type, acc, cast(u), cast(s))
        return self.b.add(acc, self.madd(self.pairs(u, s), self.splat_const(ir.VectorType(I16, 2 * n), 1)))

    def int16_pair(self, lo, hi):
        """Two int32 lanes' values, each in int16's range, as one lane's pair of int16 (lo in the
        low half): the operand vpmaddwd and vpdpwssd multiply pair by pair."""
        b = self.b
        return b.or_(b.and_(lo, self.splat_const(lo.type, 0xFFFF)), b.shl(hi, self.splat_const(hi.type, 16)))

    def dpwssd(self, acc, a, b):
        """acc + lane i: a[2i] b[2i] + a[2i+1] b[2i+1] (int16 pairs, given as int32 lanes). VNNI:
        vpdpwssd (one instruction); else vpmaddwd + vpaddd."""
        n = acc.type.count
        w = ir.VectorType(I16, 2 * n)
        if self.isa == "vnni":
            cast = lambda v: self.b.bitcast(v, acc.type)
            return self.call(f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, acc, cast(a), cast(b))
        return self.b.add(acc, self.madd(self.b.bitcast(a, w), self.b.bitcast(b, w)))

    def dpbusd_bytes(self, acc, u, s):
        """dpbusd for unsigned bytes over the whole range 0..255 (the repacked Q8_0's q + 128). VNNI:
        vpdpbusd (its sums do not saturate). AVX2: a pair of 255 * 127 products overflows
        vpmaddubsw's int16, so u = 16 hi + lo is taken in nibbles: 16 dpbusd(hi) + dpbusd(lo)."""
        if self.isa == "vnni":
            return self.dpbusd(acc, u, s)
        hi = self.dpbusd(ir.Constant(D8, None), self.nibbles(u, True), s)
        lo = self.dpbusd(acc, self.nibbles(u, False), s)
        return self.b.add(lo, self.b.shl(hi, self.splat_const(D8, 4)))

    def scaled_dots(self, acc, us, ss, scale=None, most=15):
        """acc + scale x (the byte dot products of us[j] and ss[j], summed over j), per int32 lane
        (scale: int32 lanes in int16's range, None for 1; us unsigned up to `most`, ss signed bytes
        up to 127 in size). The same integers either way. VNNI: vpdpbusd into one sum, one vpmulld.
        AVX2: vpmaddubsw's int16 pair sums (at most 2 most 127 each) added in int16 as many at a
        time as cannot overflow, then vpmaddwd with the scale in both halves of each lane, which
        widens, adds the pairs and multiplies by the scale in one instruction."""
        b, n = self.b, acc.type.count
        if self.isa == "vnni":
            d = ir.Constant(acc.type, None)
            for u, s in zip(us, ss):
                d = self.dpbusd(d, u, s)
            return b.add(acc, d if scale is None else b.mul(d, scale))
        w16 = ir.VectorType(I16, 2 * n)
        both = self.splat_const(w16, 1) if scale is None else b.bitcast(self.int16_pair(scale, scale), w16)
        per_run = max(1, 32767 // (2 * most * 127))
        for i in range(0, len(us), per_run):
            run = self.pairs(us[i], ss[i])
            for j in range(i + 1, min(i + per_run, len(us))):
                run = b.add(run, self.pairs(us[j], ss[j]))
            acc = b.add(acc, self.madd(run, both))
        return acc

    def isum(self, v):
        """The 8 int32 lanes added (llvm.vector.reduce.add: vphaddd or shuffles and vpaddd)."""
        return self.call("llvm.vector.reduce.add.v8i32", I32, v)

    # ---- float ----------------------------------------------------------------------------------
    def to_float(self, v):
        """int32 lanes -> float32 lanes (vcvtdq2ps): exact below 2^24, as every sum here is."""
        return self.b.sitofp(v, ir.VectorType(FLOAT, v.type.count))

    def fma(self, a, b, c):
        """a * b + c lane by lane with one rounding (vfmadd231ps): written as the intrinsic, so the
        kernel's float operations are these and no others, whatever the compiler's flags."""
        return self.call(f"llvm.fma.v{a.type.count}f32", a.type, a, b, c)

    def fmax(self, a, b):
        """a > b ? a : b lane by lane (vmaxps: an ordered compare, so -inf and NaN as x86 has them)."""
        return self.b.select(self.b.fcmp_ordered(">", a, b), a, b)

    def exp(self, x):
        """e^x lane by lane: layer_ops.fast_exp's polynomial (Cephes' expf) on a vector, written out
        so that every kernel computing it gives the same bits: x clamped to [-87, 88], x = n ln2 + r,
        a degree-6 polynomial in r (multiply-adds), 2^n from the exponent bits."""
        b, ty = self.b, x.type
        c = lambda v: self.splat_const(ty, v)
        x = self.fmax(x, c(-87.0))
        x = b.select(b.fcmp_ordered("<", x, c(88.0)), x, c(88.0))
        n = self.call(f"llvm.floor.v{ty.count}f32", ty, self.fma(x, c(1.44269504088896341), c(0.5)))
        r = b.fadd(b.fsub(x, b.fmul(n, c(0.693359375))), b.fmul(n, c(2.12194440e-4)))
        p = c(1.9875691500e-4)
        for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = self.fma(p, r, c(k))
        y = b.fadd(self.fma(b.fmul(p, r), r, r), c(1.0))
        ni = ir.VectorType(I32, ty.count)
        two_n = b.bitcast(b.shl(b.add(b.fptosi(n, ni), self.splat_const(ni, 127)), self.splat_const(ni, 23)), ty)
        return b.fmul(y, two_n)

    def sums8(self, vs):
        """[the sum of vs[j]'s 8 lanes, j = 0..7]: eight horizontal sums at once, every one the same
        tree ((l0 + l2) + (l1 + l3)) + ((l4 + l6) + (l5 + l7)), whichever lane it lands in."""
        b = self.b
        lo = lambda a, c: self.shuffle(a, c, (0, 8, 1, 9, 4, 12, 5, 13))
        hi = lambda a, c: self.shuffle(a, c, (2, 10, 3, 11, 6, 14, 7, 15))
        x = [b.fadd(lo(vs[i], vs[i + 1]), hi(vs[i], vs[i + 1])) for i in range(0, 8, 2)]   # pairs: (l0+l2, l1+l3)
        y = [b.fadd(self.shuffle(x[i], x[i + 1], (0, 1, 8, 9, 4, 5, 12, 13)),
                    self.shuffle(x[i], x[i + 1], (2, 3, 10, 11, 6, 7, 14, 15))) for i in (0, 2)]
        return b.fadd(self.shuffle(y[0], y[1], (0, 1, 2, 3, 8, 9, 10, 11)),
                      self.shuffle(y[0], y[1], (4, 5, 6, 7, 12, 13, 14, 15)))

    def hsum(self, v):
        """The 8 float lanes added as a tree (fixed order: the same bits on any thread)."""
        b = self.b
        s4 = b.fadd(self.shuffle(v, v, range(4)), self.shuffle(v, v, range(4, 8)))
        s2 = b.fadd(self.shuffle(s4, s4, (0, 1)), self.shuffle(s4, s4, (2, 3)))
        return b.fadd(b.extract_element(s2, ir.Constant(I32, 0)), b.extract_element(s2, ir.Constant(I32, 1)))


class _Loop:
    def __init__(self, builder, n):
        self._cm = cgutils.for_range(builder, n)

    def __enter__(self):
        return self._cm.__enter__().index

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
