"""Speculative decoding, measured: what a verify pass of k+1 rows costs against one decode step
(beside the roofline's prediction and llama.cpp's own pass), and what prompt lookup buys in
tokens/s, ours and llama.cpp's (llama-cpp-python's LlamaPromptLookupDecoding), on text that
copies itself and on free text. `python -m app bench speculative` runs these into
profiles/bench/speculative.json; the chapter notebooks/15_speculative.ipynb runs them live.

The roofline's prediction for m rows (app/measure/roofline.py): a pass reads the weights once
(and the KV cache) whatever m is, and computes m tokens' flops, so

    t(m) = max(bytes / bandwidth, m x flops per token / peak)      ratio t(m) / t(1)

flat while m stays under the ridge (bandwidth-bound), then rising by one step per row. It
is a floor: a kernel slower than the machine's ceilings sits above it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from app import ROOT
from app.args import chosen_stage
from app.measure import roofline
from app.measure.machine import machine_id
from app.measure.protocol import BENCH_DIR, add_options, alternating, header, load_average, order
from common import speculative as sp
from common.generate import ParameterError, Sampler, generate
from common.model import flops_per_token

PROMPTS_FILE = Path(__file__).with_name("speculative_prompts.json")
RECORD = BENCH_DIR / "speculative.json"
RESULTS_DIR = ROOT / "profiles" / "results"
OURS, OURS_LOOKUP, LLAMA, LLAMA_LOOKUP = "ours", "ours, lookup", "llama.cpp", "llama.cpp, lookup"
ENGINES = (OURS, OURS_LOOKUP, LLAMA, LLAMA_LOOKUP)


def prompt_sets() -> dict[str, list[str]]:
    """{'copy': [...], 'free': [...]}: the committed prompts (speculative_prompts.json)."""
    data = json.loads(PROMPTS_FILE.read_text())
    return {"copy": data["copy"], "free": data["free"]}


# ---- one verify pass against one step ----------------------------------------------------------

def timed_passes(k_max: int, rounds: int, one_pass) -> list[list[float]]:
    """ms[round][k] of one_pass(k) for k = 0..k_max in alternating rounds (protocol.py), so that
    a drift of the machine's speed falls on every k alike."""
    def timed(k, r):
        t0 = time.perf_counter()
        one_pass(k)
        return (time.perf_counter() - t0) * 1e3
    ms = alternating(range(k_max + 1), rounds, timed)
    return [[ms[k][r] for k in range(k_max + 1)] for r in range(rounds)]


def verify_times(engine, context, k_max: int, rounds: int) -> list[list[float]]:
    """ms[round][k] of one pass of k+1 rows at the end of a cached context (k = 0: the plain
    decode step, greedy_next of one row). The rows land past what the cache holds: nothing
    reads them, each pass writes over the last."""
    engine.reset()
    engine.forward(context, 0, all_logits=False)
    at = len(context)
    rows = [int(t) for t in context[:k_max + 1]]

    def one_pass(k):
        if k == 0:
            engine.greedy_next(rows[:1], at)
        else:
            engine.forward(rows[:k + 1], at, all_logits=True)
    out = timed_passes(k_max, rounds, one_pass)
    engine.reset()
    return out


def llama_verify_times(llm, context, k_max: int, rounds: int) -> list[list[float]]:
    """The same passes through llama.cpp (a Llama with logits_all: every row's logits, as ours)."""
    llm.reset()
    llm.eval(list(context))
    at = len(context)
    rows = [int(t) for t in context[:k_max + 1]]

    def one_pass(k):
        llm.n_tokens = at
        llm._ctx.kv_cache_seq_rm(-1, at, -1)          # forget the last pass's rows
        llm.eval(rows[:k + 1])
    out = timed_passes(k_max, rounds, one_pass)
    llm.reset()
    return out


def integer_matmuls(engine) -> bool:
    """Whether the engine's stage rounds activations to int8 for its matmuls (int8 and the stages
    built on it): its compute roof is the integer peak, not the float one."""
    from stages.int8 import Int8Backend
    return isinstance(engine.backend, Int8Backend)


def ceilings(threads: int, integer: bool = False) -> dict:
    """This machine's bandwidth and peak at that many threads (the recorded machine.json, the
    nearest thread count it has), else measured now; with where they came from. integer: the peak
    is the integer unit's (2 ops per int8 multiply-add) where the machine has one, for a stage
    whose matmuls are int8; `peak_name` says which it is."""
    path = RESULTS_DIR / machine_id() / "machine.json"
    if path.exists():
        m = json.loads(path.read_text())
        source = f"profiles/results/{machine_id()}/machine.json"
    else:
        m = roofline.measure(threads=threads)
        source = "measured by app/measure/roofline.py during this run"
    t = str(min((int(x) for x in m["bandwidth_gbs"]), key=lambda x: abs(x - threads)))
    ints = (m.get("int_peak_gops") or {}).get(t) if integer else None
    peak, name = (ints, f"integer peak ({m.get('int_instruction')})") if ints else (m["peak_gflops"][t], "float peak")
    return {"bandwidth_gbs": m["bandwidth_gbs"][t], "peak_gflops": peak, "peak_name": name, "threads": int(t),
            "source": source}


def roofline_prediction(engine, context_len: int, k_max: int, ceil: dict) -> dict:
    """The roofline's t(k+1) and t(k+1) / t(1) for k = 0..k_max (the module docstring)."""
    cfg = engine.config
    read = engine.weight_stream_bytes() + 2 * cfg.n_layer * cfg.kv_dim * 4 * context_len
    flops = flops_per_token(cfg, context_len)
    memory_s = read / (ceil["bandwidth_gbs"] * 1e9)
    compute_s = flops / (ceil["peak_gflops"] * 1e9)
    ms = [max(memory_s, (k + 1) * compute_s) * 1e3 for k in range(k_max + 1)]
    return {"ms": ms, "ratio": [t / ms[0] for t in ms], "bytes": read, "flops_per_token": flops,
            "ridge_rows": memory_s / compute_s, **ceil}


# ---- generation: plain against prompt lookup ---------------------------------------------------

def run_ours(engine, ids, n: int, spec: sp.Speculator | None = None) -> dict:
    """Greedy, exactly n tokens; decode = the tokens after the first, and their time (a
    Speculator whose step times are not measured yet measures them first, untimed)."""
    gen = generate(engine, ids, n, Sampler(), ignore_eos=True, step=spec)
    seconds = sum(gen.decode_ms) / 1e3
    return {"tokens": gen.tokens, "decode_s": seconds, "tokens_per_s": (len(gen.tokens) - 1) / seconds,
            "drafted": gen.drafted if spec else 0, "accepted": gen.accepted if spec else 0}


def parting(engine, ids, plain, other) -> dict | None:
    """Where another greedy text parts from plain decoding's, and by how much plain's one-row
    logits preferred its own pick there: {"at": token index, "gap": logits}; None if they agree.
    (A stage whose multi-row pass rounds differently parts only at near-ties.)"""
    at = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if at is None:
        return None
    engine.reset()
    row = engine.forward(ids, 0, all_logits=False)[0]
    for i, t in enumerate(plain[:at]):
        row = engine.forward([t], len(ids) + i, all_logits=False)[0]
    engine.reset()
    return {"at": at, "gap": float(row[plain[at]] - row[other[at]])}


def run_llama(llm, ids, n: int) -> dict:
    """llama-cpp-python's own loop (Llama.generate, greedy), with or without its draft model."""
    llm.reset()
    tokens = []
    t_first = None
    for tok in llm.generate(list(ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
        if len(tokens) == n:
            break
    seconds = time.perf_counter() - t_first
    return {"tokens": tokens, "decode_s": seconds, "tokens_per_s": (len(tokens) - 1) / seconds,
            "drafted": None, "accepted": None}


def llama_engines(model_path, threads: int, draft_max: int, n_ctx: int = 2048) -> dict | None:
    """{LLAMA: Llama, LLAMA_LOOKUP: Llama with LlamaPromptLookupDecoding(num_pred_tokens=draft_max)}
    on the same file and threads; None where llama-cpp-python is not installed."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None

    def make(draft=None):
        return llama_cpp.Llama(os.fspath(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                               n_batch=512, draft_model=draft, verbose=False)
    return {LLAMA: make(), LLAMA_LOOKUP: make(LlamaPromptLookupDecoding(num_pred_tokens=draft_max))}


def llama_for_verify(model_path, threads: int, n_ctx: int = 2048):
    """A Llama that keeps every row's logits, as our verify pass does; None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.Llama(os.fspath(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                           n_batch=512, logits_all=True, verbose=False)


def medians(ms: list[list[float]]) -> list[float]:
    """Per k, the median over rounds of t(k+1) / t(1) taken within each round."""
    a = np.asarray(ms, dtype=float)
    return np.median(a / a[:, :1], axis=0).tolist()


# ---- the benchmark: `python -m app bench speculative` ------------------------------------------

def measure_threads(args, model, stage: str, threads: int, prompts: dict, bar) -> dict:
    """At one thread count: the verify passes (ours, the roofline's, llama.cpp's), then every
    prompt by every engine, the engine that goes first rotating from round to round."""
    from stages import load
    engine = load(stage, model, threads=threads)
    engine.warmup()
    tok = engine.tokenizer
    context = tok.encode(" ".join(prompts["free"] + prompts["copy"]) * 4)[:args.context]
    out = {"verify": {"k": list(range(args.k_max + 1))}, "runs": []}
    v = out["verify"]
    bar.set_postfix_str(f"{threads} thread(s): verify passes")
    v["ours_ms"] = verify_times(engine, context, args.k_max, args.rounds)
    v["roofline"] = roofline_prediction(engine, len(context), args.k_max,
                                         ceilings(threads, integer_matmuls(engine)))
    llama = None if args.no_llama else llama_for_verify(model, threads)
    if llama is not None:
        v["llama_ms"] = llama_verify_times(llama, context, args.k_max, args.rounds)
        del llama
    engines = None if args.no_llama else llama_engines(model, threads, args.draft_max)
    names = [OURS, OURS_LOOKUP] + ([LLAMA, LLAMA_LOOKUP] if engines else [])
    step_time = sp.StepTime()                           # measured once, followed by every run after
    step_time.calibrate_arena(engine, args.draft_max + 1)
    out["calibrated"] = {"shape": step_time.shape, "seconds": step_time.calibrate_s}
    for r in range(args.rounds):
        names_now = order(names, r, rotate=True)
        for set_name, texts in prompts.items():
            for i, text in enumerate(texts):
                ids = tok.encode(text)
                for name in names_now:
                    bar.set_postfix_str(f"{threads} thread(s), round {r + 1}: {set_name} {i + 1}, {name}")
                    if name == OURS:
                        res = run_ours(engine, ids, args.n_predict)
                    elif name == OURS_LOOKUP:
                        spec = sp.Speculator(sp.Speculation(engine.n_ctx, args.draft_max, step_time))
                        res = run_ours(engine, ids, args.n_predict, spec)
                    else:
                        res = run_llama(engines[name], ids, args.n_predict)
                    out["runs"].append({"round": r, "set": set_name, "prompt": i, "engine": name,
                                        "n_tokens": len(res["tokens"]), **res})
                for run in out["runs"][-len(names_now):]:          # our lookup's text against our plain one's
                    if run["engine"] == OURS_LOOKUP:
                        plain = next(x for x in out["runs"][-len(names_now):] if x["engine"] == OURS)
                        run["parting"] = parting(engine, ids, plain["tokens"], run["tokens"])
                    bar.update(1)
    return out


def add_arguments(p):
    add_options(p, rounds=3, out=RECORD)
    p.add_argument("--stage", default="fastest", help="the stage (default: the fastest this machine runs, as "
                                                       "`make run` picks)")
    p.add_argument("--threads", default=None, help="thread counts (default: 1 and the physical cores)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--draft-max", type=int, default=10,
                   help="guesses per step at most, ours and llama-cpp-python's (default: %(default)s, its own)")
    p.add_argument("--k-max", type=int, default=16, help="verify passes of 1..k-max+1 rows (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="context before the verify passes (default: %(default)s)")
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even if it is installed")
    p.add_argument("--quick", action="store_true",
                   help="1 round, 1 thread, 2 prompts per set, 16 tokens, k up to 8: checks the benchmark in about "
                        "a minute (the record says so; not a measurement to quote)")


def records(args):
    """Measure, for each thread count, in --rounds alternating rounds: (1) one verify pass of k+1
    rows over one plain decode step, k = 0..--k-max, at the end of a --context-token context, beside
    the roofline's floor and llama.cpp's own pass; (2) greedy generation of exactly -n tokens for
    every committed prompt (speculative_prompts.json) by ours plain, ours with prompt lookup
    (--draft-max), llama.cpp plain and llama.cpp with LlamaPromptLookupDecoding. Yields (where,
    record); its page and chart: app/report/speculative.py."""
    from tqdm import tqdm

    from app.measure.bench import model_summary
    from app.models import resolve
    from common.cpu import physical_cores
    from common.gguf import GGUFFile
    for name in ("rounds", "n_predict", "draft_max", "k_max", "context"):
        if getattr(args, name) < 1:
            raise ParameterError(f"--{name.replace('_', '-')} must be at least 1")
    prompts = prompt_sets()
    threads = sorted({1, physical_cores()})
    if args.quick:
        args.rounds, args.n_predict, args.k_max = 1, 16, 8
        prompts = {k: v[:2] for k, v in prompts.items()}
        threads = [1]
    if args.threads:
        threads = [int(t) for t in args.threads.split(",")]
    stage = chosen_stage(args.stage)
    model = resolve(args.model)
    start = load_average()
    n_runs = len(threads) * args.rounds * sum(len(v) for v in prompts.values()) * (2 if args.no_llama else 4)
    rec = {"kind": "speculative", "model": model.name, "stage": stage, "threads": {}}
    t0 = time.perf_counter()
    with tqdm(total=n_runs, unit="run", desc="speculative", dynamic_ncols=True) as bar:
        for t in threads:
            rec["threads"][str(t)] = measure_threads(args, model, stage, t, prompts, bar)
    rec["seconds"] = time.perf_counter() - t0
    rec["load_average"] = {"start": start, "end": load_average()}
    rec["model_info"] = model_summary(GGUFFile(model))
    rec.update(header({"rounds": args.rounds, "n_predict": args.n_predict, "draft_max": args.draft_max,
                       "k_max": args.k_max, "context": args.context, "threads": threads, "quick": args.quick,
                       "sampling": "greedy", "ignore_eos": True,
                       "prompts": {k: len(v) for k, v in prompts.items()}}, args.command_line))
    yield args.out, rec
