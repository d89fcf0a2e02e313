"""The engine loop: one thread runs the steps the scheduler plans; between two steps
sequences join and leave.

    step:  end the cancelled -> plan (app/serve/scheduler.py) -> build the batch
           (common/batch.py) -> run it (`forward`) -> the grammars' masks of the rows that
           draw, all at once (`_fill_masks`) -> settle each sequence's logits: score its
           prompt (echo), fork its choices, take its next tokens (one drawn, or with
           speculative decoding the guesses kept and one more: app/serve/speculation.py)
           -> register the pages the step filled -> end the sequences that ended

A sequence under a grammar carries its matcher in its sampler (common/constrain/: Constraint);
the masks of a step's constrained rows are computed together, on llguidance's threads, before
any row draws (with guesses, the mask of its first row: those after a kept guess follow as the
rule walks them); a step without a constrained row does none of it.

The loop owns what is shared between threads: its lock (a Condition), held whenever the
scheduler's queues change, so another thread may submit, cancel and read the counters at any
moment; and a snapshot of the state (`stats`, `view`), published after every step, so a
reader never waits for a step. Each sequence's events go to its `on_event` callback from the
engine thread, as they happen.

A request cancelled (its client went away, or a stop string matched) gives its pages back at
the next step boundary. If a step fails, the sequences in it end with an error and their pages
are returned; the others carry on.

`forward` is the one call that runs a batch (engine.forward_batch by default): give the loop
one that first hands the batch to other workers, and the rest of the loop is unchanged.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque

import numpy as np

from app.serve.scheduler import Scheduler
from app.serve.sequence import Sequence
from common.batch import Batch
from common.constrain import fill_masks
from common.paged_kv import PAGE_SIZE, PagePool

POLL_S = 0.5          # run(): how often an idle loop asks keep_going()
RECENT_STEPS = 120    # rows of the last steps kept for the live view
RAW = "raw"           # a snapshot's copies of the page state (_capture), read by _readable only


class EngineLoop:
    """The engine, its page pool and scheduler, and the thread that runs them (see the module
    docstring). `observer`, if given, is told of every step (`step(rows)`) and preemption
    (`preempted()`), from the engine thread. `scheduler`: the Scheduler class (tests plant
    bugs in a subclass). `forward`: what runs a Batch and returns its logits rows (default:
    engine.forward_batch). `speculation`: common/speculative.py's Speculation (built by
    app/serve/speculation.py), or None (off)."""

    def __init__(self, engine, kv_pages: int, max_batch: int = 32, max_queue: int = 64, prefill_chunk: int = 64,
                 page_size: int = PAGE_SIZE, observer=None, scheduler=Scheduler, forward=None, speculation=None):
        cfg = engine.config
        self.engine = engine
        self.pool = PagePool(cfg.n_layer, engine.backend.kv_width(cfg), kv_pages, page_size, engine.backend.kv_dtype)
        self.scheduler = scheduler(self.pool, engine.n_ctx, cfg.n_ctx_train, max_batch=max_batch,
                                   max_queue=max_queue, prefill_chunk=prefill_chunk)
        self.forward = forward or engine.forward_batch
        self.observer = observer
        self.speculation = self.scheduler.speculation = speculation
        self.lock = threading.Condition()
        self._stop = False
        self.recent_rows: deque[int] = deque(maxlen=RECENT_STEPS)
        self.reset_counters(publish=False)
        self._snapshot = self._capture()

    # ---- called from any thread -----------------------------------------------------------
    def submit(self, seq: Sequence, followers=()):
        """Queue a sequence with the other choices of its prompt: ParameterError, ContextError
        (Scheduler.check), QueueFull."""
        ask = seq.ask
        self.scheduler.check(len(ask.prompt), ask.max_tokens, score_only=ask.prompt_logprobs is not None)
        if self.speculation is not None:
            for s in (seq, *followers):
                s.guesser = self.speculation.guesser()
        with self.lock:
            self._end_cancelled_waiting()
            self.scheduler.add(seq, followers)
            self.lock.notify_all()

    def cancel(self, seq: Sequence):
        """Stop a sequence (and the choices waiting to fork it); its pages are returned at the
        next step boundary."""
        with self.lock:
            seq.cancelled = True
            self.lock.notify_all()

    def stats(self) -> dict:
        with self.lock:
            return self._readable(self._snapshot, view=False)

    def view(self) -> dict:
        """stats() and the pool page by page (the live page): page_owner[p] is the id of the
        oldest sequence holding page p, 0 if free, -1 if free but holding a cached prefix;
        page_shared lists the pages more than one sequence holds; recent_rows the rows of the
        last steps; sequences the running ones."""
        with self.lock:
            return self._readable(self._snapshot, view=True)

    def wait_for(self, predicate, timeout: float | None = None) -> bool:
        """Block until predicate(view()) holds, checked at every published step, submission and
        cancellation; False if `timeout` seconds pass first."""
        with self.lock:
            return self.lock.wait_for(lambda: predicate(self.view()), timeout)

    def stop(self):
        """Ask run() to return (from any thread) at the next step boundary."""
        with self.lock:
            self._stop = True
            self.lock.notify_all()

    def reset_counters(self, publish: bool = True):
        self.steps = self.rows = self.failures = self.preemptions = 0
        self.generated_tokens = 0
        self.finished = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.step_seconds = 0.0
        self.recent_rows.clear()
        if self.speculation is not None:
            self.speculation.pooled.drafted = self.speculation.pooled.accepted = 0
        if publish:
            self._publish()

    # ---- the engine thread ----------------------------------------------------------------
    def run(self, keep_going=lambda: True, farewell: str = "the server is shutting down"):
        """The engine loop, in the calling thread, until stop() or until keep_going() turns
        false (asked between steps, and at least every POLL_S while idle; never with the lock
        held). Call it from the thread that loaded and warmed the engine: numba's OpenMP layer
        gives each thread that opens parallel regions its own team of workers, libgomp counts
        the workers of every team, and once they outnumber the CPUs they stop spinning between
        regions and sleep (libgomp's do_spin), so each of a step's hundreds of regions would
        begin by waking a sleeping thread. What is still running or waiting when it returns
        ends with the error `farewell`."""
        try:
            while not self._stop and keep_going():
                with self.lock:
                    if self.scheduler.idle and not self._stop:
                        self.lock.wait(POLL_S)
                    if self.scheduler.idle or self._stop:
                        continue
                try:
                    self.step()
                except Exception:                          # a bug outside the forward pass: the
                    traceback.print_exc()                  # sequences it touched end, the loop lives
                    self.failures += 1
                    for seq in list(self.scheduler.running):
                        self._finish(seq, "error", "the engine failed; this request was ended")
                    self._publish()
        finally:                                           # stopped, or interrupted (Ctrl-C)
            self.end_all(farewell)

    def end_all(self, message: str):
        """End every running and waiting sequence with an error (call between steps)."""
        with self.lock:
            left = list(self.scheduler.running) + list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
        for seq in left:
            self._finish(seq, "error", message)
        self._publish()

    def step(self) -> int:
        """End the cancelled, plan, run the batch, hand out the tokens. Returns the rows computed."""
        t_step = time.perf_counter()
        with self.lock:
            self._end_cancelled_waiting()
            for seq in [s for s in self.scheduler.running if s.cancelled or (s.leader and s.leader.cancelled)]:
                self._finish(seq, "done", "cancelled")
            plan = self.scheduler.schedule()
        for _ in plan.preempted:
            self.preemptions += 1
            if self.observer is not None:
                self.observer.preempted()
        segments = [seq.segment(n) for seq, n in plan.rows]
        if not segments:
            self._publish()
            return 0
        try:
            t0 = time.perf_counter()
            batch = Batch(self.pool, segments, self.engine.backend.row_block)
            logits = self.forward(batch)
            forward_s = time.perf_counter() - t0
        except Exception:                                  # a bug, not a user error: contain it
            self.failures += 1
            message = traceback.format_exc(limit=3).splitlines()[-1]
            for seq, _ in plan.rows:
                self._finish(seq, "error", f"the engine failed on this step: {message}")
            traceback.print_exc()
            self._publish()
            return 0
        guessed = self._guess_counts()
        self._fill_masks(segments, plan.rows)
        ended, row = [], 0
        for seg, (seq, _) in zip(segments, plan.rows):
            n = len(seg.tokens) if seg.all_logits else int(seg.logits)
            if n:
                ended += self._settle(seq, logits[row:row + n], len(seg.table) - len(seg.tokens), seg.logits)
            row += n
        batch.finish()              # after the refused guesses left the pages: none of them is registered
        for seq, reason in ended:
            self._finish(seq, "done", reason)
        self.step_seconds += forward_s
        self.steps += 1
        self.rows += batch.n_rows
        self.recent_rows.append(batch.n_rows)
        if self.observer is not None:
            self.observer.step(batch.n_rows)
        self._observe_guesses(guessed, batch.n_rows, forward_s, time.perf_counter() - t_step)
        self._publish()
        return batch.n_rows

    def _guess_counts(self) -> tuple[int, int]:
        """Guesses made and emitted so far (speculative decoding's counters; (0, 0) when off)."""
        pooled = self.speculation.pooled if self.speculation is not None else None
        return (pooled.drafted, pooled.accepted) if pooled is not None else (0, 0)

    def _observe_guesses(self, before: tuple[int, int], rows: int, forward_s: float, step_s: float):
        """Speculative decoding's part of a step: its time (StepTime) and its guesses, to /metrics."""
        if self.speculation is None:
            return
        self.speculation.time.observe(rows, forward_s * 1e3, step_s * 1e3)
        drafted, accepted = self._guess_counts()
        if self.observer is not None and drafted > before[0]:
            self.observer.guessed(drafted - before[0], accepted - before[1])

    @staticmethod
    def _fill_masks(segments, rows):
        """The masks of the constrained sequences about to draw (their context complete), in one
        call (fill_masks); nothing when none is constrained."""
        constraints = [seq.sampler.constraint for seg, (seq, _) in zip(segments, rows)
                       if seg.logits and seq.sampler.constraint is not None]
        if constraints:
            fill_masks(constraints)

    def _settle(self, seq: Sequence, logits: np.ndarray, start: int, complete: bool) -> list:
        """A step's logits for seq: rows for positions start.. (every row of a scored chunk or
        of guesses, else the last). Scores the prompt (echo), sent once every position is; once
        the context is complete (`complete`: the last row is its end), its waiting choices fork
        it and each takes its next tokens (Sequence.take). Returns [(sequence, reason)] for
        those that ended (ended by the caller once the step's pages are registered)."""
        if seq.scoring and seq.score(logits, start):
            seq.emit("prompt", seq.prompt_scores)
            if seq.ask.max_tokens == 0:                  # the prompt's scores were all it asked for
                return [(seq, "length")]
        if not complete:
            return []
        ended = []
        for s in (seq, *seq.fork()):
            for sampled in s.take(logits):
                s.emit("token", sampled)
                self.generated_tokens += 1
            reason = s.end_reason()
            if reason is not None:
                ended.append((s, reason))
        return ended

    def _end_cancelled_waiting(self):
        for seq in self.scheduler.drop_cancelled():
            seq.done = True
            self._count("cancelled")
            seq.emit("done", "cancelled")

    def _finish(self, seq: Sequence, kind: str, value):
        """End seq (and the choices that never forked it) with ("done", reason) or ("error",
        message): its pages go back, its end is counted and sent."""
        if seq.done:
            return
        seq.done = True
        with self.lock:
            self.scheduler.release(seq)
        for f in seq.followers:
            self._finish(f, kind, value)
        seq.followers = []
        self._count(value if kind == "done" else "error")
        seq.emit(kind, value)

    def _count(self, outcome: str):
        self.finished[outcome] = self.finished.get(outcome, 0) + 1

    # ---- what the outside sees ------------------------------------------------------------
    def _capture(self) -> dict:
        """The state as readers see it until the next step, taken on the engine thread: the
        counters, and the pool's page state as copies of what it is made of (the page view is
        made from them by _readable, on the reader's thread, when one is asked for: a step pays
        for a few copies, not for a view of every page)."""
        p = self.pool
        drafted, accepted = self._guess_counts()
        return {"kv_pages_total": p.n_pages, "kv_pages_free": p.n_free, "kv_pages_cached": p.n_cached,
                "kv_page_size": p.page_size, "kv_pages_reserved": p.reserved,
                "running": len(self.scheduler.running), "max_batch": self.scheduler.max_batch, "steps": self.steps,
                "rows": self.rows, "failures": self.failures, "preemptions": self.preemptions,
                "generated_tokens": self.generated_tokens, "finished": dict(self.finished),
                "spec": self.speculation is not None, "drafted": drafted, "accepted": accepted,
                "step_seconds": round(self.step_seconds, 6),
                RAW: (p.refs.copy(), p.idle_cached_pages(), list(self.recent_rows),
                      [(s.id, len(s.ask.prompt) + len(s.generated), list(s.table.pages) if s.table else [],
                        s.preemptions) for s in self.scheduler.running])}

    def _readable(self, snap: dict, view: bool) -> dict:
        """stats() (view=False) or view() from a snapshot (_capture); called with the lock held."""
        refs, idle, recent, running = snap[RAW]
        out = {k: v for k, v in snap.items() if k != RAW}
        out.update(kv_pages_shared=int((refs > 1).sum()), waiting=self.scheduler.n_waiting())
        if view:
            owner = np.zeros(len(refs), dtype=np.int64)
            owner[idle] = -1
            for sid, _, pages, _ in reversed(running):      # the oldest holder wins
                owner[pages] = sid
            out.update(page_owner=owner.tolist(), page_shared=np.flatnonzero(refs > 1).tolist(), recent_rows=recent,
                       sequences=[{"id": sid, "tokens": n, "pages": len(pages), "preemptions": k}
                                  for sid, n, pages, k in running])
        return out

    def _publish(self):
        snap = self._capture()
        with self.lock:
            self._snapshot = snap
            self.lock.notify_all()
