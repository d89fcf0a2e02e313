"""llama.cpp on the same file, the same prompt token ids and the same thread count: the row
every stage is compared with. Needs the optional llama-cpp-python (`make baseline`).

Timed the way app/measure/bench.py times a stage: TTFT = evaluating the prompt + the first
greedy pick; decode = one token evaluated + picked, per token after the first.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from app.measure.bench import bench_prompt, model_summary, record_path
from app.measure.counters import Counters
from app.measure.machine import rusage
from app.measure.protocol import header, write_record
from app.models import DEFAULT_MODEL, resolve
from common.gguf import GGUFFile
from common.tokenizer import Tokenizer
from stages.registry import REPORT_PROMPT_TOKENS, Tokens


class BaselineUnavailable(RuntimeError):
    pass


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
        return llama_cpp.__version__
    except ImportError:
        return None


def measure_llama_cpp(model_path, prompt_ids, n_predict: int, threads: int = 1, n_ctx: int = 2048) -> dict:
    """A record with the same timing fields as a stage's (see app/bench.run_record)."""
    try:
        import llama_cpp
    except ImportError:
        raise BaselineUnavailable("llama-cpp-python is not installed: `make baseline` installs it "
                                  "(it compiles llama.cpp, ~7 minutes)") from None
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
    with Counters() as counted:           # the timed region's counters, as a stage's record has
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
        "stop_reason": "length", "counters": counted.result,
    }
    rec.update(rusage())
    return rec


def cmd_baseline(args):
    model = resolve(args.model)
    with GGUFFile(model) as g:
        prompt = bench_prompt(Tokenizer.from_gguf(g), args.prompt_tokens)
        summary = model_summary(g)
    rec = measure_llama_cpp(model, prompt, args.n_predict, threads=args.threads, n_ctx=args.ctx_size)
    rec["model_info"] = summary
    rec.update(header({"prompt_tokens": args.prompt_tokens, "n_predict": args.n_predict, "sampling": "greedy",
                       "ignore_eos": True, "threads": args.threads, "n_ctx": args.ctx_size}))
    path = None if args.no_write else write_record(rec, record_path(rec, args.out))[0]
    if args.json:
        print(json.dumps(rec, default=float))
    else:
        print(f"llama.cpp: TTFT {rec['ttft_ms']:.1f} ms, decode {rec['decode_ms']:.1f} ms/token"
              + (f" -> {path}" if path else ""), file=sys.stderr)


def add_commands(sub):
    p = sub.add_parser("baseline", help="measure llama.cpp (llama-cpp-python) on the same prompt ids",
                       description="Record llama.cpp's row: the same model, prompt token ids and thread count "
                                   "as the stages, timed the same way. Needs llama-cpp-python "
                                   "(`make baseline` installs it).")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--prompt-tokens", type=int, default=REPORT_PROMPT_TOKENS,
                   help="prompt length (default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=Tokens().report,
                   help="tokens to generate (default: %(default)s, as the stages with a KV cache)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads (default: 1, the article's setting)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context window (default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for the record (default: profiles/results/<machine>/<model>/)")
    p.add_argument("--no-write", action="store_true", help="measure without writing a record")
    p.add_argument("--json", action="store_true", help="print the record (one JSON line)")
    p.set_defaults(func=cmd_baseline)
