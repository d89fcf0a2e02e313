"""The server between HTTP and the engine loop: one request's choices in, their text out.

The engine loop (app/serve/engine_loop.py) runs in the main thread, which loaded and warmed
the engine (EngineLoop.run says why that matters); the HTTP side is one asyncio loop (FastAPI
on uvicorn, app/serve/routes.py) in a second thread. A request's n choices become sequences
(app/serve/sequence.py) submitted to the engine loop; their events come back from the engine
thread into the request's Inbox (`submit`), and `updates` turns them into text: streamed
decoding, stop strings, log-probability entries (app/serve/text.py). A stop string found, a
client gone or a time limit passed cancels what is left, and the pages go back at the next
step boundary.

Handing an event over is what costs, not the event: waking the HTTP thread takes a write to its
loop's pipe from the engine thread and a pass of its loop, and on a machine whose cores the
engine's threads fill, that thread's every wake-up takes a core from a step in flight. So the
engine thread wakes the HTTP loop once for all the events of a step (Mail), and only for what a
handler must act on now: a stream's every event, but a whole reply's tokens only where a stop
string must be looked for (otherwise they wait in the inbox for its end). A stream served with
--stream-interval MS wakes its handler at most once in MS milliseconds (Inbox.put_paced), and the
handler sends the tokens it finds as one event: the client, too, then reads and parses one event
where it read several. Each event carries the time it was made, so /metrics times tokens when the
engine made them, woken or not.

A request under a grammar (its response_format or tools: app/serve/api.py) gets a Constraint
(common/constrain/) on its first choice's sampler; the other choices fork it when they fork
that choice's prompt pages (Sequence.fork), so each follows the grammar on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from app.serve.api import Job
from app.serve.engine_loop import EngineLoop
from app.serve.metrics import Metrics
from app.serve.sequence import Ask, Sequence
from app.serve.text import TextStream
from app.structured import tool_form
from common.constrain import Constraint, ll_tokenizer

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 600.0
STREAM_INTERVAL_S = 0.0


class EngineError(RuntimeError):
    """The engine failed on a step this request was in (a bug; the server carries on)."""


class RequestTimeout(RuntimeError):
    """The request ran past --request-timeout."""


def wakes_per_token(job: Job) -> bool:
    """Whether each token of the job must wake its handler: a stream sends it (at most once per
    --stream-interval, where one is set and there is no stop string), and a stop string must be
    looked for as the text grows (the request is cancelled where one is found); a whole reply
    without stop strings reads its tokens at its end. Other events always wake it."""
    return job.stream or bool(job.stops)


class Mail:
    """The events of every request served by one asyncio loop, from the engine thread: the
    inboxes that have news, and at most one wake-up of the loop on its way for all of them
    (`call_soon_threadsafe(deliver)`), so a step's events cost one, however many requests
    they are for."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.ready: deque[Inbox] = deque()
        self.pending = False                        # a deliver() is on its way

    def send(self, inbox: Inbox):
        """(engine thread) `inbox` has news for its reader: wake the loop unless a wake-up is
        already on its way. The flags are cleared before the reader looks (deliver), so news
        put in after a wake-up's flag was cleared asks for another: none is lost."""
        if inbox.flagged:
            return
        inbox.flagged = True
        self.ready.append(inbox)
        if not self.pending:
            self.pending = True
            try:
                self.loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:                    # the asyncio loop is closed: nobody is listening
                pass

    def deliver(self):
        """(HTTP thread) Wake the reader of every inbox with news."""
        self.pending = False
        while self.ready:
            inbox = self.ready.popleft()
            inbox.flagged = False
            inbox.wake()


class Inbox:
    """One request's events, in order: (choice, kind, value, when) put in by the engine thread
    (`put`), taken out by its handler on the HTTP thread (`get`). `wake`: whether the reader
    must see this event now (Mail wakes it) or may find it with the next one that wakes it.
    `expire_at`: the request's deadline, after which get() raises RequestTimeout."""

    def __init__(self, mail: Mail):
        self.mail, self.loop = mail, mail.loop
        self.events: deque = deque()
        self.flagged = False                        # in mail.ready, its reader not woken yet
        self.waiter: asyncio.Future | None = None   # the reader's, while it waits
        self.timer = None
        self.timeout: str | None = None             # RequestTimeout's message, once past the deadline
        self.pace, self.woke = 0.0, float("-inf")   # put_paced: seconds between its wake-ups, its last

    def put(self, event: tuple, wake: bool = True):
        self.events.append(event)
        if wake:
            self.mail.send(self)

    def put_paced(self, event: tuple):
        """A token's event that wakes the reader only if `pace` seconds have passed since this
        kind of wake-up last did (else the next wake-up finds it): a reader woken per token costs
        the HTTP thread and the client their work per token, on the cores the engine computes on."""
        self.events.append(event)
        if event[3] - self.woke >= self.pace:
            self.woke = event[3]
            self.mail.send(self)

    def take_ready(self) -> list:
        """Every event in the inbox now, without waiting."""
        ready = list(self.events)
        self.events.clear()
        return ready

    def wake(self):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def expire_at(self, deadline: float | None, message: str):
        """From now on, get() raises RequestTimeout(message) once perf_counter() passes deadline."""
        if deadline is not None:
            self.timer = self.loop.call_later(max(0.0, deadline - time.perf_counter()), self._expire, message)

    def _expire(self, message: str):
        self.timeout = message
        self.wake()

    async def get(self) -> tuple:
        while not self.events:
            if self.timeout is not None:
                raise RequestTimeout(self.timeout)
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.events.popleft()

    def close(self):
        if self.timer is not None:
            self.timer.cancel()


class Server:
    """The engine loop, the operator's settings, and what the handlers need."""

    def __init__(self, engine, stage: str, loop: EngineLoop, model_id: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, request_timeout: float | None = REQUEST_TIMEOUT_S,
                 special: bool = False, cors_origins=(), stream_interval: float = STREAM_INTERVAL_S):
        self.engine, self.stage, self.loop = engine, stage, loop
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.model_names = {model_id, engine.gguf.path.split("/")[-1]}
        self.created = int(time.time())
        self.api_key, self.max_body_bytes, self.request_timeout = api_key, max_body_bytes, request_timeout
        self.special, self.cors_origins = special, list(cors_origins)
        self.stream_interval = stream_interval
        self.tool_form = tool_form(self.tokenizer)  # how this model's calls are written (app/structured/form.py)
        self._ll = None
        self.metrics = Metrics(loop)
        loop.observer = self.metrics
        self.draining = False
        self.active = 0                             # responses still being written (the drain waits for them)
        self._mail: Mail | None = None              # the HTTP loop's (Mail), made at its first request

    @property
    def ll(self):
        """llguidance's view of the vocabulary (common/constrain: ll_tokenizer), built and checked
        token for token when a request first asks for a grammar."""
        if self._ll is None:
            self._ll = ll_tokenizer(self.tokenizer, self.engine.config.n_vocab)
        return self._ll

    def submit(self, job: Job) -> tuple[list[Sequence], Inbox]:
        """Queue the job's n choices (QueueFull: the queue cannot take them); their events
        arrive in the returned inbox, from the engine thread, as (choice, kind, value, when)."""
        inbox = self.inbox()
        every = wakes_per_token(job)
        inbox.pace = self.stream_interval if job.stream and not job.stops else 0.0

        def listener(i):
            def on_event(kind, value):
                if kind == "token" and every:
                    inbox.put_paced((i, kind, value, time.perf_counter()))
                else:
                    inbox.put((i, kind, value, time.perf_counter()), kind != "token")
            return on_event

        seqs = [Sequence(Ask(job.prompt, job.max_tokens, job.params, job.stop_ids, job.logprobs,
                             job.prompt_logprobs if i == 0 else None, choice=i), on_event=listener(i),
                         constraint=Constraint(job.grammar, self.ll) if job.grammar and i == 0 else None)
                for i in range(job.n)]
        self.loop.submit(seqs[0], seqs[1:])
        self.metrics.prompt_tokens.inc(len(job.prompt))
        return seqs, inbox

    def inbox(self) -> Inbox:
        """An empty inbox on the running asyncio loop (the HTTP thread's)."""
        loop = asyncio.get_running_loop()
        if self._mail is None or self._mail.loop is not loop:
            self._mail = Mail(loop)
        return Inbox(self._mail)

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

    async def updates(self, job: Job, seqs: list[Sequence], inbox: Inbox, t0: float):
        """Yield ("prompt", None, text, entries) first when the prompt is echoed, then
        ("text", choice, text, entries) as tokens arrive and ("done", choice, finish_reason,
        None) once per choice. Raises EngineError, RequestTimeout. Cancels what is left when
        the consumer stops early (a client gone)."""
        ends = job.stop_ids | frozenset(self.tokenizer.eog_ids if job.grammar else ())   # a grammar ends on one
        streams = [TextStream(self.tokenizer, job.stops, self.special, end_ids=ends) for _ in seqs]
        done = [False] * len(seqs)
        if self.request_timeout is not None:
            inbox.expire_at(t0 + self.request_timeout,
                            f"the request took longer than this server's limit of {self.request_timeout:g} s "
                            f"(--request-timeout); ask for fewer tokens")
        try:
            if job.echo:
                async for update in self._echoed(job, seqs, streams, inbox):
                    yield update
                if not seqs:                        # echo alone, nothing to generate or score
                    return
            last = [None] * len(seqs)
            while not all(done):
                # a wake-up's events: one piece of text per choice, whatever number of tokens
                events = [await inbox.get()] + inbox.take_ready()
                pieces = {}                         # choice -> [text, entries] not yet yielded
                for i, kind, value, when in events:
                    if done[i]:
                        continue                    # a choice already ended by its stop string
                    if kind == "error":
                        raise EngineError(value)
                    piece = pieces.setdefault(i, ["", []])
                    if kind == "done":
                        text, entries = streams[i].flush()
                        piece[0] += text
                        piece[1] += entries
                    else:
                        self._timed(i, last, t0, when)
                        text, entries, hit = streams[i].push(value.id, value.logprob, value.top)
                        piece[0] += text
                        piece[1] += entries
                        if not hit:
                            continue
                        self.loop.cancel(seqs[i])
                        value = "stop"
                    if piece[0] or piece[1]:
                        yield "text", i, piece[0], piece[1]
                    del pieces[i]
                    done[i] = True
                    yield "done", i, value, None
                for i, (text, entries) in pieces.items():
                    if text or entries:
                        yield "text", i, text, entries
        finally:
            inbox.close()
            for i, seq in enumerate(seqs):
                if not done[i]:
                    self.loop.cancel(seq)

    async def _echoed(self, job: Job, seqs, streams, inbox: Inbox):
        """The echoed prompt (with its scores, when asked for: the engine's first event), then,
        with nothing to generate, each choice's end."""
        if job.prompt_logprobs is None:
            text, entries = self.echo(job)
        else:
            _, kind, value, _ = await inbox.get()
            if kind == "error":
                raise EngineError(value)
            text, entries = self.echo(job, value)
        for s in streams:
            s.decoded = s.sent = len(text)         # the completion's offsets follow the prompt's
        yield "prompt", None, text, entries
        if not seqs:
            for i in range(job.n):
                yield "done", i, "length", None

    def _timed(self, i: int, last: list, t0: float, now: float):
        """A token of choice i, made at `now`: time to the first (choice 0's), or since its last."""
        if last[i] is None:
            if i == 0:
                self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.tbt.observe(now - last[i])
        last[i] = now
        self.metrics.generated_tokens.inc()
