"""A soak test: minutes of mixed traffic against `python -m app serve`, then what must still hold.

    python -m app bench soak                        # 180 s (`make soak`)
    python -m app bench soak --seconds 60 --out trial/soak.json    # a short trial, elsewhere
    python -m app bench soak --draw-only            # redraw the table from the record

One server on the loopback address, a pool of --kv-pages (small enough that sequences are
preempted), and --clients clients that for --seconds (at most --max-requests requests) send,
at random: greedy completions and chat (streamed and not), streams closed mid-way, requests
abandoned before their answer, slow readers (a stream read a piece every 0.1 s), n = 2,
echo with log-probabilities and max_tokens 0, seeded sampled requests, malformed JSON, an
unknown field, and bodies over --max-body-bytes. Afterwards, on the same server, every
deterministic request (greedy, seeded, echo) is sent again alone, one at a time.

It holds (the record's `checks`, each true or false):
    pages_all_free     /health: KV pages free == pages total, nothing running or waiting
    no_5xx_but_503     no status >= 500 other than 503 (a full queue)
    expected_statuses  400 for the malformed and unknown-field requests, 413 for the big ones
    rss_flat           the server's resident memory at the end within --rss-bound-mb of what it
                       was after the warm-up (the first quarter of the run: by then the page
                       pool has been written through)
    equal_alone        every deterministic reply equal to the same request alone (text;
                       echo: the prompt's log-probabilities, exactly: rows are batch-invariant)

Writes the record (profiles/bench/soak.json: settings, counts by kind and status, memory
samples, preemptions, every mismatch, machine, code) and draws profiles/bench/soak.md from it.
Exits 1 if a check fails. A benchmark, not a test: minutes, on a quiet machine.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from app.measure.local_server import LocalServer
from app.measure.protocol import BENCH_DIR, add_options, header
from app.models import resolve
from common.generate import ParameterError

RECORD = BENCH_DIR / "soak.json"
PROMPTS = ["The meaning of life is", "Once upon a time", "In 1492, Columbus", "The best way to cook rice is",
           "Python is a programming language that", "The capital of France is", "My favourite animal is",
           "Water boils at"]
KINDS = {                                   # kind: weight
    "greedy": 4, "chat_stream": 3, "stream_closed": 2, "abandoned": 2, "slow_reader": 1, "n2": 1, "echo": 1,
    "seeded": 1, "bad_json": 1, "unknown_field": 1, "oversized": 1}
EXPECTED = {"bad_json": 400, "unknown_field": 400, "oversized": 413}
DETERMINISTIC = ("greedy", "chat_stream", "slow_reader", "n2", "echo", "seeded")
RETRY_AFTER_S = 1.0                         # what a client waits after a 503 (the server's Retry-After)
# The server's flags the soak sets (flag, default, why that value): each an option of its own,
# passed to `serve` as given and written in the record.
SERVER_FLAGS = (("--kv-pages", 16, "the server's pool, small enough to preempt"),
                ("--max-batch", 8, ""),
                ("--max-queue", 4, "small, so some requests meet a full queue"),
                ("--ctx-size", 512, ""),
                ("--max-body-bytes", 16384, ""))


def server_settings(args) -> dict:
    """SERVER_FLAGS as parsed, by their names in args (kv_pages, max_batch, ...)."""
    return {name: getattr(args, name) for name in (flag[2:].replace("-", "_") for flag, _, _ in SERVER_FLAGS)}


def start(args, log: Path) -> LocalServer:
    """The server under test, on the loopback address."""
    flags = [x for name, value in server_settings(args).items() for x in ("--" + name.replace("_", "-"), value)]
    return LocalServer([sys.executable, "-m", "app", "serve", "-m", args.model, "--stage", args.stage,
                        "--host", "127.0.0.1", *flags, "--request-timeout", 300], log, stop_timeout=60)


def request_for(kind: str, rng: random.Random) -> dict:
    """What a request of this kind sends (its key: the same request, sent again alone)."""
    prompt = rng.choice(PROMPTS)
    n = rng.choice((8, 16, 32))
    if kind in ("chat_stream", "slow_reader"):
        return {"path": "/v1/chat/completions", "stream": True,
                "body": {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}}
    if kind == "echo":
        return {"path": "/v1/completions", "stream": False,
                "body": {"prompt": prompt + " " + rng.choice(PROMPTS), "max_tokens": 0, "echo": True, "logprobs": 2}}
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    if kind == "n2":
        body["n"] = 2
    if kind == "seeded":
        body.update(temperature=0.9, seed=rng.randrange(1000))
    if kind in ("stream_closed", "abandoned"):
        body["max_tokens"] = 120                       # long: only leaving ends them early
    return {"path": "/v1/completions", "stream": kind == "stream_closed", "body": body}


def answer(kind: str, data) -> object:
    """What must equal the same request alone: the texts, or the prompt's log-probabilities."""
    if kind == "echo":
        return data["choices"][0]["logprobs"]["token_logprobs"]
    return [c["text"] if "text" in c else c["message"]["content"] for c in data["choices"]]


async def stream_text(response, slow: bool) -> list[str]:
    parts = {}
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        for c in chunk["choices"]:
            parts.setdefault(c["index"], []).append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        if slow:
            await asyncio.sleep(0.1)
    return ["".join(parts[i]) for i in sorted(parts)]


async def send(http, server: LocalServer, kind: str, req: dict, rng: random.Random,
               max_body: int) -> tuple[int, object]:
    """(status, answer or None) for one request of this kind."""
    url = server.url + req["path"]
    if kind == "bad_json":
        r = await http.post(url, content=b'{"prompt": "hi", "max_tokens": ',
                            headers={"content-type": "application/json"})
        return r.status_code, None
    if kind == "unknown_field":
        r = await http.post(url, json={"prompt": "hi", "colour": "blue"})
        return r.status_code, None
    if kind == "oversized":
        r = await http.post(url, json={"prompt": "word " * (max_body // 4), "max_tokens": 1})
        return r.status_code, None
    if kind == "abandoned":
        try:
            r = await asyncio.wait_for(http.post(url, json=req["body"]), timeout=rng.uniform(0.05, 1.0))
            return r.status_code, None
        except asyncio.TimeoutError:
            return -1, None                            # the client left: no status
    if req["stream"]:
        async with http.stream("POST", url, json=dict(req["body"], stream=True)) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            if kind == "stream_closed":
                n, stop = 0, rng.randint(1, 6)
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= stop:
                        break
                return r.status_code, None
            return r.status_code, await stream_text(r, slow=kind == "slow_reader")
    r = await http.post(url, json=req["body"])
    return r.status_code, answer(kind, r.json()) if r.status_code == 200 else None


async def traffic(server: LocalServer, args, progress) -> dict:
    """The mixed traffic, then each deterministic request alone: the run's counts and findings."""
    import httpx
    rng = random.Random(args.seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    statuses = Counter()
    replies = []                                       # (kind, request, answer) of deterministic ones
    rss = []
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + args.seconds
    limits = httpx.Limits(max_connections=4 * args.clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        async def client(i):
            nonlocal n
            crng = random.Random(args.seed * 1000 + i)
            while time.perf_counter() < deadline and n < args.max_requests:
                n += 1
                kind = crng.choices(kinds, weights)[0]
                req = request_for(kind, crng)
                try:
                    status, got = await send(http, server, kind, req, crng, args.max_body_bytes)
                except (httpx.HTTPError, RuntimeError) as e:
                    status, got = f"failed: {type(e).__name__}: {e}", None
                statuses[(kind, status)] += 1
                if kind in DETERMINISTIC and got is not None:
                    replies.append((kind, req, got))
                if status == 503:                      # a full queue: back off, as a client should
                    await asyncio.sleep(crng.uniform(0.5, 1.5) * RETRY_AFTER_S)

        async def watch():
            while time.perf_counter() < deadline and n < args.max_requests:
                rss.append((round(time.perf_counter() - t0, 2), round(server.rss_mb(), 1)))
                progress(time.perf_counter() - t0, n)
                await asyncio.sleep(1.0)
        await asyncio.gather(watch(), *[client(i) for i in range(args.clients)])
        wall = time.perf_counter() - t0
        progress(None, n)
        settle = time.perf_counter() + 120
        while True:                                    # the abandoned ones land at a step boundary
            h = (await http.get(server.url + "/health")).json()
            if (h["running"], h["waiting"]) == (0, 0) or time.perf_counter() > settle:
                break
            await asyncio.sleep(0.1)
        rss.append((round(time.perf_counter() - t0, 2), round(server.rss_mb(), 1)))
        # every deterministic request once more, alone
        alone, mismatches = {}, []
        print(f"sending the {len(replies)} deterministic replies' requests again, alone...", file=sys.stderr)
        for kind, req, got in replies:
            key = json.dumps([kind == "echo", req["path"], req["body"]], sort_keys=True)
            if key not in alone:
                status, alone[key] = await send(http, server, kind if kind != "slow_reader" else "chat_stream",
                                                req, rng, args.max_body_bytes)
            want = alone[key]
            if got != want:
                mismatches.append({"kind": kind, "request": req["body"], "got": got, "alone": want})
    return {"statuses": statuses, "wall_s": wall, "requests": n, "rss": rss, "health": h,
            "deterministic": len(replies), "distinct": len(alone), "mismatches": mismatches}


def status_of(key: str) -> int:
    """'greedy 503' -> 503; a client that left (-1) or a failed connection -> -1."""
    status = key.split(" ")[1]
    return int(status) if status.lstrip("-").isdigit() else -1


def checks(rec: dict) -> dict:
    """The record's verdicts, from its own figures (see the module docstring)."""
    h = rec["health_after"]
    by = rec["statuses"]
    warm = [mb for t, mb in rec["rss_mb"] if t <= rec["settings"]["seconds"] * rec["settings"]["warmup_share"]]
    base = warm[-1] if warm else rec["rss_mb"][0][1]
    rec["rss_growth_mb"] = round(rec["rss_mb"][-1][1] - base, 1)
    bad_5xx = [k for k in by if status_of(k) >= 500 and status_of(k) != 503]
    wrong = [k for k in by if k.split(" ")[0] in EXPECTED and k.split(" ")[1] != str(EXPECTED[k.split(" ")[0]])]
    failed = [k for k in by if " failed" in k]
    return {"pages_all_free": h["kv_pages_free"] == h["kv_pages_total"] and h["running"] == h["waiting"] == 0,
            "no_5xx_but_503": not bad_5xx and not failed,
            "expected_statuses": not wrong,
            "rss_flat": abs(rec["rss_growth_mb"]) <= rec["settings"]["rss_bound_mb"],
            "equal_alone": rec["n_mismatches"] == 0 and rec["deterministic"] > 0}


def page(rec: dict, source: str) -> str:
    """The checks and what each saw (profiles/bench/soak.md), drawn from the record alone."""
    s, c = rec["settings"], rec["checks"]
    lines = [f"Drawn from `{source}` by `python -m app bench soak` ({s['model']}, stage {s['stage']}, "
             f"commit {str(rec['provenance'].get('commit', '?'))[:7]}): {rec['requests']} requests from "
             f"{s['clients']} clients over {rec['wall_s']:.0f} s, {s['kv_pages']} KV pages, max batch "
             f"{s['max_batch']}.", "",
             "| check | holds | what was seen |", "|---|---|---|"]
    h = rec["health_after"]
    seen = {"pages_all_free": f"{h['kv_pages_free']} of {h['kv_pages_total']} pages free, "
                              f"{h['running']} running, {h['waiting']} waiting",
            "no_5xx_but_503": ", ".join(f"{k}: {n}" for k, n in sorted(rec["statuses"].items())
                                        if " failed" in k or status_of(k) >= 500) or "none",
            "expected_statuses": ", ".join(f"{k}: {n}" for k, n in sorted(rec["statuses"].items())
                                           if k.split(" ")[0] in EXPECTED),
            "rss_flat": f"{rec['rss_growth_mb']:+.1f} MiB after the warm-up (bound {s['rss_bound_mb']} MiB; "
                        f"{min(mb for _, mb in rec['rss_mb']):.0f} to {max(mb for _, mb in rec['rss_mb']):.0f} MiB)",
            "equal_alone": f"{rec['deterministic']} replies ({rec['distinct']} distinct requests), "
                           f"{rec['n_mismatches']} differ"}
    for key, ok in c.items():
        lines.append(f"| {key} | {'yes' if ok else '**no**'} | {seen[key]} |")
    lines += ["", f"Preemptions: {h['preemptions']}. Requests by kind and status:", "",
              "| kind | status | requests |", "|---|---|---:|"]
    for k, n in sorted(rec["statuses"].items()):
        kind, status = k.split(" ", 1)
        lines.append(f"| {kind} | {'client left' if status == '-1' else status} | {n} |")
    return "\n".join(lines) + "\n"


def add_arguments(p):
    add_options(p, out=RECORD)
    p.add_argument("--stage", default="fastest", help="the server's stage (default: the one `serve` picks)")
    p.add_argument("--seconds", type=float, default=180, help="how long the traffic runs (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=5000, help="at most this many requests (default: %(default)s)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients (default: %(default)s)")
    for flag, default, why in SERVER_FLAGS:
        p.add_argument(flag, type=int, default=default, help=f"{why} (default: %(default)s)".lstrip())
    p.add_argument("--rss-bound-mb", type=float, default=48.0,
                   help="how far resident memory may move after the warm-up (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="(default: %(default)s)")


def records(args):
    if args.seconds <= 0 or args.max_requests < 1 or args.clients < 1:
        raise ParameterError("--seconds, --max-requests and --clients must be positive")
    from tqdm import tqdm

    from app.serve.command import serving_stage
    args.model = resolve(args.model)
    args.stage = serving_stage(args.stage)
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    print(f"starting the server (log: {log})...", file=sys.stderr)
    server = start(args, log)
    bar = tqdm(total=round(args.seconds), unit="s", desc="soak", file=sys.stderr)

    def progress(t, n):
        if t is None:                                  # the traffic is over
            bar.n = bar.total
            bar.close()
            return
        bar.n = min(round(t), bar.total)
        bar.set_postfix(requests=n, rss_mb=f"{server.rss_mb():.0f}")
    try:
        found = asyncio.run(traffic(server, args, progress))
    finally:
        bar.close()
        server.close()
    rec = {"kind": "soak", "requests": found["requests"], "wall_s": found["wall_s"],
           "statuses": {f"{k} {s}": n for (k, s), n in sorted(found["statuses"].items(), key=str)},
           "rss_mb": found["rss"], "health_after": found["health"], "deterministic": found["deterministic"],
           "distinct": found["distinct"], "mismatches": found["mismatches"][:20],
           "n_mismatches": len(found["mismatches"])}
    rec.update(header({"model": args.model.name, "stage": args.stage, "seconds": args.seconds,
                       "max_requests": args.max_requests, "clients": args.clients, **server_settings(args),
                       "rss_bound_mb": args.rss_bound_mb,
                       "warmup_share": 0.25, "seed": args.seed, "kinds": KINDS}, args.command_line))
    rec["checks"] = checks(rec)
    yield args.out, rec


def failures(rec: dict) -> list[str]:
    """The checks the record says failed."""
    return [f"{key} does not hold" for key, ok in rec["checks"].items() if not ok]
