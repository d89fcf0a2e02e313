"""llama.cpp on the same file, the same prompt token ids and the same thread count: the row
every stage is compared with. Needs the optional llama-cpp-python (`make baseline`).

Timed the way common/bench.py times a stage: TTFT = evaluating the prompt + the first
greedy pick; decode = one token evaluated + picked, per token after the first.
"""

from __future__ import annotations

import os
import time

import numpy as np


class BaselineUnavailable(RuntimeError):
    pass


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
        return llama_cpp.__version__
    except ImportError:
        return None


def measure_llama_cpp(model_path, prompt_ids, n_predict: int, threads: int = 1, n_ctx: int = 2048) -> dict:
    """A record with the same timing fields as a stage's (see common/run_cli.run_record)."""
    try:
        import llama_cpp
    except ImportError:
        raise BaselineUnavailable("llama-cpp-python is not installed: `make baseline` installs it "
                                  "(it compiles llama.cpp, ~7 minutes)") from None
    from common.machine import rusage
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(os.fspath(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                          n_batch=512, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0

    def pick() -> int:
        # llama-cpp-python 0.3.x no longer copies logits into llm.scores unless logits_all=True
        # (they stay zeros, and argmax was always token 0): read the last output row directly
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.eval(list(prompt_ids[:4]))        # warm-up: first-use costs (thread pool, buffers)
    llm.reset()
    tokens, decode_ms = [], []
    t0 = time.perf_counter()
    llm.eval(list(prompt_ids))
    tokens.append(pick())
    ttft_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(n_predict - 1):
        t0 = time.perf_counter()
        llm.eval([tokens[-1]])
        tokens.append(pick())
        decode_ms.append((time.perf_counter() - t0) * 1e3)
    rec = {
        "stage": "llama.cpp", "kind": "baseline", "model": os.path.basename(os.fspath(model_path)),
        "prompt_tokens": list(prompt_ids), "n_prompt": len(prompt_ids), "tokens": tokens,
        "n_generated": len(tokens), "ttft_ms": ttft_ms,
        "decode_ms": float(np.median(decode_ms)) if decode_ms else float("nan"),
        "decode_ms_mean": float(np.mean(decode_ms)) if decode_ms else float("nan"),
        "decode_ms_all": decode_ms,
        "tokens_per_s": 1e3 / float(np.median(decode_ms)) if decode_ms else float("nan"),
        "load_s": load_s, "jit_s": 0.0, "threads": threads, "n_ctx": n_ctx,
        "llama_cpp_version": llama_cpp.__version__,
    }
    rec.update(rusage())
    return rec
