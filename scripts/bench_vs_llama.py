"""The quantized, threads and int8 stages next to llama.cpp, and the stages before them,
measured in one run.

    python scripts/bench_vs_llama.py                          # SmolLM2 and synthetic TinyLlama
    python scripts/bench_vs_llama.py --model smollm2 --rounds 2
    python scripts/bench_vs_llama.py --engines quantized,threads,int8,llama.cpp --threads 1,2
    python scripts/bench_vs_llama.py --kernels                 # decode kernel throughput per type

llama.cpp comes from the optional llama-cpp-python (`make llama-cpp`); without it the llama.cpp
rows are skipped and said to be. Every engine runs in its own subprocess, so each peak RSS is
that engine's alone (resource.getrusage in the child); all of them get the same prompt token
ids (our tokenizer, common.bench.bench_prompt), greedy decoding. simd, kv_cache and quantized
run on 1 thread (they are single-threaded stages); threads, int8 and llama.cpp run at every
thread count of --threads (default: 1 and the machine's physical cores), each engine at a
thread count being one row, named engine@threads (threads@2, llama.cpp@1, ...).

What is measured, per model:

    decode@64   ms per token after a 64-token prompt (median over the generated tokens)
    TTFT@128    prompt of 128 tokens to the first token (median of reps): quantized, threads,
                int8, llama.cpp
    peak RSS    of each engine's process; the quantized stage's is held against
                file size + its KV arena (the float32 cache for n_ctx positions)
    bandwidth   the machine's read bandwidth at each thread count (common/roofline.py), and
                the decode floor it sets: file bytes / bandwidth

and the ratios the issues ask for:

    kv_cache decode >= 5x faster than simd          simd decode / kv_cache decode
    quantized peak RSS <= 1.5 x (file + KV arena)
    quantized decode <= 2x llama.cpp's              quantized decode / llama.cpp@1 decode
    quantized TTFT@128 <= 2x llama.cpp's            quantized TTFT / llama.cpp@1 TTFT
    threads, int8 decode and TTFT@128 <= 1x llama.cpp's at the same thread count
    decode within 10% of the bandwidth roofline     decode / (file bytes / bandwidth), <= 1.1
                                                    (the target is for TinyLlama's geometry)

The stages without a KV cache recompute the whole text for every token, and on TinyLlama's
geometry the eager stages hold 4.4 GB of float32: they get short runs there (a few tokens),
which the record's settings say. numba's cache is warmed by a separate process first, so no
measured process pays for (or holds the memory of) compiling; the first warm-up's time is
recorded as the cold JIT time when the cache was empty.

Results: profiles/bench/vs_llama_<model>.json (figures, ratios, settings, machine) and a table.
A benchmark, not a test: on a shared machine the figures move by 10-30% from run to run;
--rounds N alternates the engines N times and keeps the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT_DIR = ROOT / "profiles" / "bench"

# (prompt tokens, tokens generated) for the decode@64 measurement, per model kind.
SETTINGS = {
    "small": {"simd": (64, 6), "kv_cache": (64, 24), "quantized": (64, 32), "threads": (64, 32), "int8": (64, 32),
              "int8-auto": (64, 32),
              "llama.cpp": (64, 32)},
    "large": {"simd": (64, 3), "kv_cache": (64, 5), "quantized": (64, 16), "threads": (64, 16), "int8": (64, 16),
              "int8-auto": (64, 16),
              "llama.cpp": (64, 16)},
}
ENGINES = ("simd", "kv_cache", "quantized", "threads", "int8", "llama.cpp")
# Not in the default set: the int8 stage with its auto-vectorized decode loops instead of the
# named-instruction kernels (stages/int8_kernels.py), to measure the two side by side.
EXTRA_ENGINES = ("int8-auto",)
MULTI_THREADED = ("threads", "int8", "int8-auto", "llama.cpp")      # measured at every --threads count
WITH_TTFT = ("quantized", "threads", "int8", "int8-auto", "llama.cpp")
ROOFLINE_SLACK = 1.1                                   # decode within 10% of file bytes / bandwidth
TTFT_TOKENS = 128
TTFT_REPS = {"small": 3, "large": 2}
N_CTX = 2048                 # our engine's default context, and llama.cpp's for the same cache
LARGE_PARAMS = 500e6         # models above this get the short settings
MODEL_NAMES = ("smollm2", "tinyllama-synthetic")


# ---- children: one engine each ----------------------------------------------------------------

def child_stage(args) -> dict:
    """Load one of our stages, warm it, time decode@P and (optionally) TTFT@128."""
    from common.bench import bench_prompt, model_summary
    from common.generate import Sampler, Session, generate
    from common.machine import rusage
    from stages import load
    t0 = time.perf_counter()
    engine = load("int8" if args.stage == "int8-auto" else args.stage, args.model_path, n_ctx=N_CTX,
                  threads=args.threads)
    if args.stage == "int8-auto":
        from stages.int8_kernels import matvec_int8_auto
        engine.backend.matvec = matvec_int8_auto
    load_s = time.perf_counter() - t0
    jit_s = engine.warmup()
    rec = {"engine": args.stage, "threads": engine.backend.threads, "load_s": load_s, "jit_s": jit_s,
           "n_ctx": engine.n_ctx,
           "kv_arena_bytes": engine.kv_bytes(), "weight_bytes": engine.weight_bytes(),
           "model_info": model_summary(engine.gguf)}
    if args.warm_only:
        rec.update(rusage())
        return rec
    tok = engine.tokenizer
    prompt = bench_prompt(tok, args.prompt_tokens)
    gen = generate(engine, prompt, args.n_predict, Sampler(), ignore_eos=True)
    rec.update({"prompt_tokens": args.prompt_tokens, "n_predict": args.n_predict,
                "prompt_ids": prompt, "tokens": gen.tokens, "ttft_ms": gen.ttft_ms,
                "decode_ms": gen.decode_ms_median, "decode_ms_all": gen.decode_ms})
    if args.ttft_reps:
        long_prompt = bench_prompt(tok, TTFT_TOKENS)
        ttfts = []
        for _ in range(args.ttft_reps):
            g = generate(engine, long_prompt, 1, Sampler(), ignore_eos=True)
            ttfts.append(g.ttft_ms)
        rec.update({"ttft128_ms_all": ttfts, "ttft128_ms": sorted(ttfts)[len(ttfts) // 2],
                    "ttft128_prompt_ids": long_prompt})
    if args.profile:
        from common.profile import OpProfiler
        session = Session(engine)
        session.generate(prompt, 1, Sampler(), ignore_eos=True)          # prefill, not profiled
        with OpProfiler(engine) as prof:
            session.generate([], 8, Sampler(), ignore_eos=True)
        rec["decode_profile"] = prof.rows()
        rec["decode_profile_table"] = prof.table(f"per-op profile, 8 decode steps after {len(prompt)} tokens")
    rec.update(rusage())
    return rec


def child_runtime(args) -> dict:
    """The interpreter + numpy + numba + the quantized stage's compiled kernels, loaded and run
    once on tiny arrays, no model: the resident memory any run of the stage starts from."""
    import numpy as np
    from common.gguf import GGMLType, TensorInfo
    from common.machine import rusage
    from common.quants import quantize
    from stages.quantized import QuantizedBackend
    b = QuantizedBackend()
    rng = np.random.default_rng(0)
    for t in (GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K):
        raw = quantize(rng.normal(0, 1, (4, 256)).astype(np.float32), t)
        w = b.prepare_matrix(TensorInfo("w", (4, 256), t, 0, raw.nbytes, raw.reshape(-1)))
        b.matmul(np.ones((1, 256), np.float32), w)
        b.matmul(np.ones((2, 256), np.float32), w)
        b.embed(w, [1])
    x = rng.normal(0, 1, (2, 128)).astype(np.float32)
    cos = np.ones((8, 32), np.float32)
    b.attention(b.rope(x, cos, cos, 0, 2), b.rope(x, cos, cos, 0, 2), x, 2, 2, 0)
    b.add(b.rms_norm(x, x[0], 1e-5), b.swiglu(x, x))
    b.argmax(x[:1])
    rec = {"engine": "runtime"}
    rec.update(rusage())
    return rec


def child_llama(args) -> dict:
    from common.baseline import measure_llama_cpp
    from common.bench import bench_prompt
    from common.gguf import GGUFFile
    from common.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(args.model_path))
    prompt = bench_prompt(tok, args.prompt_tokens)
    r = measure_llama_cpp(args.model_path, prompt, args.n_predict, threads=args.threads, n_ctx=N_CTX)
    rec = {"engine": "llama.cpp", "threads": args.threads, "load_s": r["load_s"], "n_ctx": N_CTX,
           "prompt_tokens": args.prompt_tokens,
           "n_predict": args.n_predict, "prompt_ids": prompt, "tokens": r["tokens"], "ttft_ms": r["ttft_ms"],
           "decode_ms": r["decode_ms"], "decode_ms_all": r["decode_ms_all"],
           "llama_cpp_version": r.get("llama_cpp_version")}
    if args.ttft_reps:
        long_prompt = bench_prompt(tok, TTFT_TOKENS)
        ttfts = [measure_llama_cpp(args.model_path, long_prompt, 1, threads=args.threads, n_ctx=N_CTX)["ttft_ms"]
                 for _ in range(args.ttft_reps)]
        rec.update({"ttft128_ms_all": ttfts, "ttft128_ms": sorted(ttfts)[len(ttfts) // 2],
                    "ttft128_prompt_ids": long_prompt})
    from common.machine import rusage
    rec.update(rusage())
    return rec


def run_child(engine: str, model_path: Path, prompt_tokens=0, n_predict=0, ttft_reps=0, profile=False,
              warm_only=False, threads=1) -> dict:
    cmd = [sys.executable, os.fspath(Path(__file__).resolve()), "--child", engine, "--model-path",
           os.fspath(model_path), "--prompt-tokens", str(prompt_tokens), "--n-predict", str(n_predict),
           "--ttft-reps", str(ttft_reps), "--child-threads", str(threads)]
    if profile:
        cmd.append("--profile")
    if warm_only:
        cmd.append("--warm-only")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{engine} on {model_path.name} failed:\n{p.stderr[-3000:]}")
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    rec["wall_s"] = time.perf_counter() - t0
    return rec


# ---- the parent ----------------------------------------------------------------------------------

def median(xs):
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


def row_names(engines, thread_counts) -> list[tuple[str, str, int]]:
    """[(row name, engine, threads)]: the single-threaded stages once, the others per count."""
    rows = []
    for e in engines:
        if e in MULTI_THREADED:
            rows += [(f"{e}@{t}", e, t) for t in thread_counts]
        else:
            rows.append((e, e, 1))
    return rows


def bench_model(name: str, rounds: int, with_llama: bool, log, engines=ENGINES, thread_counts=(1,)) -> dict:
    from common.bench import model_summary
    from common.gguf import GGUFFile
    from common.machine import machine_info
    from common.model import LlamaConfig, n_params
    from common.models import resolve
    path = resolve(name)
    g = GGUFFile(path)
    cfg = LlamaConfig.from_gguf(g)
    kind = "large" if n_params(cfg) > LARGE_PARAMS else "small"
    settings = SETTINGS[kind]
    engines = [e for e in engines if e != "llama.cpp" or with_llama]
    rows = row_names(engines, thread_counts)

    # Warm numba's cache: the eager stages' kernels do not depend on the model, so the small
    # default model compiles them; the later stages compile the kernels of this file's types.
    warm = {}
    for stage in [e for e in engines if e != "llama.cpp"]:
        warm_path = path if stage not in ("simd", "kv_cache") else resolve("smollm2")
        log(f"  warming numba's cache: {stage} on {warm_path.name}")
        warm[stage] = run_child(stage, warm_path, warm_only=True, threads=max(thread_counts))

    runtime = run_child("runtime", path)
    log(f"  runtime alone (python + numpy + numba + the stage's kernels): "
        f"peak RSS {runtime['peak_rss_mb']:.0f} MiB")

    from common import roofline
    log("  measuring read bandwidth (common/roofline.py) ...")
    ceilings = roofline.measure(threads=max(thread_counts))

    runs = {r: [] for r, _, _ in rows}
    for r in range(rounds):
        order = rows if r % 2 == 0 else rows[::-1]
        for row, e, t in order:
            p, n = settings[e]
            reps = TTFT_REPS[kind] if e in WITH_TTFT else 0
            ttft = f", TTFT@{TTFT_TOKENS} x{reps}" if reps else ""
            log(f"  round {r + 1}/{rounds}: {row} (prompt {p}, {n} tokens{ttft})")
            profile = r == 0 and (e == "quantized" or (e in ("threads", "int8", "int8-auto") and t == max(thread_counts)))
            rec = run_child(e, path, p, n, reps, profile=profile, threads=t)
            runs[row].append(rec)
            log(f"    decode {rec['decode_ms']:.1f} ms/token"
                + (f", TTFT@{TTFT_TOKENS} {rec['ttft128_ms']:.0f} ms" if "ttft128_ms" in rec else "")
                + f", peak RSS {rec['peak_rss_mb']:.0f} MiB")

    def fig(e, key):
        return median([rec.get(key, float("nan")) for rec in runs.get(e, [])]) if runs.get(e) else float("nan")

    file_size = g.file_size
    figures = {row: {"decode_ms": fig(row, "decode_ms"), "ttft_ms@64": fig(row, "ttft_ms"),
                     "ttft128_ms": fig(row, "ttft128_ms"), "peak_rss_mb": fig(row, "peak_rss_mb"),
                     "load_s": fig(row, "load_s"), "threads": t} for row, _, t in rows}
    # the decode floor: every byte of the file read once per token at the measured bandwidth
    bandwidth = {int(k): v for k, v in ceilings["bandwidth_gbs"].items()}
    floor_ms = {t: file_size / (bandwidth[t] * 1e9) * 1e3 for t in bandwidth}
    targets = {"kv_cache_speedup_over_simd_decode": (">=", 5.0), "quantized_rss_over_file_plus_kv": ("<=", 1.5),
               "quantized_decode_over_llama_cpp": ("<=", 2.0), "quantized_ttft128_over_llama_cpp": ("<=", 2.0)}
    ratios = {}
    if "simd" in runs and "kv_cache" in runs:
        ratios["kv_cache_speedup_over_simd_decode"] = figures["simd"]["decode_ms"] / figures["kv_cache"]["decode_ms"]
    q = runs["quantized"][0] if "quantized" in runs else None
    kv_arena = (q or next(iter(runs.values()))[0]).get("kv_arena_bytes", 0)
    budget = file_size + kv_arena
    if q is not None:
        ratios["quantized_rss_over_file_plus_kv"] = figures["quantized"]["peak_rss_mb"] * 2**20 / budget
        if with_llama and "llama.cpp@1" in figures:
            ratios["quantized_decode_over_llama_cpp"] = \
                figures["quantized"]["decode_ms"] / figures["llama.cpp@1"]["decode_ms"]
            ratios["quantized_ttft128_over_llama_cpp"] = \
                figures["quantized"]["ttft128_ms"] / figures["llama.cpp@1"]["ttft128_ms"]
    for row, e, t in rows:
        if e in ("threads", "int8", "int8-auto") and with_llama:
            base = figures[f"llama.cpp@{t}"]
            ratios[f"{row}_decode_over_llama_cpp@{t}"] = figures[row]["decode_ms"] / base["decode_ms"]
            ratios[f"{row}_ttft128_over_llama_cpp@{t}"] = figures[row]["ttft128_ms"] / base["ttft128_ms"]
            targets[f"{row}_decode_over_llama_cpp@{t}"] = ("<=", 1.0)
            targets[f"{row}_ttft128_over_llama_cpp@{t}"] = ("<=", 1.0)
        if e in MULTI_THREADED and t in floor_ms:
            ratios[f"{row}_decode_over_bandwidth_floor"] = figures[row]["decode_ms"] / floor_ms[t]
            targets[f"{row}_decode_over_bandwidth_floor"] = ("<=", ROOFLINE_SLACK)
    verdicts = {}
    for k, v in ratios.items():
        op, t = targets[k]
        verdicts[k] = {"value": v, "target": f"{op} {t}", "met": bool(v >= t if op == ">=" else v <= t)}
    rss_net = ((figures["quantized"]["peak_rss_mb"] - runtime["peak_rss_mb"]) * 2**20 / budget
               if q is not None else float("nan"))
    first = next(r for r, _, _ in rows)
    reference_row = "quantized" if "quantized" in runs else first
    same_tokens = {row: runs[row][0]["tokens"] == runs[reference_row][0]["tokens"][:len(runs[row][0]["tokens"])]
                   for row, _, _ in rows}
    scaling = {e: {t: figures[f"{e}@{t}"]["decode_ms"] for t in thread_counts}
               for e in MULTI_THREADED if e in engines}
    profiles = {row: runs[row][0].get("decode_profile_table") for row, _, _ in rows
                if runs[row][0].get("decode_profile_table")}
    return {
        "model": path.name, "model_name": name, "synthetic": "synthetic" in path.name,
        "model_info": model_summary(g), "n_params": n_params(cfg),
        "settings": {"kind": kind, "decode": {e: {"prompt_tokens": settings[e][0], "n_predict": settings[e][1]}
                                              for e in engines},
                     "ttft_prompt_tokens": TTFT_TOKENS, "ttft_reps": TTFT_REPS[kind],
                     "threads": list(thread_counts), "n_ctx": N_CTX, "rounds": rounds,
                     "sampling": "greedy, EOS ignored"},
        "file_size": file_size, "kv_arena_bytes": kv_arena, "rss_budget_bytes": budget,
        "runtime_peak_rss_mb": runtime["peak_rss_mb"],
        "quantized_rss_net_of_runtime_over_file_plus_kv": rss_net,
        "bandwidth_gbs": ceilings["bandwidth_gbs"], "bandwidth_gbs_median": ceilings["bandwidth_gbs_median"],
        "peak_gflops": ceilings["peak_gflops"], "decode_floor_ms": floor_ms,
        "figures": figures, "ratios": verdicts, "decode_scaling_ms": scaling,
        "greedy_tokens_match": {"reference_row": reference_row, "rows": same_tokens},
        "cold_jit_s": {s: w["jit_s"] for s, w in warm.items()},
        "quantized_decode_profile": q.get("decode_profile") if q else None,
        "quantized_decode_profile_table": q.get("decode_profile_table") if q else None,
        "decode_profile_tables": profiles,
        "runs": runs, "machine": machine_info(),
        "command": "python scripts/bench_vs_llama.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(res: dict, out=sys.stdout):
    f = res["figures"]
    print(f"\n{res['model']} ({res['n_params'] / 1e6:.0f}M params, file {res['file_size'] / 2**20:.0f} MiB, "
          f"KV arena {res['kv_arena_bytes'] / 2**20:.0f} MiB; settings: {res['settings']['kind']})", file=out)
    print(f"{'engine':<13} {'decode ms/tok':>14} {'TTFT@64 ms':>11} {'TTFT@128 ms':>12} {'peak RSS MiB':>13}",
          file=out)
    for e, v in f.items():
        def num(x, w, p=1):
            return f"{x:>{w}.{p}f}" if x == x else f"{'-':>{w}}"
        print(f"{e:<13} {num(v['decode_ms'], 14)} {num(v['ttft_ms@64'], 11, 0)} {num(v['ttft128_ms'], 12, 0)} "
              f"{num(v['peak_rss_mb'], 13, 0)}", file=out)
    bw = res.get("bandwidth_gbs", {})
    if bw:
        print("  read bandwidth " + ", ".join(f"{v:.1f} GB/s on {k} thread(s) (decode floor "
                                               f"{res['decode_floor_ms'][int(k)]:.1f} ms)" for k, v in bw.items()),
              file=out)
    for k, v in res["ratios"].items():
        verdict = "met" if v["met"] else "MISSED"
        print(f"  {k:<46} {v['value']:6.2f}  (target {v['target']}: {verdict})", file=out)
    if res["quantized_rss_net_of_runtime_over_file_plus_kv"] == res["quantized_rss_net_of_runtime_over_file_plus_kv"]:
        print(f"  (the runtime alone - python, numpy, numba, the kernels - holds {res['runtime_peak_rss_mb']:.0f} MiB; "
              f"net of it the quantized stage holds {res['quantized_rss_net_of_runtime_over_file_plus_kv']:.2f} x "
              f"(file + KV arena))", file=out)
    match = res["greedy_tokens_match"]
    print(f"  greedy tokens equal to {match['reference_row']}'s: "
          + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in match["rows"].items()), file=out)


# ---- per-type kernel throughput --------------------------------------------------------------------

def bench_kernels(names, log):
    """Decode (one activation row) throughput of the quantized stage's float kernels and the
    int8 stage's integer ones (1 thread; the activation quantized once, as the stage does for
    q, k and v) on every 2-D weight of each model, grouped by ggml type: min CPU time over 5
    passes."""
    import numpy as np
    from common.gguf import GGUFFile
    from common.models import resolve
    from stages.int8 import Int8Backend
    from stages.int8_kernels import matvec_int8, matvec_int8_auto
    from stages.quantized import QuantizedBackend
    backends = {"quantized": QuantizedBackend(), "int8": Int8Backend(threads=1)}
    if matvec_int8 is not matvec_int8_auto:                 # named instructions: the loops too
        backends["int8-auto"] = Int8Backend(threads=1)
        backends["int8-auto"].matvec = matvec_int8_auto
    out = {}
    for name in names:
        g = GGUFFile(resolve(name))
        groups = {}
        for t in g.tensors.values():
            if len(t.shape) == 2:
                groups.setdefault(t.type_name, []).append(backends["quantized"].prepare_matrix(t))
        rng = np.random.default_rng(0)
        for tn, mats in groups.items():
            xs = {m.shape[1]: rng.standard_normal((1, m.shape[1])).astype(np.float32) for m in mats}
            for label, b in backends.items():
                for m in mats[:1]:
                    b.matmul(xs[m.shape[1]], m)                  # compile / load from cache
                best = float("inf")
                for _ in range(5):
                    t0 = time.process_time()
                    for m in mats:
                        b.matmul(xs[m.shape[1]], m)
                    best = min(best, time.process_time() - t0)
                n_w = sum(m.shape[0] * m.shape[1] for m in mats)
                n_b = sum(m.nbytes for m in mats)
                key = f"{g.path.split('/')[-1]}:{tn}" + ("" if label == "quantized" else f":{label}")
                out[key] = {"kernels": label, "matrices": len(mats), "weights": n_w, "bytes": n_b,
                            "ms": best * 1e3, "gweights_per_s": n_w / best / 1e9, "gbytes_per_s": n_b / best / 1e9}
                log(f"{name:<20} {tn:<5} {label:<9} {len(mats):4d} matrices {n_w / 1e6:7.0f}M weights "
                    f"{n_b / 2**20:6.0f} MiB: {best * 1e3:7.1f} ms  {n_w / best / 1e9:5.2f} Gweights/s  "
                    f"{n_b / best / 1e9:5.2f} GB/s")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append",
                   help=f"model name or path (repeatable; default: {', '.join(MODEL_NAMES)})")
    p.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times (default 1)")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if it is installed")
    p.add_argument("--kernels", action="store_true", help="only the per-type decode kernel throughput")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated engines to measure (default: {','.join(ENGINES)})")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts for threads, int8 and llama.cpp (default: 1 and the "
                        "physical cores)")
    p.add_argument("--out-dir", default=os.fspath(OUT_DIR))
    # the child's arguments (internal)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-path", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--prompt-tokens", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--n-predict", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--ttft-reps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-threads", dest="child_threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        args.stage = args.child
        args.threads = args.child_threads
        child = {"llama.cpp": child_llama, "runtime": child_runtime}.get(args.child, child_stage)
        rec = child(args)
        print(json.dumps(rec, default=float))
        return 0

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    names = args.model or list(MODEL_NAMES)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.kernels:
        res = bench_kernels(names, log)
        (out_dir / "quantized_kernels.json").write_text(json.dumps(res, indent=1))
        return 0

    from common.baseline import llama_cpp_version
    with_llama = not args.no_llama and llama_cpp_version() is not None
    if not with_llama:
        log("llama.cpp rows skipped: " + ("--no-llama" if args.no_llama else
                                          "llama-cpp-python is not installed (`make llama-cpp`)"))
    from common.machine import physical_cores
    thread_counts = tuple(int(t) for t in args.threads.split(",")) if args.threads else \
        tuple(sorted({1, physical_cores()}))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES) - set(EXTRA_ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; the engines are {', '.join(ENGINES + EXTRA_ENGINES)}")
    for name in names:
        log(f"{name}:")
        res = bench_model(name, args.rounds, with_llama, log, engines=engines, thread_counts=thread_counts)
        stem = name if name in MODEL_NAMES else Path(res["model"]).stem
        path = out_dir / f"vs_llama_{stem}.json"
        path.write_text(json.dumps(res, indent=1, default=float))
        print_table(res)
        if res.get("quantized_decode_profile_table"):
            print(res["quantized_decode_profile_table"])
        for row, table in res.get("decode_profile_tables", {}).items():
            if not row.startswith("quantized"):
                print(f"{row}: {table}")
        log(f"  -> {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
