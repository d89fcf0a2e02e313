"""The HTTP routes: an OpenAI-compatible API over continuous batching (FastAPI).

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
max_tokens 0: the prompt's log-probabilities alone), response_format (json_object,
json_schema; text completions too, as llama-server), tools, tool_choice, parallel_tool_calls
(chat: message.tool_calls, finish_reason "tool_calls", streamed as tool-call deltas), and
llama.cpp's top_k, min_p, repeat_penalty, ignore_eos; the fields OpenAI has and this server does
not do are a 400 that names them. Defaults are OpenAI's (temperature 1, top_p 1; completions: max_tokens 16; chat:
up to the context's end). usage.prompt_tokens_details.cached_tokens counts the prompt
positions found in the shared prefix pages. The answers' shapes: app/serve/replies.py.

A value out of range, malformed JSON, a field of the wrong type or an unknown one, a prompt
that does not fit, an unknown model, a schema llguidance refuses: 400 in OpenAI's error shape, `{"error": {"message",
"type", "param", "code"}}`. A body over --max-body-bytes: 413 (the rest of the body, up to
DISCARD_BYTES, is read and dropped first, so that a client still sending it reads the 413
rather than a reset connection). Without the --api-key (as `Authorization: Bearer KEY`): 401;
/health, the page and its files stay open. A full wait queue, or a server draining: 503 with
Retry-After. A request past --request-timeout: ended (408, or an error event in a stream). A
client that disconnects, mid-stream or while waiting, is cancelled: its pages go back at the
next step. An engine step that fails ends the requests in it with a 500 (an error event in a
stream); the others carry on. Every answer is counted by outcome in /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from app.serve.api import BadRequest, Job, parse_json
from app.serve.replies import Reply, error_body, token_pieces
from app.serve.scheduler import QueueFull
from app.serve.server import EngineError, RequestTimeout, Server

RETRY_AFTER_S = 1
STATIC = Path(__file__).resolve().parent / "static"
OPEN_PATHS = ("/health", "/", "/favicon.ico")          # without the API key (and /static/...)
DISCARD_BYTES = 256 << 20      # of a body over the limit, read and dropped before the 413 (see above)


class BodyTooLarge(ValueError):
    """The request body is over --max-body-bytes (HTTP 413)."""


async def read_body(request, limit: int) -> bytes:
    """The body, or BodyTooLarge as soon as it passes `limit` bytes (declared or sent); the
    rest of a body too large is read and dropped first, up to DISCARD_BYTES."""
    declared = request.headers.get("content-length")
    chunks = request.stream()
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await discard(chunks)
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                           f"(--max-body-bytes)")
    parts, n = [], 0
    async for chunk in chunks:
        n += len(chunk)
        if n > limit:
            await discard(chunks, n)
            raise BodyTooLarge(f"the request body is over {limit} bytes, the most this server takes "
                               f"(--max-body-bytes)")
        parts.append(chunk)
    return b"".join(parts)


async def discard(chunks, n: int = 0):
    """Read and drop what the client is still sending, up to DISCARD_BYTES in all: a server
    that answers and closes while the client sends makes the client's system reset the
    connection, and the client never reads the answer."""
    async for chunk in chunks:
        n += len(chunk)
        if n > DISCARD_BYTES:
            return


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
                self.server.metrics.outcome("unauthorized")
                said = "no API key was given" if not given else "the API key given is not this server's"
                body = error_body(f"{said}: send it as the header 'Authorization: Bearer KEY' (--api-key)",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Server):
    """The FastAPI application over a Server."""
    app = FastAPI(title="llm-inference-stages", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, server=server)
    if server.cors_origins:                         # outermost: a preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    routes = Routes(server)
    for path, handler in (("/health", routes.health), ("/engine", routes.engine_view),
                          ("/metrics", routes.exposition), ("/", routes.page)):
        app.add_api_route(path, handler, methods=["GET"])
    for prefix in ("/v1", ""):                      # OpenAI's paths, and llama-server's without /v1
        app.add_api_route(prefix + "/models", routes.models, methods=["GET"])
        app.add_api_route(prefix + "/completions", routes.completions, methods=["POST"])
        app.add_api_route(prefix + "/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    return app


class Routes:
    """The handlers, over one Server. Each answer counts its outcome (app/serve/metrics.py)."""

    def __init__(self, server: Server):
        self.server, self.metrics = server, server.metrics

    def refuse(self, status: int, message: str, outcome: str, kind="invalid_request_error", param=None, code=None,
               headers=None):
        self.metrics.outcome(outcome)
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    def unavailable(self, message: str, outcome: str, code: str):
        return self.refuse(503, f"{message}; retry after {RETRY_AFTER_S} s", outcome, kind="server_error", code=code,
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    async def body_json(self, request: HTTPRequest) -> dict:
        return parse_json(await read_body(request, self.server.max_body_bytes))

    # ---- the engine and the page ---------------------------------------------------------------
    async def health(self):
        s = self.server
        body = dict(status="draining" if s.draining else "ok", model=s.model_id, stage=s.stage, **s.loop.stats())
        return JSONResponse(body, status_code=503 if s.draining else 200)

    async def engine_view(self):
        s = self.server
        return dict(model=s.model_id, stage=s.stage, draining=s.draining, **s.loop.view())

    async def exposition(self):
        """/metrics: Prometheus' text format."""
        body, kind = self.metrics.text()
        return Response(body, media_type=kind)

    async def page(self):
        return FileResponse(STATIC / "index.html")

    async def models(self):
        s = self.server
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": s.created,
                                            "owned_by": "local"}]}

    # ---- llama-server's tokenizer paths --------------------------------------------------------
    async def tokenize(self, request: HTTPRequest):
        try:
            data = await self.body_json(request)
            content = data.get("content")
            flags = {k: data.get(k, d) for k, d in (("add_special", False), ("parse_special", True),
                                                     ("with_pieces", False))}
            if not isinstance(content, str):
                raise BadRequest("content must be the text to tokenize (a string)", "content")
            for k, v in flags.items():
                if not isinstance(v, bool):
                    raise BadRequest(f"{k} = {v!r}: must be true or false", k)
            special = None if flags["add_special"] else False
            ids = self.server.tokenizer.encode(content, add_bos=special, add_eos=special,
                                               parse_special=flags["parse_special"])
        except BodyTooLarge as e:
            return self.refuse(413, str(e), "too_large")
        except (BadRequest, ValueError) as e:
            return self.refuse(400, str(e), "bad_request", param=getattr(e, "param", None))
        return {"tokens": token_pieces(self.server.tokenizer, ids) if flags["with_pieces"] else ids}

    async def detokenize(self, request: HTTPRequest):
        try:
            data = await self.body_json(request)
            ids = data.get("tokens")
            n_vocab = self.server.engine.config.n_vocab
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                     0 <= t < n_vocab for t in ids):
                raise BadRequest(f"tokens must be a list of token ids in 0..{n_vocab - 1}", "tokens")
        except BodyTooLarge as e:
            return self.refuse(413, str(e), "too_large")
        except BadRequest as e:
            return self.refuse(400, str(e), "bad_request", param=e.param)
        return {"content": self.server.tokenizer.decode(ids)}

    # ---- completions and chat ------------------------------------------------------------------
    async def completions(self, request: HTTPRequest):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest):
        return await self.generate(request, chat=True)

    async def generate(self, request: HTTPRequest, chat: bool):
        """Parse, queue, then answer streamed or whole."""
        t0 = time.perf_counter()
        s = self.server
        if s.draining:
            return self.unavailable("the server is shutting down and takes no new requests", "draining",
                                    "server_shutting_down")
        try:
            job = Job(s, await self.body_json(request), chat)
        except BodyTooLarge as e:
            return self.refuse(413, str(e), "too_large")
        except BadRequest as e:
            return self.refuse(400, str(e), "bad_request", param=e.param)
        seqs, inbox = [], s.inbox()
        if not (job.score_only and job.prompt_logprobs is None):      # (echo alone needs no engine)
            try:                                    # a full queue is a 503 before anything is sent
                seqs, inbox = s.submit(job)
            except QueueFull as e:
                return self.unavailable(f"the server is busy: {e}", "busy", "server_busy")
        reply = Reply(job, s.model_id, s.tokenizer)
        updates = s.updates(job, seqs, inbox, t0)
        if job.stream:
            return StreamingResponse(self.events(job, reply, seqs, updates), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(request, job, reply, seqs, updates)

    def failed(self, e: Exception) -> tuple[int, dict, str]:
        """An EngineError or RequestTimeout: (status, body, outcome)."""
        if isinstance(e, RequestTimeout):
            return 408, error_body(str(e), "timeout_error", code="request_timeout"), "timeout"
        return 500, error_body(str(e), "server_error"), "error"

    def finished(self, outcomes: list):
        """A request that ran to its end counts once, by its first choice's finish reason."""
        self.metrics.outcome(outcomes[0] if outcomes and outcomes[0] in ("stop", "length") else "cancelled")

    async def events(self, job: Job, reply: Reply, seqs, updates):
        """The stream. A client that goes away closes this generator (Starlette listens for the
        disconnect), and closing `updates` cancels the request: counted as cancelled."""
        self.server.active += 1
        outcomes, counted = [], False
        try:
            for chunk in reply.opening():
                yield chunk
            async for kind, i, text, entries in updates:
                if kind == "prompt":
                    for c in range(job.n):
                        yield reply.piece(c, text, entries)
                elif kind == "text":
                    chunks = reply.piece(i, text, entries)
                    if chunks:                      # (text that may begin a tool call is held back)
                        yield chunks
                else:
                    outcomes.append(text)
                    yield reply.piece(i, "", [], text)
            self.finished(outcomes)
            counted = True
            if job.include_usage:
                yield reply.chunk([], usage=reply.usage(seqs))
            yield "data: [DONE]\n\n"
        except (EngineError, RequestTimeout) as e:
            _, body, outcome = self.failed(e)
            counted = True
            self.metrics.outcome(outcome)
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            self.server.active -= 1
            await updates.aclose()
            if not counted:
                self.metrics.outcome("cancelled")

    async def whole(self, request: HTTPRequest, job: Job, reply: Reply, seqs, updates):
        """The answer at once; a client that disconnects while it waits cancels the request."""

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

        self.server.active += 1
        try:
            work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not work.done():                 # the client left: cancel, free its pages
                    work.cancel()
                    await asyncio.wait({work})      # until `updates` has stopped (and cancelled)
                await updates.aclose()
            if work.cancelled():
                return self.refuse(499, "the client disconnected", "cancelled")
            try:
                texts, entries, finish = work.result()
            except (EngineError, RequestTimeout) as e:
                status, body, outcome = self.failed(e)
                self.metrics.outcome(outcome)
                return JSONResponse(body, status_code=status)
        finally:
            self.server.active -= 1
        self.finished(finish)
        return reply.whole(texts, entries, finish, seqs)
