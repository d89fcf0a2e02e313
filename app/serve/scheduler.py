"""Continuous batching: many requests, one engine, one forward step at a time.

One engine thread runs steps (the thread that loaded the engine: Scheduler.run says why);
between two steps requests join and leave:

    waiting  (bounded, FIFO)  --admit: its worst-case pages reserved-->  running
    running: prefilling (its prompt in chunks)  ->  decoding (one row per step)  ->  done

A step (common/batch.py) carries one row for every decoding sequence and, within
`prefill_chunk` rows, the next chunk of the prompts being prefilled, so a long prompt never
stalls the sequences already decoding. Each sequence's sampled token goes to its request's
`on_event` callback as it is made.

Admission control is by pages: a request is admitted only when the pool can promise every page
it could need (prompt + max_tokens, less the prefix pages it finds cached), so a running
sequence never runs out, and no other sequence is ever disturbed to make room. (The price: a
request that asks for many tokens holds their pages' promise from the start, and waits until
they are free.) Past the
bounded wait queue a request is refused at once (`QueueFull`: the server's 503), never
dropped later. A request cancelled (its client went away, or a stop string matched) gives its
pages back at the next step boundary. If a step fails, the requests in it end with an error
and their pages are returned; the others carry on.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from common.batch import Batch, Segment
from common.generate import ContextError, ParameterError, Sampler, SamplingParams, check_fits, check_n_predict
from common.paged_kv import PAGE_SIZE, PagePool, PageTable

POLL_S = 0.5          # run(): how often an idle loop asks keep_going()


class QueueFull(RuntimeError):
    """The wait queue is at its bound: try again later (HTTP 503)."""


@dataclass(eq=False)
class Request:
    """One generation. `on_event(kind, value)` is called from the engine thread with
    ("token", id) for each sampled token, then once ("done", "stop" | "length" | "cancelled")
    or ("error", message)."""
    prompt: list
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset = frozenset()
    on_event: object = None
    id: int = field(default_factory=itertools.count(1).__next__)
    cancelled: bool = False
    # engine-thread state
    table: PageTable | None = None
    generated: list = field(default_factory=list)
    sampler: Sampler | None = None
    t_submitted: float = field(default_factory=time.perf_counter)

    @property
    def prefilling(self) -> bool:
        return len(self.table) < len(self.prompt)

    def emit(self, kind, value):
        if self.on_event is not None:
            self.on_event(kind, value)


class Scheduler:
    """The engine thread and its queues (see the module docstring)."""

    def __init__(self, engine, kv_pages: int, max_batch: int = 32, max_queue: int = 64,
                 prefill_chunk: int = 64, page_size: int = PAGE_SIZE):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0")
        cfg = engine.config
        self.engine = engine
        self.pool = PagePool(cfg.n_layer, cfg.kv_dim, kv_pages, page_size, engine.backend.kv_dtype)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._lock = threading.Condition()
        self._stop = False
        self.steps = 0
        self.rows = 0
        self.step_seconds = 0.0                             # inside forward steps, for the load test
        self.failures = 0
        self._snapshot = self._stats()

    # ---- called from any thread -----------------------------------------------------------
    def check(self, n_prompt: int, max_tokens: int):
        """Refuse, before queueing, what can never run: ParameterError, ContextError."""
        max_tokens = check_n_predict(max_tokens)
        if n_prompt < 1:
            raise ParameterError("the prompt is empty (no tokens): give at least one token to continue from")
        check_fits(n_prompt, max_tokens, self.engine.n_ctx, self.engine.config.n_ctx_train)
        need = PageTable.pages_for(n_prompt + max_tokens, self.pool.page_size)
        if need > self.pool.n_pages:
            raise ContextError(f"{n_prompt} prompt tokens + {max_tokens} to generate need {need} KV pages of "
                               f"{self.pool.page_size} positions; the server has {self.pool.n_pages} (--kv-pages)")

    def submit(self, req: Request):
        """Queue a request (check() it first); QueueFull if the wait queue is at its bound."""
        self.check(len(req.prompt), req.max_tokens)
        req.sampler = Sampler(req.params)
        with self._lock:
            self._drop_cancelled()
            # the places free in the running set are taken at the next step boundary: requests
            # headed for them are not queued
            if len(self.waiting) >= self.max_queue + max(0, self.max_batch - len(self.running)):
                raise QueueFull(f"{self.max_batch} requests are running and {self.max_queue} waiting "
                                f"(--max-batch, --max-queue)")
            self.waiting.append(req)
            self._lock.notify()

    def cancel(self, req: Request):
        """Stop a request; its pages are returned at the next step boundary."""
        with self._lock:
            req.cancelled = True
            self._lock.notify()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._snapshot, waiting=len(self.waiting))

    def reset_counters(self):
        self.steps = self.rows = self.failures = 0
        self.step_seconds = 0.0
        self._publish()

    # ---- the engine loop ------------------------------------------------------------------
    def run(self, keep_going=lambda: True):
        """The engine loop, in the calling thread, until stop() or until keep_going() turns
        false (asked at least every POLL_S while idle). Call it from the thread that loaded and
        warmed the engine: numba's OpenMP layer gives each thread that opens parallel regions
        its own team of workers, libgomp counts the workers of every team, and once they
        outnumber the CPUs they stop spinning between regions and sleep (libgomp's do_spin),
        so each of a step's hundreds of regions would begin by waking a sleeping thread."""
        try:
            while True:
                with self._lock:
                    while not self._stop and not self.waiting and not self.running and keep_going():
                        self._lock.wait(POLL_S)
                    if self._stop or not keep_going():
                        break
                try:
                    self.step()
                except Exception:                          # a bug outside the forward pass: the
                    traceback.print_exc()                  # requests it touched end, the loop lives
                    self.failures += 1
                    for req in list(self.running):
                        self._finish(req, "error", "the engine failed; this request was ended")
                    self._publish()
        finally:                                           # stopped, or interrupted (Ctrl-C)
            with self._lock:
                left = list(self.running) + list(self.waiting)
                self.waiting.clear()
            for req in left:
                self._finish(req, "error", "the server is shutting down")
            self._publish()

    def stop(self):
        """Ask run() to return (from any thread) at the next step boundary."""
        with self._lock:
            self._stop = True
            self._lock.notify()

    def step(self) -> int:
        """Admit, build one batch, run it, hand out the tokens. Returns the rows computed."""
        with self._lock:
            self._drop_cancelled()
            self._admit()
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, "done", "cancelled")
        segments, reqs = self._plan()
        if not segments:
            self._publish()
            return 0
        try:
            t0 = time.perf_counter()
            batch = Batch(self.pool, segments, self.engine.backend.row_block)
            logits = self.engine.forward_batch(batch)
            batch.finish()
            self.step_seconds += time.perf_counter() - t0
        except Exception:                                  # a bug, not a user error: contain it
            self.failures += 1
            message = traceback.format_exc(limit=3)
            for req in reqs:
                self._finish(req, "error", f"the engine failed on this step: {message.splitlines()[-1]}")
            traceback.print_exc()
            self._publish()
            return 0
        row = 0
        for seg, req in zip(segments, reqs):
            if not seg.logits:
                continue
            self._sampled(req, logits[row])
            row += 1
        self.steps += 1
        self.rows += batch.n_rows
        self._publish()
        return batch.n_rows

    def _drop_cancelled(self):
        """Cancelled requests leave the wait queue at once (they hold no pages yet)."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.emit("done", "cancelled")

    def _admit(self):
        """Oldest first; stop at the first that cannot have its pages (no overtaking)."""
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            table = PageTable(self.pool)
            if table.admit(req.prompt, len(req.prompt) + req.max_tokens) is None:
                break
            self.waiting.popleft()
            req.table = table
            self.running.append(req)

    def _plan(self) -> tuple[list[Segment], list[Request]]:
        """Every decoding sequence's newest token, then prompt chunks within the budget."""
        segments, reqs = [], []
        for req in self.running:
            if not req.prefilling:
                segments.append(Segment(req.table, [req.generated[-1]]))
                reqs.append(req)
        budget = self.prefill_chunk
        for req in self.running:
            if budget == 0:
                break
            if req.prefilling:
                start = len(req.table)
                chunk = req.prompt[start:start + budget]
                budget -= len(chunk)
                segments.append(Segment(req.table, chunk, logits=start + len(chunk) == len(req.prompt)))
                reqs.append(req)
        return segments, reqs

    def _sampled(self, req: Request, logits: np.ndarray):
        tok = req.sampler(logits, req.prompt + req.generated)
        req.generated.append(tok)
        req.emit("token", tok)
        if tok in req.stop_ids:
            self._finish(req, "done", "stop")
        elif len(req.generated) >= req.max_tokens:
            self._finish(req, "done", "length")

    def _finish(self, req: Request, kind: str, value):
        if req.table is not None:
            req.table.release()
            req.table = None
        if req in self.running:
            self.running.remove(req)
        req.emit(kind, value)

    def _stats(self) -> dict:
        p = self.pool
        return {"kv_pages_total": p.n_pages, "kv_pages_free": p.n_free, "kv_pages_cached": p.n_cached,
                "kv_pages_shared": p.n_shared, "kv_page_size": p.page_size, "kv_pages_reserved": p.reserved,
                "running": len(self.running), "max_batch": self.max_batch, "steps": self.steps,
                "rows": self.rows, "failures": self.failures,
                "step_seconds": round(self.step_seconds, 6)}

    def _publish(self):
        with self._lock:
            self._snapshot = self._stats()
