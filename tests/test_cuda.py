"""The cuda stage, checked as far as each machine allows.

    everywhere      host logic: the arena, launch geometry, the profile table, choosing the
                    architecture, the "what is missing" messages, the CLI's one-line error
    nvcc present    stages/kernels/cuda.cu compiles for every architecture nvcc lists from sm_75
                    up, warnings as errors (the GPU compiles the same file at run time)
    g++ present     the kernels themselves on the CPU emulator (app/cuda_emulator/), whose
                    checked build fails a launch on a race, a read of memory nothing wrote, an
                    access outside an allocation, a launch beyond a kernel's __launch_bounds__ or
                    arguments that do not match its signature (tests/test_emulator.py shows each
                    caught): every block decoder bit-exact with common.quants, every op against
                    numpy, the same bits under several thread schedules, the whole graph on a
                    tiny synthetic model against the float64 reference and the CPU stages, the
                    arena reused with no allocation per token, 4 bytes each way per greedy token
    a GPU (marker gpu, skipped with the reason elsewhere)
                    the same kernel and model checks through PyCUDA, plus the default model's
                    logits and greedy tokens when models/ has it
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.gguf import BLOCK_SIZES, GGMLType, GGUFFile, GGUFWriter, ValueType
from common.quants import QUANTIZE_TYPES, UnsupportedTypeError, dequantize, dequantize_rows, quantize
from stages import cuda as cs
from stages.kernels import cuda_runtime as rt
from tests.util import tensor_from_raw

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "stages" / "kernels" / "cuda.cu"
ALL_TYPES = list(cs.CUDA_KERNEL_SUFFIX)
QUANT_TYPES = [t for t in ALL_TYPES if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)]


def _gpu_reason() -> str | None:
    return rt.probe()


# ---- devices: the CPU emulator everywhere g++ is, the GPU where there is one ------------------

def emulated_device():
    """A fresh device on the CPU emulator of the kernels (built once, then cached); a skip
    where there is no g++ to build it."""
    from app.cuda_emulator import emulator
    if emulator.compiler() is None:
        pytest.skip("no g++ to build the CUDA emulator")
    return emulator.EmulatedDevice(emulator.build())


@pytest.fixture(scope="session")
def emulator():
    return emulated_device()


@pytest.fixture(scope="session")
def gpu():
    reason = _gpu_reason()
    if reason:
        pytest.skip(f"gpu test: {reason}")
    return rt.PyCudaDevice()


DEVICES = ["emulator", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.getfixturevalue(request.param)


def make_backend(device, **kw):
    kw.setdefault("scratch_bytes", 64 << 20)
    return cs.CudaBackend(device=device, **kw)


def check_guards(device):
    if hasattr(device, "check_guards"):
        device.check_guards()


# ---- random weights in every format ----------------------------------------------------------

# Byte offsets of the float16 scale fields of each block, and (for the formats with an offset)
# of the min: random bytes there would make NaN and huge values, so they get sane ones.
SCALE_FIELDS = {GGMLType.Q4_0: ([0], []), GGMLType.Q4_1: ([0], [2]), GGMLType.Q5_0: ([0], []),
                GGMLType.Q5_1: ([0], [2]), GGMLType.Q8_0: ([0], []), GGMLType.Q2_K: ([80], [82]),
                GGMLType.Q3_K: ([108], []), GGMLType.Q4_K: ([0], [2]), GGMLType.Q5_K: ([0], [2]),
                GGMLType.Q6_K: ([208], [])}


def random_weights(ggml_type, shape, rng, std=0.05) -> np.ndarray:
    """Raw ggml bytes of a [rows, cols] weight: quantized from N(0, std) where common.quants can,
    else random blocks whose scales give values of about that size."""
    ggml_type = GGMLType(ggml_type)
    if ggml_type in QUANTIZE_TYPES:
        return quantize(rng.normal(0, std, shape).astype(np.float32), ggml_type)
    qk, nb = BLOCK_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // qk
    raw = rng.integers(0, 256, (n_blocks, nb), dtype=np.uint8)
    d_at, m_at = SCALE_FIELDS[ggml_type]
    per_q = {GGMLType.Q5_0: 16, GGMLType.Q5_1: 31, GGMLType.Q2_K: 3 * 15, GGMLType.Q3_K: 4 * 32,
             GGMLType.Q5_K: 31 * 63}[ggml_type]
    d = (rng.uniform(0.5, 1.0, n_blocks) * 2 * std / per_q).astype(np.float16)
    for at in d_at:
        raw[:, at:at + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    for at in m_at:
        m = (d.astype(np.float32) * (-per_q / 2 if ggml_type == GGMLType.Q5_1 else 1.0)).astype(np.float16)
        raw[:, at:at + 2] = m.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(shape[0], -1)


def weight(ggml_type, n_out, n_in, rng, std=0.05):
    raw = random_weights(ggml_type, (n_out, n_in), rng, std)
    t = tensor_from_raw(raw, ggml_type, (n_out, n_in), name=f"w_{GGMLType(ggml_type).name}")
    return t, dequantize(raw, ggml_type, (n_out, n_in)).astype(np.float64)


# ---- host logic ------------------------------------------------------------------------------

def test_arena_hands_out_aligned_buffers_and_starts_over():
    a = cs.Arena(base=0x10000, nbytes=4096)
    p1, p2 = a.alloc(10), a.alloc(300)
    assert (p1, p2) == (0x10000, 0x10000 + 256) and a.offset == 256 + 512
    assert a.high_water == 768 and a.generation == 0
    a.reset()
    assert a.offset == 0 and a.generation == 1 and a.alloc(4) == 0x10000   # the same memory again
    with pytest.raises(cs.ArenaExhausted, match="exhausted"):
        a.alloc(5000)
    assert a.high_water == 768


def test_scratch_size_grows_with_batch_and_matrices():
    small = cs.arena_bytes([576] * 7, 1536, 7, max_batch=1)
    assert cs.arena_bytes([576] * 7, 1536, 7, max_batch=64) > 60 * small // 2
    assert small >= 3 * 7 * 576 * 4


class NullDevice:
    """Addresses as numbers, copies and kernels that do nothing: the backend's bookkeeping at a
    real model's size, without a GPU and without the emulator's cost."""

    name, compute_capability, arch = "null", (0, 0), None

    def __init__(self):
        self.next = 1 << 40

    def alloc(self, nbytes):
        ptr, self.next = self.next, self.next + -(-int(nbytes) // 256) * 256
        return None, ptr

    def htod(self, ptr, host):
        pass

    def dtoh(self, host, ptr):
        host[...] = 0

    def pinned(self, n, dtype):
        return np.zeros(n, dtype)

    def compile(self, source):
        pass

    def function(self, name, argtypes):
        return lambda grid, block, *args: None

    def event(self):
        return None

    def record(self, event):
        pass

    def elapsed_ms(self, start, end):
        return 0.0

    def synchronize(self):
        pass


def fake_gguf(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, ggml_type, tied):
    """A GGUFFile look-alike with a llama's metadata and tensors of the right sizes whose bytes
    are all one zero (a broadcast view: no memory)."""
    from types import SimpleNamespace

    from common.gguf import TensorInfo, type_nbytes
    kv = n_head_kv * (n_embd // n_head)
    md = {"general.architecture": "llama", "llama.context_length": 2048, "llama.embedding_length": n_embd,
          "llama.block_count": n_layer, "llama.feed_forward_length": n_ff, "llama.attention.head_count": n_head,
          "llama.attention.head_count_kv": n_head_kv, "llama.vocab_size": n_vocab,
          "llama.attention.layer_norm_rms_epsilon": 1e-5}
    tensors = {}

    def add(name, shape, t):
        nbytes = type_nbytes(t, shape)
        tensors[name] = TensorInfo(name, shape, t, 0, nbytes, np.broadcast_to(np.zeros(1, np.uint8), (nbytes,)))
    add("token_embd.weight", (n_vocab, n_embd), ggml_type)
    add("output_norm.weight", (n_embd,), GGMLType.F32)
    if not tied:
        add("output.weight", (n_vocab, n_embd), ggml_type)
    for il in range(n_layer):
        p = f"blk.{il}."
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (kv, n_embd)), ("attn_v", (kv, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            add(p + name + ".weight", shape, ggml_type)
        add(p + "attn_norm.weight", (n_embd,), GGMLType.F32)
        add(p + "ffn_norm.weight", (n_embd,), GGMLType.F32)
    return SimpleNamespace(architecture="llama", metadata=md, tensors=tensors, path="fake.gguf")


@pytest.mark.parametrize("geometry", [
    dict(n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, n_vocab=49152, ggml_type=GGMLType.Q8_0, tied=True),
    dict(n_layer=22, n_embd=2048, n_ff=5632, n_head=32, n_head_kv=4, n_vocab=32000, ggml_type=GGMLType.Q4_K,
         tied=False),
], ids=["SmolLM2-135M", "TinyLlama-1.1B"])
def test_the_arena_holds_a_forward_of_max_batch_rows(geometry):
    """The arena is sized at load from the matrices' shapes; a prefill of max_batch rows (the most
    LlamaModel ever feeds at once), then a decode step, must fit, on the real models' shapes."""
    from common.model import LlamaModel
    b = cs.CudaBackend(device=NullDevice(), max_batch=64)
    engine = LlamaModel(fake_gguf(**geometry), b, n_ctx=256)
    allocs = b.device_allocs
    engine.forward(list(range(64)), 0)
    engine.greedy_next([1], 64)
    assert 0 < b.arena.high_water <= b.arena.nbytes
    assert b.device_allocs == allocs
    print(f"\n{b.arena.high_water / 2**20:.0f} of {b.arena.nbytes / 2**20:.0f} MiB arena used")


def test_launch_geometry():
    assert cs.matmul_grid(49152, 1, 1) == (12288, 1)
    assert cs.matmul_grid(13, 11, 8) == (4, 2)                    # partial warps and rows
    assert cs.cdiv(0, 256) == 0 and cs.cdiv(257, 256) == 2


def test_choose_arch():
    archs = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
    assert rt.choose_arch((9, 0), archs) == "sm_90"
    assert rt.choose_arch((8, 9), archs) == "sm_86"               # a later minor runs an earlier cubin
    assert rt.choose_arch((5, 0), archs) is None                  # the article's GTX 750 Ti
    assert rt.choose_arch((12, 1), archs) == "sm_120"
    assert rt.choose_arch((10, 3), ("sm_90a", "sm_100")) == "sm_100"


def test_profile_table_is_nvprof_style():
    rows = cs.profile_rows({"matmul_q4_1_m1": [300, 6.0], "attention": [30, 1.5], "argmax": [10, 0.5]})
    assert [r["kernel"] for r in rows] == ["matmul_q4_1_m1", "attention", "argmax"]
    assert rows[0]["avg_us"] == pytest.approx(20.0) and sum(r["share"] for r in rows) == pytest.approx(1.0)
    table = cs.format_profile_table(rows, {"h2d_count": 10, "h2d_bytes": 40, "d2h_count": 10,
                                           "d2h_bytes": 40, "forwards": 10})
    lines = table.splitlines()
    assert lines[0].split() == ["Kernel", "Calls", "Total(ms)", "Avg(us)", "Share"]
    assert lines[1].split() == ["matmul_q4_1_m1", "300", "6.000", "20.00", "75.0%"]
    assert "1.0 + 1.0 copies, 4 + 4 bytes each" in lines[-1]


def _cu_defines() -> dict:
    return {m.group(1): m.group(2) for m in re.finditer(r"^#define (\w+) (\S+)", KERNELS.read_text(), re.M)}


def test_python_constants_match_the_kernel_source():
    d = _cu_defines()
    for name in ("MM_WARPS", "MT_PREFILL", "EMBED_THREADS", "NORM_THREADS", "EW_THREADS", "HD_MAX",
                 "ARGMAX_THREADS"):
        assert int(d[name]) == getattr(cs, name), name
    assert int(d["ATT_WARPS"]) * 32 == cs.ATT_THREADS


def test_every_kernel_exists_with_the_argument_count_python_passes():
    src = KERNELS.read_text()
    # the kernels written out: extern "C" __global__ void __launch_bounds__(N)\n name(args)
    plain = {m.group(1): m.group(2) for m in
             re.finditer(r'extern "C" __global__ void __launch_bounds__\(\w+\)\s+(\w+)\(([^)]*)\)', src)}
    macro_args = {m.group(1): m.group(2) for m in re.finditer(r"#define (MATMUL|EMBED)_ARGS (.*)", src)}
    types = re.findall(r"X\((\w+), \w+\)", src)
    assert sorted(types) == sorted(cs.CUDA_KERNEL_SUFFIX.values())
    for name in cs.kernel_names():
        if name.startswith(("matmul_", "embed_")):
            args = macro_args["MATMUL" if name.startswith("matmul_") else "EMBED"]
        else:
            assert name in plain, f"no kernel '{name}' in {KERNELS.name}"
            args = plain[name]
        assert len(args.split(",")) == len(cs.arg_types(name)), name


class _FakeDriver:
    def __init__(self, init=0, count=1, cc=(9, 0)):
        self.init, self.count, self.cc = init, count, cc

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, ref):
        ref._obj.value = self.count
        return 0

    def cuDeviceGet(self, ref, i):
        ref._obj.value = i
        return 0

    def cuDeviceGetAttribute(self, ref, attr, dev):
        ref._obj.value = self.cc[0] if attr == rt.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR else self.cc[1]
        return 0


def _probe(**kw):
    args = dict(find_spec=lambda name: object(), load_driver=_FakeDriver, which_nvcc=lambda: "/x/nvcc",
                list_archs=lambda nvcc: ("sm_75", "sm_90"), import_driver=lambda: None)
    args.update(kw)
    return rt.probe(**args)


def test_probe_says_what_is_missing_and_how_to_get_it():
    assert _probe() is None
    assert "PyCUDA is not installed" in _probe(find_spec=lambda name: None)
    assert "make setup-cuda" in _probe(find_spec=lambda name: None)

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")
    assert _probe(load_driver=no_driver).startswith("no NVIDIA driver")
    assert "install the NVIDIA driver" in _probe(load_driver=no_driver)
    assert _probe(load_driver=lambda: _FakeDriver(init=rt.CUDA_ERROR_NO_DEVICE)).startswith("no NVIDIA GPU")
    assert _probe(load_driver=lambda: _FakeDriver(count=0)).startswith("no NVIDIA GPU")
    assert "update the driver" in _probe(load_driver=lambda: _FakeDriver(init=rt.CUDA_ERROR_INSUFFICIENT_DRIVER))
    assert "error 999" in _probe(load_driver=lambda: _FakeDriver(init=999))
    assert _probe(which_nvcc=lambda: None).startswith("nvcc not found")
    assert "sm_50" in _probe(load_driver=lambda: _FakeDriver(cc=(5, 0)))

    def broken():
        raise ImportError("undefined symbol: cuArrayCreate_v2")
    assert "does not load" in _probe(import_driver=broken)
    for reason in (_probe(find_spec=lambda name: None), _probe(load_driver=no_driver)):
        assert "\n" not in reason


@pytest.mark.skipif(_gpu_reason() is None, reason="this machine can run the cuda stage")
def test_without_a_gpu_loading_the_stage_says_why(tmp_path):
    from stages import StageError, load, unavailable_reason
    reason = unavailable_reason("cuda")
    assert reason and reason == cs.CudaBackend.unavailable_reason()
    with pytest.raises(StageError, match="stage 'cuda' cannot run here"):
        load("cuda", tmp_path / "never-opened.gguf")


@pytest.mark.skipif(_gpu_reason() is None, reason="this machine can run the cuda stage")
def test_cli_prints_one_line_and_no_traceback(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")                     # only its existence is checked before the stage
    proc = subprocess.run([sys.executable, "-m", "app", "run", "--stage", "cuda", "-m", str(model),
                           "-n", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: stage 'cuda' cannot run here: "), proc.stderr
    assert "Traceback" not in proc.stderr


# ---- nvcc: the kernel source compiles for every GPU architecture ------------------------------

def test_kernels_compile_for_every_architecture(tmp_path):
    nvcc = rt.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit is not installed)")
    archs = [a for a in rt.nvcc_archs(nvcc) if re.fullmatch(r"sm_\d+", a) and int(a[3:]) >= 75]
    assert archs, f"{nvcc} --list-gpu-code lists no sm_75 or later"
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    cmd = [nvcc, "--fatbin", *gencode, "--threads", "0", "-O3", "--Werror", "all-warnings,missing-launch-bounds",
           "-o", str(tmp_path / "kernels.fatbin"), str(KERNELS)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    assert "warning" not in (proc.stdout + proc.stderr).lower()
    print(f"\ncompiled {len(archs)} architectures ({archs[0]}..{archs[-1]}) in {seconds:.1f} s")


# ---- kernels: the CPU emulator, and the GPU ---------------------------------------------------

@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_block_decoders_are_bit_exact(emulator, ggml_type):
    """The kernels' decoders (host build) give common.quants' floats bit for bit, on random bytes:
    every f16 pattern in the scale fields too, subnormals, infinities and NaN included."""
    rng = np.random.default_rng(int(ggml_type))
    qk, nb = BLOCK_SIZES[ggml_type]
    n_blocks = 128 if qk == 256 else 1024
    raw = rng.integers(0, 256, n_blocks * nb, dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = dequantize(raw, ggml_type, (n_blocks * qk,))
    got = emulator.dequantize(cs.CUDA_KERNEL_SUFFIX[ggml_type], raw, n_blocks * qk)
    same = (want.view(np.uint32) == got.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
    assert same.all(), f"{(~same).sum()} values differ, first at {np.flatnonzero(~same)[:5]}"


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_every_type(device, ggml_type):
    rng = np.random.default_rng(100 + int(ggml_type))
    qk = BLOCK_SIZES[ggml_type][0]
    k = 512 if qk == 256 else (96 if qk == 32 else 72)
    n = 13                                              # not a multiple of the 4 rows per block
    t, w = weight(ggml_type, n, k, rng)
    b = make_backend(device)
    dw = b.prepare_matrix(t)
    cpu, cpu_w = _cpu_backend(), None
    if cpu is not None:
        try:
            cpu_w = cpu.prepare_matrix(t)
        except UnsupportedTypeError:
            cpu = None                                  # the quantized stage has no kernel for it
    for m in (1, 3, 8, 11):                             # decode; prefill: partial tile, full, two tiles
        x = rng.normal(0, 1, (m, k)).astype(np.float32)
        b.new_forward()
        y = b.to_host(b.matmul(x, dw))
        want = x.astype(np.float64) @ w.T
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"M={m}")
        if cpu is not None:
            np.testing.assert_allclose(y, cpu.to_host(cpu.matmul(x, cpu_w)), rtol=1e-4,
                                       atol=1e-4 * np.abs(want).max(), err_msg=f"vs {cpu.name}, M={m}")
    check_guards(device)


def _cpu_backend():
    """The quantized stage's backend, where that stage exists (it keeps the same ggml blocks)."""
    from stages import STAGES, backend_class
    return backend_class("quantized")() if "quantized" in STAGES else None


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_embed_every_type(device, ggml_type):
    rng = np.random.default_rng(200 + int(ggml_type))
    qk = BLOCK_SIZES[ggml_type][0]
    d = 512 if qk == 256 else 160
    raw = random_weights(ggml_type, (37, d), rng)
    t = tensor_from_raw(raw, ggml_type, (37, d))
    b = make_backend(device)
    table = b.prepare_embedding(t)
    ids = np.array([5, 0, 36, 5, 17])
    got = b.to_host(b.embed(table, ids))
    np.testing.assert_allclose(got, dequantize_rows(t, ids), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="token ids"):
        b.embed(table, np.array([37]))
    check_guards(device)


def test_rms_norm(device):
    rng = np.random.default_rng(3)
    b = make_backend(device)
    for d in (576, 37, 2048):
        x = (rng.normal(0, 3, (5, d))).astype(np.float32)
        w = rng.normal(1, 0.1, d).astype(np.float32)
        x64 = x.astype(np.float64)
        want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
        b.new_forward()
        got = b.to_host(b.rms_norm(x, b.prepare_table(w), 1e-5))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_rope(device):
    rng = np.random.default_rng(4)
    b = make_backend(device)
    n_heads, hd, m, start = 3, 64, 4, 5
    x = rng.normal(0, 1, (m, n_heads * hd)).astype(np.float32)
    table = rng.uniform(0, 6, size=(start + m + 3, hd // 2))
    b.new_forward()
    got = b.to_host(b.rope(x, b.prepare_table(np.cos(table)), b.prepare_table(np.sin(table)), start, n_heads))
    ang = table[start:start + m][:, None, :]
    xr = x.astype(np.float64).reshape(m, n_heads, hd // 2, 2)
    want = np.stack([xr[..., 0] * np.cos(ang) - xr[..., 1] * np.sin(ang),
                     xr[..., 0] * np.sin(ang) + xr[..., 1] * np.cos(ang)], axis=-1).reshape(m, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceed"):
        b.rope(x, b.prepare_table(np.cos(table)), b.prepare_table(np.sin(table)), 9, n_heads)


def attention_reference(q, k, v, n_head, n_head_kv, start):
    m, hd = q.shape[0], q.shape[1] // n_head
    out = np.zeros((m, n_head * hd))
    for h in range(n_head):
        kvh = h // (n_head // n_head_kv)
        qh = q[:, h * hd:(h + 1) * hd].astype(np.float64)
        kh = k[:, kvh * hd:(kvh + 1) * hd].astype(np.float64)
        vh = v[:, kvh * hd:(kvh + 1) * hd].astype(np.float64)
        s = qh @ kh.T / np.sqrt(hd)
        s[np.arange(k.shape[0])[None, :] > (start + np.arange(m))[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = p / p.sum(axis=1, keepdims=True) @ vh
    return out


@pytest.mark.parametrize("n_head,n_head_kv,hd,m,start", [
    (4, 2, 64, 1, 0),         # one key: seven of the eight warps see none
    (4, 2, 64, 1, 9),         # decode
    (6, 2, 64, 5, 3),         # prefill after a cached prefix, grouped heads
    (2, 2, 80, 3, 0),         # a head size that is not a multiple of 32
    (1, 1, 256, 2, 70),       # the largest head size
])
def test_attention(device, n_head, n_head_kv, hd, m, start):
    rng = np.random.default_rng(5)
    b = make_backend(device)
    t = start + m
    q = rng.normal(0, 2, (m, n_head * hd)).astype(np.float32)
    k = rng.normal(0, 2, (t, n_head_kv * hd)).astype(np.float32)
    v = rng.normal(0, 1, (t, n_head_kv * hd)).astype(np.float32)
    b.new_forward()
    got = b.to_host(b.attention(q, k, v, n_head, n_head_kv, start))
    np.testing.assert_allclose(got, attention_reference(q, k, v, n_head, n_head_kv, start), rtol=1e-4, atol=1e-5)


def test_elementwise(device):
    rng = np.random.default_rng(6)
    b = make_backend(device)
    a, c = rng.normal(0, 3, (3, 1000)).astype(np.float32), rng.normal(0, 1, (3, 1000)).astype(np.float32)
    a64 = a.astype(np.float64)
    b.new_forward()
    np.testing.assert_allclose(b.to_host(b.add(a, c)), a + c, rtol=1e-6)
    np.testing.assert_allclose(b.to_host(b.mul(a, c)), a * c, rtol=1e-6)
    np.testing.assert_allclose(b.to_host(b.scale(a, 0.37)), a * np.float32(0.37), rtol=1e-6)
    np.testing.assert_allclose(b.to_host(b.silu(a)), a64 / (1 + np.exp(-a64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.to_host(b.swiglu(a, c)), a64 / (1 + np.exp(-a64)) * c, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="attention"):
        b.softmax(a)


def test_argmax(device):
    rng = np.random.default_rng(7)
    b = make_backend(device)
    for n in (1, 5, 1023, 49152):
        x = rng.normal(0, 1, (1, n)).astype(np.float32)
        b.new_forward()
        assert b.argmax(b.upload(x)) == int(np.argmax(x))
    x = np.full((1, 3000), -np.inf, np.float32)
    x[0, [2999, 1500, 1024]] = 7.0                      # a tie: the first index wins
    b.new_forward()
    assert b.argmax(b.upload(x)) == 1024
    x[0, :] = -np.inf                                    # all -inf: index 0, like numpy
    assert b.argmax(b.upload(x)) == 0


SCHEDULES = [("reverse", 0, 0.0), ("random", 1, 0.1), ("random", 2, 0.5)]
SCHEDULE_IDS = ["reverse", "random1", "random2"]


def _kernels_with_barriers(device):
    rng = np.random.default_rng(8)
    x = rng.normal(0, 1, (3, 700)).astype(np.float32)
    q = rng.normal(0, 1, (2, 4 * 64)).astype(np.float32)
    k = rng.normal(0, 1, (9, 2 * 64)).astype(np.float32)
    t, _ = weight(GGMLType.Q4_K, 13, 512, rng)
    b = make_backend(device)
    w = b.prepare_matrix(t)
    b.new_forward()
    norm = b.prepare_table(np.ones(700, np.float32))
    prefill = rng.normal(0, 1, (11, 512)).astype(np.float32)
    return [b.to_host(b.rms_norm(x, norm, 1e-5)), b.to_host(b.attention(q, k, k, 4, 2, 7)),
            np.array([b.argmax(b.upload(x[:1]))]), b.to_host(b.matmul(prefill, w))]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_another_thread_schedule_changes_nothing(emulator, schedule):
    """The kernels with barriers and shuffles (norm, attention, argmax, the prefill matmul's
    reduction) give the same bits whichever thread runs first, and (checked build) none races:
    threads in reverse, in a random order, and switched before random loads and stores."""
    want = _kernels_with_barriers(emulator)
    emulator.set_schedule(*schedule)
    try:
        got = _kernels_with_barriers(emulator)
    finally:
        emulator.set_schedule("forward")
    for a, r in zip(got, want):
        np.testing.assert_array_equal(a, r)


def test_the_emulator_is_the_checked_build(emulator):
    """The kernel tests here run with every access checked (unless CUDA_EMULATOR_ASAN=1 chose
    the AddressSanitizer build, which cannot be combined with it)."""
    assert emulator.checked != emulator.asan


def test_every_kernels_signature_is_the_one_python_launches_with(emulator):
    """The emulator reads each kernel's C parameter types (P pointer, i int, f float, d double):
    PyCUDA passes what KERNEL_ARGS says, and a float where the kernel takes a double is garbage
    on the GPU, not an error."""
    block = {"matmul": cs.MM_WARPS * 32, "embed": cs.EMBED_THREADS, "rms_norm": cs.NORM_THREADS,
             "attention": cs.ATT_THREADS, "argmax": cs.ARGMAX_THREADS}
    for name in cs.kernel_names():
        assert emulator.lib.emu_signature(name.encode()).decode() == cs.arg_types(name), name
        kind = name.split("_")[0] if name.startswith(("matmul_", "embed_")) else name
        assert emulator.launch_bound(name) == block.get(kind, cs.EW_THREADS), name     # the block it is launched with


def test_kv_store_returns_the_positions_so_far(device):
    rng = np.random.default_rng(9)
    b = make_backend(device)
    kv = b.new_kv_cache(n_layer=3, n_ctx=16, kv_dim=128)
    rows = {}
    for start, m in ((0, 5), (5, 1), (6, 3)):
        k = rng.normal(0, 1, (m, 128)).astype(np.float32)
        v = rng.normal(0, 1, (m, 128)).astype(np.float32)
        b.new_forward()
        k_all, v_all = kv.store(1, start, k, v)
        rows[start] = (k, v)
        assert k_all.shape == v_all.shape == (start + m, 128)
    want_k = np.concatenate([rows[s][0] for s in (0, 5, 6)])
    want_v = np.concatenate([rows[s][1] for s in (0, 5, 6)])
    np.testing.assert_array_equal(b.to_host(k_all), want_k)
    np.testing.assert_array_equal(b.to_host(v_all), want_v)
    with pytest.raises(ValueError, match="outside the cache"):
        kv.store(1, 15, k, v)


def test_a_handle_from_an_earlier_forward_is_refused(emulator):
    b = make_backend(emulator)
    b.new_forward()
    x = b.upload(np.ones((2, 8), np.float32))
    b.new_forward()
    with pytest.raises(cs.StaleArrayError, match="earlier forward pass"):
        b.to_host(x)


# ---- the whole model -------------------------------------------------------------------------

# A tiny llama with every ggml type the kernels know, grouped KV heads and tied embeddings.
TINY = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=96, n_ctx=64)
TINY_TYPES = [
    # attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down
    (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0),
    (GGMLType.Q5_1, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.F16, GGMLType.BF16, GGMLType.F32, GGMLType.Q6_K),
]


def write_tiny_model(path: Path, seed: int = 11) -> Path:
    g = TINY
    rng = np.random.default_rng(seed)
    hd = g["n_embd"] // g["n_head"]
    kv = g["n_head_kv"] * hd
    w = GGUFWriter(path)
    U32, F32 = ValueType.UINT32, ValueType.FLOAT32
    w.add("general.architecture", "llama")
    w.add("general.name", "tiny synthetic llama for the cuda stage's tests")
    for key, value in (("context_length", g["n_ctx"]), ("embedding_length", g["n_embd"]),
                       ("block_count", g["n_layer"]), ("feed_forward_length", g["n_ff"]),
                       ("attention.head_count", g["n_head"]), ("attention.head_count_kv", g["n_head_kv"]),
                       ("rope.dimension_count", hd), ("vocab_size", g["n_vocab"])):
        w.add(f"llama.{key}", value, U32)
    w.add("llama.attention.layer_norm_rms_epsilon", 1e-5, F32)
    w.add("llama.rope.freq_base", 10000.0, F32)
    w.add_tensor("token_embd.weight", random_weights(GGMLType.Q8_0, (g["n_vocab"], g["n_embd"]), rng, 1.0),
                 GGMLType.Q8_0, shape=(g["n_vocab"], g["n_embd"]))
    shapes = [(g["n_embd"], g["n_embd"]), (kv, g["n_embd"]), (kv, g["n_embd"]), (g["n_embd"], g["n_embd"]),
              (g["n_ff"], g["n_embd"]), (g["n_ff"], g["n_embd"]), (g["n_embd"], g["n_ff"])]
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    for il, types in enumerate(TINY_TYPES):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", rng.normal(1, 0.1, g["n_embd"]).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", rng.normal(1, 0.1, g["n_embd"]).astype(np.float32))
        for name, shape, t in zip(names, shapes, types):
            std = 1.0 / np.sqrt(shape[1])
            w.add_tensor(p + name + ".weight", random_weights(t, shape, rng, std), t, shape=shape)
    w.add_tensor("output_norm.weight", rng.normal(1, 0.1, g["n_embd"]).astype(np.float32))
    w.write()
    return path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_path):
    from common import reference
    return reference.forward(GGUFFile(tiny_model_path), TINY_TOKENS)


TINY_TOKENS = [1, 17, 42, 5, 88, 23, 61, 9, 30, 77]
N_SPLIT = 7          # prefill 7 tokens, then one at a time


def load_cuda(path, device, **kw):
    from common.model import LlamaModel
    return LlamaModel(GGUFFile(path), cs.CudaBackend(device=device, **kw))


def cached_logits(engine, tokens, split):
    engine.reset()
    rows = [engine.forward(tokens[:split], 0)]
    for i in range(split, len(tokens)):
        rows.append(engine.forward(tokens[i:i + 1], i))
    engine.reset()
    return np.concatenate(rows)


def test_tiny_model_logits_match_the_reference(device, tiny_model_path, tiny_reference):
    engine = load_cuda(tiny_model_path, device)
    logits = cached_logits(engine, TINY_TOKENS, N_SPLIT)
    assert logits.shape == tiny_reference.shape and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    err = np.abs(logits - tiny_reference).max(axis=1)
    print(f"\ntiny model on {device.name}: max |logit - reference| = {err.max():.2e} (tolerance {cs.LOGIT_TOLERANCE})")
    assert err.max() <= cs.LOGIT_TOLERANCE, f"max |logit - reference| per position {np.round(err, 6)}"
    check_guards(device)


def test_tiny_model_under_a_random_schedule(emulator, tiny_model_path):
    """The whole graph with threads in a random order and switched before random accesses:
    the same logits, bit for bit, as in the forward order, and no race or unwritten read."""
    want = cached_logits(load_cuda(tiny_model_path, emulator), TINY_TOKENS, N_SPLIT)
    emulator.set_schedule("random", 7, 0.05)
    try:
        got = cached_logits(load_cuda(tiny_model_path, emulator), TINY_TOKENS, N_SPLIT)
    finally:
        emulator.set_schedule("forward")
    np.testing.assert_array_equal(got, want)


def test_tiny_model_greedy_matches_a_cpu_stage(device, tiny_model_path):
    """Against kv_cache (float32 weights): the quantized stage has no Q2_K/Q3_K kernels, which
    the tiny model uses; it is compared with the quantized stage on the default model."""
    from common.generate import generate
    from stages import load
    want = generate(load("kv_cache", tiny_model_path), TINY_TOKENS[:4], 6, ignore_eos=True).tokens
    got = generate(load_cuda(tiny_model_path, device), TINY_TOKENS[:4], 6, ignore_eos=True).tokens
    assert got == want, f"cuda {got} vs kv_cache {want}"


def test_no_allocation_per_token_and_four_bytes_each_way(device, tiny_model_path):
    """The article's two mistakes, measured: after loading, generating tokens allocates no device
    memory, and a greedy token costs one 4-byte copy each way."""
    from common.generate import generate
    engine = load_cuda(tiny_model_path, device)
    b = engine.backend
    engine.warmup()
    allocs, gen0 = b.device_allocs, b.arena.generation
    before = b.transfer_stats()
    n_new = 5
    generate(engine, TINY_TOKENS[:3], n_new + 1, ignore_eos=True)       # prefill + first token, then 5
    after = b.transfer_stats()
    assert b.device_allocs == allocs, "device memory was allocated while generating"
    assert b.arena.generation == gen0 + n_new + 1                        # one arena reset per forward
    assert 0 < b.arena.high_water <= b.arena.nbytes
    assert after["forwards"] - before["forwards"] == n_new + 1
    assert after["h2d_count"] - before["h2d_count"] == n_new + 1        # the token ids
    assert after["h2d_bytes"] - before["h2d_bytes"] == 4 * (3 + n_new)
    assert after["d2h_count"] - before["d2h_count"] == n_new + 1        # the argmax
    assert after["d2h_bytes"] - before["d2h_bytes"] == 4 * (n_new + 1)


def test_long_prompt_goes_in_pieces_of_max_batch(device, tiny_model_path, tiny_reference):
    engine = load_cuda(tiny_model_path, device, max_batch=4)
    assert engine.pieces(TINY_TOKENS)[-1] == (TINY_TOKENS[8:], 8)
    logits = cached_logits(engine, TINY_TOKENS, len(TINY_TOKENS))      # 10 tokens: 4 + 4 + 2
    np.testing.assert_allclose(logits, tiny_reference, rtol=0, atol=cs.LOGIT_TOLERANCE)
    engine.reset()
    assert engine.greedy_next(TINY_TOKENS, 0) == int(np.argmax(tiny_reference[-1]))
    assert engine.backend.arena.high_water <= engine.backend.arena.nbytes


def test_profile_counts_every_launch(emulator, tiny_model_path):
    engine = load_cuda(tiny_model_path, emulator)
    b = engine.backend
    engine.warmup()
    b.start_profile()
    engine.greedy_next([3], 0)
    engine.greedy_next([4], 1)
    rows = {r["kernel"]: r for r in b.profile_rows()}
    b.stop_profile()
    assert rows["attention"]["calls"] == 2 * TINY["n_layer"]
    assert rows["argmax"]["calls"] == 2 and rows["embed_q8_0"]["calls"] == 2
    assert rows["matmul_q6_k_m1"]["calls"] == 2 * 2          # layer 0's attn_v, layer 1's ffn_down
    assert rows["matmul_q8_0_m1"]["calls"] == 2 * 2          # layer 0's attn_output, the tied output
    table = b.profile_table()
    assert "matmul_q4_k_m1" in table
    assert "(1.0 + 1.0 copies, 4 + 4 bytes each)" in table     # since start_profile: 2 greedy tokens


@pytest.mark.slow
def test_default_model_on_the_emulator(emulator, default_model_path):
    """SmolLM2 through the emulated kernels (about a minute): Q4_1 and Q8_0 blocks, 9 query heads
    on 3 KV heads, tied embeddings, a 49152-way argmax, against the float64 reference."""
    from common import reference
    path = default_model_path
    from common.model import LlamaModel
    engine = LlamaModel(GGUFFile(path), cs.CudaBackend(device=emulator), n_ctx=64)
    tokens = engine.tokenizer.encode("The quick brown fox")
    logits = cached_logits(engine, tokens, len(tokens) - 1)
    ref = reference.forward(GGUFFile(path), tokens)
    err = np.abs(logits - ref).max(axis=1)
    assert err.max() <= cs.LOGIT_TOLERANCE, np.round(err, 6)
    engine.reset()
    assert engine.greedy_next(tokens, 0) == int(np.argmax(ref[-1]))
    check_guards(emulator)


# ---- the default model, on a GPU --------------------------------------------------------------

@pytest.mark.gpu
def test_default_model_logits_and_greedy_tokens(gpu, default_model_path):
    """SmolLM2's logits within LOGIT_TOLERANCE of the float64 reference at every position, and
    the greedy continuation identical to a CPU stage's."""
    from common import reference
    from common.generate import generate
    from stages import STAGES, load
    path = default_model_path
    engine = load("cuda", path)
    cpu_stage = "quantized" if "quantized" in STAGES else "simd"
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")
    want = generate(load(cpu_stage, path), prompt, 8, ignore_eos=True).tokens
    got = generate(engine, prompt, 8, ignore_eos=True).tokens
    assert got == want, f"cuda {got} vs {cpu_stage} {want}"
    tokens = prompt + want
    ref = reference.forward(GGUFFile(path), tokens)
    logits = cached_logits(engine, tokens, len(prompt))
    err = np.abs(logits - ref).max(axis=1)
    print(f"\ndefault model: max |logit - reference| = {err.max():.2e} (tolerance {cs.LOGIT_TOLERANCE})")
    assert np.isfinite(logits).all() and err.max() <= cs.LOGIT_TOLERANCE, np.round(err, 5)


@pytest.mark.gpu
def test_default_model_generates_without_allocating(gpu, default_model_path):
    from common.generate import generate
    from stages import load
    engine = load("cuda", default_model_path)
    engine.warmup()
    b = engine.backend
    allocs = b.device_allocs
    before = b.transfer_stats()
    generate(engine, engine.tokenizer.encode("Hello"), 17, ignore_eos=True)
    after = b.transfer_stats()
    assert b.device_allocs == allocs
    per_token = (after["d2h_bytes"] - before["d2h_bytes"]) / (after["forwards"] - before["forwards"])
    assert per_token == 4, f"{per_token} bytes back per token"
