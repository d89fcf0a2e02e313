"""`python -m app serve`: an OpenAI-compatible HTTP server over continuous batching.

    POST /v1/completions         prompt tokenized as `run -p` does (BOS where the vocabulary
                                 adds one, no template)
    POST /v1/chat/completions    messages rendered with the model's chat template
    GET  /v1/models              the one model served
    GET  /health                 status, KV pages total and free, requests running and waiting

Both POSTs take `max_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or up to four)
and `stream` (server-sent events, `data: {...}` lines ending in `data: [DONE]`), and, as
llama.cpp's server does, `top_k`, `min_p`, `repeat_penalty` and `ignore_eos`. Defaults are
OpenAI's (temperature 1, top_p 1; completions: max_tokens 16; chat: up to the context's end,
whose pages admission control then promises it: give max_tokens to serve many at once).

The generation parameters go through the same validation as the command line
(common/generate.py: SamplingParams, check_n_predict, check_fits): a value out of range is a
400 in OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, as are
malformed JSON, a field of the wrong type or an unknown one, a prompt that does not fit the
context, and an unknown model. A full wait queue is a 503 with `Retry-After`. A client that
disconnects, mid-stream or while waiting, is cancelled: its pages go back at the next step.

The engine loop (app/serve/scheduler.py) runs in the main thread, which loaded and warmed
the engine (Scheduler.run says why that matters); the HTTP side is one asyncio loop (FastAPI
on uvicorn) in a second thread, which hands each request's tokens from the engine thread to
its response through an asyncio queue.
"""

import asyncio
import json
import re
import signal
import sys
import threading
import time
import uuid

from app.models import DEFAULT_MODEL, resolve
from app.serve.scheduler import QueueFull, Request, Scheduler
from common.generate import ContextError, ParameterError, SamplingParams
from common.tokenizer import TokenizerError
from stages import StageError, info, runnable_stages

# What the server sets when a request does not: OpenAI's defaults, and llama.cpp's samplers off.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
COMPLETION_MAX_TOKENS = 16                   # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4
RETRY_AFTER_S = 1

# Every field a request may carry; anything else is refused by name, as OpenAI does.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                 "n", "user", "top_k", "min_p", "repeat_penalty", "ignore_eos"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
# SamplingParams' names for the API's
API_NAMES = {"temp": "temperature", "n_predict": "max_tokens"}


class BadRequest(ValueError):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- requests: JSON -> prompt ids, sampling parameters -------------------------------------------

def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def check_fields(data: dict, allowed: set):
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]} (this server takes: "
                         f"{', '.join(sorted(allowed))})", unknown[0])


def typed(data: dict, name: str, kinds, what: str, default=None):
    value, kinds = data.get(name), kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"{name} = {value!r}: must be {what}", name)
    return value


def stop_strings(data: dict) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop = {stop!r}: must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in stops if s]


def sampling_params(data: dict) -> SamplingParams:
    """The request's sampler through SamplingParams: the command line's one validation."""
    values = {k: v if data.get(k) is None else data[k] for k, v in OPENAI_DEFAULTS.items()}
    try:
        return SamplingParams(temp=values["temperature"], top_p=values["top_p"], top_k=values["top_k"],
                              min_p=values["min_p"], repeat_penalty=values["repeat_penalty"], seed=data.get("seed"))
    except ParameterError as e:
        raise api_error(e) from None


def api_error(e: ParameterError, key: str | None = None) -> BadRequest:
    """A ParameterError in the API's words: 'temp = -1: ...' -> 'temperature = -1: ...'."""
    message = str(e)
    m = re.match(r"(\w+)( \([^)]*\))? = ", message)
    if m is None:
        return BadRequest(message)
    api = key if m.group(1) == "n_predict" and key else API_NAMES.get(m.group(1), m.group(1))
    return BadRequest(api + message[m.end() - 3:], api if api in CHAT_FIELDS | COMPLETION_FIELDS else None)


def chat_text(messages) -> list[dict]:
    """OpenAI's messages -> [{role, content: str}]; content may be a string or text parts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest(f"messages[{i}] must be an object with role system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


class Job:
    """A parsed request: prompt ids, max tokens, sampler, stop strings, stream or not."""

    def __init__(self, server: "Server", data: dict, chat: bool):
        check_fields(data, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        model = typed(data, "model", str, "a string")
        if model is not None and model not in server.model_names:
            raise BadRequest(f"model '{model}' is not served here; this server has '{server.model_id}'", "model")
        self.stream = typed(data, "stream", bool, "true or false", False)
        options = typed(data, "stream_options", dict, "an object", {})
        self.include_usage = bool(options.get("include_usage", False))
        if typed(data, "n", int, "an integer", 1) != 1:
            raise BadRequest("n: this server makes one choice per request", "n")
        typed(data, "user", str, "a string")
        ignore_eos = typed(data, "ignore_eos", bool, "true or false", False)
        self.stops = stop_strings(data)
        self.params = sampling_params(data)
        tok = server.tokenizer
        try:
            if chat:
                text = tok.apply_chat_template(chat_text(data.get("messages")), add_generation_prompt=True)
                self.prompt = tok.encode(text, add_bos=None, parse_special=True)
            else:
                prompt = data.get("prompt")
                if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    if any(t < 0 or t >= server.engine.config.n_vocab for t in prompt):
                        raise BadRequest(f"prompt token ids must be in 0..{server.engine.config.n_vocab - 1}", "prompt")
                    self.prompt = list(prompt)
                elif isinstance(prompt, str):
                    self.prompt = tok.encode(prompt)
                else:
                    raise BadRequest("prompt must be a string (or a list of token ids); one prompt per request",
                                     "prompt")
        except TokenizerError as e:
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
        if not self.prompt:
            raise BadRequest("the prompt is empty (no tokens): give at least one token to continue from",
                             "messages" if chat else "prompt")
        n_ctx = server.engine.n_ctx
        default = max(1, n_ctx - len(self.prompt)) if chat else COMPLETION_MAX_TOKENS
        key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
        self.max_tokens = data.get(key) if data.get(key) is not None else default
        try:
            server.scheduler.check(len(self.prompt), self.max_tokens)
        except ParameterError as e:
            raise api_error(e, key) from None
        except ContextError as e:
            raise BadRequest(str(e), key) from None
        self.stop_ids = frozenset() if ignore_eos else frozenset(tok.eog_ids)


class StopMatcher:
    """Text out, held back only while it could still be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found: nothing after it is sent)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:                        # the longest tail that begins a stop string
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---- the server ----------------------------------------------------------------------------------

class Server:
    """The engine, its scheduler and what the HTTP handlers need to know."""

    def __init__(self, engine, stage: str, scheduler: Scheduler, model_id: str):
        self.engine, self.stage, self.scheduler = engine, stage, scheduler
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.model_names = {model_id, engine.gguf.path.split("/")[-1]}
        self.created = int(time.time())

    def submit(self, job: Job) -> tuple[Request, asyncio.Queue]:
        """Queue the job's request (QueueFull: the queue is at its bound); its events arrive
        on the returned asyncio queue, from the engine thread."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(kind, value):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:                    # the loop is closed: nobody is listening
                pass

        req = Request(prompt=job.prompt, max_tokens=job.max_tokens, params=job.params,
                      stop_ids=job.stop_ids, on_event=on_event)
        self.scheduler.submit(req)
        return req, queue

    async def pieces(self, job: Job, req: Request, queue: asyncio.Queue):
        """Yield (text, finish_reason, tokens generated) as tokens arrive; finish_reason is None
        until the last item. Cancels the request if the consumer stops early (a client gone)."""
        decoder, stops, done = self.tokenizer.stream_decoder(), StopMatcher(job.stops), False
        try:
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    if value in job.stop_ids:       # end of generation: no text
                        continue
                    text, hit = stops.push(decoder.push(value))
                    if hit:
                        self.scheduler.cancel(req)
                        done = True
                        yield text, "stop", len(req.generated)
                        return
                    if text:
                        yield text, None, len(req.generated)
                elif kind == "done":
                    done = True
                    yield stops.push(decoder.flush())[0] + stops.flush(), value, len(req.generated)
                    return
                else:
                    done = True
                    raise EngineError(value)
        finally:
            if not done:
                self.scheduler.cancel(req)


class EngineError(RuntimeError):
    """The engine failed on a step this request was in (a bug; the server carries on)."""


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(server: Server):
    """The FastAPI application over a Server."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="llm-inference-stages", docs_url=None, redoc_url=None)

    def bad(e: BadRequest):
        return JSONResponse(error_body(str(e), param=e.param), status_code=400)

    def busy(e: QueueFull):
        return JSONResponse(error_body(f"the server is busy: {e}; retry after {RETRY_AFTER_S} s",
                                       kind="server_error", code="server_busy"),
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/health")
    async def health():
        return dict(status="ok", model=server.model_id, stage=server.stage, **server.scheduler.stats())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": server.created,
                                            "owned_by": "local"}]}

    async def generate(request: HTTPRequest, chat: bool):
        try:
            job = Job(server, parse_json(await request.body()), chat)
        except BadRequest as e:
            return bad(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        try:                                        # a full queue is a 503 before anything is sent
            req, queue = server.submit(job)
        except QueueFull as e:
            return busy(e)
        tokens = server.pieces(job, req, queue)

        def usage(n):
            return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n}

        def chunk(choice, **extra):
            body = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                    "model": server.model_id, "choices": choice, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def piece(text, finish):
            if chat:
                delta = {"content": text} if text or finish is None else {}
                return chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
            return chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}])

        if job.stream:
            async def events():
                # a client that goes away cancels this generator (Starlette listens for the
                # disconnect), and closing `tokens` cancels the request
                try:
                    if chat:
                        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}])
                    async for text, finish, n in tokens:
                        if text:
                            yield piece(text, None)
                        if finish is not None:
                            yield piece("", finish)
                            if job.include_usage:
                                yield chunk([], usage=usage(n))
                    yield "data: [DONE]\n\n"
                except EngineError as e:
                    yield f"data: {json.dumps(error_body(str(e), kind='server_error'))}\n\n"
                finally:
                    await tokens.aclose()
            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect():
            parts = []
            async for text, finish, n in tokens:
                parts.append(text)
                if finish is not None:
                    return "".join(parts), finish, n

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():                     # the client left: cancel, free its pages
                work.cancel()
            await tokens.aclose()
        if work.cancelled():
            return JSONResponse(error_body("the client disconnected"), status_code=499)
        try:
            text, finish, n = work.result()
        except EngineError as e:
            return JSONResponse(error_body(str(e), kind="server_error"), status_code=500)
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": obj, "created": created, "model": server.model_id, "choices": [choice],
                "usage": usage(n)}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await generate(request, chat=True)

    return app


# ---- the command ---------------------------------------------------------------------------------

def build(stage: str, model, ctx_size=None, threads=None, max_batch=32, kv_pages=512, max_queue=64,
          prefill_chunk=64, progress=False) -> Server:
    """Load the stage and warm its kernels up (single and batched), in the calling thread:
    the thread that must then run the engine loop (server.scheduler.run())."""
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
    return Server(engine, stage, scheduler, model_id)


# The stage `serve` picks by default: a batch runs every stage's multi-row kernels, and the
# threads stage runs them on every core (int8 rounds the rows first, then multiplies the same
# way; the single-thread stages are the same lesson on one core).
SERVING_STAGE = "threads"


def serving_stage(name: str) -> str:
    """The stage to serve with: as named, or for 'fastest' the threads stage where it runs
    (else the last CPU stage with a KV cache this machine can run)."""
    from app.run import chosen_stage
    if name != "fastest":
        return chosen_stage(name)
    cpu = [s for s in runnable_stages() if info(s).kv_cache and not info(s).gpu]
    if not cpu:
        raise StageError("no CPU stage with a KV cache can run here")
    return SERVING_STAGE if SERVING_STAGE in cpu else cpu[-1]


def interrupted(signum, frame):
    """SIGTERM ends the server as Ctrl-C does: the requests still running get an error event."""
    raise KeyboardInterrupt


def cmd_serve(args):
    stage = serving_stage(args.stage)
    server = build(stage, args.model, ctx_size=args.ctx_size, threads=args.threads, max_batch=args.max_batch,
                   kv_pages=args.kv_pages, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                   progress=True)
    import uvicorn
    pool = server.scheduler.pool
    print(f"serving {server.model_id} with stage {stage} on http://{args.host}:{args.port}  "
          f"(max batch {args.max_batch}, {pool.n_pages} KV pages of {pool.page_size} positions = "
          f"{pool.nbytes / 2**20:.0f} MiB, queue {args.max_queue}, context {server.engine.n_ctx})", file=sys.stderr)
    http = uvicorn.Server(uvicorn.Config(create_app(server), host=args.host, port=args.port,
                                         log_level=args.log_level))
    web = threading.Thread(target=http.run, name="http", daemon=True)
    signal.signal(signal.SIGTERM, interrupted)
    web.start()
    try:
        server.scheduler.run(keep_going=web.is_alive)      # here, in the thread that warmed the engine
    except KeyboardInterrupt:
        pass
    finally:
        server.scheduler.stop()
        http.should_exit = True
        web.join(timeout=10)
    if not http.started:
        raise SystemExit(f"error: the server could not listen on {args.host}:{args.port} (see uvicorn's "
                         f"message above; is the port in use? try --port)")


def add_commands(sub):
    from app.run import add_model_args
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, paged KV cache)",
                       description="Serve the model over HTTP with OpenAI's API: /v1/completions, "
                                   "/v1/chat/completions (both with stream), /v1/models, /health. Requests "
                                   "share forward steps (continuous batching) and a pool of KV pages.")
    add_model_args(p)
    p.set_defaults(model=str(DEFAULT_MODEL.path), stage="fastest")
    for action in p._actions:
        if action.dest == "stage":
            action.help = f"a CPU stage with a KV cache (default: {SERVING_STAGE} where it runs; it runs the " \
                          f"multi-row kernels a batch uses on every core)"
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--kv-pages", type=int, default=512,
                   help="KV pages of 16 positions in the pool (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a place; past it: 503 (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="prompt tokens prefilled per step, beside the decoding rows (default: %(default)s)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=cmd_serve)
