"""`python -m common run` (generate text with one stage) and `bench` (measure it into profiles/)."""

from __future__ import annotations

import argparse
import json
import sys

# Tokens generated when -n is not given: enough to read, few enough that the stages without
# a KV cache (which re-run the whole text for every token) finish in about a minute.
DEFAULT_N_PREDICT = {"naive": 8, "tiling": 8, "simd": 32}
DEFAULT_N_PREDICT_CACHED = 64


def add_model_args(p: argparse.ArgumentParser):
    from common.models import DEFAULT_MODEL
    p.add_argument("--stage", "-s", default="fastest",
                   help="naive | tiling | simd | kv_cache | quantized | cuda | ... (default: the fastest "
                        "this machine can run)")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path),
                   help="GGUF file or model name (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context window in tokens (default: min(model's, 2048))")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for stages that use several (default: physical cores)")


def add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling (llama.cpp's chain: penalties, top-k, top-p, min-p, temperature)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default: 0)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (default: 40; 0 = off)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default: 0.95; 1 = off)")
    g.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min_p x the best (default: 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize recent tokens (default: 1.0 = off)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="window of the repeat penalty (default: 64)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def sampling_params(args):
    from common.generate import SamplingParams
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def load_engine(args, progress=True):
    """(engine, stage name) with every error turned into a sentence."""
    from common.models import resolve
    from stages import fastest_stage, load
    stage = fastest_stage() if args.stage == "fastest" else args.stage
    path = resolve(args.model)
    engine = load(stage, path, n_ctx=args.ctx_size, threads=args.threads, progress=progress)
    return engine, stage


def run_record(engine, stage, gen, text, jit_s) -> dict:
    """The figures every run and benchmark reports (see the measurement protocol)."""
    from common.machine import rusage
    from common.model import flops_per_token
    rec = {
        "stage": stage, "model": engine.gguf.path.split("/")[-1],
        "prompt_tokens": gen.prompt_tokens, "n_prompt": len(gen.prompt_tokens),
        "tokens": gen.tokens, "n_generated": len(gen.tokens), "text": text,
        "ttft_ms": gen.ttft_ms, "decode_ms": gen.decode_ms_median, "decode_ms_mean": gen.decode_ms_mean,
        "decode_ms_all": gen.decode_ms, "tokens_per_s": gen.tokens_per_s,
        "load_s": engine.load_s, "jit_s": jit_s, "threads": engine.backend.threads,
        "n_ctx": engine.n_ctx, "uses_kv_cache": engine.uses_kv_cache,
        "weights_mb": engine.weight_bytes() / 2**20, "kv_cache_mb": engine.kv_bytes() / 2**20,
        "stop_reason": gen.stop_reason,
        # for the roofline: what one forward pass computes and reads
        "flops_per_token": flops_per_token(engine.config, len(gen.prompt_tokens)),
        "weights_stream_bytes": engine.weight_stream_bytes(),
        "kv_bytes_per_position": 2 * engine.config.n_layer * engine.config.kv_dim * 4,
    }
    rec.update(rusage())
    return rec


def print_stats(rec: dict, out=sys.stderr):
    def f(x, unit=""):
        return "n/a" if x != x else f"{x:.1f}{unit}"          # NaN when only one token was made
    print(f"\n--- {rec['stage']} on {rec['model']}: {rec['n_prompt']} prompt tokens, "
          f"{rec['n_generated']} generated ({rec['stop_reason']})", file=out)
    print(f"TTFT {f(rec['ttft_ms'], ' ms')} | decode {f(rec['decode_ms'], ' ms/token')} median, "
          f"{f(rec['decode_ms_mean'], ' ms')} mean | {f(rec['tokens_per_s'])} tokens/s", file=out)
    print(f"load {rec['load_s']:.2f} s | JIT/warm-up {rec['jit_s']:.2f} s | weights {rec['weights_mb']:.0f} MiB"
          f" | KV cache {rec['kv_cache_mb']:.0f} MiB | peak RSS {rec['peak_rss_mb']:.0f} MiB | page faults "
          f"{rec['minor_faults']} minor, {rec['major_faults']} major | threads {rec['threads']}", file=out)


def start_profile(engine):
    """A per-op profiler for the run: the backend's own (CUDA events) if it has one."""
    if hasattr(engine.backend, "start_profile"):
        engine.backend.start_profile()
        return engine.backend
    from common.profile import OpProfiler
    return OpProfiler(engine).__enter__()


def stop_profile(engine, profiler) -> list[dict]:
    """[{op, calls, total_ms, avg_us, share}]; a GPU stage's rows are its kernels."""
    if profiler is engine.backend:
        engine.backend.stop_profile()
        return [{"op": r["kernel"], **r} for r in engine.backend.profile_rows()]
    profiler.__exit__(None, None, None)
    return profiler.rows()


def check_prompt_fits(args, stage: str) -> tuple[list, int]:
    """Tokenize the prompt and check it fits the context before the weights are loaded:
    (prompt ids, n_predict), or ContextError."""
    from common.generate import check_fits
    from common.gguf import GGUFFile
    from common.model import LlamaConfig, context_size
    from common.models import resolve
    from common.tokenizer import Tokenizer
    with GGUFFile(resolve(args.model)) as g:
        cfg = LlamaConfig.from_gguf(g)
        prompt = Tokenizer.from_gguf(g).encode(args.prompt)
    n_predict = args.n_predict if args.n_predict is not None else \
        DEFAULT_N_PREDICT.get(stage, DEFAULT_N_PREDICT_CACHED)
    check_fits(len(prompt), n_predict, context_size(cfg, args.ctx_size), cfg.n_ctx_train)
    return prompt, n_predict


def cmd_run(args):
    from common.generate import Sampler, Session
    from stages import StageError, fastest_stage, unavailable_reason
    stage_name = fastest_stage() if args.stage == "fastest" else args.stage
    reason = unavailable_reason(stage_name)
    if reason:                                  # say so before touching the model file
        raise StageError(f"stage '{stage_name}' cannot run here: {reason}")
    if not args.chat:
        prompt, n_predict = check_prompt_fits(args, stage_name)
    engine, stage = load_engine(args)
    tok = engine.tokenizer
    if args.chat:
        from common.chat import chat_loop
        return chat_loop(engine, stage, args)
    session = Session(engine)
    jit_s = engine.warmup()
    stream = tok.stream_decoder()
    echo = not args.json

    def on_token(t):
        if echo:
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

    if echo:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    profiler = start_profile(engine) if args.profile else None
    gen = session.generate(prompt, n_predict, Sampler(sampling_params(args)), stop_ids=tok.eog_ids,
                           on_token=on_token)
    if echo:
        sys.stdout.write(stream.flush() + "\n")
    rec = run_record(engine, stage, gen, tok.decode(gen.tokens), jit_s)
    if profiler:
        rec["profile"] = stop_profile(engine, profiler)
    if args.json:
        rec.pop("decode_ms_all")
        print(json.dumps(rec))
    else:
        print_stats(rec)
        if profiler is engine.backend:
            print("\n" + engine.backend.profile_table(), file=sys.stderr)
        elif profiler:
            from common.profile import format_table
            print("\n" + format_table(rec["profile"], f"per-op profile ({stage}, this run)"), file=sys.stderr)


def cmd_bench(args):
    from common.bench import bench_stage
    rec, path = bench_stage(args.stage, args.model, prompt_tokens=args.prompt_tokens, n_predict=args.n_predict,
                            threads=args.threads, ctx_size=args.ctx_size, out_dir=args.out,
                            profile_n=args.profile_n)
    if args.json:
        print(json.dumps(rec, default=float))
    else:
        print_stats(rec)
        print(f"wrote {path}", file=sys.stderr)


def add_commands(sub):
    p = sub.add_parser("run", help="generate text with one stage, then print its timings",
                       description="Generate a completion with one stage, streaming the text, then print TTFT, "
                                   "decode ms/token, tokens/s, load and JIT time, peak RSS and page faults.")
    add_model_args(p)
    p.add_argument("-p", "--prompt", default="The meaning of life is", help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help=f"tokens to generate (default: {DEFAULT_N_PREDICT} by stage, else "
                        f"{DEFAULT_N_PREDICT_CACHED})")
    p.add_argument("--chat", action="store_true",
                   help="interactive chat with the model's template (stages with a KV cache); /reset, Ctrl-D")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--profile", action="store_true",
                   help="time every op (matmul by weight, attention, norms, ...) and print an nvprof-style table")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="measure one stage (fixed prompt, greedy) into profiles/results/",
                       description="Measure one stage on a fixed prompt of exactly --prompt-tokens tokens, "
                                   "greedy, generating exactly -n tokens (EOS ignored); JIT warmed up first. "
                                   "Writes one JSON record (timings, RSS, page faults, machine, versions).")
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (default: by stage)")
    p.add_argument("-n", "--n-predict", type=int, default=None, help="tokens to generate (default: by stage)")
    p.add_argument("--out", default=None, help="folder for the record (default: profiles/results/<machine>/<model>/)")
    p.add_argument("--json", action="store_true", help="print the record (one JSON line) instead of a summary")
    p.add_argument("--profile-n", type=int, default=0,
                   help="after measuring, profile a run of this many tokens per op and add it to the record")
    p.set_defaults(func=cmd_bench)

