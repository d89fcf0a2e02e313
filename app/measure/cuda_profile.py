"""Profile the cuda stage on one model: per-kernel time from CUDA events, copies per token.

    python -m app bench cuda-profile [-m MODEL] [--prompt-tokens 64] [-n 32] [--out DIR]

Prints two nvprof-style tables (prefill, decode) and writes profiles/results/<machine>/<model>/
cuda_profile.json with them, the host<->device copies (count and bytes) per prefill and per
decoded token, the device allocations made while generating (0 is the point) and the memory the
stage holds. The timings of `python -m app bench --stage cuda` are taken without events; these
are taken with them, so they are a little slower. profile(engine, ...) takes any cuda engine: the
tests run it on the CPU emulator of the kernels (app/cuda_emulator/).
"""

from __future__ import annotations

import time

from app.measure.bench import bench_prompt, model_summary, results_dir
from app.measure.machine import versions
from app.measure.protocol import header


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def per_unit(d: dict, n: int) -> dict:
    return {k: (v / n if n else float("nan")) for k, v in d.items()}



def profile(engine, prompt_tokens: int, n: int) -> dict:
    """Prefill, then n greedy tokens one at a time, with CUDA events around every launch: the
    record's figures (the module docstring); the two tables printed."""
    from stages.cuda import format_profile_table
    b = engine.backend
    jit_s = engine.warmup()
    try:
        prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    except Exception:                                 # a model file without a tokenizer (tests' tiny model)
        prompt = [i % engine.config.n_vocab for i in range(1, prompt_tokens + 1)]
    engine.reset()
    allocs_before = b.device_allocs
    t0 = b.transfer_stats()
    b.start_profile()
    tok = engine.greedy_next(prompt, 0)
    prefill_rows = b.profile_rows()
    t1 = b.transfer_stats()
    b.start_profile()                                 # reset: decode only from here
    tokens, pos = [tok], len(prompt)
    wall = time.perf_counter()
    for _ in range(n):
        tokens.append(engine.greedy_next([tokens[-1]], pos))
        pos += 1
    wall = time.perf_counter() - wall
    decode_rows = b.profile_rows()
    b.stop_profile()
    t2 = b.transfer_stats()
    allocs_while_generating = b.device_allocs - allocs_before

    prefill_copies, decode_copies = delta(t1, t0), delta(t2, t1)
    name = engine.gguf.path.split("/")[-1]
    title = f"{name} on {b.device.name}"
    print(format_profile_table(prefill_rows, prefill_copies, f"prefill of {len(prompt)} tokens: {title}"))
    print()
    print(format_profile_table(decode_rows, decode_copies, f"decode, {n} tokens: {title}"))
    print(f"\ndevice allocations while generating: {allocs_while_generating}; arena high water "
          f"{b.arena.high_water / 2**20:.1f} of {b.arena.nbytes / 2**20:.1f} MiB")
    dev = b.device
    return {
        "kind": "cuda_profile", "stage": "cuda", "model": name, "model_info": model_summary(engine.gguf),
        "device": {"name": dev.name, "compute_capability": list(getattr(dev, "compute_capability", ())),
                   "total_memory": getattr(dev, "total_memory", None), "arch": getattr(dev, "arch", None)},
        "prompt_tokens": len(prompt), "n_decode": n, "jit_s": jit_s, "load_s": engine.load_s,
        "decode_ms_per_token_with_events": wall / n * 1e3 if n else None,
        "prefill": {"copies": prefill_copies, "kernels": prefill_rows},
        "decode": {"copies": decode_copies, "copies_per_token": per_unit(decode_copies, n), "kernels": decode_rows},
        "device_allocs_while_generating": allocs_while_generating,
        "memory": b.memory_summary(), "weights_bytes": engine.weight_bytes(), "kv_cache_bytes": engine.kv_bytes(),
        "tokens": tokens, "versions": versions(),
    }


def add_arguments(p):
    p.add_argument("-m", "--model", default=None, help="GGUF file or model name (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("-c", "--ctx-size", type=int, default=None)
    p.add_argument("--out", default=None, help="folder for the JSON (default: next to the bench records)")


def records(args):
    from app.models import resolve
    from stages import load
    path = resolve(args.model)
    rec = profile(load("cuda", path, n_ctx=args.ctx_size), args.prompt_tokens, args.n_predict)
    rec.update(header(command=args.command_line))
    yield results_dir(path.name, args.out) / "cuda_profile.json", rec
