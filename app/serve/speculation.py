"""Speculative decoding in the server's batched step: every decoding sequence may guess its
next tokens, and one step verifies all of them.

    plan      before a step (the scheduler calls it): each decoding sequence offers what prompt
              lookup finds in its own prompt and output so far (common/speculative.py: Guesser),
              or up to the most a draft model may guess, with an accept rate drawn from its
              own counts; `allot` decides how many guesses ride in this step (then a draft
              model makes them: DraftSpeculation.fill)
    run       its rows are [newest token, guesses]: every row of every sequence in the same
              compiled call (rows carry their own positions and page tables: common/batch.py),
              every row's logits back
    settle    the rule on its rows (app/serve/sequence.py: Sequence.take): the kept guesses
              and the model's own token are its new tokens, cut where its text ends; the
              positions of the rest leave its pages (PageTable.truncate) and its grammar's
              matcher (Constraint.rollback)

Two kinds of guesser (`serve --spec lookup` or `--spec draft --model-draft FILE`): prompt
lookup (`Speculation`: common/speculative.py's Guesser), whose guesses cost nothing to make,
and a draft model of the same vocabulary (`DraftSpeculation`: DraftGuesser), whose guesses cost
its own steps, batched over every guessing sequence, each with its pages in the draft model's
pool (caught up on what the target kept, rolled back past what it refused).

How many guesses, the rule (common/speculative.py: allot). Guess j of a sequence whose guesses
are kept with probability a is worth a^j tokens; every other row of the step (a decoding row's
token, a prompt row's share of the prompt) is worth one. The step takes the K most valuable
guess rows for the K that gives the most worth per unit of step time, where the time of a step
of M rows is measured on this engine (`StepTime`). Why this rule: a guess costs what its row
adds to the step, which the measurements say, not a constant. While the step reads weights and
its rows are nearly free (memory-bound: few sequences, a small batch), a likely guess is worth
more than its row costs; once the step is compute-bound, a row costs about the step's average
row, worth one token, and no guess (worth a^j < 1) pays: the rule then guesses nothing.
vLLM's n-gram proposer guesses the same k at any load, and its docs note n-gram speculation can
run slower than none at high load; TensorRT-LLM's policy drafts 5 tokens at batch <= 4, 3 up to
32 and none above, constants that fit one GPU and one model. Here the same shape comes out of
the measured step times and each sequence's own accept rate, on whatever machine runs it.

`StepTime` is the shape of t(M), the forward pass of M rows, timed once when the server starts
(`calibrate`: passes of 1..max rows, the best of three; a stage that pads rows to its row block
costs the same for every M in a block), scaled by what the steps take as they run (the machine
may be busier now), plus the rest of a step outside the forward pass (planning, sampling,
events), measured as the steps run. Without a calibration every row costs a step: nothing is
guessed.
"""

from __future__ import annotations

import time

import numpy as np

from app.measure.protocol import order
from common import speculative as sp
from common.batch import Batch, Segment, padded
from common.generate import Sampler, SamplingParams
from common.paged_kv import PagePool, PageTable

CALIBRATE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
SMOOTH = 0.1            # weight of a new step in the running figures (scale, time outside the pass)


class StepTime:
    """t(M): the ms of a step of M rows (the module docstring)."""

    def __init__(self, shape: dict | None = None, row_block: int = 1):
        self.shape = dict(shape or {})          # rows -> ms of the forward pass, as calibrated
        self.row_block = row_block
        self.scale = 1.0                        # forward passes now take scale x the calibration
        self.other_ms = 0.0                     # a step's time outside its forward pass

    @property
    def calibrated(self) -> bool:
        return len(self.shape) >= 2

    def forward_ms(self, rows: int) -> float:
        """The calibrated pass of `rows` rows (padded to the row block), interpolated between
        the row counts timed, and past the last by its slope; scaled."""
        m = padded(max(rows, 1), self.row_block)
        known = sorted(self.shape)
        lo = max([r for r in known if r <= m], default=known[0])
        hi = min([r for r in known if r >= m], default=known[-1])
        if lo == hi:
            if m <= known[-1]:
                return self.scale * self.shape[lo]
            lo, hi = known[-2], known[-1]
        t = self.shape[lo] + (self.shape[hi] - self.shape[lo]) * (m - lo) / (hi - lo)
        return self.scale * t

    def __call__(self, rows: int) -> float:
        """A step of `rows` rows: its forward pass and the rest. Uncalibrated: `rows` steps."""
        if not self.calibrated:
            return float(rows)
        return self.forward_ms(rows) + self.other_ms

    def observe(self, rows: int, forward_ms: float, step_ms: float):
        """A step ran: its rows, its forward pass's ms and its whole ms."""
        if not self.calibrated:
            return
        self.scale += SMOOTH * (forward_ms / (self.forward_ms(rows) / self.scale) - self.scale)
        self.other_ms += SMOOTH * (max(step_ms - forward_ms, 0.0) - self.other_ms)

    def calibrate(self, forward, pool, max_rows: int, rounds: int = 3):
        """Time forward(Batch) for M rows of one sequence at positions 0.., M up to max_rows
        (and what the pool can hold): `rounds` rounds over every M, in an order that alternates
        (a burst of other work falls on several M, not on one), the best of each; its pages are
        given back."""
        sizes = sorted({padded(m, self.row_block) for m in CALIBRATE_ROWS if m <= max_rows})
        while sizes and PageTable.pages_for(sizes[-1], pool.page_size) > pool.n_available:
            sizes.pop()
        table = PageTable(pool)
        if not sizes or table.admit([0], sizes[-1]) is None:
            return
        ms = dict.fromkeys(sizes, float("inf"))
        for r in range(rounds):
            for m in order(sizes, r):
                table.truncate(0)
                table.reserve_for(m)
                batch = Batch(pool, [Segment(table, [0] * m, all_logits=True)], self.row_block)
                t0 = time.perf_counter()
                forward(batch)
                ms[m] = min(ms[m], (time.perf_counter() - t0) * 1e3)
        table.release()
        top = 0.0                                    # a pass of more rows never costs less
        self.shape = {m: (top := max(top, t)) for m, t in sorted(ms.items())}
        self.scale = 1.0


class Speculation:
    """Prompt lookup for a server's decoding sequences: the guesses of each step (`plan`), the
    measured step times, and the counts of guesses made and kept (`pooled`: every sequence's,
    the prior a new sequence starts from; its `drafted` and `accepted` are /metrics' counters).
    `rule`: common/speculative.py's accept (tests plant wrong ones); `seed`: the accept-rate
    draws are reproducible."""

    def __init__(self, n_ctx: int, draft_max: int = sp.DRAFT_MAX, time: StepTime | None = None, rule=sp.accept,
                 n_max: int = sp.LOOKUP_NGRAM[1], seed: int = 0):
        self.n_ctx, self.draft_max, self.rule, self.n_max = n_ctx, draft_max, rule, n_max
        self.time = time or StepTime()
        self.pooled = sp.AcceptCounts()
        self.rng = np.random.default_rng(seed)

    def guesser(self) -> sp.Guesser:
        """One sequence's part (app/serve/sequence.py: Sequence.guesser)."""
        return sp.Guesser(self.pooled, self.n_max, self.rule)

    def plan(self, decoding: list, rows: int):
        """Set each decoding sequence's `guesses` for the next step, whose other rows number
        `rows` (the module docstring's rule)."""
        offers = []
        for seq in decoding:
            cap = min(self.draft_max, seq.ask.max_tokens - len(seq.generated) - 1, self.n_ctx - len(seq.context))
            offers.append(seq.guesser.offer(seq.context, cap, self.rng) if cap > 0 and seq.guesser else (0, 0.0))
        ks = sp.allot([(a, n) for n, a in offers], rows, self.cost(rows, sum(n > 0 for n, _ in offers)))
        self.fill(decoding, ks)

    def cost(self, rows: int, guessing: int):
        """cost(extra): a step of rows + extra rows (prompt lookup costs nothing more)."""
        return lambda extra: self.time(rows + extra)

    def fill(self, decoding: list, ks: list[int]):
        """Each sequence's guesses for the step: the first k of what it found."""
        for seq, k in zip(decoding, ks):
            seq.guesses = list(seq.guesser.found[:k]) if k else []


class DraftGuesser(sp.Guesser):
    """One sequence's guesses from a draft model (DraftSpeculation): its pages in the draft
    model's pool hold the first `valid` positions of its context (caught up before it drafts),
    then the guesses it fed; `sampler` draws sampled guesses (the sequence's temperature, top-k,
    top-p and min-p; its own random numbers) and keeps what each was drawn from, the rule's q."""

    def __init__(self, pooled: sp.AcceptCounts, rule, pool: PagePool):
        super().__init__(pooled, rule=rule)
        self.table = PageTable(pool)
        self.valid = 0
        self.sampler = None
        self.key = "model"

    def offer(self, context, k_max: int, rng) -> tuple[int, float]:
        return k_max, self.draw(rng)

    def feed(self, context) -> list:
        """The tokens the next draft step runs for it: its context past what its pages hold
        (the first step; its last guesses dropped), else its newest guess."""
        if not self.found:
            self.table.truncate(self.valid)
            return list(context[self.valid:])
        return self.found[-1:]

    def take(self, logits: np.ndarray, sequence_sampler: Sampler):
        """A guess from the draft model's row after what it fed."""
        if self.sampler is None:
            p = sequence_sampler.params
            self.sampler = Sampler(SamplingParams(temp=p.temp, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p))
            self.sampler.rng = np.random.default_rng(int(sequence_sampler.rng.integers(2**63)))
        if self.sampler.params.greedy:
            self.found.append(int(np.argmax(logits)))
            return
        ids, probs = self.sampler.distribution(logits)
        self.found.append(int(ids[self.sampler.rng.choice(len(ids), p=probs)]))
        self.q = (self.q or []) + [sp.dense_distribution(ids, probs, len(logits))]

    def verify(self, rows, guesses, sampler, history):
        kept, tok = super().verify(rows, guesses, sampler, history)
        self.valid = min(len(self.table), len(history) + kept)       # its context and the kept guesses
        self.table.truncate(self.valid)
        return kept, tok

    def release(self):
        self.table.release()
        self.valid = 0


class DraftSpeculation(Speculation):
    """A draft model's guesses for a server's decoding sequences (`serve --spec draft
    --model-draft FILE`): the same rule for how many (allot), where a step's guesses also cost
    the draft model's steps, ceil(extra rows / sequences offering) of them at `draft_time`
    (calibrated like the target's); then the draft steps run batched, every guessing sequence's
    rows in one call of the draft model per guess, over its own page pool."""

    def __init__(self, n_ctx: int, draft, pages: int, draft_max: int = sp.DRAFT_MAX, time: StepTime | None = None,
                 draft_time: StepTime | None = None, rule=sp.accept, seed: int = 0):
        super().__init__(n_ctx, draft_max, time, rule, seed=seed)
        cfg = draft.config
        self.draft = draft
        self.pool = PagePool(cfg.n_layer, cfg.kv_dim, pages, dtype=draft.backend.kv_dtype)
        self.draft_time = draft_time or StepTime(row_block=draft.backend.row_block)

    def guesser(self) -> DraftGuesser:
        return DraftGuesser(self.pooled, self.rule, self.pool)

    def cost(self, rows: int, guessing: int):
        def cost(extra: int) -> float:
            steps = -(-extra // max(guessing, 1))
            return self.time(rows + extra) + steps * (self.draft_time(guessing) if self.draft_time.calibrated else 0)
        return cost

    def fill(self, decoding: list, ks: list[int]):
        """Run the draft model for the sequences that guess: k_max steps, each a batch of every
        sequence still drafting; one whose draft pages cannot be had stops guessing there."""
        drafting = []
        for seq, k in zip(decoding, ks):
            seq.guesses, seq.guesser.found, seq.guesser.q = [], [], None
            if k:
                drafting.append((seq, k))
        for j in range(max((k for _, k in drafting), default=0)):
            rows = []
            for seq, k in drafting:
                g = seq.guesser
                if len(g.found) == j < k:
                    tokens = g.feed(seq.context)
                    if g.table.reserve_for(len(tokens)):
                        rows.append((seq, tokens))
                        g.valid = len(seq.context) if j == 0 else g.valid     # caught up once this runs
            if not rows:
                break
            t0 = time.perf_counter()
            batch = Batch(self.pool, [Segment(s.guesser.table, tokens) for s, tokens in rows],
                          self.draft.backend.row_block)
            logits = self.draft.forward_batch(batch)
            ms = (time.perf_counter() - t0) * 1e3
            self.draft_time.observe(batch.n_rows, ms, ms)
            for i, (seq, _) in enumerate(rows):
                seq.guesser.take(logits[i], seq.sampler)
        for seq, _ in drafting:
            seq.guesses = list(seq.guesser.found)
