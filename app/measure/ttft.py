"""Time to first token against the prompt's length, and decode at that context: stages beside
llama.cpp with flash attention off and on, on the same file, in one run of alternating rounds.

    python -m app bench ttft --lengths 128,512,1024,2048           # SmolLM2 and TinyLlama's geometry
    python -m app bench ttft --llama-quantize Q4_K_M --lengths 128,512,1024,2048 --threads 2

    sweep(engine, lengths, n_predict)   in one process: for each length a prompt of that many ids
        by the protocol (TTFT; then the median decode step at that context), and where the stage
        keeps them (the compiled layer stack: layer_stack.PHASES), the prompt's time per phase
    sweep_in_child(engine, model, lengths, ...)     one engine's sweep in a fresh process
    compare(model, engines, lengths, threads, rounds)    every engine in alternating rounds -> record
    summary(record), page(record, source)                the medians and ratios, the markdown page

Writes profiles/bench/ttft_<model>.json (one process per engine and round, every length in it;
the integer peak measured in the same run) and the page drawn from it beside it.

Each engine process also says what its memory did: its resident set after loading and its peak
after each length (the peak of a sweep is its longest prompt's), and for a stage the bytes that
prompt needs besides the weights: its K and V, and where the stage says (prefill's scratch_bytes)
one piece's scratch.

An engine is a stage, `llama.cpp` (flash attention off: llama-cpp-python's default) or
`llama.cpp+fa` (on). A ratio is taken within a round against the faster of the two llama.cpp rows
in that round ("llama.cpp's better"), then the median over rounds. The integer peak of this CPU
(app/measure/roofline.py) is measured in the same run, and a stage's prompt is placed on it: the
prompt's matmul operations (common/model.py's prompt_matmul_ops) over TTFT, as a share of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from app.measure.phases import PHASE_NAMES
from app.measure.protocol import alternating, header, median, run_child

BASELINES = {"llama.cpp": False, "llama.cpp+fa": True}        # engine -> flash attention
DEFAULT_ENGINES = ("repack", "prefill", *BASELINES)
ATTENTION_PHASES = ("attend", "merge")


def _prompt(tokenizer, n):
    from app.measure.bench import bench_prompt
    ids = bench_prompt(tokenizer, n)
    if len(ids) != n:
        raise ValueError(f"the benchmark text gives {len(ids)} tokens, not {n}")
    return ids


def rss_mib() -> float:
    """This process's resident set now (/proc/self/statm), MiB."""
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's largest resident set so far (getrusage: KiB on Linux), MiB."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_bytes(engine, n: int) -> dict:
    """What a prompt of n tokens needs besides the weights: its K and V (every layer, n positions,
    as the stage stores them) and, for the prefill stage, one piece's scratch (its scratch_bytes)."""
    cfg, backend = engine.config, engine.backend
    kv = cfg.n_layer * n * cfg.kv_dim * 2 * np.dtype(getattr(backend, "kv_dtype", np.float32)).itemsize
    out = {"kv_mib": kv / 2**20}
    if engine.backend.name == "prefill":
        from stages.prefill import PIECE_ROWS, scratch_bytes, tile_rows_for
        tile = tile_rows_for(cfg.n_head, cfg.n_head_kv, cfg.head_dim, backend.caches["L2"])
        out["scratch_mib"] = scratch_bytes(cfg, min(n, PIECE_ROWS), backend._threads(), n, tile) / 2**20
    return out


def sweep(engine, lengths, n_predict: int) -> dict:
    """{length: {ttft_ms, decode_ms, tokens, phases_ms?, memory}} for one loaded stage engine."""
    from common.generate import Sampler, generate
    engine.warmup()
    backend, out = engine.backend, {}
    loaded = rss_mib()
    for n in lengths:
        prompt = _prompt(engine.tokenizer, n)
        engine.reset()
        phases = getattr(backend, "phase_seconds", None)
        seen = {}
        if phases is not None:
            phases[:] = 0.0

            def first(tok, seen=seen, phases=phases):
                seen.setdefault("prompt", phases.copy())
        gen = generate(engine, prompt, n_predict, Sampler(), ignore_eos=True,
                       on_token=first if phases is not None else None)
        row = {"ttft_ms": gen.ttft_ms, "decode_ms": gen.decode_ms_median, "tokens": gen.tokens}
        if "prompt" in seen:
            row["phases_ms"] = dict(zip(PHASE_NAMES, (seen["prompt"] * 1e3).tolist()))
        row["memory"] = {"rss_loaded_mib": loaded, "peak_rss_mib": peak_rss_mib(), **prompt_bytes(engine, n)}
        out[str(n)] = row
    engine.reset()
    return out


def sweep_llama(model_path, lengths, n_predict: int, threads: int, n_ctx: int, flash_attn: bool) -> dict:
    """The same for llama.cpp (llama-cpp-python) on the same file, prompt ids and thread count."""
    import llama_cpp

    from common.gguf import GGUFFile
    from common.tokenizer import Tokenizer
    with GGUFFile(model_path) as g:
        tokenizer = Tokenizer.from_gguf(g)
    llm = llama_cpp.Llama(str(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                          logits_all=False, verbose=False, flash_attn=flash_attn)

    def pick() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.eval(_prompt(tokenizer, 4))                 # first-use costs: thread pool, buffers
    out, loaded = {}, rss_mib()
    for n in lengths:
        prompt = _prompt(tokenizer, n)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tokens = [pick()]
        ttft = (time.perf_counter() - t0) * 1e3
        steps = []
        for _ in range(n_predict - 1):
            t0 = time.perf_counter()
            llm.eval([tokens[-1]])
            tokens.append(pick())
            steps.append((time.perf_counter() - t0) * 1e3)
        out[str(n)] = {"ttft_ms": ttft, "decode_ms": float(np.median(steps)) if steps else float("nan"),
                       "tokens": tokens, "memory": {"rss_loaded_mib": loaded, "peak_rss_mib": peak_rss_mib()}}
    return out


def measure_engine(engine: str, model, lengths, n_predict: int, threads: int, n_ctx: int) -> dict:
    """One engine's sweep, in this process."""
    if engine in BASELINES:
        return sweep_llama(model, lengths, n_predict, threads, n_ctx, BASELINES[engine])
    from stages import load
    return sweep(load(engine, model, n_ctx=n_ctx, threads=threads), lengths, n_predict)


def sweep_in_child(engine: str, model, lengths, n_predict: int, threads: int, n_ctx: int) -> dict:
    """One engine's sweep in a fresh process (`python -m app bench ttft --worker ENGINE`)."""
    return run_child([sys.executable, "-m", "app", "bench", "ttft", "--worker", engine, "--model", model,
                      "--lengths", ",".join(map(str, lengths)), "-n", n_predict, "--threads", threads,
                      "--ctx-size", n_ctx], engine)


def compare(model, engines, lengths, threads: int, rounds: int, n_predict: int = 8, log=print,
            command: str | None = None) -> dict:
    """Every engine's sweep in `rounds` alternating rounds (forward, backward, ...); the record."""
    from app.measure import roofline
    from app.models import resolve
    from common.gguf import GGUFFile
    from common.model import LlamaConfig, prompt_matmul_ops
    path = resolve(model)
    with GGUFFile(path) as g:
        cfg = LlamaConfig.from_gguf(g)
    n_ctx = max(lengths) + n_predict + 8
    log(f"warming numba's cache (not measured): {', '.join(e for e in engines if e not in BASELINES)}")
    for e in engines:
        if e not in BASELINES:
            sweep_in_child(e, path, [8], 2, threads, n_ctx)
    log("measuring the integer peak (app/measure/roofline.py) ...")
    peak = {"instruction": roofline.int_instruction(), "gops": {}}
    if peak["instruction"]:
        peak["gops"] = {str(t): roofline.int_peak_gops(t)[0] for t in sorted({1, threads})}

    def one(e: str, k: int) -> dict:
        log(f"  round {k + 1}/{rounds}: {e} at {', '.join(map(str, lengths))} tokens")
        rec = sweep_in_child(e, path, lengths, n_predict, threads, n_ctx)
        log("    TTFT " + ", ".join(f"{n}: {r['ttft_ms']:.0f} ms" for n, r in rec.items()))
        return rec
    runs = alternating(engines, rounds, one)
    return {"kind": "ttft_sweep", "model": path.name, "synthetic": "synthetic" in path.name.lower(),
            "settings": {"lengths": list(lengths), "threads": threads, "rounds": rounds, "n_predict": n_predict,
                         "n_ctx": n_ctx, "order": "alternating (forward, backward, ...)",
                         "sampling": "greedy, EOS ignored"},
            "engines": list(engines), "runs": runs, "int_peak": peak, "builds": builds(engines),
            "prompt_matmul_ops": {str(n): prompt_matmul_ops(cfg, n) for n in lengths},
            **header(command=command)}


def builds(engines) -> dict:
    """What each side was compiled for: numba's target CPU (NUMBA_CPU_NAME, or this host's), and
    the CPU features llama.cpp's library reports (llama_print_system_info), where it ran."""
    import os
    out = {"numba_cpu": os.environ.get("NUMBA_CPU_NAME") or "host"}
    if any(e in BASELINES for e in engines):
        import llama_cpp
        out["llama_cpp_system"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return out


def summary(record: dict) -> dict:
    """{engine: {length: figures}}: medians over rounds; ratios per round against llama.cpp's
    better (the faster of its rows with flash attention off and on, in that round); the prompt's
    attention share (phases attend + merge over all phases); its integer ops/s as a share of the
    integer peak at the run's thread count."""
    runs, lengths = record["runs"], [str(n) for n in record["settings"]["lengths"]]
    llama = [e for e in BASELINES if e in runs]
    peak = (record.get("int_peak") or {}).get("gops", {}).get(str(record["settings"]["threads"]))
    out = {}
    for e, recs in runs.items():
        rows = {}
        for n in lengths:
            r = {key: median(x[n][key] for x in recs) for key in ("ttft_ms", "decode_ms")}
            if llama and e not in BASELINES:
                for key in ("ttft_ms", "decode_ms"):
                    best = [min(runs[b][k][n][key] for b in llama) for k in range(len(recs))]
                    r[f"{key}_over_llama"] = median(x[n][key] / b for x, b in zip(recs, best))
            phases = [x[n]["phases_ms"] for x in recs if "phases_ms" in x[n]]
            if phases:
                r["attention_share"] = median(sum(p[a] for a in ATTENTION_PHASES) / sum(p.values()) for p in phases)
            if peak and e not in BASELINES:
                ops = record["prompt_matmul_ops"][n]
                r["int_gops"] = ops / (r["ttft_ms"] / 1e3) / 1e9
                r["int_peak_share"] = r["int_gops"] / peak
            ours, first = recs[0][n]["tokens"], runs[record["engines"][0]][0][n]["tokens"]
            r["same_tokens_as_first"] = ours == first
            r["parts_at"] = next((i for i, (a, b) in enumerate(zip(ours, first)) if a != b), None)
            rows[n] = r
        out[e] = rows
    return out


def _num(x, digits=1) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) and np.isfinite(x) else "-"


def page(record: dict, source: str) -> str:
    """The markdown page of a sweep record (source: its path, as shown)."""
    s = summary(record)
    st, m, peak = record["settings"], record["machine"], record.get("int_peak") or {}
    t = st["threads"]
    lines = [f"# {record['model']}: time to first token against the prompt's length", "",
             f"_Generated from `{source}`; do not edit. Measured on {m.get('cpu', '?')} "
             f"({m.get('physical_cores', '?')} cores), {t} thread(s), {record.get('time', '?')}; "
             f"`{record['command']}`._", "",
             ("SYNTHETIC weights (the geometry and type mix of the real model). " if record["synthetic"] else "")
             + f"{st['rounds']} rounds, {st['order']}; medians over rounds; a ratio is the median of the ratios "
             f"within each round against llama.cpp's better (flash attention off or on, whichever was faster in "
             f"that round). Decode: the median step of {st['n_predict'] - 1} after the prompt, at that context. "
             f"Integer peak: {peak.get('instruction') or 'not measured (no AVX2)'}"
             + (f", {_num(peak['gops'].get(str(t)), 0)} Gop/s at {t} thread(s)" if peak.get("gops") else "") + "."
             + _builds_line(record.get("builds"))
             + f" Same tokens: the first round's greedy tokens against {record['engines'][0]}'s; where they part, "
             "the token at which."
             + (" Random weights lead by little, so engines that round differently part early (llama.cpp with flash "
                "attention on and off part from each other too); the real model's greedy text, and the near-ties "
                "where a stage may part, are checked by tests/test_stages.py." if record["synthetic"] else ""), "",
             "| engine | prompt | TTFT (ms) | TTFT / llama.cpp's better | decode (ms/token) | decode / llama.cpp's "
             "better | attention share of the prompt | integer Gop/s (share of the peak) | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for e, rows in s.items():
        for n, r in rows.items():
            share = f"{_num(r['int_gops'], 0)} ({r['int_peak_share']:.0%})" if "int_gops" in r else "-"
            att = f"{r['attention_share']:.0%}" if "attention_share" in r else "-"
            lines.append(f"| {e} | {n} | {_num(r['ttft_ms'], 0)} | {_num(r.get('ttft_ms_over_llama'), 2)} "
                         f"| {_num(r['decode_ms'])} | {_num(r.get('decode_ms_over_llama'), 2)} | {att} | {share} "
                         f"| {_same(r)} |")
    return "\n".join(lines + memory_lines(record)) + "\n"


def _same(r: dict) -> str:
    if r["same_tokens_as_first"]:
        return "yes"
    return "no" if r.get("parts_at") is None else f"from token {r['parts_at'] + 1}"


def _builds_line(builds: dict | None) -> str:
    if not builds:
        return ""
    line = f" Our stages compiled for numba's target `{builds['numba_cpu']}`"
    if builds.get("llama_cpp_system"):
        line += f"; llama.cpp's library reports `{builds['llama_cpp_system']}`"
    return line + "."


def memory_lines(record: dict) -> list[str]:
    """The memory table (first round's processes), where the record has one."""
    first = {e: recs[0] for e, recs in record["runs"].items() if recs and "memory" in next(iter(recs[0].values()))}
    if not first:
        return []
    lines = ["", "## Memory", "",
             "Each engine's process in the first round: its resident set after loading, its peak after each "
             "length (a sweep's lengths run one after another in one process, so a peak holds the longest "
             "prompt so far), what the prompt added, and for a stage what that prompt needs besides the "
             "weights: its K and V, and for prefill one piece's scratch (stages/prefill.py, scratch_bytes).", "",
             "| engine | prompt | resident after load (MiB) | peak (MiB) | added (MiB) | K and V (MiB) | "
             "one piece's scratch (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for e, rows in first.items():
        for n, r in rows.items():
            mem = r["memory"]
            lines.append(f"| {e} | {n} | {_num(mem['rss_loaded_mib'], 0)} | {_num(mem['peak_rss_mib'], 0)} | "
                         f"{_num(mem['peak_rss_mib'] - mem['rss_loaded_mib'], 0)} | {_num(mem.get('kv_mib'), 0)} | "
                         f"{_num(mem.get('scratch_mib'), 0)} |")
    return lines


# ---- the benchmark: `python -m app bench ttft` ---------------------------------------------------------

def add_arguments(p):
    from app.measure.compare import add_model_arguments
    add_model_arguments(p)
    p.add_argument("--lengths", required=True, metavar="N,N,...", help="the prompt lengths, in tokens")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated stages, {', '.join(BASELINES)} (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="threads, every engine (default: the physical cores)")
    p.add_argument("-n", type=int, default=8, help="tokens generated after each prompt (default: %(default)s)")
    p.add_argument("--worker", metavar="ENGINE", help=argparse.SUPPRESS)     # one engine's sweep, in a child
    p.add_argument("--ctx-size", type=int, default=2048, help=argparse.SUPPRESS)


def records(args):
    from app.measure.compare import engines_to_measure, log, models_to_measure, record_path, without_llama
    from common.cpu import physical_cores
    from stages import REGISTRY
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.worker:                                  # the child: its sweep as JSON on the last line
        print(json.dumps(measure_engine(args.worker, args.model[0], lengths, args.n, args.threads or 1,
                                        args.ctx_size), default=float))
        return
    engines = without_llama(engines_to_measure(args.engines, REGISTRY, tuple(BASELINES)), tuple(BASELINES), args)
    threads = args.threads or physical_cores()
    for model in models_to_measure(args):
        record = compare(model, engines, lengths, threads, args.rounds, args.n, log=log, command=args.command_line)
        yield record_path("ttft", model, record, args.out_dir), record
