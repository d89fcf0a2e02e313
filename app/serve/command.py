"""`python -m app serve`: load and warm the engine, serve HTTP in a second thread, run the
engine loop in this one, drain on a signal.

SIGTERM or Ctrl-C drains: no new request is admitted (503), the running and waiting ones go
on for up to --drain-timeout seconds, then what is left ends with an error saying so, and the
server exits 0. A second signal ends the drain at once.

The pieces: app/serve/routes.py (HTTP), app/serve/server.py (a request's choices in, their
text out), app/serve/engine_loop.py (the steps), app/serve/scheduler.py (what runs in each),
app/serve/sequence.py (one choice's state).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from app.args import add_model_args, add_spec_args, checked, chosen_stage, fastest_stage, one_line_errors, spec_mode
from app.models import DEFAULT_MODEL, resolve
from app.serve import speculation as serve_speculation
from app.serve.engine_loop import EngineLoop
from app.serve.sequence import Ask, Sequence
from app.serve.server import MAX_BODY_BYTES, REQUEST_TIMEOUT_S, STREAM_INTERVAL_S, Server
from common.gguf import GGUFFile
from common.speculative import DRAFT_MAX, check_vocabulary
from stages import StageError, info

DRAIN_TIMEOUT_S = 30.0


def build(stage: str, model, ctx_size=None, threads=None, max_batch=32, kv_pages=512, max_queue=64,
          prefill_chunk=64, progress=False, spec="off", draft_max=DRAFT_MAX, model_draft=None,
          **settings) -> Server:
    """Load the stage and warm its kernels up (single and batched), and hand the vocabulary to
    llguidance (Server.ll), in the calling thread: the thread that must then run the engine
    loop (server.loop.run()). spec: speculative decoding, "lookup", "draft" (with model_draft,
    a GGUF file of the same vocabulary, loaded on the same stage) or "off"
    (app/serve/speculation.py), whose step times are measured here. settings: the Server's
    (api_key, max_body_bytes, request_timeout, special, cors_origins)."""
    from stages import load
    s = info(stage)
    if not s.kv_cache or s.gpu:
        raise StageError(f"stage '{stage}' cannot serve a batch: serving needs a CPU stage with a KV cache "
                         f"(kv_cache, quantized, threads, int8, ...)")
    target = GGUFFile(resolve(model))
    draft = None
    if spec == "draft":                                  # its vocabulary checked before any weights load
        draft = GGUFFile(resolve(model_draft))
        check_vocabulary(target, draft)
    engine = load(stage, target, n_ctx=ctx_size, threads=threads, progress=progress)
    engine.warmup()
    if spec == "draft":
        draft = load(stage, draft, n_ctx=engine.n_ctx, threads=threads, progress=progress)
        draft.warmup()
    speculation = serve_speculation.for_server(spec, engine, draft, draft_max, kv_pages, max_batch)
    loop = EngineLoop(engine, kv_pages=kv_pages, max_batch=max_batch, max_queue=max_queue,
                      prefill_chunk=prefill_chunk, speculation=speculation)
    loop.submit(Sequence(Ask([0, 1], max_tokens=2)))     # compile the batched kernels before serving
    while loop.step() or loop.scheduler.running:
        pass
    if speculation is not None:                          # what a step of M rows costs on this engine
        serve_speculation.calibrate(speculation, loop, max_batch, prefill_chunk)
    loop.reset_counters()
    model_id = engine.gguf.path.split("/")[-1].removesuffix(".gguf")
    server = Server(engine, stage, loop, model_id, **settings)
    server.ll                                           # llguidance's vocabulary, built and checked now:
    return server                                       # a first request under a grammar would wait for it


def serving_stage(name: str) -> str:
    """The stage to serve with: as named, or for 'fastest' the one `make run` picks among those
    that keep a KV cache on the CPU to hold pages (app/args.py: fastest_stage)."""
    stage = chosen_stage(fastest_stage(serving=True) if name == "fastest" else name)
    if not info(stage).kv_cache or info(stage).gpu:
        raise StageError(f"stage '{stage}' cannot serve: the server needs a CPU stage with a KV cache "
                         f"(the stages are listed by `python -m app stages`)")
    return stage


class Drain:
    """SIGTERM and Ctrl-C: the first starts the drain (no new requests; --drain-timeout for
    the rest), a second ends it at once. keep_going() is the engine loop's condition: serving
    while the HTTP thread lives; draining while anything runs or waits, until the deadline.
    `clock`: seconds (time.monotonic; tests give their own)."""

    def __init__(self, server: Server, web, timeout: float, clock=time.monotonic):
        self.server, self.web, self.timeout, self.clock = server, web, timeout, clock
        self.deadline = None

    def signalled(self, signum, frame):
        if self.server.draining:
            self.deadline = self.clock()
            return
        self.server.draining = True
        self.deadline = self.clock() + self.timeout
        s = self.server.loop.stats()
        print(f"\n{signal.Signals(signum).name}: draining: {s['running']} running and {s['waiting']} waiting "
              f"may finish within {self.timeout:g} s (--drain-timeout); new requests get 503. "
              f"Again to stop now.", file=sys.stderr)

    def keep_going(self) -> bool:
        if not self.web.is_alive():
            return False
        if not self.server.draining:
            return True
        s = self.server.loop.stats()
        return bool(s["running"] or s["waiting"]) and self.clock() < self.deadline


def cmd_serve(args):
    import uvicorn

    from app.serve import ranks
    from app.serve.routes import create_app
    mode = spec_mode(args)                          # contradictions refused before anything loads
    stage = serving_stage(args.stage)
    if ranks.follows(stage):                       # tp's ranks > 0: rank 0's steps, no HTTP
        return ranks.follow(stage, args)
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()] if args.cors_origins else []
    server = build(stage, args.model, ctx_size=args.ctx_size, threads=args.threads, max_batch=args.max_batch,
                   kv_pages=args.kv_pages, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                   progress=True, spec=mode, draft_max=args.draft_max, model_draft=args.model_draft,
                   api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                   request_timeout=args.request_timeout or None, special=args.special, cors_origins=origins,
                   stream_interval=args.stream_interval / 1e3)
    lead = ranks.Lead(server)                      # over N ranks: each step to every rank
    pool = server.loop.pool
    spec = {"lookup": ", speculative: prompt lookup", "draft": f", speculative: draft model {args.model_draft}",
            "off": ""}[mode] + (f", up to {args.draft_max} guesses" if mode != "off" else "")
    print(f"serving {server.model_id} with stage {stage} on http://{args.host}:{args.port}  "
          f"(max batch {args.max_batch}, {pool.n_pages} KV pages of {pool.page_size} positions = "
          f"{pool.nbytes / 2**20:.0f} MiB, queue {args.max_queue}, context {server.engine.n_ctx}{spec}"
          f"{', API key required' if args.api_key else ''})", file=sys.stderr)
    if (block := server.engine.backend.row_block) > 1:     # fused: a lone decode row padded to 8
        print(f"note: the {stage} stage pads every step to a multiple of {block} rows (its multi-row kernels "
              f"give a row the same bits whatever rows come with it), so a step of one or two sequences costs "
              f"{block} rows' work; `--stage repack` computes a row alike in any batch without padding",
              file=sys.stderr)
    http = uvicorn.Server(uvicorn.Config(create_app(server), host=args.host, port=args.port,
                                         log_level=args.log_level, timeout_graceful_shutdown=5))
    web = threading.Thread(target=http.run, name="http", daemon=True)
    drain = Drain(server, web, args.drain_timeout)
    signal.signal(signal.SIGTERM, drain.signalled)
    signal.signal(signal.SIGINT, drain.signalled)
    web.start()
    try:                                           # here, in the thread that warmed the engine
        server.loop.run(keep_going=drain.keep_going,
                        farewell=f"the server shut down before this request finished "
                                 f"(--drain-timeout {args.drain_timeout:g} s)")
    finally:
        deadline = time.monotonic() + 5                # the last events reach their clients
        while server.active and web.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        http.should_exit = True
        web.join(timeout=10)
        lead.end()
    if not http.started:
        raise SystemExit(f"error: the server could not listen on {args.host}:{args.port} (see uvicorn's "
                         f"message above; is the port in use? try --port)")
    if server.draining:
        print("drained; exiting", file=sys.stderr)


def add_commands(sub):
    p = one_line_errors(sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching, paged KV cache)",
        description="Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions "
                    "(streamed or not), /v1/models, and llama-server's /tokenize, /detokenize; /health, "
                    "/metrics (Prometheus), and a page at / that chats and shows the engine live. Requests "
                    "share forward steps (continuous batching) and a pool of KV pages. response_format "
                    "(json_object, json_schema) and tools (tool_choice, parallel_tool_calls) constrain the "
                    "reply with llguidance, each request its own grammar in the shared step."))
    add_model_args(p, stage_help="a CPU stage with a KV cache (default: fastest, the stage `make run` picks: "
                                 "the best decode recorded on this machine, else the last CPU stage)")
    p.set_defaults(model=str(DEFAULT_MODEL.path), stage="fastest", func=cmd_serve)
    engine_args(p.add_argument_group("the engine"))
    add_spec_args(p)
    operator_args(p.add_argument_group("the operator's"))


def count(flag, minimum=1):
    from common.generate import check_count
    return checked(lambda n: check_count(f"{flag.lstrip('-').replace('-', '_')} ({flag})", n, minimum))


def at_least_0(unit: str):
    """An argparse type: a number of `unit` >= 0, or a message that says so."""
    def parse(text):
        import argparse
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a number of {unit} >= 0")
        return value
    return parse


seconds, milliseconds = at_least_0("seconds"), at_least_0("milliseconds")


def engine_args(g):
    g.add_argument("--max-batch", type=count("--max-batch"), default=32,
                   help="sequences decoded together (default: %(default)s)")
    g.add_argument("--kv-pages", type=count("--kv-pages"), default=512,
                   help="KV pages of 16 positions in the pool; when they run out the newest sequence is "
                        "preempted and recomputed later (default: %(default)s)")
    g.add_argument("--max-queue", type=count("--max-queue", 0), default=64,
                   help="requests that may wait for a place; past it: 503 (default: %(default)s)")
    g.add_argument("--prefill-chunk", type=count("--prefill-chunk"), default=64,
                   help="prompt tokens prefilled per step, beside the decoding rows (default: %(default)s)")
    g.add_argument("--special", action="store_true",
                   help="render control tokens (<|im_end|>, ...) as text in replies (llama.cpp's --special)")


def operator_args(g):
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=count("--port", 0), default=8080, help="port (default: %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health and the page (default: none)")
    g.add_argument("--cors-origins", default=None,
                   help="comma-separated origins a browser may call the API from, or '*' (default: none)")
    g.add_argument("--max-body-bytes", type=count("--max-body-bytes"), default=MAX_BODY_BYTES,
                   help="largest request body; past it: 413 (default: %(default)s)")
    g.add_argument("--request-timeout", type=seconds, default=REQUEST_TIMEOUT_S,
                   help="seconds a request may take from arrival to its last token; 0: no limit "
                        "(default: %(default)s)")
    g.add_argument("--stream-interval", type=milliseconds, default=STREAM_INTERVAL_S * 1e3, metavar="MS",
                   help="a stream's tokens are sent at most every MS milliseconds, those made in between "
                        "together in one event (the first at once; a request with stop strings: each token); "
                        "0: an event per token (default: %(default)g)")
    g.add_argument("--drain-timeout", type=seconds, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C, seconds the running requests may take to finish "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
