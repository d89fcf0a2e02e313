"""Continuous batching: many requests, one engine, one forward step at a time.

One engine thread runs steps (the thread that loaded the engine: Scheduler.run says why);
between two steps requests join and leave:

    waiting (bounded, first in first out)  --admit: the pages it needs now-->  running
    running: prefilling (its context in chunks)  ->  decoding (one row per step)  ->  done
       ^                                                        |
       +---- preempted: pages freed, back to the queue's front --+

A step (common/batch.py) carries one row for every decoding sequence and, within
`prefill_chunk` rows, the next chunk of the prompts being prefilled, so a long prompt never
stalls the sequences already decoding. Each sequence's sampled token goes to its request's
`on_event` callback as it is made.

Pages follow need. A request is admitted when the pool can promise the pages its context
needs now plus HEADROOM_PAGES to grow into (less the prefix pages it finds cached), and before
every step each running sequence reserves the pages its rows of that step will write. When the
pool cannot promise them, the newest running sequence is preempted: its pages go back, and it
re-enters the queue at the front, keeping its tokens and its sampler; when it is admitted
again it recomputes its context (prompt + the tokens it generated), finding in the prefix cache
whatever full pages of it are still there. A row's numbers do not depend on how it was batched
(common/backend.py), so a resumed sequence continues with the very logits it would have had,
and its output equals its uninterrupted output. Sequences are served oldest first: the oldest
is never preempted for a newer one, and since a request is refused up front (`check`) unless
it fits the pool alone, the oldest always finishes, then the next.

Past the bounded wait queue a request is refused at once (`QueueFull`: the server's 503),
never dropped later. A request cancelled (its client went away, or a stop string matched)
gives its pages back at the next step boundary. If a step fails, the requests in it end with
an error and their pages are returned; the others carry on.

A request may ask for n choices (`submit(req, followers)`): the first computes the prompt and
the others fork its page table once the prompt is in (common/paged_kv.py: PageTable.fork), so
the prompt's pages are held once; from the first sampled token on each is a sequence of its
own. It may ask for its prompt's log-probabilities (echo): every prompt position's logits come
back, and its prompt is computed whole (no cached prefix), once.

The per-sequence step is `_rows` (which tokens a sequence feeds this step) and `_sampled`
(what it does with its logits): the two places a per-sequence policy plugs in.
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
from common.generate import (
    ContextError,
    ParameterError,
    Sampler,
    SamplingParams,
    check_fits,
    check_n_predict,
    token_logprobs,
)
from common.paged_kv import PAGE_SIZE, PagePool, PageTable

POLL_S = 0.5          # run(): how often an idle loop asks keep_going()
HEADROOM_PAGES = 1    # pages promised at admission beyond the context: room to decode into
RECENT_STEPS = 120    # rows of the last steps kept for the live view
_ids = itertools.count(1)
VIEW_ONLY = ("page_owner", "page_shared", "sequences", "recent_rows")     # view(), not stats()


class QueueFull(RuntimeError):
    """The wait queue is at its bound: try again later (HTTP 503)."""


@dataclass
class Sampled:
    """One sampled token: its id and, when asked for, the model's log-probability of it and
    the most likely tokens as (id, logprob) (common/generate.py: token_logprobs)."""
    id: int
    logprob: float | None = None
    top: list = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One generation. `on_event(kind, value)` is called from the engine thread with
    ("prompt", [None, (logprob, top), ...]) once if prompt_logprobs was asked for, ("token",
    Sampled) for each sampled token, then once ("done", "stop" | "length" | "cancelled") or
    ("error", message).

    logprobs: None, or how many alternatives each sampled token reports (0: its own only).
    prompt_logprobs: None, or the same for every prompt position (echo); with it max_tokens
    may be 0 (score the prompt, generate nothing)."""
    prompt: list
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset = frozenset()
    on_event: object = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    choice: int = 0                                 # which of the request's n choices (its random stream)
    id: int = field(default_factory=_ids.__next__)  # arrival order: the older, the higher the priority
    cancelled: bool = False
    # engine-thread state
    table: PageTable | None = None
    generated: list = field(default_factory=list)
    sampler: Sampler | None = None
    followers: list = field(default_factory=list)   # choices waiting to fork this one's prompt pages
    leader: Request | None = None
    prompt_scores: list = field(default_factory=list)
    cached_tokens: int | None = None                # prompt positions found in the prefix cache, first admission
    preemptions: int = 0
    done: bool = False
    t_submitted: float = field(default_factory=time.perf_counter)

    @property
    def context(self) -> list:
        """What the sequence's KV cache must hold to go on: its prompt and what it generated."""
        return self.prompt + self.generated

    @property
    def scoring(self) -> bool:
        """Its prompt's log-probabilities are asked for and not yet computed."""
        return self.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt)

    def emit(self, kind, value):
        if self.on_event is not None:
            self.on_event(kind, value)


class Scheduler:
    """The engine thread and its queues (see the module docstring). `observer`, if given, is
    told of every step (`step(rows)`) and preemption (`preempted()`), from the engine thread."""

    def __init__(self, engine, kv_pages: int, max_batch: int = 32, max_queue: int = 64,
                 prefill_chunk: int = 64, page_size: int = PAGE_SIZE, observer=None):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0")
        cfg = engine.config
        self.engine = engine
        self.pool = PagePool(cfg.n_layer, cfg.kv_dim, kv_pages, page_size, engine.backend.kv_dtype)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.observer = observer
        self.waiting: deque[Request] = deque()       # leaders; their followers ride with them
        self.running: list[Request] = []             # by arrival, oldest first
        self._lock = threading.Condition()
        self._stop = False
        self.recent_rows: deque[int] = deque(maxlen=RECENT_STEPS)
        self.reset_counters(publish=False)
        self._snapshot = self._stats()

    # ---- called from any thread -----------------------------------------------------------
    def check(self, n_prompt: int, max_tokens: int, score_only: bool = False):
        """Refuse, before queueing, what can never run: ParameterError, ContextError. A
        request must fit the pool alone (then, served oldest first, it always finishes).
        score_only: max_tokens may be 0 (the prompt's log-probabilities, nothing generated)."""
        if not (score_only and max_tokens == 0):
            max_tokens = check_n_predict(max_tokens)
        if n_prompt < 1:
            raise ParameterError("the prompt is empty (no tokens): give at least one token to continue from")
        check_fits(n_prompt, max_tokens, self.engine.n_ctx, self.engine.config.n_ctx_train)
        need = PageTable.pages_for(n_prompt + max_tokens, self.pool.page_size)
        if need > self.pool.n_pages:
            raise ContextError(f"{n_prompt} prompt tokens + {max_tokens} to generate need {need} KV pages of "
                               f"{self.pool.page_size} positions; the server has {self.pool.n_pages} (--kv-pages)")

    def submit(self, req: Request, followers=()):
        """Queue a request (check() it first), with the other choices of the same prompt;
        QueueFull if the wait queue cannot take them all."""
        self.check(len(req.prompt), req.max_tokens, score_only=req.prompt_logprobs is not None)
        group = [req, *followers]
        for r in group:
            if r.sampler is None:
                r.sampler = Sampler(r.params, stream=r.choice)
        with self._lock:
            self._drop_cancelled()
            if self._n_waiting() + len(group) > self._bound():
                raise QueueFull(f"{self.max_batch} requests are running and {self.max_queue} waiting "
                                f"(--max-batch, --max-queue)")
            req.followers = list(followers)
            for f in followers:
                f.leader = req
            self.waiting.append(req)
            self._lock.notify()

    def cancel(self, req: Request):
        """Stop a request (and the choices waiting to fork it); its pages are returned at the
        next step boundary."""
        with self._lock:
            req.cancelled = True
            self._lock.notify()

    def stats(self) -> dict:
        with self._lock:
            snap = {k: v for k, v in self._snapshot.items() if k not in VIEW_ONLY}
            return dict(snap, waiting=self._n_waiting())

    def view(self) -> dict:
        """stats() and the pool page by page (the live page): page_owner[p] is the id of the
        oldest sequence holding page p, 0 if free, -1 if free but holding a cached prefix;
        page_shared lists the pages more than one sequence holds; recent_rows the rows of the
        last steps; sequences the running ones."""
        with self._lock:
            return dict(self._snapshot, waiting=self._n_waiting())

    def reset_counters(self, publish: bool = True):
        self.steps = self.rows = self.failures = self.preemptions = 0
        self.generated_tokens = 0
        self.finished = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.step_seconds = 0.0
        self.recent_rows.clear()
        if publish:
            self._publish()

    # ---- the engine loop ------------------------------------------------------------------
    def run(self, keep_going=lambda: True, farewell: str = "the server is shutting down"):
        """The engine loop, in the calling thread, until stop() or until keep_going() turns
        false (asked at least every POLL_S while idle, and between steps). Call it from the
        thread that loaded and warmed the engine: numba's OpenMP layer gives each thread that
        opens parallel regions its own team of workers, libgomp counts the workers of every
        team, and once they outnumber the CPUs they stop spinning between regions and sleep
        (libgomp's do_spin), so each of a step's hundreds of regions would begin by waking a
        sleeping thread. What is still running or waiting when it returns ends with the error
        `farewell`."""
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
            self.end_all(farewell)

    def end_all(self, message: str):
        """End every running and waiting request with an error (call between steps)."""
        with self._lock:
            left = list(self.running) + list(self.waiting)
            self.waiting.clear()
        for req in left:
            self._finish(req, "error", message)
        self._publish()

    def stop(self):
        """Ask run() to return (from any thread) at the next step boundary."""
        with self._lock:
            self._stop = True
            self._lock.notify()

    def step(self) -> int:
        """Cancel, reserve (preempting if it must), admit, build one batch, run it, hand out
        the tokens. Returns the rows computed."""
        with self._lock:
            self._drop_cancelled()
        for req in [r for r in self.running if r.cancelled or (r.leader is not None and r.leader.cancelled)]:
            self._finish(req, "done", "cancelled")
        rows, budget = self._rows(self.running, self.prefill_chunk)
        plan, preempted = self._reserve(rows, may_preempt=True)
        if not preempted:                        # (a pool that just preempted admits nobody)
            with self._lock:
                admitted = self._admit()
            # admission promised their first chunk's pages: nothing to preempt for
            plan += self._reserve(self._rows(admitted, budget)[0], may_preempt=False)[0]
        segments, reqs = [], []
        for req, n in plan:
            start = len(req.table)
            end = start + n
            segments.append(Segment(req.table, req.context[start:end], logits=end == len(req.context),
                                    all_logits=req.scoring))
            reqs.append(req)
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
            n = len(seg.tokens) if seg.all_logits else int(seg.logits)
            if n:
                self._sampled(req, logits[row:row + n], len(seg.table) - len(seg.tokens))
            row += n
        self.steps += 1
        self.rows += batch.n_rows
        self.recent_rows.append(batch.n_rows)
        if self.observer is not None:
            self.observer.step(batch.n_rows)
        self._publish()
        return batch.n_rows

    # ---- the per-sequence step ----------------------------------------------------------------
    def _rows(self, reqs, budget: int) -> tuple[list[tuple[Request, int]], int]:
        """[(request, how many of its context's tokens it feeds this step)]: every decoding
        sequence its newest token, then prompt (or recomputed context) chunks within budget;
        and what is left of the budget."""
        decoding, chunks = [], []
        for req in reqs:
            if req.table is None:                        # a choice waiting for its leader's prompt
                continue
            pending = len(req.context) - len(req.table)
            if pending == 1 and not req.scoring:
                decoding.append((req, 1))
            elif pending > 0 and budget > 0:
                n = min(pending, budget)
                budget -= n
                chunks.append((req, n))
        return decoding + chunks, budget

    def _reserve(self, rows, may_preempt: bool) -> tuple[list[tuple[Request, int]], bool]:
        """Each sequence's pages for its rows, oldest first; where the pool cannot promise
        them, preempt the newest running sequence (it may be this one: no older one is ever
        preempted for it) and try again. The rows that got their pages, and whether anything
        was preempted."""
        out, preempted = [], False
        for req, n in sorted(rows, key=lambda rn: rn[0].id):
            while req.table is not None and not req.table.reserve_for(n) and may_preempt:
                self._preempt(max((r for r in self.running if r.table is not None), key=lambda r: r.id))
                preempted = True
            if req.table is not None and req.table.reserve_for(n):
                out.append((req, n))
        return out, preempted

    def _sampled(self, req: Request, logits: np.ndarray, start: int):
        """A step's logits for req: rows for positions start.. (every row of a scored chunk,
        else the last). Scores the prompt positions, samples the next token when the context
        is complete, forks the choices waiting for this prompt."""
        if req.scoring:
            scores = req.prompt_scores
            if not scores:
                scores.append(None)                              # the first token has nothing before it
            for i, pos in enumerate(range(start, start + len(logits))):
                # entry j scores prompt token j, from position j - 1's logits; a chunk computed
                # again after a preemption adds nothing twice
                if pos + 1 == len(scores) and pos + 1 < len(req.prompt):
                    scores.append(token_logprobs(logits[i], req.prompt[pos + 1], req.prompt_logprobs))
            if start + len(logits) < len(req.prompt):
                return
            req.emit("prompt", scores)
            if req.max_tokens == 0:
                for f in req.followers:
                    self._finish(f, "done", "length")
                self._finish(req, "done", "length")
                return
        last = logits[-1]
        followers = [f for f in req.followers if not f.done]
        req.followers = []
        for f in followers:                                      # the other choices: this prompt's pages
            f.leader, f.table = None, req.table.fork()
        self._draw(req, last)
        for f in followers:
            self._draw(f, last)

    def _draw(self, req: Request, logits: np.ndarray):
        tok = req.sampler(logits, req.context)
        lp = token_logprobs(logits, tok, req.logprobs) if req.logprobs is not None else (None, [])
        req.generated.append(tok)
        self.generated_tokens += 1
        req.emit("token", Sampled(tok, *lp))
        if tok in req.stop_ids:
            self._finish(req, "done", "stop")
        elif len(req.generated) >= req.max_tokens:
            self._finish(req, "done", "length")

    # ---- queues ---------------------------------------------------------------------------
    def _bound(self) -> int:
        """How many may wait: max_queue, and the places free in the running set (taken at the
        next step boundary: requests headed for them are not queued)."""
        return self.max_queue + max(0, self.max_batch - len(self.running))

    def _n_waiting(self) -> int:
        return sum(1 + len(r.followers) for r in self.waiting)

    def _drop_cancelled(self):
        """Cancelled requests leave the wait queue at once (they hold no pages)."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            for r in (req, *req.followers):
                self._count("cancelled")
                r.emit("done", "cancelled")

    def _admit(self) -> list[Request]:
        """Oldest first; stop at the first that cannot have its pages (no overtaking). A
        request's choices are admitted with it, each promised a page to copy its shared last
        page into."""
        admitted = []
        while self.waiting:
            req = self.waiting[0]
            group = [req, *req.followers]
            if len(self.running) + len(group) > self.max_batch:
                break
            table = PageTable(self.pool)
            room = min(len(req.context) + HEADROOM_PAGES * self.pool.page_size,
                       len(req.prompt) + max(req.max_tokens, 1))
            n_cached = table.admit(req.context, room, use_cache=not req.scoring, spare=len(req.followers))
            if n_cached is None:
                break
            self.waiting.popleft()
            req.table = table
            if req.cached_tokens is None:
                req.cached_tokens = min(n_cached, len(req.prompt))
            self.running.extend(group)
            admitted.extend(group)
        self.running.sort(key=lambda r: r.id)
        return admitted

    def _preempt(self, req: Request):
        """Free req's pages and put it (with the choices still waiting to fork it) back at the
        front of the queue; it keeps its tokens and its sampler."""
        req.table.release()
        req.table = None
        for r in (req, *req.followers):
            self.running.remove(r)
        req.preemptions += 1
        self.preemptions += 1
        if self.observer is not None:
            self.observer.preempted()
        with self._lock:
            # the queue stays in arrival order: a preempted request goes before every newer one
            i = next((i for i, w in enumerate(self.waiting) if w.id > req.id), len(self.waiting))
            self.waiting.insert(i, req)

    def _finish(self, req: Request, kind: str, value):
        if req.done:
            return
        req.done = True
        if req.table is not None:
            req.table.release()
            req.table = None
        if req in self.running:
            self.running.remove(req)
        for f in req.followers:                     # choices that never forked end with it
            self._finish(f, kind, value)
        req.followers = []
        self._count(value if kind == "done" else "error")
        req.emit(kind, value)

    def _count(self, outcome: str):
        self.finished[outcome] = self.finished.get(outcome, 0) + 1

    # ---- what the outside sees ------------------------------------------------------------
    def _stats(self) -> dict:
        p = self.pool
        owner = np.zeros(p.n_pages, dtype=np.int64)
        owner[p.idle_cached_pages()] = -1
        for req in reversed(self.running):           # the oldest holder wins
            if req.table is not None:
                owner[req.table.pages] = req.id
        return {"kv_pages_total": p.n_pages, "kv_pages_free": p.n_free, "kv_pages_cached": p.n_cached,
                "kv_pages_shared": p.n_shared, "kv_page_size": p.page_size, "kv_pages_reserved": p.reserved,
                "running": len(self.running), "max_batch": self.max_batch, "steps": self.steps,
                "rows": self.rows, "failures": self.failures, "preemptions": self.preemptions,
                "generated_tokens": self.generated_tokens, "finished": dict(self.finished),
                "step_seconds": round(self.step_seconds, 6),
                "recent_rows": list(self.recent_rows), "page_owner": owner.tolist(),
                "page_shared": np.flatnonzero(p.refs > 1).tolist(),
                "sequences": [{"id": r.id, "tokens": len(r.context), "pages": len(r.table.pages) if r.table else 0,
                               "preemptions": r.preemptions} for r in self.running]}

    def _publish(self):
        snap = self._stats()
        with self._lock:
            self._snapshot = snap
