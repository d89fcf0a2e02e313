"""Continuous batching's decisions: who waits, who runs, and what each runs in the next step.

    waiting (bounded, first in first out)  --admit: the pages it needs now-->  running
    running: prefilling (its context in chunks)  ->  decoding (one row per step)  ->  done
       ^                                                        |
       +---- preempted: pages freed, back to the queue's front --+

`schedule()` plans one step: a row for every decoding sequence and, within `prefill_chunk`
rows, the next chunk of the prompts being prefilled, so a long prompt never stalls the
sequences already decoding. With speculative decoding (`speculation`, app/serve/speculation.py)
a decoding sequence may add rows of guesses, as many as the measured step times say pay, decided
once every other row of the step is known (the chunks of the prompts admitted in it too);
guesses never take a page another sequence needs (planned after admission, from the pages left;
without them they are dropped, never a reason to preempt). It runs nothing: the engine loop
(app/serve/engine_loop.py) runs the plan, hands out the tokens, and calls `release` for the
sequences that end. Nothing here knows of threads, locks or HTTP; the engine loop holds its
lock while it calls in.

Pages follow need. A sequence is admitted when the pool can promise the pages its context
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
never dropped later. The n choices of one request wait and are admitted together: the first
(the leader) computes the prompt, the others (its followers) fork its page table once the
prompt is in (app/serve/sequence.py: Sequence.fork), so the prompt's pages are held once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from app.serve.sequence import Sequence
from common.generate import ContextError, ParameterError, check_fits, check_n_predict
from common.paged_kv import PagePool, PageTable

HEADROOM_PAGES = 1    # pages promised at admission beyond the context: room to decode into


class QueueFull(RuntimeError):
    """The wait queue is at its bound: try again later (HTTP 503)."""


@dataclass
class Plan:
    """One step: rows [(sequence, how many of its tokens it feeds)], every one with its pages
    reserved, and the sequences preempted to make room."""
    rows: list = field(default_factory=list)
    preempted: list = field(default_factory=list)


class Scheduler:
    """The wait queue, the running set and the page policy over one PagePool."""

    def __init__(self, pool: PagePool, n_ctx: int, n_ctx_train: int, max_batch: int = 32, max_queue: int = 64,
                 prefill_chunk: int = 64):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0")
        self.pool, self.n_ctx, self.n_ctx_train = pool, n_ctx, n_ctx_train
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Sequence] = deque()      # leaders; their followers ride with them
        self.running: list[Sequence] = []            # by arrival, oldest first
        self.speculation = None                      # app/serve/speculation.py: who guesses what, if on

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- entering ---------------------------------------------------------------------------
    def check(self, n_prompt: int, max_tokens: int, score_only: bool = False):
        """Refuse, before queueing, what can never run: ParameterError, ContextError. A
        request must fit the pool alone (then, served oldest first, it always finishes).
        score_only: max_tokens may be 0 (the prompt's log-probabilities, nothing generated)."""
        if not (score_only and max_tokens == 0):
            max_tokens = check_n_predict(max_tokens)
        if n_prompt < 1:
            raise ParameterError("the prompt is empty (no tokens): give at least one token to continue from")
        check_fits(n_prompt, max_tokens, self.n_ctx, self.n_ctx_train)
        need = PageTable.pages_for(n_prompt + max_tokens, self.pool.page_size)
        if need > self.pool.n_pages:
            raise ContextError(f"{n_prompt} prompt tokens + {max_tokens} to generate need {need} KV pages of "
                               f"{self.pool.page_size} positions; the server has {self.pool.n_pages} (--kv-pages)")

    def add(self, seq: Sequence, followers=()):
        """Queue a sequence with the other choices of its prompt (check() it first);
        QueueFull if the wait queue cannot take them all."""
        group = [seq, *followers]
        if self.n_waiting() + len(group) > self._bound():
            raise QueueFull(f"{self.max_batch} requests are running and {self.max_queue} waiting "
                            f"(--max-batch, --max-queue)")
        seq.followers = list(followers)
        for f in followers:
            f.leader = seq
        self.waiting.append(seq)

    def n_waiting(self) -> int:
        return sum(1 + len(s.followers) for s in self.waiting)

    def _bound(self) -> int:
        """How many may wait: max_queue, and the places free in the running set (taken at the
        next step boundary: requests headed for them are not queued)."""
        return self.max_queue + max(0, self.max_batch - len(self.running))

    # ---- leaving ----------------------------------------------------------------------------
    def drop_cancelled(self) -> list[Sequence]:
        """Cancelled sequences leave the wait queue at once (they hold no pages): the ones
        dropped, each with its followers."""
        dropped = []
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            dropped += [seq, *seq.followers]
        return dropped

    def release(self, seq: Sequence):
        """seq has ended: its pages go back (a draft model's too), it leaves the running set."""
        if seq.table is not None:
            seq.table.release()
            seq.table = None
        if seq.guesser is not None:
            seq.guesser.release()
        if seq in self.running:
            self.running.remove(seq)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> Plan:
        """Reserve the running sequences' rows (preempting if it must), then admit what fits
        and give the newcomers what is left of the prefill budget; then the guesses (_guess). A
        pool that just preempted admits nobody."""
        rows, budget = self._rows(self.running, self.prefill_chunk)
        planned, preempted = self._reserve(rows, may_preempt=True)
        if not preempted:
            admitted = self._admit()
            # admission promised their first chunk's pages: nothing to preempt for
            planned += self._reserve(self._rows(admitted, budget)[0], may_preempt=False)[0]
        return Plan(self._guess(planned), preempted)

    def _rows(self, seqs, budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        """[(sequence, how many rows it feeds this step)]: every decoding sequence one, then
        prompt (or recomputed context) chunks within budget; and what is left of the budget."""
        decoding, chunks = [], []
        for seq in seqs:
            if seq.table is None:                        # a choice waiting for its leader's prompt
                continue
            pending = seq.pending
            if self._decoding(seq):
                decoding.append((seq, 1))
            elif pending > 0 and budget > 0:
                n = min(pending, budget)
                budget -= n
                chunks.append((seq, n))
        return decoding + chunks, budget

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        """Its context is in its pages but its newest token: it feeds that one."""
        return seq.pending == 1 and not seq.scoring

    def _guess(self, planned: list) -> list[tuple[Sequence, int]]:
        """The step's guesses (speculative decoding): the planner told of every row of the step,
        then each decoding sequence's guess rows reserved, or its guesses dropped where the pool
        cannot promise their pages (never a reason to preempt)."""
        decoding = [seq for seq, _ in planned if self._decoding(seq)]
        if self.speculation is None or not decoding:
            return planned
        self.speculation.plan(decoding, sum(n for _, n in planned))
        out = []
        for seq, n in planned:
            if seq.guesses and not seq.table.reserve_for(seq.decode_rows()):
                seq.guesses = []                         # guesses never cost another sequence its pages
            out.append((seq, seq.decode_rows() if self._decoding(seq) else n))
        return out

    def _reserve(self, rows, may_preempt: bool) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Each sequence's pages for its rows, oldest first; where the pool cannot promise
        them, preempt the newest running sequence (it may be this one: no older one is ever
        preempted for it) and try again. The rows that got their pages, and the preempted."""
        out, preempted = [], []
        for seq, n in sorted(rows, key=lambda rn: rn[0].id):
            ok = seq.table is not None and seq.table.reserve_for(n)
            while not ok and may_preempt and seq.table is not None:
                newest = max((s for s in self.running if s.table is not None), key=lambda s: s.id)
                self._preempt(newest)
                preempted.append(newest)
                ok = seq.table is not None and seq.table.reserve_for(n)
            if ok:
                out.append((seq, n))
        return out, preempted

    def _admit(self) -> list[Sequence]:
        """Oldest first; stop at the first that cannot have its pages (no overtaking). A
        sequence's followers are admitted with it, each promised a page to copy its shared
        last page into."""
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            group = [seq, *seq.followers]
            if len(self.running) + len(group) > self.max_batch:
                break
            table = PageTable(self.pool)
            room = min(len(seq.context) + HEADROOM_PAGES * self.pool.page_size,
                       len(seq.ask.prompt) + max(seq.ask.max_tokens, 1))
            n_cached = table.admit(seq.context, room, use_cache=not seq.scoring, spare=len(seq.followers))
            if n_cached is None:
                break
            self.waiting.popleft()
            seq.table = table
            if seq.cached_tokens is None:
                seq.cached_tokens = min(n_cached, len(seq.ask.prompt))
            self.running.extend(group)
            admitted.extend(group)
        if admitted:                                     # (one preempted before is older than some running)
            self.running.sort(key=lambda s: s.id)
        return admitted

    def _preempt(self, seq: Sequence):
        """Free seq's pages and put it (with the choices still waiting to fork it) back in the
        queue, before every newer one; it keeps its tokens and its sampler."""
        seq.table.release()
        seq.table, seq.guesses = None, []
        if seq.guesser is not None:
            seq.guesser.release()
        for s in (seq, *seq.followers):
            self.running.remove(s)
        seq.preemptions += 1
        i = next((i for i, w in enumerate(self.waiting) if w.id > seq.id), len(self.waiting))
        self.waiting.insert(i, seq)
