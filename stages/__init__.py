"""The stages, in order. Each module defines one Backend subclass that inherits from the
stage before it and overrides only what its optimization changes:

    naive      textbook loops, float32 weights, no KV cache
    tiling     the matmul blocked for the caches
    simd       packed panels + a contiguous inner loop that LLVM vectorizes
    kv_cache   keep K and V of past positions: each step computes the new token only
    quantized  weights stay in their ggml blocks; fused dequantize-matmul kernels
    threads    the quantized kernels and a fused attention on every core (numba prange)
    int8       activations rounded to 8-bit blocks as llama.cpp does; integer dot products
    cuda       everything on the GPU (PyCUDA)

    engine = load("simd", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = engine.forward(tokens, start_pos=0)        # float32 [len(tokens), n_vocab]
"""

from __future__ import annotations

import importlib
import importlib.util

# name -> (module, Backend class name)
_REGISTRY = {
    "naive": ("stages.naive", "NaiveBackend"),
    "tiling": ("stages.tiling", "TilingBackend"),
    "simd": ("stages.simd", "SimdBackend"),
    "kv_cache": ("stages.kv_cache", "KVCacheBackend"),
    "quantized": ("stages.quantized", "QuantizedBackend"),
    "threads": ("stages.threads", "ThreadsBackend"),
    "int8": ("stages.int8", "Int8Backend"),
    "cuda": ("stages.cuda", "CudaBackend"),
}


def _present(name: str) -> bool:
    try:
        return importlib.util.find_spec(_REGISTRY[name][0]) is not None
    except ModuleNotFoundError:
        return False


STAGES = [name for name in _REGISTRY if _present(name)]


class StageError(ValueError):
    """An unknown stage, or one this machine cannot run; the message says why."""


def backend_class(stage: str):
    if stage not in _REGISTRY:
        raise StageError(f"unknown stage '{stage}'; the stages are: {', '.join(STAGES)}")
    module, cls = _REGISTRY[stage]
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(stage: str) -> str | None:
    """None if this machine can run the stage, else a sentence saying what is missing."""
    check = getattr(backend_class(stage), "unavailable_reason", None)
    return check() if check else None


def runnable_stages() -> list[str]:
    return [s for s in STAGES if unavailable_reason(s) is None]


def fastest_stage() -> str:
    """The stage `make run` uses: cuda where it can run; else the CPU stage with the best
    decode time recorded on this machine by `make report`; else threads (measured, not
    assumed: a later stage is not always a faster one)."""
    runnable = runnable_stages()
    if "cuda" in runnable:
        return "cuda"
    recorded = _recorded_decode_ms()
    measured = [s for s in runnable if s in recorded]
    if measured:
        return min(measured, key=recorded.get)
    return "threads" if "threads" in runnable else runnable[-1]


def _recorded_decode_ms() -> dict:
    """{stage: decode ms/token} from this machine's report records for the default model."""
    import json
    from common.bench import results_dir
    from common.models import DEFAULT_MODEL
    out = {}
    for path in results_dir(DEFAULT_MODEL.filename).glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("kind") == "stage" and isinstance(rec.get("decode_ms"), float) and rec["decode_ms"] == rec["decode_ms"]:
            out[rec["stage"]] = rec["decode_ms"]
    return out


def load(stage: str, model_path, n_ctx: int | None = None, threads: int | None = None,
         progress: bool = False):
    """A LlamaModel bound to the stage's backend (see common/model.py)."""
    from common.gguf import GGUFFile
    from common.model import LlamaModel
    reason = unavailable_reason(stage)
    if reason:
        raise StageError(f"stage '{stage}' cannot run here: {reason}")
    backend = backend_class(stage)(threads=threads)
    model = LlamaModel(GGUFFile(model_path), backend, n_ctx=n_ctx, progress=progress)
    model.stage = stage
    return model
