"""Helpers shared by the stage tests: tensors from bytes, the CPU stages, numpy oracles, the
thread counts a "1 thread and N agree" test compares, what this CPU offers numba (decided apart
from the probes under test), a check that a mask selects something, what mpiexec says of a killed
rank, llama.cpp's recorded departure from the float64 reference, and what the server's text stream
sends for a run of token ids."""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import numpy as np
import pytest

from common.gguf import BLOCK_SIZES, GGMLType, TensorInfo

GOLDEN_LOGITS = Path(__file__).parent / "golden" / "llama_cpp_logits.npz"


def tensor_from_raw(raw: np.ndarray, ggml_type: GGMLType, shape, name: str = "w") -> TensorInfo:
    """A TensorInfo over bytes in memory, as if it had been read from a GGUF file."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    block, size = BLOCK_SIZES[GGMLType(ggml_type)]
    assert raw.nbytes == int(np.prod(shape)) // block * size
    return TensorInfo(name, tuple(shape), GGMLType(ggml_type), 0, raw.nbytes, raw)


def tensor_from_f32(a: np.ndarray, name: str = "w") -> TensorInfo:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return tensor_from_raw(a, GGMLType.F32, a.shape, name)


def cpu_stages() -> list[str]:
    """The stages whose ops run on this machine's CPU (the cuda stage has its own tests)."""
    from stages import STAGES, unavailable_reason
    return [s for s in STAGES if s != "cuda" and unavailable_reason(s) is None]


def attention_numpy(q, k, v, n_head, n_kv, start):
    """Causal grouped-query attention in float64 numpy: the ops tests' oracle."""
    m, t = q.shape[0], k.shape[0]
    hd = q.shape[1] // n_head
    out = np.empty((m, n_head * hd))
    for h in range(n_head):
        kh = h // (n_head // n_kv)
        sc = q[:, h * hd:(h + 1) * hd].astype(np.float64) @ k[:, kh * hd:(kh + 1) * hd].T / np.sqrt(hd)
        sc += np.triu(np.full((m, t), -np.inf), k=start + 1)
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = (p / p.sum(axis=1, keepdims=True)) @ v[:, kh * hd:(kh + 1) * hd]
    return out


# ---- thread counts ---------------------------------------------------------------------------------

def thread_counts(pool: int | None = None) -> list[int]:
    """[1, N]: the thread counts a "1 thread and N agree" test runs, N numba's whole pool (or
    `pool`). Refuses a pool of one thread: [1, 1] would compare a run with itself, which passes
    whatever the parallel code does."""
    if pool is None:
        import numba
        pool = numba.config.NUMBA_NUM_THREADS
    if pool < 2:
        pytest.fail(f"numba's pool has {pool} thread (NUMBA_NUM_THREADS={pool}): comparing 1 thread with N needs "
                    "N >= 2; set NUMBA_NUM_THREADS=2 or more (it may exceed the cores)", pytrace=False)
    return [1, pool]


# ---- what this CPU offers numba ------------------------------------------------------------------
#
# Skips for a missing vector instruction are decided here from LLVM's view of the CPU numba
# compiles for, not from common/cpu.py or the int8 stage's named_isa(): a regression in those
# probes then fails the tests that need the instructions instead of skipping them as "expected".
# By default that CPU is this one (LLVM's host features); where numba is told to compile for
# another (NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=, the AVX2-only path `make test` runs a
# subset of), its features come from TARGETS below, LLVM's own processor definitions
# (llvm/lib/Target/X86/X86.td), written here apart from the kernels' probe (vector_ir.target_isa),
# plus the +/- features given. The reasons' form is one tests/conftest.py EXPECTED_SKIPS knows.

FEATURE_NAMES = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avxvnni": "AVX-VNNI", "avx512vnni": "AVX512-VNNI",
                 "avx512vl": "AVX512VL"}
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
# LLVM's x86 processors the project has met (cpu-kinds), with the features the tests ask about
TARGETS = {"x86-64": frozenset(), "haswell": _AVX2, "broadwell": _AVX2, "skylake": _AVX2, "znver2": _AVX2,
           "znver3": _AVX2, "skylake-avx512": _AVX512, "cascadelake": _AVX512 | {"avx512vnni"},
           "icelake-server": _AVX512 | {"avx512vnni"}, "sapphirerapids": _AVX512 | {"avx512vnni", "avxvnni"},
           "znver4": _AVX512 | {"avx512vnni"}}


@functools.lru_cache(maxsize=None)
def host_features() -> frozenset:
    """LLVM's feature names that are on for this CPU ('avx2', 'f16c', 'avxvnni', ...)."""
    import llvmlite.binding as llvm
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


def target_features() -> frozenset | None:
    """LLVM's features of the CPU numba compiles for: this CPU's, or a named target's (TARGETS and
    the +/- features given); None for a named CPU TARGETS does not know."""
    from numba import config
    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        return host_features()
    if config.CPU_NAME is not None and config.CPU_NAME not in TARGETS:
        return None
    have = set(TARGETS[config.CPU_NAME] if config.CPU_NAME is not None else host_features())
    for f in filter(None, (config.CPU_FEATURES or "").split(",")):
        (have.add if f[0] == "+" else have.discard)(f[1:])
    return frozenset(have)


def numba_target_reason() -> str | None:
    """Why the tests cannot tell which instructions numba compiles with (a named CPU TARGETS does
    not know), or None."""
    from numba import config
    if target_features() is None:
        return (f"numba's target is set (NUMBA_CPU_NAME={config.CPU_NAME or ''}, NUMBA_CPU_FEATURES="
                f"{config.CPU_FEATURES or ''}): it compiles for that, not this CPU")
    return None


def not_x86_reason() -> str | None:
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return None
    return f"the check reads x86 assembly; this is {'an' if machine[:1].lower() in 'aeiou' else 'a'} {machine} machine"


def lacks(*features: str, then: str = "", have=None) -> str | None:
    """None if numba compiles for this CPU and LLVM says it has every one of `features` (LLVM's
    names), else the skip reason; `then` says what the code does instead, `have` stands in
    for the host's features (the planted cases in tests/test_int8.py)."""
    if have is None:
        why = numba_target_reason()
        if why:
            return why
        have = target_features()
    missing = [FEATURE_NAMES.get(f, f.upper()) for f in features if f not in have]
    if not missing:
        return None
    return f"{whose()} has no {' + '.join(missing)} ({source()})" + (f": {then}" if then else "")


def whose() -> str:
    """Whose features a skip reason speaks of: this CPU's, or numba's named target's."""
    from numba import config
    return "this CPU" if config.CPU_NAME is None and config.CPU_FEATURES is None else \
        f"numba's target {config.CPU_NAME or 'host'}{config.CPU_FEATURES or ''}"


def source() -> str:
    from numba import config
    return "LLVM's host features" if config.CPU_NAME is None and config.CPU_FEATURES is None else \
        "LLVM's features of that CPU"


def expected_isa(have=None) -> str | None:
    """The int8 kernels' instruction set numba's target should get (stages/kernels/vector_ir.py
    named_isa's rule, from LLVM's features): 'vnni' (vpdpbusd on 256-bit registers: AVX-VNNI, or
    AVX512-VNNI with AVX512VL), 'avx2', or None (no AVX2 + F16C, or a target not known here)."""
    if have is None:
        if not_x86_reason() or numba_target_reason():
            return None
        have = target_features()
    if not {"avx2", "f16c"} <= have:
        return None
    return "vnni" if "avxvnni" in have or {"avx512vnni", "avx512vl"} <= have else "avx2"


def lacks_vnni(then: str) -> str | None:
    """None on a VNNI CPU, else the skip reason."""
    if expected_isa() == "vnni":
        return None
    why = lacks("avx2", "f16c", then=then)
    return why or f"{whose()} has no AVX-VNNI, nor AVX512-VNNI with AVX512VL ({source()}): {then}"


# ---- masks -----------------------------------------------------------------------------------------

def some(mask, at_least: int = 1, what: str = "positions") -> np.ndarray:
    """The mask, once it selects at least `at_least` entries: a check over an empty selection
    (`(a[mask] == b[mask]).all()`) is true whatever a and b hold."""
    mask = np.asarray(mask, dtype=bool)
    n = int(mask.sum())
    assert n >= at_least, f"the check would cover {n} {what} (of {mask.size}); it needs at least {at_least}"
    return mask


def mpiexec_saw_a_rank_killed(text: str, pids) -> bool:
    """mpiexec's report that a rank was killed (SIGKILL) and it ended the run. It names one pid:
    the first rank it finds ended by a signal, and it kills the others with that same signal, so
    the pid may be any rank's, not always the one killed first."""
    named = re.search(r"PID (\d+) RUNNING AT", text)
    return bool(named) and int(named[1]) in set(pids) and "BAD TERMINATION" in text and "signal 9" in text


def greedy_at_clear_choices(ours, theirs, tokens, near_tie: float, at_least: int = 10):
    """Assert that ours [n, n_vocab] picks `tokens` [n] wherever theirs (the stage it is checked
    against) has a clear winner (top two more than near_tie apart); at least `at_least` such rows."""
    top2 = np.sort(theirs, axis=1)[:, -2:]
    clear = some(top2[:, 1] - top2[:, 0] > near_tie, at_least, "clear choices")
    assert (ours.argmax(axis=1)[clear] == np.array(tokens)[clear]).all()


# ---- llama.cpp's departure from the float64 reference (tests/golden) ------------------------------

def golden_prompts() -> list[str]:
    golden = np.load(GOLDEN_LOGITS)
    return sorted({k.split("_")[0] for k in golden.files if k.startswith("p")})


@functools.lru_cache(maxsize=None)
def golden_reference(prompt: str, model_path: str) -> np.ndarray:
    """The float64 reference's logits [n_ids, n_vocab] for a golden prompt ('p0', ...), computed
    once per test run (tests/test_reference.py, test_int8.py and the tolerance check share it)."""
    from common import reference
    from common.gguf import GGUFFile
    ids = np.load(GOLDEN_LOGITS)[f"{prompt}_ids"].tolist()
    with GGUFFile(model_path) as g:
        logits = reference.forward(g, ids)
    logits.flags.writeable = False
    return logits


def departure(ref: np.ndarray, golden, prompt: str) -> float:
    """max |llama.cpp - reference| of one prompt, over the recorded logits (a subset of the vocabulary
    at every position, and llama.cpp's top candidates)."""
    diff = ref[:, golden["subset_ids"]] - golden[f"{prompt}_subset_logits"]
    top = np.take_along_axis(ref, golden[f"{prompt}_top_ids"], 1) - golden[f"{prompt}_top_logits"]
    return float(max(np.abs(diff).max(), np.abs(top).max()))


def llama_cpp_departure(model_path) -> float:
    """The largest departure of llama.cpp's recorded logits from the float64 reference over every
    golden prompt: how far 8-bit activations (llama.cpp's) move the default model's logits."""
    golden = np.load(GOLDEN_LOGITS)
    return max(departure(golden_reference(p, str(model_path)), golden, p) for p in golden_prompts())


def sent_until_stop(stream, ids, logprob=None, top=None) -> tuple[str, list, bool]:
    """Token ids pushed through a TextStream (app/serve/text.py) until a stop string is found:
    (the text sent, the log-probability entries sent with it, whether a stop string was found)."""
    sent, entries, hit = "", [], False
    for t in ids:
        text, out, hit = stream.push(t, logprob, top)
        sent += text
        entries += out
        if hit:
            break
    return sent, entries, hit
