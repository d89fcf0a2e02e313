"""Stage 6, cuda: the whole forward pass on the GPU, with nothing crossing the bus that need not.

The lesson: a GPU is fast only while it has the data and the work. Everything the earlier
stages learned still holds (keep the weights in their quantized blocks, keep K and V, never
compute a token twice); what is new is the *distance*. The weights, the KV cache and every
intermediate live in GPU memory; per token the host sends one token id and gets one token id
back. What remains on the CPU is Python launching kernels: 16 launches per layer per
token, each costing microseconds of Python, against weights that an H200 reads in tens of
microseconds for SmolLM2 (the profile below shows which one wins on your machine).

The article's Optimization 5 moved the kernels to the GPU and made two mistakes that this
stage does not repeat:

1. A cudaMalloc and a cudaFree around every op. Allocation synchronizes and goes through the
   driver; the article's profile shows cudaFree at 95.9% of all CUDA API time. Here device
   memory is allocated only while the model loads: each weight once, the KV cache, and one
   scratch arena. Every intermediate (a matmul's output, a norm's, ...) is carved out of the
   arena by a bump allocator that starts again at the top of every forward pass, because
   nothing of the previous pass is needed any more (K and V live in the cache, not in the
   arena). `device_allocs` counts every cuMemAlloc; tests check that it does not move while
   tokens are generated.
2. Copying all n_vocab logits back to the host every token (128 KB for TinyLlama's 32000)
   to take their argmax there. Here a one-block argmax kernel reduces them on the device and
   4 bytes come back. Sampling with a temperature needs the whole distribution, so that path
   still copies the logits (forward(..., all_logits=False)); greedy decoding never does.

The kernels (stages/cuda_kernels.cu, compiled at first use by PyCUDA's SourceModule for the
GPU's own architecture):
* fused dequantize-matmul for every ggml type common/quants.py decodes (F32 F16 BF16 Q4_0 Q4_1
  Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K): the weight row is read once, in its ggml blocks,
  and dequantized in registers. Decode (one activation row): one warp per output row, lanes
  walking the row's blocks side by side, a warp-shuffle sum at the end. Prefill: the same warp
  multiplies each decoded chunk into 8 activation rows, so a weight byte fetched once serves 8
  tokens.
* attention fused into one kernel with an online softmax: each (query row, head) keeps a
  running maximum, a running sum and a running weighted sum of V over the cached positions, so
  the scores are never stored; grouped KV heads (head h reads KV head h // (H/Hkv)).
* embedding lookup (dequantizing the row on the device), rms_norm, RoPE ('NORM' mode), the
  KV-cache store, silu(gate)*up in one pass, add, argmax.

The KV cache is float32 [n_layer, n_ctx, Hkv*hd] for K and for V, like the CPU stages' (f16
would halve the bytes attention reads; on a 2048-token context that read is small next to the
weights). No --use_fast_math: the kernels wait on memory, not on arithmetic, so approximate
exp and division would buy nothing and cost agreement with the CPU stages.

Why CudaBackend inherits from common.backend.Backend, not from the quantized stage: it
overrides every op the graph calls, and an op it forgot must fail loudly instead of handing
device pointers to a numba kernel. The quantized stage's lesson (blocks stay blocks, fused
dequantize-matmul) is carried over in the kernels, not in the class hierarchy.

Arrays flowing through the graph are DeviceArray handles (a pointer and a shape). A handle
from the arena is valid until the next forward pass starts; using it later raises an error
instead of reading whatever the arena holds by then.

Prefill longer than `max_batch` rows (64; LLM_CUDA_MAX_BATCH) is fed to the model in pieces
(LlamaModel splits it), so the arena is sized for max_batch rows, not for n_ctx.

Everything CudaBackend asks of the GPU goes through one small object (PyCudaDevice: allocate,
copy, compile, launch, time). The tests put a CPU emulator with the same methods in its place
(tests/cuda_emulator.py), which runs this very kernel source, so the stage is checked end to
end on machines without a GPU; the GPU tests repeat those checks through PyCUDA.

Profile (CUDA events around every launch, off by default because events cost time):
    LLM_CUDA_PROFILE=1 python -m common run --stage cuda        # table printed at exit
    engine.backend.start_profile(); ...; print(engine.backend.profile_table())
    python scripts/cuda_profile.py -m MODEL                     # table + JSON with copies per token
An event pair brackets each launch, so a kernel's time includes any wait for Python to launch
it: small kernels read as upper bounds.
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
from pathlib import Path

import numpy as np

from common.backend import Backend
from common.gguf import BLOCK_SIZES, GGMLType
from common.quants import UnsupportedTypeError, dequantize_tensor

KERNEL_SOURCE = Path(__file__).with_name("cuda_kernels.cu")
# The CPU stages' tolerance. Measured: 3.5e-5 on the default model through the CPU emulator of
# these kernels (tests/cuda_emulator.py: the same code and summation order; a GPU adds fused
# multiply-adds); scripts/gpu_check.sh prints the GPU's own figure.
LOGIT_TOLERANCE = 5e-3

# Launch constants; they must match the #defines at the top of cuda_kernels.cu.
MM_WARPS = 4
MM_THREADS = 32 * MM_WARPS
MT_PREFILL = 8
EMBED_THREADS = 128
NORM_THREADS = 256
EW_THREADS = 256
ATT_THREADS = 256
HD_MAX = 256
ARGMAX_THREADS = 1024
ALIGN = 256                  # every buffer in the arena starts on this boundary

DEFAULT_MAX_BATCH = 64
NVCC_OPTIONS = ["-O3", "-lineinfo"]

# ggml type -> the suffix of its kernels (matmul_<suffix>_m1, _m8, embed_<suffix>)
KERNEL_TYPES = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q5_0: "q5_0", GGMLType.Q5_1: "q5_1",
    GGMLType.Q8_0: "q8_0", GGMLType.Q2_K: "q2_k", GGMLType.Q3_K: "q3_k", GGMLType.Q4_K: "q4_k",
    GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
}

# Argument types of every kernel (PyCUDA's prepared calls: P pointer, i int32, f float32,
# d float64), in the order of the parameters in cuda_kernels.cu.
KERNEL_ARGS = {"matmul": "PPPiiii", "embed": "PPPii", "rms_norm": "PPPid", "rope": "PPPPiiii",
               "kv_store": "PPPPi", "attention": "PPPPiiiif", "swiglu": "PPPi", "silu": "PPi",
               "add": "PPPi", "mul": "PPPi", "scale": "PPif", "argmax": "PiP"}


def kernel_names() -> list[str]:
    """Every entry point of cuda_kernels.cu."""
    names = [n for n in KERNEL_ARGS if n not in ("matmul", "embed")]
    for suffix in KERNEL_TYPES.values():
        names += [f"matmul_{suffix}_m1", f"matmul_{suffix}_m{MT_PREFILL}", f"embed_{suffix}"]
    return names


def arg_types(name: str) -> str:
    return KERNEL_ARGS[name.split("_")[0] if name.startswith(("matmul_", "embed_")) else name]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- can this machine run the stage? ---------------------------------------------------------

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
def _probe_once() -> str | None:
    return probe()


# ---- device memory ---------------------------------------------------------------------------

class ArenaExhausted(RuntimeError):
    pass


class StaleArrayError(RuntimeError):
    pass


class Arena:
    """One device allocation handed out front to back. reset() at the start of every forward
    pass makes all of it free again: no allocation or free on the per-token path.

    Pure bookkeeping on integers (base is a device address), so it is tested without a GPU."""

    def __init__(self, base: int, nbytes: int, align: int = ALIGN):
        self.base, self.nbytes, self.align = int(base), int(nbytes), align
        self.offset = 0
        self.generation = 0          # incremented by reset(): arrays of older generations are stale
        self.high_water = 0          # the most bytes one forward pass has used
        self.allocs = 0              # sub-buffers handed out, all time

    def alloc(self, nbytes: int) -> int:
        size = -(-int(nbytes) // self.align) * self.align
        if self.offset + size > self.nbytes:
            raise ArenaExhausted(
                f"cuda scratch arena exhausted: {nbytes} bytes asked, {self.nbytes - self.offset} of "
                f"{self.nbytes} left in this forward pass (the arena is sized at load for max_batch "
                f"rows; feed longer prompts in pieces, as LlamaModel does)")
        ptr = self.base + self.offset
        self.offset += size
        self.high_water = max(self.high_water, self.offset)
        self.allocs += 1
        return ptr

    def reset(self):
        self.offset = 0
        self.generation += 1


def arena_bytes(out_dims, max_width: int, n_matrices: int, max_batch: int) -> int:
    """Arena bytes for one forward pass of max_batch rows. Every matmul output is one buffer
    ([rows, out]); the other ops (norms, RoPE, attention, adds, swiglu) allocate no more than
    twice the matmul outputs of a layer, plus the embedding and final norm rows; every buffer
    is rounded up to ALIGN; the token ids take max_batch int32."""
    floats_per_row = 3 * sum(int(n) for n in out_dims) + 4 * int(max_width)
    return (max_batch * floats_per_row * 4 + (3 * n_matrices + 16) * ALIGN
            + cdiv(max_batch * 4, ALIGN) * ALIGN)


class DeviceArray:
    """A float32 array in device memory: an address and a shape. gen is the arena generation
    it was allocated in (None: memory that lives as long as the backend: weights, tables, KV)."""

    __slots__ = ("ptr", "shape", "gen")
    dtype = np.dtype(np.float32)

    def __init__(self, ptr: int, shape, gen=None):
        self.ptr, self.shape, self.gen = int(ptr), tuple(int(s) for s in shape), gen

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, gen={self.gen})"


class DeviceMatrix:
    """A weight [n_out, n_in] on the device, in its ggml blocks exactly as in the file."""

    __slots__ = ("ptr", "ggml_type", "n_out", "n_in", "row_bytes", "nbytes", "suffix", "name")

    def __init__(self, ptr, ggml_type, n_out, n_in, row_bytes, name=""):
        self.ptr, self.ggml_type, self.n_out, self.n_in = int(ptr), GGMLType(ggml_type), int(n_out), int(n_in)
        self.row_bytes, self.nbytes, self.name = int(row_bytes), int(row_bytes) * int(n_out), name
        self.suffix = KERNEL_TYPES[self.ggml_type]

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    def __repr__(self):
        return f"DeviceMatrix({self.name!r}, {self.ggml_type.name}, {self.shape})"


class DeviceKVCache:
    """K and V for every layer and position: two float32 [n_layer, n_ctx, kv_dim] device arrays."""

    def __init__(self, backend: "CudaBackend", n_layer: int, n_ctx: int, kv_dim: int):
        self.backend, self.n_layer, self.n_ctx, self.kv_dim = backend, n_layer, n_ctx, kv_dim
        layer_bytes = n_ctx * kv_dim * 4
        self.k = backend._alloc_permanent(n_layer * layer_bytes, "KV cache: K")
        self.v = backend._alloc_permanent(n_layer * layer_bytes, "KV cache: V")
        self.layer_bytes = layer_bytes
        self.nbytes = 2 * n_layer * layer_bytes

    def store(self, layer: int, start_pos: int, k, v):
        """Write the new rows k, v [M, kv_dim] at positions start_pos.. of `layer`; return
        handles to all positions so far, [start_pos + M, kv_dim] each."""
        b = self.backend
        k, v = b._device(k), b._device(v)
        m = k.shape[0]
        if k.shape != (m, self.kv_dim) or v.shape != k.shape:
            raise ValueError(f"kv store: k {k.shape} and v {v.shape} must both be [M, {self.kv_dim}]")
        if not (0 <= layer < self.n_layer and 0 <= start_pos and start_pos + m <= self.n_ctx):
            raise ValueError(f"kv store: layer {layer}, positions {start_pos}..{start_pos + m - 1} are outside "
                             f"the cache ({self.n_layer} layers, {self.n_ctx} positions)")
        at = layer * self.layer_bytes + start_pos * self.kv_dim * 4
        n = m * self.kv_dim
        b._launch("kv_store", (cdiv(n, EW_THREADS), 1), (EW_THREADS, 1, 1), k.ptr, v.ptr, self.k + at, self.v + at, n)
        end = start_pos + m
        return (DeviceArray(self.k + layer * self.layer_bytes, (end, self.kv_dim)),
                DeviceArray(self.v + layer * self.layer_bytes, (end, self.kv_dim)))

    def reset(self):
        """Nothing to clear: positions past the current length are never read."""


# ---- the profile -----------------------------------------------------------------------------

def format_profile_table(rows: list[dict], transfers: dict | None = None, title: str = "") -> str:
    """nvprof-style: kernel, calls, total ms, average us, share of the kernel time."""
    lines = [title] if title else []
    width = max([len("Kernel")] + [len(r["kernel"]) for r in rows])
    lines.append(f"{'Kernel':<{width}} {'Calls':>8} {'Total(ms)':>11} {'Avg(us)':>10} {'Share':>7}")
    total_ms = sum(r["total_ms"] for r in rows)
    for r in rows:
        lines.append(f"{r['kernel']:<{width}} {r['calls']:>8d} {r['total_ms']:>11.3f} {r['avg_us']:>10.2f} "
                     f"{r['share'] * 100:>6.1f}%")
    lines.append(f"{'total':<{width}} {sum(r['calls'] for r in rows):>8d} {total_ms:>11.3f}")
    if transfers:
        f = transfers.get("forwards") or 0
        per = (lambda key: transfers[key] / f) if f else (lambda key: float("nan"))
        lines.append(f"host->device: {transfers['h2d_count']} copies, {transfers['h2d_bytes']} bytes; "
                     f"device->host: {transfers['d2h_count']} copies, {transfers['d2h_bytes']} bytes; over "
                     f"{f} forward passes ({per('h2d_count'):.1f} + {per('d2h_count'):.1f} copies, "
                     f"{per('h2d_bytes'):.0f} + {per('d2h_bytes'):.0f} bytes each)")
    return "\n".join(lines)


def profile_rows(totals: dict) -> list[dict]:
    """{kernel: [calls, total_ms]} -> rows by total time, with avg and share."""
    grand = sum(t for _, t in totals.values()) or 1.0
    return [{"kernel": k, "calls": c, "total_ms": t, "avg_us": t / c * 1e3 if c else 0.0, "share": t / grand}
            for k, (c, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])]


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
    the same methods in its place: tests/cuda_emulator.py.)"""

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

    def compile(self, source: str):
        """Compile (PyCUDA caches the cubin on disk, so later processes only load it); once per
        device object, however many backends share it."""
        if self.module is None or self._source != source:
            from pycuda.compiler import SourceModule
            self.module = SourceModule(source, nvcc=self.nvcc or "nvcc", options=NVCC_OPTIONS, no_extern_c=True,
                                       arch=self.arch)
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


# ---- the backend -----------------------------------------------------------------------------

class CudaBackend(Backend):
    name = "cuda"

    @staticmethod
    def unavailable_reason() -> str | None:
        return _probe_once()

    def __init__(self, threads: int | None = None, *, device=None, max_batch: int | None = None,
                 scratch_bytes: int | None = None, profile: bool | None = None):
        super().__init__(threads=1)            # one Python thread drives the GPU
        self.device = device if device is not None else PyCudaDevice()
        self.max_batch = int(max_batch or os.environ.get("LLM_CUDA_MAX_BATCH", DEFAULT_MAX_BATCH))
        self._scratch_request = scratch_bytes
        self._owners = []                      # keeps every device allocation alive
        self.device_allocs = 0                 # cuMemAlloc calls, all time: load only
        self.device_bytes = 0
        self.h2d_count = self.h2d_bytes = self.d2h_count = self.d2h_bytes = 0
        self.forwards = 0                      # forward passes started (embed calls)
        self.rows = 0                          # token rows fed through embed
        self.arena: Arena | None = None
        self._out_dims: list[int] = []         # output width of every matrix, for the arena size
        self._max_width = 0
        self._fns = {}
        self._compiled = False
        self._argmax_dev = self._alloc_permanent(4, "argmax result")
        self._argmax_host = self.device.pinned(1, np.int32)
        self._ids_host = self.device.pinned(self.max_batch, np.int32)
        # profiling
        self._profiling = False
        self._pending = []                     # (kernel, start event, end event) not yet read
        self._event_pool = []
        self._totals: dict[str, list] = {}
        self._transfers_at_start: dict = {}
        if profile if profile is not None else os.environ.get("LLM_CUDA_PROFILE") == "1":
            self.start_profile()
            atexit.register(lambda: print(self.profile_table(), file=sys.stderr))

    # ---- memory ------------------------------------------------------------------------------
    def _alloc_permanent(self, nbytes: int, what: str) -> int:
        owner, ptr = self.device.alloc(nbytes)
        self._owners.append((what, owner))
        self.device_allocs += 1
        self.device_bytes += int(nbytes)
        return ptr

    def _htod(self, ptr: int, host: np.ndarray):
        self.device.htod(ptr, host)
        self.h2d_count += 1
        self.h2d_bytes += host.nbytes

    def _dtoh(self, host: np.ndarray, ptr: int):
        self.device.dtoh(host, ptr)
        self.d2h_count += 1
        self.d2h_bytes += host.nbytes

    def _ensure_arena(self):
        if self.arena is None:
            n = self._scratch_request or arena_bytes(self._out_dims, self._max_width, len(self._out_dims),
                                                       self.max_batch)
            self.arena = Arena(self._alloc_permanent(n, "scratch arena"), n)
        return self.arena

    def _empty(self, shape) -> DeviceArray:
        """A new float32 buffer for this forward pass, from the arena."""
        arena = self._ensure_arena()
        shape = tuple(int(s) for s in shape)
        return DeviceArray(arena.alloc(4 * int(np.prod(shape, dtype=np.int64))), shape, arena.generation)

    def _device(self, x) -> DeviceArray:
        """x as a device array: a handle is checked for staleness, a numpy array is uploaded
        (and counted as a copy: the graph never passes one, so the counters would show it)."""
        if isinstance(x, DeviceArray):
            if x.gen is not None and (self.arena is None or x.gen != self.arena.generation):
                raise StaleArrayError(f"{x} belongs to an earlier forward pass: its arena memory has been "
                                      f"reused (copy results to the host with to_host before the next pass)")
            return x
        if isinstance(x, DeviceMatrix):
            raise TypeError(f"{x} is a weight matrix, not an activation")
        host = np.ascontiguousarray(x, dtype=np.float32)
        out = self._empty(host.shape)
        if host.size:
            self._htod(out.ptr, host)
        return out

    def upload(self, x) -> DeviceArray:
        """A host array into this forward pass's arena (tests and notebooks)."""
        return self._device(x)

    def new_forward(self):
        """Start a forward pass: everything in the arena is free again."""
        self._ensure_arena().reset()

    # ---- weights -----------------------------------------------------------------------------
    def _upload_raw(self, raw: np.ndarray, what: str) -> int:
        raw = np.ascontiguousarray(raw).view(np.uint8)
        ptr = self._alloc_permanent(raw.nbytes, what)
        try:
            self._htod(ptr, raw)
        except (TypeError, ValueError, BufferError):     # a read-only mmap view PyCUDA will not take
            self._htod(ptr, np.array(raw))
        return ptr

    def _matrix(self, tensor) -> DeviceMatrix:
        t = GGMLType(tensor.ggml_type)
        if t not in KERNEL_TYPES:
            raise UnsupportedTypeError(f"cuda stage: no kernel for ggml type {t.name} (tensor '{tensor.name}'); "
                                       f"supported: {', '.join(x.name for x in KERNEL_TYPES)}")
        if len(tensor.shape) != 2:
            raise ValueError(f"cuda stage: '{tensor.name}' has shape {tensor.shape}, expected [out, in]")
        n_out, n_in = (int(s) for s in tensor.shape)
        rows = tensor.rows()
        ptr = self._upload_raw(rows, tensor.name)
        self._max_width = max(self._max_width, n_out, n_in)
        return DeviceMatrix(ptr, t, n_out, n_in, rows.shape[1], tensor.name)

    def prepare_matrix(self, tensor):
        m = self._matrix(tensor)
        self._out_dims.append(m.n_out)
        return m

    def prepare_embedding(self, tensor):
        return self._matrix(tensor)

    def tie_output(self, embedding, tensor):
        """The output matrix IS the embedding table: the same device blocks, uploaded once."""
        self._out_dims.append(embedding.n_out)
        return embedding

    def prepare_vector(self, tensor):
        v = np.ascontiguousarray(dequantize_tensor(tensor), dtype=np.float32)
        ptr = self._alloc_permanent(v.nbytes, tensor.name)
        self._htod(ptr, v)
        self._max_width = max(self._max_width, v.size)
        return DeviceArray(ptr, v.shape)

    def prepare_table(self, table):
        t = np.ascontiguousarray(table, dtype=np.float32)
        ptr = self._alloc_permanent(t.nbytes, "table")
        self._htod(ptr, t)
        return DeviceArray(ptr, t.shape)

    def new_kv_cache(self, n_layer, n_ctx, kv_dim):
        """Called last while the model loads: the KV cache, then the scratch arena, whose size
        needs every matrix's shape."""
        cache = DeviceKVCache(self, n_layer, n_ctx, kv_dim)
        self._ensure_arena()
        self._transfers_at_start = self.transfer_stats()     # a profile counts copies from here
        return cache

    def weight_bytes(self, weight) -> int:
        return int(getattr(weight, "nbytes", 0))

    def to_host(self, x) -> np.ndarray:
        if not isinstance(x, DeviceArray):
            return np.asarray(x)
        x = self._device(x)
        out = np.empty(x.shape, np.float32)
        if x.size:
            self._dtoh(out, x.ptr)
        return out

    def last_row(self, x):
        x = self._device(x)
        m, d = x.shape
        return DeviceArray(x.ptr + (m - 1) * d * 4, (1, d), x.gen)

    # ---- kernels -----------------------------------------------------------------------------
    def _compile(self):
        if not self._compiled:
            self.device.compile(KERNEL_SOURCE.read_text())
            self._compiled = True

    def _fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            self._compile()
            f = self._fns[name] = self.device.function(name, arg_types(name))
        return f

    def _launch(self, name: str, grid, block, *args):
        f = self._fns.get(name) or self._fn(name)
        if self._profiling:
            start, end = self._event_pool.pop() if self._event_pool else (self.device.event(), self.device.event())
            self.device.record(start)
            f(grid, block, *args)
            self.device.record(end)
            self._pending.append((name, start, end))
            if len(self._pending) >= 4096:
                self._harvest()
        else:
            f(grid, block, *args)

    def warmup(self):
        """Compile the kernels (PyCUDA caches the binary on disk: later runs only load it)."""
        for name in kernel_names():
            self._fn(name)

    # ---- the ops -----------------------------------------------------------------------------
    def embed(self, table, ids):
        """Start of a forward pass: reset the arena, send the token ids (the only host->device
        copy of a token), dequantize their rows on the device."""
        ids = np.asarray(ids).reshape(-1)
        m, d = len(ids), table.n_in
        if m and (ids.min() < 0 or ids.max() >= table.n_out):
            raise ValueError(f"token ids must be in 0..{table.n_out - 1}")
        self.new_forward()
        self.forwards += 1
        self.rows += m
        ids_dev = self._ensure_arena().alloc(4 * max(m, 1))
        host = self._ids_host[:m] if m <= len(self._ids_host) else np.empty(m, np.int32)
        host[:] = ids
        self._htod(ids_dev, host)
        out = self._empty((m, d))
        if table.suffix in ("f32", "f16", "bf16"):
            grid = (cdiv(d, EMBED_THREADS), m)
        else:
            qk, _ = BLOCK_SIZES[table.ggml_type]
            grid = (cdiv(d // qk * _chunks_per_block(table.ggml_type), EMBED_THREADS), m)
        self._launch(f"embed_{table.suffix}", grid, (EMBED_THREADS, 1, 1), table.ptr, ids_dev, out.ptr, d,
                     table.row_bytes)
        return out

    def matmul(self, x, w):
        x = self._device(x)
        m, k = x.shape
        if k != w.n_in:
            raise ValueError(f"matmul: x is [{m}, {k}] but {w} takes rows of {w.n_in}")
        y = self._empty((m, w.n_out))
        mt = 1 if m == 1 else MT_PREFILL
        self._launch(f"matmul_{w.suffix}_m{mt}", matmul_grid(w.n_out, m, mt), (MM_THREADS, 1, 1),
                     w.ptr, x.ptr, y.ptr, w.n_out, k, m, w.row_bytes)
        return y

    def _elementwise(self, name, a, b):
        a, b = self._device(a), self._device(b)
        if a.shape != b.shape:
            raise ValueError(f"{name}: shapes {a.shape} and {b.shape} differ")
        out = self._empty(a.shape)
        self._launch(name, (cdiv(a.size, EW_THREADS), 1), (EW_THREADS, 1, 1), a.ptr, b.ptr, out.ptr, a.size)
        return out

    def add(self, a, b):
        return self._elementwise("add", a, b)

    def mul(self, a, b):
        return self._elementwise("mul", a, b)

    def swiglu(self, gate, up):
        """silu(gate) * up in one kernel: one read of each input, one write, no temporary."""
        return self._elementwise("swiglu", gate, up)

    def silu(self, x):
        x = self._device(x)
        out = self._empty(x.shape)
        self._launch("silu", (cdiv(x.size, EW_THREADS), 1), (EW_THREADS, 1, 1), x.ptr, out.ptr, x.size)
        return out

    def scale(self, x, s):
        x = self._device(x)
        out = self._empty(x.shape)
        self._launch("scale", (cdiv(x.size, EW_THREADS), 1), (EW_THREADS, 1, 1), x.ptr, out.ptr, x.size,
                     np.float32(s))
        return out

    def rms_norm(self, x, weight, eps):
        x = self._device(x)
        m, d = x.shape
        if weight.shape != (d,):
            raise ValueError(f"rms_norm: x is [{m}, {d}], weight {weight.shape}")
        out = self._empty(x.shape)
        self._launch("rms_norm", (m, 1), (NORM_THREADS, 1, 1), x.ptr, weight.ptr, out.ptr, d, float(eps))
        return out

    def rope(self, x, cos, sin, start_pos, n_heads):
        x = self._device(x)
        m, width = x.shape
        n_ctx, half = cos.shape
        if width != n_heads * 2 * half or sin.shape != cos.shape:
            raise ValueError(f"rope: x [{m}, {width}] is not {n_heads} heads of {2 * half}")
        if start_pos < 0 or start_pos + m > n_ctx:
            raise ValueError(f"rope: positions {start_pos}..{start_pos + m - 1} exceed the table of {n_ctx}")
        out = self._empty(x.shape)
        n = m * n_heads * half
        self._launch("rope", (cdiv(n, EW_THREADS), 1), (EW_THREADS, 1, 1), x.ptr, cos.ptr, sin.ptr, out.ptr,
                     m, n_heads, half, int(start_pos))
        return out

    def attention(self, q, k, v, n_head, n_head_kv, start_pos):
        """Fused causal attention with online softmax (see cuda_kernels.cu): one launch per layer,
        no score matrix in memory."""
        q, k, v = self._device(q), self._device(k), self._device(v)
        m, q_dim = q.shape
        hd = q_dim // n_head
        t, kv_dim = k.shape
        if q_dim != n_head * hd or kv_dim != n_head_kv * hd or v.shape != k.shape or n_head % n_head_kv:
            raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                             f"{n_head} heads / {n_head_kv} KV heads")
        if t < start_pos + m:
            raise ValueError(f"attention: {m} queries from position {start_pos} need {start_pos + m} keys, got {t}")
        if hd > HD_MAX:
            raise ValueError(f"attention: head dim {hd} > {HD_MAX}, the most the kernel holds")
        out = self._empty(q.shape)
        self._launch("attention", (n_head, m), (ATT_THREADS, 1, 1), q.ptr, k.ptr, v.ptr, out.ptr, n_head,
                     n_head_kv, hd, int(start_pos), np.float32(1.0 / np.sqrt(hd)))
        return out

    def dot(self, a, b):
        raise NotImplementedError("the cuda stage fuses dot and softmax into attention(); it has no separate kernels")

    def softmax(self, x, causal_offset=None):
        raise NotImplementedError("the cuda stage fuses dot and softmax into attention(); it has no separate kernels")

    def argmax(self, x) -> int:
        """On the device: 4 bytes come back instead of n_vocab floats."""
        if not isinstance(x, DeviceArray):
            return int(np.argmax(np.asarray(x).reshape(-1)))
        x = self._device(x)
        if x.ndim == 2 and x.shape[0] != 1:
            raise ValueError(f"argmax takes one row, got {x.shape}")
        self._launch("argmax", (1, 1), (ARGMAX_THREADS, 1, 1), x.ptr, x.size, self._argmax_dev)
        self._dtoh(self._argmax_host, self._argmax_dev)
        return int(self._argmax_host[0])

    # ---- profile -----------------------------------------------------------------------------
    def start_profile(self, reset: bool = True):
        """Time every kernel launch with CUDA events from now on."""
        if reset:
            self._harvest()
            self._totals = {}
            self._transfers_at_start = self.transfer_stats()
        self._profiling = True

    def stop_profile(self):
        self._profiling = False
        self._harvest()

    def _harvest(self):
        for name, start, end in self._pending:
            ms = self.device.elapsed_ms(start, end)
            t = self._totals.setdefault(name, [0, 0.0])
            t[0] += 1
            t[1] += ms
            self._event_pool.append((start, end))
        self._pending = []

    def profile_rows(self) -> list[dict]:
        """[{kernel, calls, total_ms, avg_us, share}] by total time."""
        self._harvest()
        return profile_rows(self._totals)

    def transfer_stats(self) -> dict:
        """Host<->device copies and forward passes so far (snapshot before and after to get per token)."""
        return {"h2d_count": self.h2d_count, "h2d_bytes": self.h2d_bytes, "d2h_count": self.d2h_count,
                "d2h_bytes": self.d2h_bytes, "forwards": self.forwards, "rows": self.rows,
                "device_allocs": self.device_allocs}

    def profile_table(self, transfers: dict | None = None) -> str:
        """The kernels since start_profile(), and the copies made since then."""
        if transfers is None:
            now, then = self.transfer_stats(), self._transfers_at_start
            transfers = {k: now[k] - then.get(k, 0) for k in now}
        return format_profile_table(self.profile_rows(), transfers,
                                    f"cuda stage: per-kernel time from CUDA events ({self.device.name})")

    def memory_summary(self) -> dict:
        return {"device_allocs": self.device_allocs, "device_bytes": self.device_bytes,
                "arena_bytes": self.arena.nbytes if self.arena else 0,
                "arena_high_water": self.arena.high_water if self.arena else 0,
                "max_batch": self.max_batch}


def _chunks_per_block(ggml_type) -> int:
    """Chunks of a block as the kernels split it (the CPB of cuda_kernels.cu's Block* structs)."""
    return 4 if BLOCK_SIZES[GGMLType(ggml_type)][0] == 32 else 16


def matmul_grid(n_out: int, m: int, mt: int) -> tuple[int, int]:
    """Blocks of MM_WARPS output rows x mt activation rows."""
    return (cdiv(n_out, MM_WARPS), cdiv(m, mt))
