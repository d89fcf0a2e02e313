"""The cuda stage without a GPU: its kernels on the CPU, for the tests.

scripts/cuda_emulator.cpp wraps stages/kernels/cuda.cu (the same source PyCUDA compiles for the
GPU) in a small emulator of CUDA threads, blocks, barriers and warp shuffles; g++ builds it
into a shared library. EmulatedDevice has the methods of stages.cuda.PyCudaDevice, with host
memory standing in for device memory, so

    CudaBackend(device=EmulatedDevice(build()))

runs the whole cuda stage (the same Python, the same kernels) on the CPU, slowly. What it checks
that nothing else can without a GPU: every kernel's indexing, reductions and barriers, every
launch's grid and arguments, every pointer the backend computes (each must fall inside an
allocation; writes past an allocation's end are caught by guard bytes), and the graph running
end to end on device handles. What it cannot check: the device-only code paths (the f16
conversion instruction, float4 loads), timing, and races that the OS threads happen not to hit.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "scripts" / "cuda_emulator.cpp", ROOT / "stages" / "kernels" / "cuda.cu")
GUARD = 256                  # guard bytes on each side of every allocation
GUARD_BYTE = 0xA5
# CUDA_EMULATOR_ASAN=1: build with AddressSanitizer and allocate without guard bytes, so that a
# kernel reading past an allocation is reported too (run python with
# LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0).
ASAN = os.environ.get("CUDA_EMULATOR_ASAN") == "1"


class EmulatorError(RuntimeError):
    pass


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")


def build(out_dir: Path | None = None) -> Path:
    """Compile the emulator (once per source version) and return the library's path."""
    cxx = compiler()
    if cxx is None:
        raise EmulatorError("no C++ compiler (g++) to build the CUDA emulator")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    out_dir = Path(out_dir or ROOT / ".pytest_cache" / "cuda_emulator")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cuda_emulator_{digest}{'_asan' if ASAN else ''}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-DCUDA_EMULATOR",
               "-Wall", "-Wno-unknown-pragmas", "-Werror", "-I", str(ROOT / "stages" / "kernels"),
               str(SOURCES[0]), "-o", str(tmp)] + (["-fsanitize=address", "-fno-omit-frame-pointer"] if ASAN else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulatorError(f"building the CUDA emulator failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


class _Event:
    __slots__ = ("t",)

    def __init__(self):
        self.t = 0.0


_CTYPES = {"P": ctypes.c_void_p, "i": ctypes.c_int32, "f": ctypes.c_float, "d": ctypes.c_double}


class EmulatedDevice:
    """stages.cuda.PyCudaDevice's methods over host memory and the emulator library."""

    name = "CPU emulator of the CUDA kernels"
    compute_capability = (0, 0)
    arch = None

    def __init__(self, lib_path: Path | None = None):
        self.lib = ctypes.CDLL(str(lib_path or build()))
        self.lib.emu_launch.restype = ctypes.c_int
        self.lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.emu_error.restype = ctypes.c_char_p
        self.lib.emu_dequantize.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
        self._buffers = {}              # start address -> (numpy buffer, size)
        self._starts = []               # sorted start addresses
        self.compiled = False
        self.launches = 0

    # ---- memory ------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        nbytes = max(1, int(nbytes))
        if ASAN:                                                # exact bounds for the sanitizer
            buf = np.zeros(nbytes, np.uint8)
            self._buffers[buf.ctypes.data] = (buf, nbytes)
            bisect.insort(self._starts, buf.ctypes.data)
            return buf, buf.ctypes.data
        buf = np.full(nbytes + 2 * GUARD + 256, GUARD_BYTE, np.uint8)
        base = buf.ctypes.data
        start = base + GUARD + (-(base + GUARD) % 256)          # 256-aligned like cuMemAlloc
        buf[start - base:start - base + nbytes] = 0
        self._buffers[start] = (buf, nbytes)
        bisect.insort(self._starts, start)
        return buf, start

    def owner_of(self, ptr: int):
        """(start, size) of the allocation holding address ptr, or None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        size = self._buffers[start][1]
        return (start, size) if ptr < start + size else None

    def check_guards(self):
        """Raise if any kernel wrote past either end of an allocation."""
        for start, (buf, size) in self._buffers.items():
            if ASAN:
                return
            lo = start - buf.ctypes.data
            before, after = buf[lo - GUARD:lo], buf[lo + size:lo + size + GUARD]
            if (before != GUARD_BYTE).any() or (after != GUARD_BYTE).any():
                raise EmulatorError(f"a kernel wrote outside the allocation at 0x{start:x} ({size} bytes)")

    def htod(self, ptr: int, host: np.ndarray):
        host = np.ascontiguousarray(host)
        self._check_span(ptr, host.nbytes, "htod")
        ctypes.memmove(ptr, host.ctypes.data, host.nbytes)

    def dtoh(self, host: np.ndarray, ptr: int):
        assert host.flags.c_contiguous
        self._check_span(ptr, host.nbytes, "dtoh")
        ctypes.memmove(host.ctypes.data, ptr, host.nbytes)

    def _check_span(self, ptr, nbytes, what):
        own = self.owner_of(ptr)
        if own is None or ptr + nbytes > own[0] + own[1]:
            raise EmulatorError(f"{what}: {nbytes} bytes at 0x{ptr:x} are not inside one allocation")

    def pinned(self, n: int, dtype) -> np.ndarray:
        return np.zeros(n, dtype)

    # ---- kernels -------------------------------------------------------------------------
    def compile(self, source: str):
        self.compiled = True

    def function(self, name: str, argtypes: str):
        if not self.lib.emu_has(name.encode()):
            raise EmulatorError(f"the kernel source has no kernel '{name}'")
        lib, cname = self.lib, name.encode()

        def launch(grid, block, *args):
            if len(args) != len(argtypes):
                raise EmulatorError(f"{name}: {len(args)} arguments for the signature '{argtypes}'")
            values = []
            for code, a in zip(argtypes, args):
                if code == "P":
                    if self.owner_of(int(a)) is None:
                        raise EmulatorError(f"{name}: pointer 0x{int(a):x} is not inside any allocation")
                elif code == "i" and not -2**31 <= int(a) < 2**31:
                    raise EmulatorError(f"{name}: {a} does not fit an int32 argument")
                values.append(_CTYPES[code](a))
            ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
            g = tuple(grid) + (1,) * (3 - len(grid))
            b = tuple(block) + (1,) * (3 - len(block))
            if lib.emu_launch(cname, *g, *b, ptrs) != 0:
                raise EmulatorError(f"{name} grid {g} block {b}: {lib.emu_error().decode()}")
            self.launches += 1
        return launch

    def dequantize(self, suffix: str, raw: np.ndarray, n_values: int) -> np.ndarray:
        """The kernels' block decoders run on the host: raw blocks -> float32 [n_values]."""
        raw = np.ascontiguousarray(raw, np.uint8)
        out = np.empty(n_values, np.float32)
        if self.lib.emu_dequantize(suffix.encode(), raw.ctypes.data, n_values, out.ctypes.data) != 0:
            raise EmulatorError(f"no decoder for '{suffix}'")
        return out

    # ---- events --------------------------------------------------------------------------
    def event(self):
        return _Event()

    def record(self, event):
        event.t = time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return (end.t - start.t) * 1e3

    def synchronize(self):
        pass
