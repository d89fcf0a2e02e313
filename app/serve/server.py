"""`python -m app serve`: an OpenAI-compatible HTTP server over continuous batching.

    POST /v1/completions         prompt tokenized as `run -p` does (BOS where the vocabulary
                                 adds one, no template), or a list of token ids
    POST /v1/chat/completions    messages rendered with the model's chat template
    GET  /v1/models              the one model served
    POST /tokenize, /detokenize  llama-server's: {"content", "add_special", "parse_special",
                                 "with_pieces"} -> {"tokens"}; {"tokens"} -> {"content"}
    GET  /health                 status, KV pages, requests running and waiting, preemptions
    GET  /metrics                Prometheus' text format (app/serve/metrics.py)
    GET  /                       a page: chat, and the engine live (GET /engine: what it draws)

The same paths without /v1 too. The request fields (app/serve/api.py): OpenAI's max_tokens,
temperature, top_p, seed, stop, stream, stream_options.include_usage, n, user,
frequency_penalty, presence_penalty, logit_bias, logprobs (+ top_logprobs in chat), echo (with
max_tokens 0: the prompt's log-probabilities alone), and llama.cpp's top_k, min_p,
repeat_penalty, ignore_eos; the fields OpenAI has and this server does not do are a 400 that
names them. Defaults are OpenAI's (temperature 1, top_p 1; completions: max_tokens 16; chat:
up to the context's end). usage.prompt_tokens_details.cached_tokens counts the prompt
positions found in the shared prefix pages.

A value out of range, malformed JSON, a field of the wrong type or an unknown one, a prompt
that does not fit, an unknown model: 400 in OpenAI's error shape, `{"error": {"message",
"type", "param", "code"}}`. A body over --max-body-bytes: 413. Without the --api-key (as
`Authorization: Bearer KEY`): 401; /health, the page and its files stay open. A full wait
queue, or a server draining: 503 with Retry-After. A request past --request-timeout: ended
(408, or an error event in a stream). A client that disconnects, mid-stream or while waiting,
is cancelled: its pages go back at the next step. An engine step that fails ends the requests
in it with a 500 (an error event in a stream); the others carry on.

SIGTERM or Ctrl-C drains: no new request is admitted (503), the running and waiting ones go
on for up to --drain-timeout seconds, then what is left ends with an error saying so, and the
server exits 0. A second signal ends the drain at once.

The engine loop (app/serve/scheduler.py) runs in the main thread, which loaded and warmed
the engine (Scheduler.run says why that matters); the HTTP side is one asyncio loop (FastAPI
on uvicorn) in a second thread, which hands each request's tokens from the engine thread to
its response through an asyncio queue.
"""

import asyncio
import hmac
import json
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from app.models import DEFAULT_MODEL, resolve
from app.serve.api import BadRequest, Job, chat_logprobs, completion_logprobs
from app.serve.metrics import Metrics
from app.serve.scheduler import QueueFull, Request, Scheduler
from app.serve.text import TextStream
from stages import StageError, info

RETRY_AFTER_S = 1
STATIC = Path(__file__).resolve().parent / "static"
OPEN_PATHS = ("/health", "/", "/favicon.ico")          # without the API key (and /static/...)
MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 30.0


class EngineError(RuntimeError):
    """The engine failed on a step this request was in (a bug; the server carries on)."""


class RequestTimeout(RuntimeError):
    """The request ran past --request-timeout."""


class BodyTooLarge(ValueError):
    """The request body is over --max-body-bytes (HTTP 413)."""


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Server:
    """The engine, its scheduler, the operator's settings, and what the handlers need."""

    def __init__(self, engine, stage: str, scheduler: Scheduler, model_id: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, request_timeout: float | None = REQUEST_TIMEOUT_S,
                 special: bool = False, cors_origins=()):
        self.engine, self.stage, self.scheduler = engine, stage, scheduler
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.model_names = {model_id, engine.gguf.path.split("/")[-1]}
        self.created = int(time.time())
        self.api_key, self.max_body_bytes, self.request_timeout = api_key, max_body_bytes, request_timeout
        self.special, self.cors_origins = special, list(cors_origins)
        self.metrics = Metrics(scheduler)
        scheduler.observer = self.metrics
        self.draining = False
        self.active = 0                             # responses still being written (the drain waits for them)

    # ---- one request: its choices in the scheduler, their events back here ------------------------
    def submit(self, job: Job) -> tuple[list[Request], asyncio.Queue]:
        """Queue the job's n choices (QueueFull: the queue cannot take them); their events
        arrive on the returned asyncio queue, from the engine thread, as (choice, kind, value)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def listener(i):
            def on_event(kind, value):
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, kind, value))
                except RuntimeError:                # the loop is closed: nobody is listening
                    pass
            return on_event

        reqs = [Request(prompt=job.prompt, max_tokens=job.max_tokens, params=job.params, stop_ids=job.stop_ids,
                        on_event=listener(i), logprobs=job.logprobs, choice=i,
                        prompt_logprobs=job.prompt_logprobs if i == 0 else None) for i in range(job.n)]
        self.scheduler.submit(reqs[0], reqs[1:])
        self.metrics.prompt_tokens.inc(len(job.prompt))
        return reqs, queue

    def echo(self, job: Job, scores=None) -> tuple[str, list]:
        """The prompt as text and, given its scores, its log-probability entries (the first
        token's is None: nothing comes before it)."""
        stream = TextStream(self.tokenizer, [], self.special)
        text, entries = "", []
        for i, t in enumerate(job.prompt):
            offset = len(text)
            text += stream.push(t)[0]
            if scores is not None:
                lp, top = scores[i] if scores[i] is not None else (None, None)
                entries.append((t, lp, top, offset))
        return text + stream.flush()[0], entries

    async def updates(self, job: Job, reqs: list[Request], queue: asyncio.Queue, t0: float):
        """Yield ("prompt", None, text, entries) first when the prompt is echoed, then
        ("text", choice, text, entries) as tokens arrive and ("done", choice, finish_reason,
        None) once per choice. Raises EngineError, RequestTimeout. Cancels what is left when
        the consumer stops early (a client gone)."""
        streams = [TextStream(self.tokenizer, job.stops, self.special) for _ in reqs]
        last = [None] * len(reqs)
        done = [False] * len(reqs)
        deadline = None if self.request_timeout is None else t0 + self.request_timeout
        try:
            if job.echo:
                if job.prompt_logprobs is None:
                    text, entries = self.echo(job)
                else:
                    _, kind, value = await self._next(queue, deadline)
                    if kind == "error":
                        raise EngineError(value)
                    text, entries = self.echo(job, value)
                for s in streams:
                    s.decoded = s.sent = len(text)     # the completion's offsets follow the prompt's
                yield "prompt", None, text, entries
                if not reqs:                        # echo alone, nothing to generate or score
                    for i in range(job.n):
                        yield "done", i, "length", None
                    return
            while not all(done):
                i, kind, value = await self._next(queue, deadline)
                if done[i]:
                    continue                        # a choice already ended by its stop string
                if kind == "token":
                    now = time.perf_counter()
                    if last[i] is None:
                        if i == 0:
                            self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.tbt.observe(now - last[i])
                    last[i] = now
                    self.metrics.generated_tokens.inc()
                    if value.id in job.stop_ids:    # end of generation: no text
                        continue
                    text, entries, hit = streams[i].push(value.id, value.logprob, value.top)
                    if text or entries:
                        yield "text", i, text, entries
                    if hit:
                        self.scheduler.cancel(reqs[i])
                        done[i] = True
                        yield "done", i, "stop", None
                elif kind == "done":
                    text, entries = streams[i].flush()
                    if text or entries:
                        yield "text", i, text, entries
                    done[i] = True
                    yield "done", i, value, None
                elif kind == "error":
                    raise EngineError(value)
        finally:
            for i, req in enumerate(reqs):
                if not done[i]:
                    self.scheduler.cancel(req)

    async def _next(self, queue: asyncio.Queue, deadline):
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"the request took longer than this server's limit of {self.request_timeout:g} s "
                                 f"(--request-timeout); ask for fewer tokens") from None


async def read_body(request, limit: int) -> bytes:
    """The body, or BodyTooLarge as soon as it passes `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                           f"(--max-body-bytes)")
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise BodyTooLarge(f"the request body is over {limit} bytes, the most this server takes "
                               f"(--max-body-bytes)")
        parts.append(chunk)
    return b"".join(parts)


class Guard:
    """ASGI middleware: the API key (Bearer) on every path but the open ones. Plain ASGI,
    not Starlette's BaseHTTPMiddleware, so a client's disconnect still reaches the handlers."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        key = self.server.api_key
        if scope["type"] == "http" and key and scope["method"] != "OPTIONS" and not (
                scope["path"] in OPEN_PATHS or scope["path"].startswith("/static/")):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                from fastapi.responses import JSONResponse
                self.server.metrics.outcome("unauthorized")
                said = "no API key was given" if not given else "the API key given is not this server's"
                body = error_body(f"{said}: send it as the header 'Authorization: Bearer KEY' (--api-key)",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Server):
    """The FastAPI application over a Server."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles

    app = FastAPI(title="llm-inference-stages", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, server=server)
    if server.cors_origins:                         # outermost: a preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    m = server.metrics

    def refuse(status: int, message: str, outcome: str, kind="invalid_request_error", param=None, code=None,
               headers=None):
        m.outcome(outcome)
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    def unavailable(message: str, outcome: str, code: str):
        return refuse(503, f"{message}; retry after {RETRY_AFTER_S} s", outcome, kind="server_error", code=code,
                      headers={"Retry-After": str(RETRY_AFTER_S)})

    async def body_json(request: HTTPRequest) -> dict:
        from app.serve.api import parse_json
        return parse_json(await read_body(request, server.max_body_bytes))

    @app.get("/health")
    async def health():
        body = dict(status="draining" if server.draining else "ok", model=server.model_id, stage=server.stage,
                    **server.scheduler.stats())
        return JSONResponse(body, status_code=503 if server.draining else 200)

    @app.get("/engine")
    async def engine_view():
        return dict(model=server.model_id, stage=server.stage, draining=server.draining, **server.scheduler.view())

    @app.get("/metrics")
    async def metrics():
        body, kind = m.text()
        return Response(body, media_type=kind)

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": server.created,
                                            "owned_by": "local"}]}

    async def tokenize(request: HTTPRequest):
        try:
            data = await body_json(request)
            content = data.get("content")
            flags = {k: data.get(k, d) for k, d in (("add_special", False), ("parse_special", True),
                                                     ("with_pieces", False))}
            if not isinstance(content, str):
                raise BadRequest("content must be the text to tokenize (a string)", "content")
            for k, v in flags.items():
                if not isinstance(v, bool):
                    raise BadRequest(f"{k} = {v!r}: must be true or false", k)
            tok = server.tokenizer
            ids = tok.encode(content, add_bos=None if flags["add_special"] else False,
                             add_eos=None if flags["add_special"] else False, parse_special=flags["parse_special"])
        except BodyTooLarge as e:
            return refuse(413, str(e), "too_large")
        except (BadRequest, ValueError) as e:
            return refuse(400, str(e), "bad_request", param=getattr(e, "param", None))
        if not flags["with_pieces"]:
            return {"tokens": ids}
        pieces = []
        for i in ids:
            raw = tok.token_piece(i, special=True)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)                   # llama-server: the bytes, where it is not whole UTF-8
            pieces.append({"id": i, "piece": piece})
        return {"tokens": pieces}

    async def detokenize(request: HTTPRequest):
        try:
            data = await body_json(request)
            ids = data.get("tokens")
            n_vocab = server.engine.config.n_vocab
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                     0 <= t < n_vocab for t in ids):
                raise BadRequest(f"tokens must be a list of token ids in 0..{n_vocab - 1}", "tokens")
        except BodyTooLarge as e:
            return refuse(413, str(e), "too_large")
        except BadRequest as e:
            return refuse(400, str(e), "bad_request", param=e.param)
        return {"content": server.tokenizer.decode(ids)}

    async def generate(request: HTTPRequest, chat: bool):
        t0 = time.perf_counter()
        if server.draining:
            return unavailable("the server is shutting down and takes no new requests", "draining",
                               "server_shutting_down")
        try:
            job = Job(server, await body_json(request), chat)
        except BodyTooLarge as e:
            return refuse(413, str(e), "too_large")
        except BadRequest as e:
            return refuse(400, str(e), "bad_request", param=e.param)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        reqs = []
        if not (job.score_only and job.prompt_logprobs is None):      # (echo alone needs no engine)
            try:                                    # a full queue is a 503 before anything is sent
                reqs, queue = server.submit(job)
            except QueueFull as e:
                return unavailable(f"the server is busy: {e}", "busy", "server_busy")
        else:
            queue = asyncio.Queue()
        updates = server.updates(job, reqs, queue, t0)

        def logprobs(entries):
            if job.logprobs is None:
                return None
            return (chat_logprobs if chat else completion_logprobs)(server.tokenizer, entries)

        def usage():
            n = sum(len(r.generated) for r in reqs)
            cached = reqs[0].cached_tokens if reqs and reqs[0].cached_tokens else 0
            return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
                    "prompt_tokens_details": {"cached_tokens": cached}}

        def chunk(choices, **extra):
            body = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                    "model": server.model_id, "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def piece(i, text, entries, finish=None):
            lp = logprobs(entries) if entries or finish is None else None
            if chat:
                delta = {"content": text} if text or finish is None else {}
                return chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])
            return chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}])

        def failed(e: Exception) -> tuple[int, dict, str]:
            if isinstance(e, RequestTimeout):
                return 408, error_body(str(e), "timeout_error", code="request_timeout"), "timeout"
            return 500, error_body(str(e), "server_error"), "error"

        def finished(outcomes):                     # a request counts once, by its first choice
            m.outcome(outcomes[0] if outcomes and outcomes[0] in ("stop", "length") else "cancelled")

        if job.stream:
            async def events():
                # a client that goes away cancels this generator (Starlette listens for the
                # disconnect), and closing `updates` cancels the request
                server.active += 1
                outcomes = []
                try:
                    if chat:
                        for i in range(job.n):
                            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                    async for kind, i, text, entries in updates:
                        if kind == "prompt":
                            for c in range(job.n):
                                yield piece(c, text, entries)
                        elif kind == "text":
                            yield piece(i, text, entries)
                        else:
                            outcomes.append(text)
                            yield piece(i, "", [], text)
                    if job.include_usage:
                        yield chunk([], usage=usage())
                    yield "data: [DONE]\n\n"
                    finished(outcomes)
                except (EngineError, RequestTimeout) as e:
                    _, body, outcome = failed(e)
                    m.outcome(outcome)
                    yield f"data: {json.dumps(body)}\n\n"
                finally:
                    server.active -= 1
                    await updates.aclose()
            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect():
            texts, entries, finish = [""] * job.n, [[] for _ in range(job.n)], [None] * job.n
            async for kind, i, text, more in updates:
                for c in (range(job.n) if kind == "prompt" else [i]):
                    if kind == "done":
                        finish[c] = text
                    else:
                        texts[c] += text
                        entries[c] += more
            return texts, entries, finish

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        server.active += 1
        try:
            work = asyncio.ensure_future(collect())
            gone = asyncio.ensure_future(disconnected())
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not work.done():                 # the client left: cancel, free its pages
                    work.cancel()
                await updates.aclose()
            if work.cancelled():
                m.outcome("cancelled")
                return JSONResponse(error_body("the client disconnected"), status_code=499)
            try:
                texts, entries, finish = work.result()
            except (EngineError, RequestTimeout) as e:
                status, body, outcome = failed(e)
                m.outcome(outcome)
                return JSONResponse(body, status_code=status)
        finally:
            server.active -= 1
        finished(finish)
        choices = []
        for i in range(job.n):
            choice = {"index": i, "logprobs": logprobs(entries[i]), "finish_reason": finish[i]}
            choice.update({"message": {"role": "assistant", "content": texts[i], "refusal": None}} if chat
                          else {"text": texts[i]})
            choices.append(choice)
        return {"id": rid, "object": obj, "created": created, "model": server.model_id, "choices": choices,
                "usage": usage()}

    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    async def chat_completions(request: HTTPRequest):
        return await generate(request, chat=True)

    for prefix in ("/v1", ""):                      # OpenAI's paths, and llama-server's without /v1
        app.add_api_route(prefix + "/models", models, methods=["GET"])
        app.add_api_route(prefix + "/completions", completions, methods=["POST"])
        app.add_api_route(prefix + "/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    return app


# ---- the command ---------------------------------------------------------------------------------

def build(stage: str, model, ctx_size=None, threads=None, max_batch=32, kv_pages=512, max_queue=64,
          prefill_chunk=64, progress=False, **settings) -> Server:
    """Load the stage and warm its kernels up (single and batched), in the calling thread:
    the thread that must then run the engine loop (server.scheduler.run()). settings: the
    Server's (api_key, max_body_bytes, request_timeout, special, cors_origins)."""
    from stages import load
    s = info(stage)
    if not s.kv_cache or s.gpu:
        raise StageError(f"stage '{stage}' cannot serve a batch: serving needs a CPU stage with a KV cache "
                         f"(kv_cache, quantized, threads, int8, ...)")
    engine = load(stage, resolve(model), n_ctx=ctx_size, threads=threads, progress=progress)
    engine.warmup()
    scheduler = Scheduler(engine, kv_pages=kv_pages, max_batch=max_batch, max_queue=max_queue,
                          prefill_chunk=prefill_chunk)
    scheduler.submit(Request(prompt=[0, 1], max_tokens=2))   # compile the batched kernels before serving
    while scheduler.step() or scheduler.running:
        pass
    scheduler.reset_counters()
    model_id = engine.gguf.path.split("/")[-1].removesuffix(".gguf")
    return Server(engine, stage, scheduler, model_id, **settings)


def serving_stage(name: str) -> str:
    """The stage to serve with: as named, or for 'fastest' the one `make run` picks among those
    that keep a KV cache on the CPU to hold pages (app/run.py: fastest_stage)."""
    from app.run import chosen_stage, fastest_stage
    stage = chosen_stage(fastest_stage(serving=True) if name == "fastest" else name)
    if not info(stage).kv_cache or info(stage).gpu:
        raise StageError(f"stage '{stage}' cannot serve: the server needs a CPU stage with a KV cache "
                         f"(the stages are listed by `python -m app stages`)")
    return stage


class Drain:
    """SIGTERM and Ctrl-C: the first starts the drain (no new requests; --drain-timeout for
    the rest), a second ends it at once. keep_going() is the engine loop's condition."""

    def __init__(self, server: Server, web: threading.Thread, timeout: float):
        self.server, self.web, self.timeout = server, web, timeout
        self.deadline = None

    def signalled(self, signum, frame):
        if self.server.draining:
            self.deadline = time.monotonic()
            return
        self.server.draining = True
        self.deadline = time.monotonic() + self.timeout
        s = self.server.scheduler.stats()
        print(f"\n{signal.Signals(signum).name}: draining: {s['running']} running and {s['waiting']} waiting "
              f"may finish within {self.timeout:g} s (--drain-timeout); new requests get 503. "
              f"Again to stop now.", file=sys.stderr)

    def keep_going(self) -> bool:
        if not self.web.is_alive():
            return False
        if not self.server.draining:
            return True
        s = self.server.scheduler.stats()
        return (s["running"] or s["waiting"]) and time.monotonic() < self.deadline


def cmd_serve(args):
    stage = serving_stage(args.stage)
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()] if args.cors_origins else []
    server = build(stage, args.model, ctx_size=args.ctx_size, threads=args.threads, max_batch=args.max_batch,
                   kv_pages=args.kv_pages, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                   progress=True, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                   request_timeout=args.request_timeout or None, special=args.special, cors_origins=origins)
    import uvicorn
    pool = server.scheduler.pool
    print(f"serving {server.model_id} with stage {stage} on http://{args.host}:{args.port}  "
          f"(max batch {args.max_batch}, {pool.n_pages} KV pages of {pool.page_size} positions = "
          f"{pool.nbytes / 2**20:.0f} MiB, queue {args.max_queue}, context {server.engine.n_ctx}"
          f"{', API key required' if args.api_key else ''})", file=sys.stderr)
    http = uvicorn.Server(uvicorn.Config(create_app(server), host=args.host, port=args.port,
                                         log_level=args.log_level, timeout_graceful_shutdown=5))
    web = threading.Thread(target=http.run, name="http", daemon=True)
    drain = Drain(server, web, args.drain_timeout)
    signal.signal(signal.SIGTERM, drain.signalled)
    signal.signal(signal.SIGINT, drain.signalled)
    web.start()
    try:                                           # here, in the thread that warmed the engine
        server.scheduler.run(keep_going=drain.keep_going,
                             farewell=f"the server shut down before this request finished "
                                      f"(--drain-timeout {args.drain_timeout:g} s)")
    finally:
        deadline = time.monotonic() + 5                # the last events reach their clients
        while server.active and web.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        http.should_exit = True
        web.join(timeout=10)
    if not http.started:
        raise SystemExit(f"error: the server could not listen on {args.host}:{args.port} (see uvicorn's "
                         f"message above; is the port in use? try --port)")
    if server.draining:
        print("drained; exiting", file=sys.stderr)


def add_commands(sub):
    from app.run import add_model_args, checked, one_line_errors
    from common.generate import check_count

    def count(flag, minimum=1):
        return checked(lambda n: check_count(f"{flag.lstrip('-').replace('-', '_')} ({flag})", n, minimum))

    def seconds(text):
        import argparse
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds >= 0")
        return value
    p = one_line_errors(sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching, paged KV cache)",
        description="Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions "
                    "(streamed or not), /v1/models, and llama-server's /tokenize, /detokenize; /health, "
                    "/metrics (Prometheus), and a page at / that chats and shows the engine live. Requests "
                    "share forward steps (continuous batching) and a pool of KV pages."))
    add_model_args(p)
    p.set_defaults(model=str(DEFAULT_MODEL.path), stage="fastest")
    for action in p._actions:
        if action.dest == "stage":
            action.help = "a CPU stage with a KV cache (default: fastest, the stage `make run` picks: " \
                          "the best decode recorded on this machine, else the last CPU stage)"
    g = p.add_argument_group("the engine")
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
    g = p.add_argument_group("the operator's")
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
    g.add_argument("--drain-timeout", type=seconds, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C, seconds the running requests may take to finish "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=cmd_serve)
