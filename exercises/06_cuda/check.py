"""Chapter 06's check: your CUDA kernel for the decode matvec of Q4_1 weights against the cuda
stage's own, matmul_q4_1_m1 (stages/kernels/cuda.cu), both launched the way the stage launches it
(one warp per output row, 4 per thread block) on the CPU emulator of CUDA (app/cuda_emulator/):
no GPU is needed, and a race, a read of memory nothing wrote or an access outside an array stops
the launch and is reported in your kernel's terms (which thread, which row, which array). Timed
only where a GPU and PyCUDA are there: the emulator checks what a kernel computes, not its speed."""

from __future__ import annotations

import functools
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from app.cuda_emulator import emulator
from common.quants import quantize
from exercises import harness
from exercises.harness import Case, Exercise, Timing, best_seconds, close, sum_bound, worst_ratio
from stages import cuda as cs
from stages.kernels import cuda_runtime
from stages.kernels.dequant_dot import matvec_q4_1 as cpu_matvec_q4_1
from stages.kernels.toolkit import F16_TO_F32

# chapter 05's check: its weights, their magnitudes (the bound) and the matrix it times
_quantized = harness.load_file(harness.ROOT / "exercises" / "05_quantized" / "check.py")

NAME, ARGS = "matvec_q4_1", "PPPiii"           # the learner's kernel: W, x, y, N, K, row_bytes
SIGNATURE = "(const u8* W, const float* x, float* y, int N, int K, int row_bytes)"
STAGE = "matmul_q4_1_m1"                       # the stage's: W, X, Y, N, K, M (1 here), row_bytes
FRESH = 0xFFFFFFFF                             # a float of fresh emulated memory (0xFF bytes): no kernel computes it


class Stopped(Exception):
    """The emulator refused a launch or stopped it: what happened, in the kernel's terms."""


class Kernel:
    """One kernel of a source file, launched as the check launches it: grid ceil(N / 4), 128
    threads (the stage's matmul_grid and MM_THREADS). Called with (raw, x), it runs on the CPU
    emulator and returns y; `seconds` times it on a GPU."""

    def __init__(self, source: Path, name: str):
        self.source, self.name = Path(source), name
        self.stage = name == STAGE
        self.args = cs.arg_types(name) if self.stage else ARGS

    @functools.cached_property
    def emulated(self) -> emulator.EmulatedDevice:
        """The emulator built around the source (g++, a few seconds; cached by the sources' digest)."""
        return emulator.EmulatedDevice(emulator.build(source=self.source))

    def _upload(self, device, raw, x) -> tuple[dict, list]:
        """W and x on the device, y allocated: ({name: address}, the owners that keep them alive)."""
        owners, ptrs = [], {}
        for label, a in (("W", raw), ("x", x), ("y", None)):
            owner, ptr = device.alloc(4 * raw.shape[0] if a is None else a.nbytes)
            if a is not None:
                device.htod(ptr, np.ascontiguousarray(a))
            owners.append(owner)
            ptrs[label] = ptr
        return ptrs, owners

    def _launcher(self, device, ptrs, raw, x):
        """The launch, as a function of nothing."""
        N, K = raw.shape[0], x.shape[0]
        sizes = (N, K, 1, raw.shape[1]) if self.stage else (N, K, raw.shape[1])
        kernel = device.function(self.name, self.args)
        return lambda: kernel(cs.matmul_grid(N, 1, 1), (cs.MM_THREADS, 1, 1), ptrs["W"], ptrs["x"], ptrs["y"], *sizes)

    def __call__(self, raw, x) -> np.ndarray:
        device = self.emulated
        ptrs, owners = self._upload(device, raw, x)
        try:
            self._launcher(device, ptrs, raw, x)()
            device.check_guards()
        except emulator.EmulatorError as e:
            raise Stopped(in_words(str(e), ptrs, self.name)) from None
        y = np.empty(raw.shape[0], np.float32)
        device.dtoh(y, ptrs["y"])
        return y

    def seconds(self, device, raw, x, reps: int) -> float:
        """The best of `reps` launches on a GPU, each between two CUDA events (the kernel alone)."""
        ptrs, owners = self._upload(device, raw, x)
        launch = self._launcher(device, ptrs, raw, x)
        launch()                                    # the first launch loads the module
        best = math.inf
        for _ in range(reps):
            start, end = device.event(), device.event()
            device.record(start)
            launch()
            device.record(end)
            best = min(best, device.elapsed_ms(start, end) / 1e3)
        return best


STAGE_KERNEL = Kernel(emulator.KERNELS, STAGE)


def in_words(message: str, ptrs: dict, name: str) -> str:
    """The emulator's message with the arrays named (W, x, y, not addresses) and each thread as
    its warp, lane and row, then what such an error usually means in this kernel."""
    for label, ptr in ptrs.items():
        message = message.replace(f"the allocation at 0x{ptr:x}", label)

    def thread(m):
        t, b = int(m.group(1)), int(m.group(2))
        return (f"thread {t} of block {b} (warp {t // 32}, lane {t % 32}: "
                f"row {b * cs.MM_WARPS + t // 32})")
    message = re.sub(r"thread \((\d+),0,0\) of block \((\d+),0,0\)", thread, message)
    message = re.sub(rf"^{name} grid \((\d+), 1, 1\) block \((\d+), 1, 1\): ", r"(grid \1, block \2): ", message)
    hint = next((h for words, h in HINTS if words in message), "")
    return f"the emulator stopped your kernel {message}" + (f"\n{hint}" if hint else "")


HINTS = [
    ("race: ", "Two threads touched the same bytes with no __syncthreads() between them, one of them "
               "writing: a barrier missing between a write and another thread's read, or two threads "
               "writing one y[n]."),
    ("outside", "An index past the end of an array: does every warp whose row n >= N read and write "
                "nothing? Does a lane stop at the row's last block?"),
    ("that nothing has written", "A read of memory nothing wrote: __shared__ memory starts as garbage, "
                                 "as device memory does. Write before you read, with a barrier between."),
    ("__launch_bounds__", "Keep __launch_bounds__(128): the check launches 128 threads per block."),
]


def compiler_errors(output: str) -> str:
    """g++'s errors about a kernel source, its paths relative to the repository and the lines
    that only say where the emulator included it dropped."""
    lines = [line.replace(str(harness.ROOT) + "/", "") for line in output.splitlines()
             if not line.startswith(("In file included from", "                 from", "compilation terminated"))]
    return "\n".join(lines[:40]) + ("\n..." if len(lines) > 40 else "")


def gpu_device(source: Path):
    """A PyCudaDevice holding `source` compiled for its GPU, with stages/kernels/ on the include
    path (for #include "cuda.cu")."""
    device = cuda_runtime.PyCudaDevice()
    device.compile(source.read_text(), include_dirs=(source.parent, emulator.KERNELS.parent))
    return device


class Cuda(Exercise):
    chapter = "06"
    title = "cuda: a warp per row, the Q4_1 decode matvec as a CUDA kernel"
    folder = "exercises/06_cuda"
    file = "matvec.cu"
    reference = {NAME: STAGE_KERNEL}
    reference_code = "stages/kernels/cuda.cu: matmul_q4_1_m1 (matmul_q, chunk_dot, BlockQ4_1, warp_sum_rows)"
    baseline = "the quantized stage's (CPU, one thread)"
    isolated = True                  # in a child process: a wild pointer in a kernel could end the check's own
    stuck = ("your kernel never finished (on the emulator one CPU thread runs every GPU thread in turn): a loop "
             "whose index never reaches its end? (a lane's loop over blocks steps by WARP: b += WARP)")

    def load(self, path):
        """Your .cu built into the emulator (checked for the kernel and its signature), as a namespace
        whose matvec_q4_1(raw, x) launches it."""
        path = Path(path).resolve()
        mine = harness.rel(path)
        if emulator.compiler() is None:
            raise harness.Unwritten("no C++ compiler: the check builds your kernel with g++ around the CPU emulator "
                                    "of CUDA; install g++ (Debian, Ubuntu: apt install g++)")
        kernel = Kernel(path, NAME)
        t0 = time.perf_counter()
        try:
            device = kernel.emulated
        except emulator.BuildError as e:
            raise harness.Unwritten(f"{mine} does not compile:\n{compiler_errors(e.output)}") from None
        except emulator.EmulatorError as e:                  # no __launch_bounds__
            raise harness.Unwritten(f"{mine} cannot be built: {str(e).removeprefix(path.name + ': ')}") from None
        built = time.perf_counter() - t0
        if not device.lib.emu_has(NAME.encode()):
            raise harness.Unwritten(f'{mine} has no kernel {NAME}: the check launches extern "C" __global__ void '
                                    f"{NAME}{SIGNATURE} (see the starting file {harness.rel(self.starting_file)})")
        takes = device.lib.emu_signature(NAME.encode()).decode()
        if takes != ARGS:
            raise harness.Unwritten(f"{NAME} takes '{takes}', the check launches it with {SIGNATURE} ('{ARGS}': "
                                    "P a pointer, i an int): keep the starting file's parameters")
        notes = [f"built in {built:.1f} s (g++ around the emulator, once for each version of your file)"] \
            if built > 0.5 else []
        return SimpleNamespace(**{NAME: kernel}, load_notes=notes)

    def cases(self, rng, quick):
        plans = [((1, 32), {}, "one row of one block: 31 lanes add nothing, 3 warps have no row"),
                 ((5, 64), {}, "5 rows: the second thread block has one row, and 3 warps with none"),
                 ((37, 576), {}, "37 rows of SmolLM2's width: 18 blocks, lanes 18..31 hold none"),
                 ((3, 1536), {}, "3 rows of 48 blocks (ffn_down's width): lanes 0..15 take two"),
                 ((6, 96), {"zero_blocks": 2}, "blocks of zeros (d = m = 0) beside ordinary ones"),
                 ((9, 160), {"scale": 40.0}, "large weights and activations"),
                 ((3, 128), {"offset": True}, "all weights far from zero (m large, d small)")]
        out = []
        for (N, K), opt, why in plans:
            if opt.get("offset"):
                raw = _quantized.read_only(quantize(rng.uniform(3.0, 3.5, (N, K)).astype(np.float32),
                                                    _quantized.Q4_1))
            else:
                raw = _quantized.q4_1_weight(rng, N, K, opt.get("scale", 0.05), opt.get("zero_blocks", 0))
            x = rng.standard_normal(K).astype(np.float32) * np.float32(opt.get("scale", 1.0))
            out.append(Case(f"N={N} K={K}: {why}", {"x": x, "w": raw}))
        return out

    def judge(self, sol, case):
        x, w = case.inputs["x"], case.inputs["w"]
        try:
            got = sol.matvec_q4_1(w, x)
        except Stopped as e:
            return str(e), ""
        fresh = np.flatnonzero(got.view(np.uint32) == FRESH)
        if fresh.size == got.size:
            none = "y[0] was never written" + (f", nor any of y's {got.size} values" if got.size > 1 else "")
            return (f"{none}: y still holds the garbage fresh device memory holds here (0xFF bytes: NaN).\n"
                    "Your kernel is not written yet, or no lane stores its row's sum (lane 0 of warp w in block b "
                    "stores y[4 b + w])."), ""
        if fresh.size:
            n = int(fresh[0])
            return (f"y[{n}] was never written ({fresh.size} of {got.size} values were not): row {n} is warp "
                    f"{n % cs.MM_WARPS} of block {n // cs.MM_WARPS}. Does every warp whose row n < N store its "
                    "sum?"), ""
        want = STAGE_KERNEL(w, x)
        # a decoded value d q + m rounds once too: K + 2 roundings per product chain
        bound = sum_bound(_quantized.magnitudes(x, w), x.shape[0] + 2)
        return close("y", got, want, bound), worst_ratio(got, want, bound)

    def untimed(self):
        reason = cuda_runtime.probe_once()
        if reason is None:
            return None
        return (f"this machine cannot run CUDA kernels: {reason}.\n"
                "The emulator checks what your kernel computes, not its speed (one CPU thread plays every GPU\n"
                "thread in turn). On a machine with an NVIDIA GPU and PyCUDA, this check times your kernel\n"
                "beside the stage's there.")

    def timings(self, sol, quick):
        raw, what = _quantized.decode_weight(quick)
        K = raw.shape[1] // 20 * 32
        x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
        reps = 5 if quick else 20
        work = (raw.nbytes, "GB/s of blocks")
        rows = []
        for label, kernel, who in (("yours", sol.matvec_q4_1, "yours"),
                                   (f"the stage's ({STAGE})", STAGE_KERNEL, "stage")):
            device = gpu_device(kernel.source)
            rows.append(Timing(f"{label}, on the GPU", kernel.seconds(device, raw, x, reps), who, work))
        self.timing_note = f"{what}; on {device.name}, the kernel alone, between CUDA events"
        rows.append(Timing("the quantized stage's matvec_q4_1 on the CPU", best_seconds(
            lambda: cpu_matvec_q4_1(x, raw, F16_TO_F32), 3 if quick else 10), "previous", work))
        return rows


EXERCISE = Cuda()
