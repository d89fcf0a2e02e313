"""The server between HTTP and the engine loop: one request's choices in, their text out.

The engine loop (app/serve/engine_loop.py) runs in the main thread, which loaded and warmed
the engine (EngineLoop.run says why that matters); the HTTP side is one asyncio loop (FastAPI
on uvicorn, app/serve/routes.py) in a second thread. A request's n choices become sequences
(app/serve/sequence.py) submitted to the engine loop; their events come back from the engine
thread through an asyncio queue (`submit`), and `updates` turns them into text: streamed
decoding, stop strings, log-probability entries (app/serve/text.py). A stop string found, a
client gone or a time limit passed cancels what is left, and the pages go back at the next
step boundary.

A request under a grammar (its response_format or tools: app/serve/api.py) gets a Constraint
(common/constrain/) on its first choice's sampler; the other choices fork it when they fork
that choice's prompt pages (Sequence.fork), so each follows the grammar on its own.
"""

from __future__ import annotations

import asyncio
import time

from app.serve.api import Job
from app.serve.engine_loop import EngineLoop
from app.serve.metrics import Metrics
from app.serve.sequence import Ask, Sequence
from app.serve.text import TextStream
from app.structured import tool_form
from common.constrain import Constraint, ll_tokenizer

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 600.0


class EngineError(RuntimeError):
    """The engine failed on a step this request was in (a bug; the server carries on)."""


class RequestTimeout(RuntimeError):
    """The request ran past --request-timeout."""


class Server:
    """The engine loop, the operator's settings, and what the handlers need."""

    def __init__(self, engine, stage: str, loop: EngineLoop, model_id: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, request_timeout: float | None = REQUEST_TIMEOUT_S,
                 special: bool = False, cors_origins=()):
        self.engine, self.stage, self.loop = engine, stage, loop
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.model_names = {model_id, engine.gguf.path.split("/")[-1]}
        self.created = int(time.time())
        self.api_key, self.max_body_bytes, self.request_timeout = api_key, max_body_bytes, request_timeout
        self.special, self.cors_origins = special, list(cors_origins)
        self.tool_form = tool_form(self.tokenizer)  # how this model's calls are written (app/structured/form.py)
        self._ll = None
        self.metrics = Metrics(loop)
        loop.observer = self.metrics
        self.draining = False
        self.active = 0                             # responses still being written (the drain waits for them)

    @property
    def ll(self):
        """llguidance's view of the vocabulary (common/constrain: ll_tokenizer), built and checked
        token for token when a request first asks for a grammar."""
        if self._ll is None:
            self._ll = ll_tokenizer(self.tokenizer, self.engine.config.n_vocab)
        return self._ll

    def submit(self, job: Job) -> tuple[list[Sequence], asyncio.Queue]:
        """Queue the job's n choices (QueueFull: the queue cannot take them); their events
        arrive on the returned asyncio queue, from the engine thread, as (choice, kind, value)."""
        http_loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def listener(i):
            def on_event(kind, value):
                try:
                    http_loop.call_soon_threadsafe(queue.put_nowait, (i, kind, value))
                except RuntimeError:                # the asyncio loop is closed: nobody is listening
                    pass
            return on_event

        seqs = [Sequence(Ask(job.prompt, job.max_tokens, job.params, job.stop_ids, job.logprobs,
                             job.prompt_logprobs if i == 0 else None, choice=i), on_event=listener(i),
                         constraint=Constraint(job.grammar, self.ll) if job.grammar and i == 0 else None)
                for i in range(job.n)]
        self.loop.submit(seqs[0], seqs[1:])
        self.metrics.prompt_tokens.inc(len(job.prompt))
        return seqs, queue

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

    async def updates(self, job: Job, seqs: list[Sequence], queue: asyncio.Queue, t0: float):
        """Yield ("prompt", None, text, entries) first when the prompt is echoed, then
        ("text", choice, text, entries) as tokens arrive and ("done", choice, finish_reason,
        None) once per choice. Raises EngineError, RequestTimeout. Cancels what is left when
        the consumer stops early (a client gone)."""
        ends = job.stop_ids | frozenset(self.tokenizer.eog_ids if job.grammar else ())   # a grammar ends on one
        streams = [TextStream(self.tokenizer, job.stops, self.special, end_ids=ends) for _ in seqs]
        done = [False] * len(seqs)
        deadline = None if self.request_timeout is None else t0 + self.request_timeout
        try:
            if job.echo:
                async for update in self._echoed(job, seqs, streams, queue, deadline):
                    yield update
                if not seqs:                        # echo alone, nothing to generate or score
                    return
            last = [None] * len(seqs)
            while not all(done):
                i, kind, value = await self._next(queue, deadline)
                if done[i]:
                    continue                        # a choice already ended by its stop string
                if kind == "error":
                    raise EngineError(value)
                if kind == "done":
                    text, entries = streams[i].flush()
                    if text or entries:
                        yield "text", i, text, entries
                    done[i] = True
                    yield "done", i, value, None
                    continue
                self._timed(i, last, t0)
                text, entries, hit = streams[i].push(value.id, value.logprob, value.top)
                if text or entries:
                    yield "text", i, text, entries
                if hit:
                    self.loop.cancel(seqs[i])
                    done[i] = True
                    yield "done", i, "stop", None
        finally:
            for i, seq in enumerate(seqs):
                if not done[i]:
                    self.loop.cancel(seq)

    async def _echoed(self, job: Job, seqs, streams, queue, deadline):
        """The echoed prompt (with its scores, when asked for: the engine's first event), then,
        with nothing to generate, each choice's end."""
        if job.prompt_logprobs is None:
            text, entries = self.echo(job)
        else:
            _, kind, value = await self._next(queue, deadline)
            if kind == "error":
                raise EngineError(value)
            text, entries = self.echo(job, value)
        for s in streams:
            s.decoded = s.sent = len(text)         # the completion's offsets follow the prompt's
        yield "prompt", None, text, entries
        if not seqs:
            for i in range(job.n):
                yield "done", i, "length", None

    def _timed(self, i: int, last: list, t0: float):
        """A token of choice i arrived: time to the first (choice 0's), or since its last."""
        now = time.perf_counter()
        if last[i] is None:
            if i == 0:
                self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.tbt.observe(now - last[i])
        last[i] = now
        self.metrics.generated_tokens.inc()

    async def _next(self, queue: asyncio.Queue, deadline):
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"the request took longer than this server's limit of {self.request_timeout:g} s "
                                 f"(--request-timeout); ask for fewer tokens") from None
