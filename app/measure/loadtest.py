"""Many clients at once: `python -m app serve` under load (and llama.cpp's llama-server beside it).

    python -m app bench loadtest                              # 1, 2, 4, ..., 32 clients; our server
    python -m app bench loadtest --llama-server auto          # also llama-server (built once, see below)
    python -m app bench loadtest --llama-server PATH          # a llama-server binary you have
    python -m app bench loadtest --draw-only                  # redraw the charts and tables from the records
    python -m app bench loadtest --kv-pages 200 --out ...     # a pool too small for every worst case: preemptions
    python -m app bench loadtest --stage tp --np 2 --out ...  # the server over 2 MPI ranks (mpiexec -n 2)

For each number of concurrent clients C, both servers are started with room for C sequences
(llama-server with C parallel slots) and, in --rounds rounds that alternate which server goes
first, C clients of the official `openai` package each send --requests streamed completions
to one of them, one after the other: greedy, exactly --max-tokens tokens each (`ignore_eos`,
which both servers take), every prompt a different text of about --prompt-tokens tokens (so no
request reuses another's prefix). Measured from the clients: aggregate generated tokens per
second (all tokens / wall time of the round), time to first token and the time between tokens
(p50, p99); from our server's /health: KV pages in use (sampled while the round runs), the
engine's share of the wall time (seconds inside forward steps, the mean step), and how many
sequences were preempted because the pool ran out (none while the pool holds every request's
worst case, the default; --kv-pages makes it smaller). A level's
figures are the medians of its rounds; the ratio to llama-server is the median of the rounds'
ratios. Beside them, the machine's roofline (app/measure/roofline.py): a step reads the weights once
for all B sequences (bandwidth ceiling B x bandwidth / weight bytes) and computes B tokens'
FLOPs (compute ceiling peak / FLOPs per token), and the throughput cannot pass the lower one.

Writes profiles/bench/batching.json (the record: every level, settings, machine, code) and
draws profiles/batching.png and profiles/bench/batching.md from it (page and chart below). A
benchmark, not a test: minutes, on a quiet machine.

    python -m app bench loadtest --spec --clients 1,4,8,16   # `serve` against `serve --spec lookup`

--spec: our server plain and with speculative decoding (prompt lookup, --draft-max), both up
at once, in alternating rounds, on two sets of prompts (--sets): copy-heavy (app/measure/
speculative_prompts.json: code and prose edited, a template filled in, a list recited) and the
free text above; per level each server's tokens/s, the rounds' ratios and the guesses kept. Then
what a verify pass of k+1 rows costs in the server's step against one step, for each of
--verify-models (TinyLlama's geometry among them: synthetic), in this process. Writes
profiles/bench/speculative_serve.json and draws profiles/bench/speculative_serve.md
(app/measure/spec_serve.py).

llama-server: `--llama-server auto` builds it once with cmake from the llama.cpp sources that
llama-cpp-python's source distribution carries (the same release `make llama-cpp` installs),
into models/llama-server/ (several minutes on 2 cores); optional, like `make baseline`.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from app import ROOT
from app.measure import llama_tools, roofline, spec_serve
from app.measure.bench import BENCH_TEXT
from app.measure.local_server import LocalServer
from app.measure.protocol import BENCH_DIR, add_options, header, load_average, median, order, paired, run_child
from app.measure.speculative import prompt_sets
from app.models import resolve
from app.report.charts import machine_label
from app.serve.command import serving_stage
from common.cpu import physical_cores
from common.generate import ParameterError
from common.gguf import GGUFFile
from common.model import LlamaConfig, flops_per_token
from common.speculative import DRAFT_MAX

RECORD = BENCH_DIR / "batching.json"
SPEC_RECORD = BENCH_DIR / "speculative_serve.json"
OURS, LLAMA = "ours", "llama-server"
OURS_LOOKUP = spec_serve.LOOKUP


# ---- the servers ---------------------------------------------------------------------------------

def start(kind: str, args, clients: int, log_dir: Path) -> LocalServer:
    """A server process for one level: ours or llama-server, C sequences at a time."""
    ctx = longest_prompt(args) + args.max_tokens + 64
    if kind in (OURS, OURS_LOOKUP):
        pages = args.kv_pages or clients * -(-ctx // 16) + 16
        cmd = [sys.executable, "-m", "app", "serve", "-m", args.model, "--stage", args.stage,
               "--max-batch", clients, "--kv-pages", pages, "--max-queue", clients, "--threads", args.threads]
        if kind == OURS_LOOKUP:
            cmd += ["--spec", "lookup", "--draft-max", args.draft_max]
        if args.np:                                    # tp: --threads for each rank
            cmd = [Path(sys.executable).parent / "mpiexec", "-n", args.np, *cmd]
    else:
        cmd = [args.llama_server, "-m", args.model, "-np", clients, "-c", clients * ctx, "-t", args.threads,
               "-tb", args.threads]
    return LocalServer(cmd, log_dir / f"{kind}-{clients}.log", name=kind)


# ---- one level: C clients ------------------------------------------------------------------------

def prompts(n: int, words: int, first: int = 0, set_name: str = "free") -> list[str]:
    """n different prompts: a numbered request (first, first + 1, ...), then about `words`
    words of the bench text (free), or one of the copy-heavy prompts in turn (copy).
    Numbered from `first`, each round's differ from every earlier round's at their first
    tokens, so neither server finds them in its prompt cache."""
    if set_name == "copy":
        copy = prompt_sets()["copy"]
        return [f"Request {i}: " + copy[i % len(copy)] for i in range(first, first + n)]
    text = (BENCH_TEXT * 4).split()
    return [f"Request {i}: " + " ".join(text[i % 40:i % 40 + words]) for i in range(first, first + n)]


def longest_prompt(args) -> int:
    """Tokens of the longest prompt the sets hold (a generous count: 2 per word), for the context."""
    sets = getattr(args, "sets", ["free"])
    longest = max(len(t.split()) for t in prompt_sets()["copy"]) * 2 + 8 if "copy" in sets else 0
    return max(args.prompt_tokens, longest)


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class PagesSampler(threading.Thread):
    """Our /health, sampled every 50 ms while a level runs: KV pages in use."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.used, self.stop = url, [], threading.Event()

    def run(self):
        import httpx
        with httpx.Client(timeout=2) as c:
            while not self.stop.is_set():
                try:
                    h = c.get(self.url + "/health").json()
                    self.used.append(h["kv_pages_total"] - h["kv_pages_free"])
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                self.stop.wait(0.05)


async def run_level(url: str, clients: int, args, round_: int = 0, counters=None, set_name: str = "free") -> dict:
    """One round: a warm-up request, then the clients. `counters()` (our server's step
    counters) is read after the warm-up and at the end, so the engine's figures cover exactly
    the timed requests."""
    import openai
    # A fresh connection per request ("Connection: close"): a pooled keep-alive connection that the
    # server closes just as it is reused ends the request with "Server disconnected" (seen with
    # llama-server), and with no retries (a retry would hide a real failure) that ends the level.
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600,
                           default_headers={"Connection": "close"})
    model = (await c.models.list()).data[0].id
    n = clients * args.requests + 1
    texts = prompts(n, args.prompt_tokens * 3 // 4, first=round_ * n, set_name=set_name)
    kw = dict(model=model, max_tokens=args.max_tokens, temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    ttft, itl, tokens, decode = [], [], [], []

    async def request(text):
        t0 = time.perf_counter()
        first, last, n, usage = None, None, 0, None
        async for ch in await c.completions.create(prompt=text, **kw):
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            if ch.choices and ch.choices[0].text:
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                    first = now
                else:
                    itl.append(now - last)
                last, n = now, n + 1
        tokens.append(usage if usage is not None else n)
        if last is not None and last > first:                 # the tokens after the first, over their time
            decode.append((tokens[-1] - 1) / (last - first))

    async def client(i):
        for r in range(args.requests):
            await request(texts[1 + i * args.requests + r])

    await request(texts[0])                          # warm: the first request pays for nothing later
    ttft.clear(), itl.clear(), tokens.clear(), decode.clear()
    before = counters() if counters else None
    t0 = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(clients)])
    wall = time.perf_counter() - t0
    after = counters() if counters else None
    await c.close()
    ms = [x * 1e3 for x in ttft], [x * 1e3 for x in itl]
    row = {"clients": clients, "requests": clients * args.requests, "tokens": sum(tokens), "wall_s": wall,
           "tokens_per_s": sum(tokens) / wall,
           "ttft_ms_p50": percentile(ms[0], 50), "ttft_ms_p99": percentile(ms[0], 99),
           "itl_ms_p50": percentile(ms[1], 50), "itl_ms_p99": percentile(ms[1], 99),
           "itl_ms_mean": statistics.fmean(ms[1]) if ms[1] else float("nan"),
           "decode_tokens_per_s_p50": statistics.median(decode) if decode else float("nan")}
    if counters:
        steps, rows = after["steps"] - before["steps"], after["rows"] - before["rows"]
        busy = after["step_seconds"] - before["step_seconds"]
        row.update(engine_steps=steps, engine_rows_per_step=rows / max(1, steps),
                   engine_step_ms_mean=1e3 * busy / max(1, steps), engine_busy=busy / wall,
                   engine_preemptions=after["preemptions"] - before["preemptions"],
                   drafted=after["drafted"] - before["drafted"], accepted=after["accepted"] - before["accepted"])
    return row


def engine_counters(url: str) -> dict:
    """Our /health's step counters: steps, rows, seconds inside forward steps, preemptions,
    guesses made and emitted (speculative decoding)."""
    import httpx
    h = httpx.get(url + "/health", timeout=5).json()
    return {k: h[k] for k in ("steps", "rows", "step_seconds", "preemptions", "drafted", "accepted")}


def run_round(server: LocalServer, clients: int, args, round_: int, set_name: str = "free") -> dict:
    """One round of one level against one server; for ours also the KV pages in use and how
    busy the engine was (run_level: time inside forward steps / wall time; the rest is HTTP,
    sampling and waiting for the clients, which share the machine's cores)."""
    sampler = PagesSampler(server.url) if server.name in (OURS, OURS_LOOKUP) else None
    counters = (lambda: engine_counters(server.url)) if sampler else None
    try:
        if sampler:
            sampler.start()
        row = asyncio.run(run_level(server.url, clients, args, round_, counters, set_name))
    finally:
        if sampler:
            sampler.stop.set()
            sampler.join()
    if sampler and sampler.used:
        row["kv_pages_used_max"] = max(sampler.used)
        row["kv_pages_used_mean"] = statistics.fmean(sampler.used)
    return row


def summary(rounds: list[dict]) -> dict:
    """A level's row: the median of each figure over the rounds, and the rounds themselves."""
    row = {"clients": rounds[0]["clients"], "rounds": rounds}
    for key in rounds[0]:
        values = [r[key] for r in rounds if key in r]
        if key != "clients" and values and all(isinstance(v, (int, float)) for v in values):
            row[key] = median(values)
    return row


def run_once(args) -> dict:
    """One request as `python -m app run` makes it, no server: `bench stage` with the same stage,
    threads, prompt length and tokens (its record: time to the first token, then each token's)."""
    b = run_child([sys.executable, "-m", "app", "bench", "stage", "-m", args.model, "--stage", args.stage,
                   "-t", args.threads, "--prompt-tokens", args.prompt_tokens, "-n", args.max_tokens,
                   "--no-write", "--json"], f"`run` alone ({args.stage})")
    whole_s = (b["ttft_ms"] + sum(b["decode_ms_all"])) / 1e3
    return {"clients": 1, "tokens_per_s": b["n_generated"] / whole_s, "ttft_ms_p50": b["ttft_ms"],
            "itl_ms_p50": b["decode_ms"], "decode_tokens_per_s": 1000.0 / b["decode_ms"]}


def versus_run(rec: dict) -> list[tuple[str, list[float]]]:
    """One client through our server against `run` (rounds paired in order): whole requests
    (tokens / (first token + the rest)) and the decode rate (1000 / the median ms between tokens)."""
    one = next((r for r in rec["engines"][OURS] if r["clients"] == 1), None)
    if one is None or "run" not in rec:
        return []
    pairs = list(zip(one["rounds"], rec["run"]["rounds"]))
    return [("whole requests, tokens/s", [o["tokens_per_s"] / r["tokens_per_s"] for o, r in pairs]),
            ("decode, 1000 / ms between tokens (p50)", [r["itl_ms_p50"] / o["itl_ms_p50"] for o, r in pairs])]


# One client through the server decodes what `run` decodes, plus the HTTP and the scheduler's
# Python per step: below this share of run's decode rate, the server's path costs the stage
# something its own path does not (fused pads a lone row to its row_block through the tiles).
SERVE_VS_RUN_FLOOR = 0.8


def serving_gaps(rec: dict) -> list[str]:
    """A sentence for each serve ÷ run decode ratio under SERVE_VS_RUN_FLOOR (none: no gap)."""
    stage = rec.get("settings", {}).get("stage", "?")
    slow = [median(each) for name, each in versus_run(rec)
            if name.startswith("decode") and median(each) < SERVE_VS_RUN_FLOOR]
    return [f"The server decodes one client at {ratio:.2f}x `run`'s rate with the {stage} stage (under "
            f"{SERVE_VS_RUN_FLOOR}x): its path through the server costs something `run`'s does not; profile "
            f"one step (app/serve/engine_loop.py) before trusting these figures." for ratio in slow]


def measure(args, log_dir: Path) -> tuple[dict[str, list[dict]], dict | None]:
    """Every level: both servers started (each idle while the other runs), then --rounds
    rounds in alternating order (ours first, then theirs first, ...). At one client each
    round also makes the same requests with `run` (run_once), which uses the machine alone:
    what serving costs one user."""
    kinds = [OURS] + ([LLAMA] if args.llama_server else [])
    out = {k: [] for k in kinds}
    alone = None
    for clients in args.clients:
        servers = {}
        try:
            for k in kinds:
                servers[k] = start(k, args, clients, log_dir)
            runs = {k: [] for k in kinds}
            solo = []
            for r in range(args.rounds):
                for k in order(kinds, r):
                    runs[k].append(run_round(servers[k], clients, args, r))
                if clients == 1 and not args.np:      # `bench stage` runs in one process
                    solo.append(run_once(args))
            if solo:
                alone = summary(solo)
                print(f"{'run':>12}   1 client:  {alone['tokens_per_s']:7.1f} tokens/s, TTFT "
                      f"{alone['ttft_ms_p50']:.0f} ms, between tokens p50 {alone['itl_ms_p50']:.1f} ms",
                      file=sys.stderr)
        finally:
            for server in servers.values():
                server.close()
        for k in kinds:
            row = summary(runs[k])
            out[k].append(row)
            print(f"{k:>12} {clients:>3} clients: {row['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                  f"{row['ttft_ms_p50']:.0f} ms, between tokens p50 {row['itl_ms_p50']:.1f} ms (medians of "
                  f"{len(runs[k])} rounds)", file=sys.stderr)
    return out, alone


def measure_spec(args, log_dir: Path) -> list[dict]:
    """--spec: at every level both of our servers (plain, lookup) are up, idle while the other
    runs; each round runs every set on both, in an order that alternates from round to round."""
    levels = []
    for clients in args.clients:
        servers = {}
        try:
            for k in (OURS, OURS_LOOKUP):
                servers[k] = start(k, args, clients, log_dir)
            rows = {name: [] for name in args.sets}
            for r in range(args.rounds):
                for i, set_name in enumerate(args.sets):
                    servers_now = order((OURS, OURS_LOOKUP), r + i)
                    rows[set_name].append({k: run_round(servers[k], clients, args, r, set_name) for k in servers_now})
        finally:
            for server in servers.values():
                server.close()
        for set_name in args.sets:
            row = {"set": set_name, "clients": clients, "rounds": rows[set_name]}
            levels.append(row)
            each = spec_serve.round_ratios(row)
            decode = [spec_serve.median_of(row, k, "decode_tokens_per_s_p50") for k in (OURS, OURS_LOOKUP)]
            print(f"{set_name:>5} {clients:>3} clients: a client decodes {decode[0]:.1f} tokens/s plain, "
                  f"{decode[1]:.1f} with lookup: {median(each):.2f}x ({', '.join(f'{x:.2f}' for x in each)}"
                  f"); whole requests {median(spec_serve.round_ratios(row, 'tokens_per_s')):.2f}x; "
                  f"{100 * spec_serve.accept_rate(row):.0f}% of guesses kept", file=sys.stderr)
    return levels


def measure_verify(args) -> list[dict]:
    """--spec: the server step's verify pass of k+1 rows over one step, for each --verify-models
    (spec_serve.batch_verify_times), in this process, on our stage and threads."""
    from stages import load
    out = []
    for name in args.verify_models:
        engine = load(args.stage, resolve(name), threads=args.threads)
        engine.warmup()
        context = engine.tokenizer.encode(BENCH_TEXT * 4)[:args.prompt_tokens + args.max_tokens // 2]
        v = spec_serve.verify_record(engine, engine.gguf.path.split("/")[-1], context, args.verify_k,
                                     2 * args.rounds + 1)
        print(f"{v['model']}: a pass of k+1 rows over one step ({v['step_ms']:.2f} ms): "
              + ", ".join(f"{k + 1}: {r:.2f}x" for k, r in zip(v["k"], v["ratio"])), file=sys.stderr)
        out.append(v)
        del engine
    return out


def spec_record(args, log_dir: Path) -> dict:
    """--spec: the record (the module docstring)."""
    start_load = load_average()
    levels = measure_spec(args, log_dir)
    verify = measure_verify(args)
    rec = {"kind": "speculative_serve", "levels": levels, "verify": verify,
           "load_average": {"start": start_load, "end": load_average()}}
    rec.update(header({"model": args.model.name, "stage": args.stage, "clients": args.clients, "sets": args.sets,
                       "requests": args.requests, "rounds": args.rounds, "max_tokens": args.max_tokens,
                       "prompt_tokens": args.prompt_tokens, "threads": args.threads, "draft_max": args.draft_max,
                       "sampling": "greedy", "ignore_eos": True, "kv_pages": args.kv_pages,
                       "verify_models": args.verify_models, "verify_k": args.verify_k}, args.command_line))
    return rec


# ---- the record, its chart and table -------------------------------------------------------------

def ceilings(rec: dict, clients) -> list[float]:
    """tokens/s the roofline allows at batch B: min(B x bandwidth / bytes per step, peak / FLOPs)."""
    r = rec["roofline"]
    bw = r["bandwidth_gbs"] * 1e9
    peak = r["peak_gflops"] * 1e9
    return [min(b * bw / r["weight_bytes"], peak / r["flops_per_token"]) for b in clients]


def round_ratios(ours: dict, theirs: dict) -> list[float]:
    """Our tokens/s over llama-server's, round by round (the rounds ran side by side)."""
    pairs = paired(ours["rounds"], theirs["rounds"], (f"{ours['clients']} clients: ours", "llama-server"))
    return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in pairs]


def count(value) -> str:
    """A count from the record (a median of whole numbers may be a half): '-' where not measured."""
    return "-" if value is None else f"{value:g}"


def busy(row: dict) -> str:
    if "engine_busy" not in row:
        return "-"
    return f"{100 * row['engine_busy']:.0f}% ({row['engine_step_ms_mean']:.1f})"


def styles(rec: dict) -> dict:
    """{server: (marker, colour, label)}: how the chart and the page name each server."""
    return {OURS: ("o", "C0", f"this engine ({rec['settings']['stage']})"),
            LLAMA: ("s", "C1", "llama.cpp's llama-server")}


def settings_line(rec: dict) -> tuple[str, str]:
    """(threads, rounds) as the chart's title and the page say them."""
    s = rec["settings"]
    threads = f"{s['threads']} thread" + ("s" if s["threads"] != 1 else "")
    if s.get("ranks", 1) > 1:
        threads += f" in each of {s['ranks']} ranks"
    rounds = s.get("rounds", 1)
    return threads, f"medians of {rounds} alternating rounds" if rounds > 1 else "one round"


def chart(rec: dict, path: Path):
    """Throughput and waits against the clients (profiles/batching.png for the default record)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    style = styles(rec)
    every = sorted({row["clients"] for rows in rec["engines"].values() for row in rows})
    for kind, rows in rec["engines"].items():
        marker, color, label = style[kind]
        xs = [row["clients"] for row in rows]
        ax.plot(xs, [row["tokens_per_s"] for row in rows], marker + "-", color=color, label=label)
        ax2.plot(xs, [row["itl_ms_p50"] for row in rows], marker + "-", color=color,
                 label=f"{label}: between tokens, p50")
        ax2.plot(xs, [row["ttft_ms_p50"] for row in rows], marker + "--", color=color, alpha=0.5,
                 label=f"{label}: first token, p50")
    roof = ceilings(rec, every)
    r = rec["roofline"]
    ax.plot(every, roof, "k--", lw=1,
            label=f"roofline: min(B x {r['bandwidth_gbs']:.0f} GB/s / {r['weight_bytes'] / 2**20:.0f} MiB, "
                  f"{r['peak_gflops']:.0f} GFLOP/s / {r['flops_per_token'] / 1e6:.0f} MFLOP)")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(every, [str(x) for x in every])
        a.set_xlabel("concurrent clients (sequences per step)")
        a.grid(alpha=0.3, which="both")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("generated tokens/s, all clients")
    ax.set_title("Throughput rises with the batch until compute caps it")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("What each client waits")
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    s, m = rec["settings"], rec["machine"]
    threads, medians = settings_line(rec)
    fig.suptitle(f"Many users at once: {Path(s['model']).stem} on {machine_label(m)}\n{threads}, "
                 f"{s['requests']} requests per client, {s['max_tokens']} tokens each, ~{s['prompt_tokens']}-token "
                 f"prompts, {medians}; commit {str(rec['provenance'].get('commit', '?'))[:7]}", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def page(rec: dict, source: str) -> str:
    """The table of every level (profiles/bench/batching.md), drawn from the record alone."""
    s, style = rec["settings"], styles(rec)
    threads, medians = settings_line(rec)
    lines = [f"Drawn from `{source}` by `python -m app bench loadtest` "
             f"({s['model']}, {threads}, commit {str(rec['provenance'].get('commit', '?'))[:7]}; {medians}).", "",
             "| server | clients | tokens/s | vs 1 client | roofline tokens/s | TTFT p50 / p99 (ms) | "
             "between tokens p50 / p99 (ms) | KV pages used (max) | engine busy (mean step, ms) | preempted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, rows in rec["engines"].items():
        base = rows[0]["tokens_per_s"]
        for row, ceil in zip(rows, ceilings(rec, [r["clients"] for r in rows])):
            lines.append(f"| {style[kind][2]} | {row['clients']} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / base:.2f}x | {ceil:.0f} | {row['ttft_ms_p50']:.0f} / "
                         f"{row['ttft_ms_p99']:.0f} | {row['itl_ms_p50']:.1f} / {row['itl_ms_p99']:.1f} | "
                         f"{count(row.get('kv_pages_used_max'))} | {busy(row)} | "
                         f"{count(row.get('engine_preemptions'))} |")
    if LLAMA in rec["engines"]:
        theirs = {r["clients"]: r for r in rec["engines"][LLAMA]}
        lines += ["", "| clients | this engine / llama-server (median of the rounds' ratios) | each round |",
                  "|---:|---:|---|"]
        for row in rec["engines"][OURS]:
            if row["clients"] in theirs:
                each = round_ratios(row, theirs[row["clients"]])
                lines.append(f"| {row['clients']} | {median(each):.2f}x | "
                             f"{', '.join(f'{x:.2f}' for x in each)} |")
    else:
        lines += ["", f"_llama-server: {rec.get('llama_server_missing', 'not measured')}_"]
    paired = versus_run(rec)
    if paired:
        run = rec["run"]
        lines += ["", f"One client through our server ÷ the same requests made with `run` on the machine alone "
                      f"({run['tokens_per_s']:.1f} tokens/s whole requests, {run['itl_ms_p50']:.2f} ms per token "
                      f"after the first; median of the rounds' ratios):", "",
                  "| measure | server ÷ run | each round |", "|---|---:|---|"]
        for name, each in paired:
            lines.append(f"| {name} | {median(each):.2f}x | {', '.join(f'{x:.2f}' for x in each)} |")
        lines += [line for gap in serving_gaps(rec) for line in ("", f"**{gap}**")]
    return "\n".join(lines) + "\n"


def add_arguments(p):
    add_options(p)
    p.add_argument("--stage", default="fastest",
                   help="our server's stage (default: the one `serve` picks, app/serve/command.py)")
    p.add_argument("--clients", default="1,2,4,8,16,32", help="concurrency levels (default: %(default)s)")
    p.add_argument("--requests", type=int, default=4, help="requests per client per level (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="about this many prompt tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per level, the servers alternating; figures are medians (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads, both servers (default: cores; over N ranks, cores / N each)")
    p.add_argument("--np", type=int, default=None,
                   help="our server over N MPI ranks (the tp stage under mpiexec -n N; --threads each); "
                        "then without the comparison with `run`")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="our server's KV pages (default: every client's worst case at once, so nothing is "
                        "preempted); smaller: the pool runs out and sequences are preempted, counted")
    p.add_argument("--llama-server", default=None,
                   help="'auto' (build it from the llama-cpp-python sdist once) or a llama-server binary")
    p.add_argument("--out", type=Path, default=None,
                   help=f"the record (default: {RECORD.relative_to(ROOT)}; with --spec "
                        f"{SPEC_RECORD.relative_to(ROOT)})")
    g = p.add_argument_group("--spec: our server plain against `serve --spec lookup` (the module docstring)")
    g.add_argument("--spec", action="store_true", help="measure speculative decoding in the server, on and off")
    g.add_argument("--sets", default=None, help="prompt sets: copy, free (default: free; with --spec copy,free)")
    g.add_argument("--draft-max", type=int, default=DRAFT_MAX, help="the lookup server's --draft-max "
                                                                     "(default: %(default)s)")
    g.add_argument("--verify-models", default="smollm2,tinyllama-synthetic",
                   help="models whose verify pass is timed in this process (default: %(default)s)")
    g.add_argument("--verify-k", type=int, default=8, help="guesses at most in the timed passes (default: %(default)s)")


def records(args):
    """Measure (the module docstring); yields (where, record)."""
    if args.rounds < 1:
        raise ParameterError(f"--rounds {args.rounds}: give at least 1")
    args.out = args.out or (SPEC_RECORD if args.spec else RECORD)
    args.sets = (args.sets or ("copy,free" if args.spec else "free")).split(",")
    if set(args.sets) - {"copy", "free"}:
        raise ParameterError(f"--sets {','.join(args.sets)}: the sets are copy and free")
    if args.spec and args.llama_server:
        raise ParameterError("--spec compares our server with itself; measure llama-server without --spec")
    args.verify_models = [m for m in args.verify_models.split(",") if m]
    args.model = resolve(args.model)
    args.stage = serving_stage(args.stage)
    args.threads = args.threads or max(1, physical_cores() // (args.np or 1))
    args.clients = [int(c) for c in args.clients.split(",")]
    args.llama_server = llama_tools.server_binary(args.llama_server)
    missing = None if args.llama_server else "not measured (--llama-server auto builds it)"
    log_dir = Path(tempfile.mkdtemp(prefix="loadtest-"))          # the servers' logs
    if args.spec:
        yield args.out, spec_record(args, log_dir)
        return

    with GGUFFile(args.model) as g:
        cfg = LlamaConfig.from_gguf(g)
        weight_bytes = sum(t.nbytes for name, t in g.tensors.items() if name != "token_embd.weight") \
            + (g.tensors["token_embd.weight"].nbytes if "output.weight" not in g.tensors else 0)
    print("measuring the roofline...", file=sys.stderr)
    cores = args.threads * (args.np or 1)                  # over N ranks every rank's threads read weights
    ceil = roofline.measure(threads=cores)
    key = str(cores) if str(cores) in ceil["bandwidth_gbs"] else "1"
    engines, alone = measure(args, log_dir)
    rec = {"kind": "batching", "engines": engines,
           "roofline": {"bandwidth_gbs": ceil["bandwidth_gbs"][key], "peak_gflops": ceil["peak_gflops"][key],
                        "weight_bytes": weight_bytes,
                        "flops_per_token": flops_per_token(cfg, args.prompt_tokens + args.max_tokens // 2),
                        "method": ceil["method"]}}
    if missing:
        rec["llama_server_missing"] = missing
    if alone:
        rec["run"] = alone
    rec.update(header({"model": args.model.name, "stage": args.stage, "clients": args.clients,
                       "requests": args.requests, "rounds": args.rounds,
                       "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                       "threads": args.threads, "ranks": args.np or 1, "sampling": "greedy", "ignore_eos": True,
                       "kv_pages": args.kv_pages,
                       "llama_server": str(args.llama_server) if args.llama_server else None}, args.command_line))
    for gap in serving_gaps(rec):
        print(f"warning: {gap}", file=sys.stderr)
    yield args.out, rec
