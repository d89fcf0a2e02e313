"""Stage 6, cuda: the whole forward pass on the GPU, with nothing crossing the bus that need not.

The lesson: a GPU is fast only while it has the data and the work. Everything the CPU stages
learned still holds (keep the weights in their quantized blocks, keep K and V, never compute a
token twice); what is new is the *distance*. The weights, the KV cache and every intermediate
live in GPU memory; per token the host sends one token id and gets one token id back. What
remains on the CPU is Python launching kernels, 16 per layer per token, each costing
microseconds, against weights a modern GPU reads in tens of microseconds for SmolLM2: the
kernel table (`--profile`) shows which wins.

The article's GPU chapter made two mistakes, both of which cost time to first token; this stage
repeats neither, and brings each back behind a switch (off by default) that measures its cost:

1. A cudaMalloc and a cudaFree around every op (the article's profile: cudaFree was 95.9% of
   all CUDA API time). Here device memory is allocated only while the model loads: each weight
   once, the KV cache, and one scratch arena, handed out again by a bump allocator in every
   forward pass (`device_allocs` stays still while generating). Switch: alloc_per_op=True
   (LLM_CUDA_ALLOC_PER_OP=1), a device allocation per op, freed when its result is dropped.
2. The embedding lookup on the host. Here it runs on the device (dequantizing the row there):
   the only host-to-device copy of a token is its id. Switch: host_embedding=True
   (LLM_CUDA_HOST_EMBEDDING=1): rows dequantized on the host, n_embd floats over the bus each.

The article copied the logits back to pick the token on the host, a sound design (128 KB per
token for TinyLlama); this stage goes one step further: a one-block argmax kernel reduces them
on the device and 4 bytes come back (sampling with a temperature still copies them).

The kernels (stages/kernels/cuda.cu, compiled at first use by PyCUDA's SourceModule for the
GPU's own architecture): a fused dequantize-matmul per ggml type (decode: one warp per output
row, a warp-shuffle sum; prefill: each decoded chunk multiplied into 8 activation rows, so a
weight byte serves 8 tokens); attention fused into one kernel with an online softmax (running
maximum, sum and weighted sum of V: the scores are never stored); embedding, rms_norm, RoPE,
the KV store, silu(gate)*up in one pass, add, argmax. No --use_fast_math: the kernels wait on
memory, not arithmetic, so approximate exp would cost agreement with the CPU stages for nothing.

CudaBackend inherits from common.backend.Backend, not from the quantized stage: it overrides
every op the graph calls, and an op it forgot must fail loudly instead of handing device pointers
to a numba kernel. Arrays in the graph are DeviceArray handles; one from the arena is valid until
the next forward pass, and using it later raises instead of reading garbage.
Prompts longer than `max_batch` rows (64; LLM_CUDA_MAX_BATCH) are fed in pieces by LlamaModel;
per-kernel times come from CUDA events (`--profile`, LLM_CUDA_PROFILE=1, `python -m app bench cuda-profile`).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import numpy as np

from common.backend import Backend
from common.gguf import BLOCK_SIZES, GGMLType
from common.profile import Profiler
from common.quants import UnsupportedTypeError, dequantize_rows, dequantize_tensor
from stages.kernels.cuda_runtime import PyCudaDevice, probe_once

KERNEL_SOURCE = Path(__file__).parent / "kernels" / "cuda.cu"
# The CPU stages' tolerance. The CPU emulator of these kernels (app/cuda_emulator/: the same code
# and summation order) stays far inside it; a GPU adds fused multiply-adds, and
# scripts/gpu_check.sh records its own figure.
LOGIT_TOLERANCE = 5e-3

# Launch constants; they must match the #defines at the top of kernels/cuda.cu.
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

# ggml type -> the suffix of its kernels (matmul_<suffix>_m1, _m8, embed_<suffix>)
CUDA_KERNEL_SUFFIX = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q5_0: "q5_0", GGMLType.Q5_1: "q5_1",
    GGMLType.Q8_0: "q8_0", GGMLType.Q2_K: "q2_k", GGMLType.Q3_K: "q3_k", GGMLType.Q4_K: "q4_k",
    GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
}

# Argument types of every kernel (PyCUDA's prepared calls: P pointer, i int32, f float32,
# d float64), in the order of the parameters in kernels/cuda.cu.
KERNEL_ARGS = {"matmul": "PPPiiii", "embed": "PPPii", "rms_norm": "PPPid", "rope": "PPPPiiii",
               "kv_store": "PPPPi", "attention": "PPPPiiiif", "swiglu": "PPPi", "silu": "PPi",
               "add": "PPPi", "mul": "PPPi", "scale": "PPif", "argmax": "PiP"}


def kernel_names() -> list[str]:
    """Every entry point of kernels/cuda.cu."""
    names = [n for n in KERNEL_ARGS if n not in ("matmul", "embed")]
    for suffix in CUDA_KERNEL_SUFFIX.values():
        names += [f"matmul_{suffix}_m1", f"matmul_{suffix}_m{MT_PREFILL}", f"embed_{suffix}"]
    return names


def arg_types(name: str) -> str:
    return KERNEL_ARGS[name.split("_")[0] if name.startswith(("matmul_", "embed_")) else name]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    it was allocated in (None: memory that lives as long as the backend: weights, tables, KV,
    or as long as `owner`, an allocation of its own: the alloc_per_op switch)."""

    __slots__ = ("ptr", "shape", "gen", "owner")
    dtype = np.dtype(np.float32)

    def __init__(self, ptr: int, shape, gen=None, owner=None):
        self.ptr, self.shape, self.gen, self.owner = int(ptr), tuple(int(s) for s in shape), gen, owner

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
        self.suffix = CUDA_KERNEL_SUFFIX[self.ggml_type]

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    def __repr__(self):
        return f"DeviceMatrix({self.name!r}, {self.ggml_type.name}, {self.shape})"


class HostEmbedding:
    """The embedding table left on the host (the host_embedding switch): its ggml rows are
    dequantized by the CPU for every forward pass and copied to the device."""

    __slots__ = ("tensor", "n_out", "n_in", "nbytes")

    def __init__(self, tensor):
        self.tensor = tensor
        self.n_out, self.n_in = (int(x) for x in tensor.shape)
        self.nbytes = 0                          # nothing of it on the device


class _OwnAllocation:
    """One device allocation of the alloc_per_op switch; counts its free when it is dropped
    (PyCUDA frees device memory when the allocation object goes)."""

    __slots__ = ("owner", "backend")

    def __init__(self, owner, backend):
        self.owner, self.backend = owner, backend

    def __del__(self):
        self.backend.device_frees += 1


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


class CudaProfiler(Profiler):
    """The cuda stage's per-op profile (common/profile.py's interface): every kernel launch
    timed with CUDA events, a row per kernel, and the copies made over PCIe."""

    def __init__(self, backend: "CudaBackend"):
        self.backend = backend

    def start(self):
        self.backend.start_profile()

    def stop(self):
        self.backend.stop_profile()

    def rows(self) -> list[dict]:
        return [{"op": r["kernel"], **r} for r in self.backend.profile_rows()]

    def table(self, title: str = "") -> str:
        return self.backend.profile_table()


# ---- the backend -----------------------------------------------------------------------------

class CudaBackend(Backend):
    name = "cuda"
    logit_tolerance = LOGIT_TOLERANCE
    max_batch = DEFAULT_MAX_BATCH              # rows its scratch arena is sized for (LLM_CUDA_MAX_BATCH)

    @staticmethod
    def unavailable_reason() -> str | None:
        return probe_once()

    def __init__(self, threads: int | None = None, *, device=None, max_batch: int | None = None,
                 scratch_bytes: int | None = None, profile: bool | None = None,
                 alloc_per_op: bool | None = None, host_embedding: bool | None = None):
        super().__init__(threads=1)            # one Python thread drives the GPU
        # The article's two mistakes, off unless asked for (see the module's docstring).
        self.alloc_per_op = _switch(alloc_per_op, "LLM_CUDA_ALLOC_PER_OP")
        self.host_embedding = _switch(host_embedding, "LLM_CUDA_HOST_EMBEDDING")
        self.device = device if device is not None else PyCudaDevice()
        self.max_batch = int(max_batch or os.environ.get("LLM_CUDA_MAX_BATCH", DEFAULT_MAX_BATCH))
        self._scratch_request = scratch_bytes
        self._owners = []                      # keeps every device allocation alive
        self.device_allocs = 0                 # cuMemAlloc calls, all time: load only (unless alloc_per_op)
        self.device_frees = 0                  # allocations of alloc_per_op freed so far
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
        if self.alloc_per_op:
            return None                        # every buffer is an allocation of its own
        if self.arena is None:
            n = self._scratch_request or arena_bytes(self._out_dims, self._max_width, len(self._out_dims),
                                                       self.max_batch)
            self.arena = Arena(self._alloc_permanent(n, "scratch arena"), n)
        return self.arena

    def _empty(self, shape) -> DeviceArray:
        """A new float32 buffer for this forward pass, from the arena (alloc_per_op: from the
        device's allocator, freed when the handle is dropped)."""
        shape = tuple(int(s) for s in shape)
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        if self.alloc_per_op:
            owner, ptr = self._alloc_own(nbytes)
            return DeviceArray(ptr, shape, None, owner)
        arena = self._ensure_arena()
        return DeviceArray(arena.alloc(nbytes), shape, arena.generation)

    def _alloc_own(self, nbytes: int):
        """A device allocation for one op's result, counted (the alloc_per_op switch)."""
        owner, ptr = self.device.alloc(max(int(nbytes), 1))
        self.device_allocs += 1
        return _OwnAllocation(owner, self), ptr

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
        arena = self._ensure_arena()
        if arena is not None:
            arena.reset()

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
        if t not in CUDA_KERNEL_SUFFIX:
            raise UnsupportedTypeError(f"cuda stage: no kernel for ggml type {t.name} (tensor '{tensor.name}'); "
                                       f"supported: {', '.join(x.name for x in CUDA_KERNEL_SUFFIX)}")
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
        if self.host_embedding:
            return HostEmbedding(tensor)
        return self._matrix(tensor)

    def tie_output(self, embedding, tensor):
        """The output matrix IS the embedding table: the same device blocks, uploaded once
        (with host_embedding, uploaded here for the output only)."""
        if isinstance(embedding, HostEmbedding):
            return self.prepare_matrix(tensor)
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
        return DeviceArray(x.ptr + (m - 1) * d * 4, (1, d), x.gen, x.owner)     # a view keeps its memory

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
        if isinstance(table, HostEmbedding):
            return self._embed_on_host(table, ids)
        if self.alloc_per_op:
            ids_owner, ids_dev = self._alloc_own(4 * max(m, 1))
        else:
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
        if self.alloc_per_op:
            del ids_owner                          # freed after the op, as the article did
        return out

    def _embed_on_host(self, table: HostEmbedding, ids) -> DeviceArray:
        """The article's lookup: the rows dequantized by the CPU, then [M, n_embd] float32
        across the bus (the id that came back from the argmax went the other way)."""
        rows = np.ascontiguousarray(dequantize_rows(table.tensor, ids), dtype=np.float32)
        out = self._empty(rows.shape)
        self._htod(out.ptr, rows)
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
        """Fused causal attention with online softmax (see kernels/cuda.cu): one launch per layer,
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

    def profiler(self, model) -> CudaProfiler:
        return CudaProfiler(self)

    def memory_summary(self) -> dict:
        return {"device_allocs": self.device_allocs, "device_frees": self.device_frees,
                "device_bytes": self.device_bytes, "alloc_per_op": self.alloc_per_op,
                "host_embedding": self.host_embedding,
                "arena_bytes": self.arena.nbytes if self.arena else 0,
                "arena_high_water": self.arena.high_water if self.arena else 0,
                "max_batch": self.max_batch}


def _switch(value: bool | None, env: str) -> bool:
    """An explicit True/False, else the environment variable (1 = on)."""
    return bool(value) if value is not None else os.environ.get(env, "") == "1"


def _chunks_per_block(ggml_type) -> int:
    """Chunks of a block as the kernels split it (the CPB of kernels/cuda.cu's Block* structs)."""
    return 4 if BLOCK_SIZES[GGMLType(ggml_type)][0] == 32 else 16


def matmul_grid(n_out: int, m: int, mt: int) -> tuple[int, int]:
    """Blocks of MM_WARPS output rows x mt activation rows."""
    return (cdiv(n_out, MM_WARPS), cdiv(m, mt))
