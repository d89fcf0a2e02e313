"""Chapter 14 · batching: write the scheduler's admit-or-preempt decision.

Run the check:   make exercise ch=14
(or: .venv/bin/python -m exercises.check 14)

A server runs one step for every sequence at once, and the KV pages those sequences hold are
few: a sequence gets pages as it needs them, not its worst case up front. So before every step
the scheduler decides, oldest sequence first, who may grow (and whom to preempt when the pool
cannot promise the pages), then who of the waiting may come in. Your two decisions are driven
through the same traffic as the server's own scheduler (app/serve/scheduler.py), step by step,
and every step's plan must be the same: the same rows, the same preemptions, the same queue.
Then the steps your scheduler needs to serve a burst of requests, beside one at a time.
"""

from app.serve.scheduler import HEADROOM_PAGES, Scheduler  # noqa: F401  (HEADROOM_PAGES: for your code)
from common.paged_kv import PageTable  # noqa: F401  (for your code)


class AdmitOrPreempt(Scheduler):
    """The server's scheduler with its two decisions left to you. Everything else is the
    server's: schedule() calls _reserve(rows, may_preempt=True) for the running sequences, then,
    if nobody was preempted, _admit() and _reserve(...) for the newcomers' first rows.

    What you may use (app/serve/scheduler.py, common/paged_kv.py):
        self.running          the running sequences, oldest first (seq.id: the arrival order)
        self.waiting          a deque of waiting sequences, oldest (or preempted) first
        self.max_batch        the most sequences that may run at once
        self.pool             the page pool; self.pool.page_size positions per page
        seq.table             its PageTable, or None while it waits
        seq.table.reserve_for(n)     True if the pool promises the pages n more positions need
                                     (and reserves them), False (nothing reserved) if it cannot
        self._preempt(seq)    gives seq's pages back and puts it in the queue before every newer one
        PageTable(self.pool).admit(seq.context, room)   takes the pages a newcomer needs for
                                     `room` positions: the number of its positions already cached,
                                     or None (nothing taken) if the pool cannot promise them
    """

    def _reserve(self, rows, may_preempt):
        """rows: [(sequence, rows it feeds this step)]. Returns (planned, preempted): the rows
        whose pages are reserved, and the sequences preempted to make room.

        What to write: go through rows OLDEST FIRST (sorted by seq.id). For each, reserve its
        pages (seq.table.reserve_for(n)). While that fails and may_preempt, preempt the NEWEST
        running sequence that holds pages (the largest id among self.running with a table),
        record it, and try again; it may be this very sequence, which then has no table and
        drops out of the plan. A sequence whose pages are reserved goes into `planned`.

        The edge: a sequence preempted after it was planned (an older one needed its pages)
        must not stay in `planned`: it holds no pages any more.

        Why oldest first and newest preempted: the oldest then always finishes (a request is
        refused up front unless it fits the pool alone), so the server never deadlocks with every
        sequence half done and no pages left; and nobody is preempted for a newer one.

        Hint: notebooks/14_batching.ipynb, "When the pages run out: preemption". Try it before you
        read app/serve/scheduler.py (Scheduler._reserve and _admit).
        """
        raise NotImplementedError("write the reservation, preempting the newest when the pool is short")

    def _admit(self):
        """Admit waiting sequences, oldest first; returns the admitted ones.

        What to write: while someone waits: the first in the queue (self.waiting[0]) and its
        followers (seq.followers: the other choices of its request; they come in with it) may
        enter only if the running set has places for all of them (self.max_batch). Give it a
        PageTable and ask for room for its context plus HEADROOM_PAGES pages to grow into,
        but never more than it can ever need:
            room = min(len(seq.context) + HEADROOM_PAGES * self.pool.page_size,
                       len(seq.ask.prompt) + max(seq.ask.max_tokens, 1))
            n_cached = table.admit(seq.context, room, use_cache=not seq.scoring,
                                   spare=len(seq.followers))
        If that is None, STOP: nobody behind it overtakes it. Else take it off the queue, set
        seq.table = table (and seq.cached_tokens = min(n_cached, len(seq.ask.prompt)) if it is
        still None), and add it and its followers to self.running. At the end keep
        self.running sorted by id.

        Why: first in, first out with no overtaking: a long request is not starved by a stream
        of short ones slipping past it.
        """
        raise NotImplementedError("write the admission: oldest first, stop at the first that does not fit")
