"""How decode slows down when the cores are shared: alone, beside a busy loop, beside a second run.

A decode step of the fused and repack stages is one parallel region whose threads meet at
barriers (stages/kernels/sync.py); how a thread waits at a barrier decides what happens when
another process wants the same cores. This measures 2-thread decode (ms/token, the median of
the tokens of one run) of each engine in three conditions:

    alone      nothing else running
    busy       beside one single-threaded busy loop (another program taking one core)
    twin       beside a second, identical run of the same engine (2 threads too, decoding without end)

and the slowdown of each condition over `alone`, for our stages and for llama.cpp on the same file
(llama-cpp-python: beside a second llama.cpp), with how many spells on one thread our stages began
(stages/kernels/sync.py CoreShare: a stage on shared cores goes to one thread while that is faster).
Conditions alternate within each round (protocol.py) and the medians of the rounds are reported:
the machine's own noise shifts every condition alike.

    python -m app bench shared-core [-m MODEL] [--engines repack,fused,llama.cpp] [--rounds 3]

writes profiles/bench/shared_core.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from app.measure.protocol import BENCH_DIR, add_options, header, order, run_child
from app.models import resolve

RECORD = BENCH_DIR / "shared_core.json"
CONDITIONS = ("alone", "busy", "twin")
PROMPT = list(range(100, 132))          # 32 prompt tokens (ids; the text does not matter to the time)
# a core kept busy until its parent is gone (a bench killed midway leaves no busy loop behind)
BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"


# ---- one engine decoding: the measured run and the twin -------------------------------------------

def decoder(engine: str, model: str, threads: int):
    """A function that decodes n greedy tokens after PROMPT and returns ms per token (list)."""
    if engine == "llama.cpp":
        import llama_cpp
        llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

        def pick():
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

        def run(n):
            llm.reset()
            llm.eval(PROMPT)
            tok, out = pick(), []
            for _ in range(n):
                t0 = time.perf_counter()
                llm.eval([tok])
                tok = pick()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        return run
    from stages import load
    e = load(engine, model, threads=threads, n_ctx=1024)
    e.warmup()

    def run(n):
        e.reset()
        tok = e.greedy_next(PROMPT, 0)
        pos, out = len(PROMPT), []
        for _ in range(n):
            t0 = time.perf_counter()
            tok = e.greedy_next([tok], pos)
            pos += 1
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    run.spells = lambda: getattr(getattr(e.backend, "cores", None), "switches", None)
    return run


def worker(args):
    run = decoder(args.worker, args.model, args.threads)
    run(8)                                        # warm: pages, pools, caches
    if args.forever:
        print("ready", flush=True)
        while True:
            run(args.tokens)
    ms = run(args.tokens)
    # spells on one thread the stage began (stages/kernels/sync.py CoreShare; None: llama.cpp)
    print(json.dumps({"ms": ms, "spells": getattr(run, "spells", lambda: None)()}), flush=True)


# ---- the harness ---------------------------------------------------------------------------------

def worker_command(engine: str, args) -> list[str]:
    return [sys.executable, "-m", "app", "bench", "shared-core", "--worker", engine, "-m", args.model, "--threads",
            str(args.threads), "--tokens", str(args.tokens)]


def start_twin(engine: str, args) -> subprocess.Popen:
    p = subprocess.Popen(worker_command(engine, args) + ["--forever"], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"the twin run of {engine} did not start: {line!r}")
    return p


def co_runner(condition: str, engine: str, args):
    if condition == "busy":
        return subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    if condition == "twin":
        return start_twin(engine, args)
    return None


def measured(engine: str, args) -> tuple[float, int | None]:
    """(median ms/token, spells on one thread the stage began, or None)."""
    out = run_child(worker_command(engine, args), f"{engine} decoding")
    return float(np.median(out["ms"])), out.get("spells")


def stop(p):
    if p is not None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def measure(args) -> dict:
    rows = {(e, c): [] for e in args.engines for c in CONDITIONS}
    spells = {(e, c): [] for e in args.engines for c in CONDITIONS}
    for r in range(args.rounds):
        for engine in args.engines:
            for condition in order(CONDITIONS, r):
                other = co_runner(condition, engine, args)
                try:
                    if other is not None:
                        time.sleep(1.0)          # the co-runner settles into its loop
                    ms, n = measured(engine, args)
                finally:
                    stop(other)
                rows[(engine, condition)].append(ms)
                spells[(engine, condition)].append(n)
                print(f"round {r + 1}: {engine:10s} {condition:6s} {ms:8.2f} ms/token", file=sys.stderr)
    out = []
    for engine in args.engines:
        alone = float(np.median(rows[(engine, "alone")]))
        for condition in CONDITIONS:
            ms = rows[(engine, condition)]
            ratios = [m / a for m, a in zip(ms, rows[(engine, "alone")])]
            out.append({"engine": engine, "condition": condition, "rounds_ms": ms, "median_ms": float(np.median(ms)),
                        "slowdown": float(np.median(ratios)), "slowdown_rounds": ratios, "alone_ms": alone,
                        "one_thread_spells_rounds": spells[(engine, condition)]})
    return {"kind": "shared_core", "model": Path(args.model).name, "threads": args.threads, "tokens": args.tokens,
            "rounds": args.rounds, "conditions": {"alone": "nothing else running",
                                                  "busy": "beside one single-threaded busy loop",
                                                  "twin": "beside a second run of the same engine (2 threads)"},
            "rows": out, **header(command=args.command_line)}


def page(record: dict, source: str) -> str:
    lines = [f"Measured by `python -m app bench shared-core` on {record['machine']['cpu']} "
             f"({record['machine']['physical_cores']} cores, {record['machine'].get('isa', '?')}), "
             f"{record['model']}, {record['threads']} threads, {record['tokens']} tokens a run, "
             f"medians of {record['rounds']} alternating rounds; code {record['provenance']['code_hash']}. "
             f"Record: `{source}`.", "",
             "| engine | alone (ms/token) | beside a busy loop | slowdown | beside a second run | slowdown "
             "| spells on one thread a run: alone / busy / twin |",
             "|---|---:|---:|---:|---:|---:|---|"]
    by = {(r["engine"], r["condition"]): r for r in record["rows"]}

    def spells(r):
        n = [x for x in r.get("one_thread_spells_rounds", []) if x is not None]
        return f"{np.median(n):g}" if n else "-"
    for engine in dict.fromkeys(r["engine"] for r in record["rows"]):
        a, b, t = (by[(engine, c)] for c in CONDITIONS)
        lines.append(f"| {engine} | {a['median_ms']:.2f} | {b['median_ms']:.2f} | {b['slowdown']:.2f}x "
                     f"| {t['median_ms']:.2f} | {t['slowdown']:.2f}x | {spells(a)} / {spells(b)} / {spells(t)} |")
    return "\n".join(lines) + "\n"


def add_arguments(p):
    add_options(p, rounds=3, out=RECORD)
    p.add_argument("--engines", default="repack,fused,llama.cpp", help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=64, help="tokens a run (default: %(default)s)")
    p.add_argument("--worker", help=argparse.SUPPRESS)           # one engine decoding, in a child
    p.add_argument("--forever", action="store_true", help=argparse.SUPPRESS)


def records(args):
    args.model = str(resolve(args.model))
    if args.worker:
        worker(args)
        return
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    yield args.out, measure(args)
