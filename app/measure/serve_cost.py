"""What the server costs one user: one client through `python -m app serve` against `python -m app run`.

Both decode the same prompt greedily to exactly --tokens tokens (`ignore_eos`), with the same stage
and threads. `run` pays for the forward pass and the sampling; a server also pays, per step, for its
engine loop (app/serve/engine_loop.py: the scheduler's plan, the batch's rows, the step's events and
its published state) and for its HTTP thread (app/serve/server.py, routes.py: the event handed over,
text decoded, a chunk formatted and written), which runs beside the step on the same cores. The gap
between the two is the server's own cost.

    python -m app bench serve-cost [-m MODEL] [--stage S] [--threads 2] [--tokens 256] [--rounds 5]
                                   [--stream-interval MS] [--llama-server auto|PATH]

--stream-interval passes the server its own: the tokens made within MS milliseconds of a stream go
out in one event, so the HTTP thread and the client handle fewer events on the cores the steps
run on (0, the server's default: an event per token, as OpenAI's API and llama-server send them).

The server is started once; each round measures, in an order that alternates (protocol.py):

    run      `python -m app run --json` in a fresh process: decode (1000 / its mean ms per token after
             the first) and whole (its tokens over its time to first token plus their decode time)
    stream   one streamed completion, the official `openai` client: the tokens after the first over
             the time from the first piece of text to the last
    whole    one completion at once: its tokens over the request's wall time

and the ratios serve / run of the round (stream against run's decode, whole against run's whole). A
figure is the median of the rounds' ratios.

--llama-server (auto: built once from the llama-cpp-python sdist, app/measure/llama_tools.py) adds
llama.cpp's server, one slot, the same threads, model and client, in the same rounds:

    llama stream   one streamed completion, timed as ours
    llama decode   one completion at once: its decode rate as llama-server times it (timings)

An engine with a shorter step feels the same per-token work more, so the page sets both servers'
streams side by side as time: what streaming added to a token, in milliseconds (the median of the
rounds' 1000/stream - 1000/decode), beside each one's step. Beside them, from the server's /health, the share of the
stream's time between tokens spent outside the forward steps (the server's share, with the client's
own work beside it on the same cores). TARGET: the stream's ratio it should reach; failures() says
where it did not (the command then exits 1).

Writes profiles/bench/serve_cost.json and its page serve_cost.md. A benchmark, not a test: minutes,
on a quiet machine (the client runs on the same cores as the server, as it would beside `run`).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.measure import llama_tools
from app.measure.local_server import LocalServer
from app.measure.protocol import BENCH_DIR, add_options, header, load_average, median, order, run_child, shown
from app.models import resolve
from app.serve.command import milliseconds
from app.serve.server import STREAM_INTERVAL_S

RECORD = BENCH_DIR / "serve_cost.json"
PROMPT = "The history of the printing press begins in the workshops of"
CONDITIONS = ("run", "stream", "whole")
LLAMA_CONDITIONS = ("llama stream", "llama decode")
TARGET = 0.9        # one client through the server decodes at this share of run's rate, or better


def run_once(args) -> dict:
    """`run` alone, in a fresh process: {decode, whole} in tokens per second."""
    rec = run_child([sys.executable, "-m", "app", "run", "-m", args.model, "--stage", args.stage, "-t", args.threads,
                     "-p", PROMPT, "-n", args.tokens, "--ignore-eos", "--json"], f"`run` ({args.stage})")
    decode_s = rec["decode_ms_mean"] * (len(rec["tokens"]) - 1) / 1e3
    return {"decode": 1000.0 / rec["decode_ms_mean"], "whole": len(rec["tokens"]) / (rec["ttft_ms"] / 1e3 + decode_s),
            "tokens": len(rec["tokens"])}


def forward_seconds(url: str) -> tuple[int, float]:
    """The server's steps so far and the seconds spent inside their forward passes (/health)."""
    import httpx
    h = httpx.get(url + "/health", timeout=60).json()
    return h["steps"], h["step_seconds"]


def stream_times(client, model: str, args, on_first=lambda: None) -> tuple[int, float, float]:
    """One streamed completion: (tokens, the first piece of text's time, the last's); on_first() is
    called when the first arrives (the prompt's step is done: the decode steps from there)."""
    first = last = None
    tokens = 0
    for ch in client.completions.create(model=model, prompt=PROMPT, max_tokens=args.tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}):
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].text:
            last = time.perf_counter()
            if first is None:
                first = last
                on_first()
    if tokens != args.tokens or last is None or last <= first:
        raise RuntimeError(f"the stream gave {tokens} tokens, not {args.tokens}")
    return tokens, first, last


def streamed(client, model: str, args) -> dict:
    """One streamed completion: decode tokens/s (the tokens after the first over their time) and
    the share of that time the server spent outside its forward passes."""
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    at_first = {}

    def on_first():
        at_first.update(zip(("steps", "forward"), forward_seconds(url)), since=time.perf_counter())
    tokens, first, last = stream_times(client, model, args, on_first)
    steps1, fwd1 = forward_seconds(url)
    per_token = (last - at_first["since"]) / (steps1 - at_first["steps"])
    forward = (fwd1 - at_first["forward"]) / (steps1 - at_first["steps"])
    return {"stream": (tokens - 1) / (last - first), "outside_forward": 1.0 - forward / per_token}


def whole(client, model: str, args) -> float:
    """One completion at once: tokens / wall seconds."""
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=args.tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    wall = time.perf_counter() - t0
    if r.usage.completion_tokens != args.tokens:
        raise RuntimeError(f"the completion gave {r.usage.completion_tokens} tokens, not {args.tokens}")
    return args.tokens / wall


def llama_decode(url: str, args) -> float:
    """One completion at once through llama-server: its decode tokens/s as it times them itself."""
    import httpx
    r = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": args.tokens, "temperature": 0,
                                             "ignore_eos": True, "cache_prompt": False}, timeout=600).json()
    if r["timings"]["predicted_n"] != args.tokens:
        raise RuntimeError(f"llama-server gave {r['timings']['predicted_n']} tokens, not {args.tokens}")
    return r["timings"]["predicted_per_second"]


def measure(args) -> dict:
    import openai
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        server = LocalServer([sys.executable, "-m", "app", "serve", "-m", args.model, "--stage", args.stage,
                              "-t", args.threads, "--stream-interval", args.stream_interval],
                             Path(tmp) / "serve.log", name="serve")
        servers.callback(server.close)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        streamed(client, model, args), whole(client, model, args)          # warm: connections, pages
        conditions = CONDITIONS
        if args.llama_server:
            theirs = LocalServer([args.llama_server, "-m", args.model, "-np", 1, "-c", 2048, "-t", args.threads,
                                  "-tb", args.threads], Path(tmp) / "llama-server.log", name="llama-server")
            servers.callback(theirs.close)
            their_client = openai.OpenAI(base_url=theirs.url + "/v1", api_key="none", max_retries=0, timeout=600)
            stream_times(their_client, model, args), llama_decode(theirs.url, args)
            conditions += LLAMA_CONDITIONS
        for r in range(args.rounds):
            got = {}
            for condition in order(conditions, r, rotate=True):
                if condition == "run":
                    got.update(run=run_once(args))
                elif condition == "stream":
                    got.update(streamed(client, model, args))
                elif condition == "whole":
                    got["whole"] = whole(client, model, args)
                elif condition == "llama stream":
                    tokens, first, last = stream_times(their_client, model, args)
                    got.setdefault("llama", {})["stream"] = (tokens - 1) / (last - first)
                else:
                    got.setdefault("llama", {})["decode"] = llama_decode(theirs.url, args)
            rounds.append(got)
            theirs_said = (f" | llama-server: stream {got['llama']['stream']:.1f}, decode {got['llama']['decode']:.1f}"
                           if "llama" in got else "")
            print(f"round {r + 1}: run {got['run']['decode']:.1f} tokens/s decode, {got['run']['whole']:.1f} "
                  f"whole | serve: stream {got['stream']:.1f} ({ratios(got)[0]:.3f}x), whole "
                  f"{got['whole']:.1f} ({ratios(got)[1]:.3f}x) | outside forward "
                  f"{100 * got['outside_forward']:.1f}%{theirs_said}", file=sys.stderr)
    return {"kind": "serve_cost", "model": Path(args.model).name, "stage": args.stage, "threads": args.threads,
            "tokens": args.tokens, "stream_interval_ms": args.stream_interval, "target": TARGET,
            "load_average": load_average(), **summary(rounds),
            **header({"llama_server": shown(args.llama_server) if args.llama_server else None},
                     command=args.command_line)}


def ratios(got: dict) -> tuple[float, float]:
    """A round's serve / run: streamed against run's decode, whole against run's whole."""
    return got["stream"] / got["run"]["decode"], got["whole"] / got["run"]["whole"]


def streaming_ms(stream: float, decode: float) -> float:
    """What streaming added to a token, in milliseconds: the stream's time per token less the
    decode's alone."""
    return 1e3 / stream - 1e3 / decode


def summary(rounds: list[dict]) -> dict:
    """The rounds, each with its ratios, and the medians of the ratios (taken within a round, so
    a round the machine ran slow in counts against both conditions alike); with llama-server in
    the rounds, its stream against its own decode, and both servers' streaming_ms."""
    rounds = [dict(r, ratio_stream=ratios(r)[0], ratio_whole=ratios(r)[1]) for r in rounds]
    out = {"rounds": rounds, "ratio_stream": median(r["ratio_stream"] for r in rounds),
           "ratio_whole": median(r["ratio_whole"] for r in rounds),
           "outside_forward": median(r["outside_forward"] for r in rounds),
           "streaming_ms": median(streaming_ms(r["stream"], r["run"]["decode"]) for r in rounds)}
    if all("llama" in r for r in rounds):
        out["llama"] = {"ratio_stream": median(r["llama"]["stream"] / r["llama"]["decode"] for r in rounds),
                        "streaming_ms": median(streaming_ms(r["llama"]["stream"], r["llama"]["decode"])
                                               for r in rounds)}
    return out


def paced(record: dict) -> str:
    """How the stream's events went out (records before --stream-interval: one per token)."""
    ms = record.get("stream_interval_ms", 0)
    return f"the stream at most one event per {ms:g} ms (`serve --stream-interval {ms:g}`)" if ms else \
        "the stream an event per token"


def page(record: dict, source: str) -> str:
    rounds = record["rounds"]
    med = statistics.median

    def each(values):
        return ", ".join(f"{v:.2f}" for v in values)
    run_decode = med(r["run"]["decode"] for r in rounds)
    run_whole = med(r["run"]["whole"] for r in rounds)
    ours_ms = med(streaming_ms(r["stream"], r["run"]["decode"]) for r in rounds)
    m = record["machine"]
    lines = [
        f"Measured by `python -m app bench serve-cost` on {m['cpu']} ({m['physical_cores']} cores, "
        f"{m.get('isa', '?')}; load average {record['load_average']}), {record['model']}, stage {record['stage']}, "
        f"{record['threads']} threads, {record['tokens']} tokens greedy, {paced(record)}, medians of "
        f"{len(rounds)} alternating rounds; code {record['provenance']['code_hash']}. Record: `{source}`.", "",
        "| one client | tokens/s (median) | ÷ `run` (median of the rounds' ratios) | each round |",
        "|---|---:|---:|---|",
        f"| `run` alone: decode | {run_decode:.1f} | 1 | |",
        f"| `serve`, streamed: decode | {med(r['stream'] for r in rounds):.1f} | "
        f"{record['ratio_stream']:.3f}x | {each(r['ratio_stream'] for r in rounds)} |",
        f"| `run` alone: whole request | {run_whole:.1f} | 1 | |",
        f"| `serve`, whole request | {med(r['whole'] for r in rounds):.1f} | "
        f"{record['ratio_whole']:.3f}x | {each(r['ratio_whole'] for r in rounds)} |"]
    theirs = record.get("llama")
    if theirs:
        their_decode = med(r["llama"]["decode"] for r in rounds)
        lines += [f"| llama-server, whole request: decode (as it times it) | {their_decode:.1f} | 1 | |",
                  f"| llama-server, streamed: decode | {med(r['llama']['stream'] for r in rounds):.1f} | "
                  f"{theirs['ratio_stream']:.3f}x (÷ its own decode) | "
                  f"{each(r['llama']['stream'] / r['llama']['decode'] for r in rounds)} |"]
    lines += ["", f"Of the stream's time between tokens, {100 * record['outside_forward']:.1f}% (median) went outside "
              f"the server's forward passes: its engine loop, its HTTP thread and the client, on the same cores. "
              f"The target: the streamed decode at {record['target']}x `run`'s or better."]
    if theirs:
        lines += ["", f"What the stream added to a token (the median of the rounds' 1000 / stream - 1000 / decode, "
                  f"in ms): ours {ours_ms:.2f} ms on a step of {1e3 / run_decode:.2f} ms; llama-server "
                  f"{theirs['streaming_ms']:.2f} ms on a step of {1e3 / their_decode:.2f} ms (llama.cpp "
                  f"{record['settings']['llama_server']}, the same client, model and threads, one slot). The "
                  f"same events weigh more on a shorter step."]
    return "\n".join(lines + [""])


def failures(record: dict) -> list[str]:
    if record["ratio_stream"] >= record["target"]:
        return []
    return [f"one client streamed through the server decodes at {record['ratio_stream']:.3f}x `run`'s rate, under "
            f"the target {record['target']}x"]


def add_arguments(p):
    add_options(p, rounds=5, out=RECORD)
    p.add_argument("--stage", default="fastest",
                   help="the stage both use (default: fastest, the one `serve` and `make run` pick on this machine)")
    p.add_argument("-t", "--threads", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens each request decodes (default: %(default)s)")
    p.add_argument("--stream-interval", type=milliseconds, default=STREAM_INTERVAL_S * 1e3, metavar="MS",
                   help="the server's --stream-interval: at most one event of the stream per MS milliseconds "
                        "(default: the server's, %(default)g)")
    p.add_argument("--llama-server", default=None, metavar="auto|PATH",
                   help="also llama.cpp's llama-server, one slot, the same client: 'auto' builds it once from "
                        "the llama-cpp-python sdist (several minutes), or a binary you have")


def records(args):
    from app.serve.command import serving_stage
    args.model = str(resolve(args.model))
    args.stage = serving_stage(args.stage)
    args.llama_server = llama_tools.server_binary(args.llama_server)
    yield args.out, measure(args)
