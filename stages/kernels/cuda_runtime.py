"""What the cuda stage runs on: whether this machine can run it at all (`probe`), and the one
object through which the backend asks anything of a GPU (`PyCudaDevice`: allocate, copy,
compile, launch, time). The tests put a CPU emulator with the same methods in its place
(app/cuda_emulator/), which runs the very kernel source, stages/kernels/cuda.cu.

Nothing here knows about models or ops: that is stages/cuda.py.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np

NVCC_OPTIONS = ["-O3", "-lineinfo"]


CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def load_libcuda():
    """The NVIDIA driver's user-space library (ctypes), or OSError."""
    name = {"win32": "nvcuda.dll", "darwin": "libcuda.dylib"}.get(sys.platform, "libcuda.so.1")
    return ctypes.CDLL(name)


@functools.lru_cache(maxsize=None)
def nvcc_archs(nvcc: str) -> tuple[str, ...]:
    """The sm_XY targets this nvcc compiles for (`nvcc --list-gpu-code`); () if it cannot say."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(a for a in out.split() if re.fullmatch(r"sm_\d+[a-z]?", a))


def choose_arch(capability: tuple[int, int], archs) -> str | None:
    """The target to compile for on a GPU of this compute capability: its own sm_XY when nvcc
    has it, else the newest sm_XZ of the same major below it (cubins run on later minors of
    their major); None when nvcc has nothing this GPU can run."""
    major, minor = capability
    plain = {}
    for a in archs:
        m = re.fullmatch(r"sm_(\d+)", a)
        if m:
            v = int(m.group(1))
            plain[(v // 10, v % 10)] = a
    if (major, minor) in plain:
        return plain[(major, minor)]
    lower = [cc for cc in plain if cc[0] == major and cc[1] < minor]
    return plain[max(lower)] if lower else None


def probe(find_spec=importlib.util.find_spec, load_driver=load_libcuda, which_nvcc=find_nvcc,
          list_archs=nvcc_archs, import_driver=None) -> str | None:
    """None if the cuda stage can run here, else one sentence: what is missing, how to get it.
    Checked in order: PyCUDA installed, the NVIDIA driver loads and initializes, a GPU is
    present, nvcc is there (SourceModule compiles with it) and can target that GPU, PyCUDA
    loads. Nothing here creates a CUDA context."""
    if find_spec("pycuda") is None:
        return ("PyCUDA is not installed: run `make setup-cuda` (needs an NVIDIA GPU with its driver "
                "and the CUDA toolkit's nvcc)")
    try:
        drv = load_driver()
    except OSError as e:
        return (f"no NVIDIA driver: libcuda cannot be loaded ({e}); install the NVIDIA driver for "
                f"your GPU (`nvidia-smi` should then list it)")
    rc = drv.cuInit(0)
    if rc == CUDA_ERROR_NO_DEVICE:
        return ("no NVIDIA GPU: the driver is installed but finds no device; check `nvidia-smi` "
                "and CUDA_VISIBLE_DEVICES")
    if rc == CUDA_ERROR_INSUFFICIENT_DRIVER:
        return "the NVIDIA driver is older than this CUDA needs: update the driver (`nvidia-smi` shows its version)"
    if rc != 0:
        return f"the NVIDIA driver failed to initialize (cuInit returned error {rc}); check `nvidia-smi`"
    count = ctypes.c_int(0)
    if drv.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no NVIDIA GPU: the driver finds no device; check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
    nvcc = which_nvcc()
    if nvcc is None:
        return ("nvcc not found: the cuda stage compiles its kernels with the CUDA toolkit's nvcc when "
                "it starts; install the CUDA toolkit and put its bin/ on PATH (or set CUDA_HOME)")
    device = int(os.environ.get("LLM_CUDA_DEVICE", "0"))
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    dev = ctypes.c_int(0)
    if (device < count.value and drv.cuDeviceGet(ctypes.byref(dev), device) == 0
            and drv.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) == 0
            and drv.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) == 0):
        archs = list_archs(nvcc)
        if archs and choose_arch((major.value, minor.value), archs) is None:
            return (f"this GPU is sm_{major.value}{minor.value} but {nvcc} compiles only for "
                    f"{archs[0]}..{archs[-1]}: install a CUDA toolkit that supports this GPU")
    try:
        (import_driver or (lambda: importlib.import_module("pycuda.driver")))()
    except ImportError as e:
        return f"PyCUDA is installed but does not load ({e}); reinstall it: `make setup-cuda`"
    return None


@functools.lru_cache(maxsize=1)
def probe_once() -> str | None:
    """probe(), asked once per process."""
    return probe()


# ---- PyCUDA ----------------------------------------------------------------------------------

_CONTEXT = None


def _release_context():
    global _CONTEXT
    if _CONTEXT is not None:
        _CONTEXT.pop()
        _CONTEXT = None
        from pycuda.tools import clear_context_caches
        clear_context_caches()


def _context():
    """The primary context of GPU LLM_CUDA_DEVICE (0), made current once per process."""
    global _CONTEXT
    if _CONTEXT is None:
        import pycuda.driver as cuda
        cuda.init()
        ctx = cuda.Device(int(os.environ.get("LLM_CUDA_DEVICE", "0"))).retain_primary_context()
        ctx.push()
        _CONTEXT = ctx
        atexit.register(_release_context)
    return _CONTEXT


class PyCudaDevice:
    """Everything CudaBackend asks of a GPU, through PyCUDA. (The tests put a CPU emulator with
    the same methods in its place: app/cuda_emulator/.)"""

    def __init__(self):
        import pycuda.driver as cuda
        self.cuda = cuda
        dev = _context().get_device()
        self.name = dev.name()
        self.compute_capability = dev.compute_capability()
        self.total_memory = dev.total_memory()
        self.nvcc = find_nvcc()
        self.arch = choose_arch(self.compute_capability, nvcc_archs(self.nvcc)) if self.nvcc else None
        self.module = self._source = None

    def alloc(self, nbytes: int):
        """(owner, device address); the memory is freed when the owner is garbage."""
        a = self.cuda.mem_alloc(max(1, int(nbytes)))
        return a, int(a)

    def htod(self, ptr: int, host: np.ndarray):
        self.cuda.memcpy_htod(ptr, host)

    def dtoh(self, host: np.ndarray, ptr: int):
        self.cuda.memcpy_dtoh(host, ptr)

    def pinned(self, n: int, dtype) -> np.ndarray:
        return self.cuda.pagelocked_empty(n, dtype)

    def compile(self, source: str, include_dirs=()):
        """Compile (PyCUDA caches the cubin on disk, so later processes only load it); once per
        device object, however many backends share it. include_dirs: where the source's
        #include "..." files are (a learner's kernel includes the stage's cuda.cu)."""
        if self.module is None or self._source != source:
            from pycuda.compiler import SourceModule
            self.module = SourceModule(source, nvcc=self.nvcc or "nvcc", options=NVCC_OPTIONS, no_extern_c=True,
                                       arch=self.arch, include_dirs=[str(d) for d in include_dirs])
            self._source = source

    def function(self, name: str, argtypes: str):
        """A launcher: f(grid, block, *args)."""
        f = self.module.get_function(name)
        f.prepare(argtypes)
        return f.prepared_call

    def event(self):
        return self.cuda.Event()

    def record(self, event):
        event.record()

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return start.time_till(end)

    def synchronize(self):
        self.cuda.Context.synchronize()
