"""One sequence: one choice of one request, from the wait queue to its last token.

A request asks for n choices of one prompt; each is a Sequence. Its state, in three parts:

    what it asks      `ask` (Ask): prompt, max_tokens, sampler settings, end-of-generation ids,
                      which log-probabilities; fixed once submitted
    what it has made  `generated`, its `sampler` (random state, what it drew), its prompt's
                      log-probabilities (`prompt_scores`, when echo asks for them)
    where it lives    `table`, its KV pages (None while it waits, or was preempted); `leader`
                      and `followers`, the choices that share its prompt's pages

Its lifetime: waiting -> running (prefilling its context in chunks, then decoding a row per
step) -> done; a preempted sequence gives its pages back, keeps what it made and waits again.
The engine loop (app/serve/engine_loop.py) moves it along; the scheduler
(app/serve/scheduler.py) decides when.

A few small methods make one step of a sequence; they are where a per-sequence policy plugs in:

    decode_rows   how many rows a decoding sequence feeds in a step (1: its newest token;
                  with speculative decoding, its newest token and the `guesses` the step's plan
                  gave it: app/serve/speculation.py)
    segment       the tokens of those rows and which logits come back (all of them to verify
                  guesses)
    draw          its next token from its row's logits, by its `sampler` (a constrained
                  sequence's sampler carries the grammar's token mask, first in its chain)
    take          its new tokens from its rows: a draw, or the guesses the rule keeps and the
                  model's own token, cut where its text ends; the positions of the rest leave its
                  pages (PageTable.truncate) and its grammar (the sampler's constraint)
    fork          a choice takes its leader's prompt pages (and whatever else a choice copies
                  from its leader, such as a fork of its constraint's state)

A preempted sequence keeps `generated` and its sampler, so whatever follows from its tokens
(a constraint's state too) stays where it was, or can be rebuilt from `context`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from common.batch import Segment
from common.generate import Sampler, SamplingParams, standing, token_logprobs
from common.paged_kv import PageTable

_ids = itertools.count(1)


@dataclass
class Sampled:
    """One sampled token: its id and, when asked for, the model's log-probability of it and
    the most likely tokens as (id, logprob) (common/generate.py: token_logprobs)."""
    id: int
    logprob: float | None = None
    top: list = field(default_factory=list)


@dataclass(frozen=True)
class Ask:
    """What one choice asks for. logprobs: None, or how many alternatives each sampled token
    reports (0: its own only). prompt_logprobs: None, or the same for every prompt position
    (echo); with it max_tokens may be 0 (score the prompt, generate nothing). choice: which of
    the request's n choices (its sampler's random stream)."""
    prompt: list
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset = frozenset()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    choice: int = 0


class Sequence:
    """One choice (see the module docstring). `on_event(kind, value)` is called from the engine
    thread with ("prompt", [None, (logprob, top), ...]) once if the prompt's log-probabilities
    were asked for, ("token", Sampled) for each sampled token, then once ("done", "stop" |
    "length" | "cancelled") or ("error", message)."""

    def __init__(self, ask: Ask, on_event=None, constraint=None):
        self.id = next(_ids)                    # arrival order: the older, the higher the priority
        self.ask, self.on_event = ask, on_event
        self.generated: list[int] = []
        self.sampler = Sampler(ask.params, stream=ask.choice, constraint=constraint)
        self.prompt_scores: list = []
        self.table: PageTable | None = None
        self.leader: Sequence | None = None     # a choice waiting to fork its leader's prompt pages
        self.followers: list[Sequence] = []     # the choices waiting to fork this one's
        self.cancelled = self.done = False
        self.cached_tokens: int | None = None   # prompt positions found in the prefix cache, first admission
        self.preemptions = 0
        self.guesser = None                     # its speculative decoding (common/speculative.py: Guesser), if on
        self.guesses: list[int] = []            # the next step's guesses (the scheduler's plan)

    @property
    def context(self) -> list:
        """What its KV cache must hold to go on: its prompt and what it generated."""
        return self.ask.prompt + self.generated

    @property
    def pending(self) -> int:
        """Positions of its context its pages do not hold yet (decoding: 1, its newest token).
        Counted, not read off `context`, which copies every token: a step asks this of every
        running sequence."""
        return len(self.ask.prompt) + len(self.generated) - len(self.table)

    def _after(self, start: int) -> list:
        """context[start:], without copying the positions before start."""
        n = len(self.ask.prompt)
        return self.ask.prompt[start:] + self.generated if start < n else self.generated[start - n:]

    @property
    def history(self) -> list:
        """What its sampler reads of the text so far: its context where a repeat penalty looks
        back over it, else nothing (the context is a copy of every token: not made for nothing)."""
        return self.context if self.ask.params.repeat_penalized else []

    @property
    def room(self) -> int:
        """Tokens it may still make (what speculative decoding's planner may guess within)."""
        return self.ask.max_tokens - len(self.generated)

    @property
    def scoring(self) -> bool:
        """Its prompt's log-probabilities are asked for and not yet computed."""
        return self.ask.prompt_logprobs is not None and len(self.prompt_scores) < len(self.ask.prompt)

    def emit(self, kind, value):
        if self.on_event is not None:
            self.on_event(kind, value)

    # ---- one step ----------------------------------------------------------------------------
    def decode_rows(self) -> int:
        """Rows it feeds in a step once decoding: its newest token and its guesses."""
        return 1 + len(self.guesses)

    def segment(self, n: int) -> Segment:
        """Its part of a step: the next n tokens of its context that its pages do not hold yet,
        then its guesses; the logits of the last row once the context is complete, of every row
        while scoring or guessing."""
        start, pending = len(self.table), self.pending
        del self.guesses[max(0, n - pending):]                          # rows the step could not take
        tokens = (self._after(start) + self.guesses)[:n]
        return Segment(self.table, tokens, logits=n >= pending, all_logits=self.scoring or bool(self.guesses))

    def score(self, logits: np.ndarray, start: int) -> bool:
        """Record its prompt's log-probabilities from the rows for positions start.. (entry j
        scores prompt token j from position j - 1's logits; the first has nothing before it).
        True once every prompt position is scored: after the row of the prompt's last position
        but one, which may come before the prompt's last token is computed."""
        prompt, scores = self.ask.prompt, self.prompt_scores
        if not scores:
            scores.append(None)
        for i, pos in enumerate(range(start, start + len(logits))):
            if pos + 1 == len(scores) and pos + 1 < len(prompt):    # a chunk recomputed adds nothing twice
                scores.append(token_logprobs(logits[i], prompt[pos + 1], self.ask.prompt_logprobs))
        return len(scores) == len(prompt)

    def draw(self, logits: np.ndarray) -> Sampled:
        """Its next token from its row's logits [n_vocab], added to what it generated."""
        tok = self.sampler(logits, self.history)
        k = self.ask.logprobs
        lp = token_logprobs(logits, tok, k) if k is not None else (None, [])
        self.generated.append(tok)
        return Sampled(tok, *lp)

    def take(self, logits: np.ndarray) -> list[Sampled]:
        """Its new tokens from its rows of a step: a draw from the last row, or, with guesses
        (rows [k+1, n_vocab]: after its newest token, after each guess), the ones the rule keeps
        and the model's own token (common/speculative.py), cut at the first that ends its text
        (a stop id, its grammar's end). Its pages then hold its context but the newest token,
        as after a plain step; the rows' logits give each token's log-probabilities."""
        if not self.guesses:
            return [self.draw(logits[-1])]
        guesses, self.guesses = self.guesses, []
        before = len(self.context)
        kept, tok = self.guesser.verify(logits, guesses, self.sampler, self.context)
        out = standing(guesses[:kept] + [tok], self.ask.stop_ids, self.sampler)
        self.guesser.observe(len(guesses), kept, min(kept, len(out)))
        self.table.truncate(before - 1 + len(out))
        self.generated += out
        k = self.ask.logprobs
        return [Sampled(t, *(token_logprobs(logits[i], t, k) if k is not None else (None, [])))
                for i, t in enumerate(out)]

    def end_reason(self) -> str | None:
        """'stop' after an end-of-generation token or once its grammar's text is over (even
        with ignore_eos), 'length' at max_tokens, else None."""
        if self.generated and self.generated[-1] in self.ask.stop_ids or self.sampler.ended:
            return "stop"
        return "length" if len(self.generated) >= self.ask.max_tokens else None

    def fork(self) -> list[Sequence]:
        """Its prompt is in: the choices waiting for it take its pages (PageTable.fork) and its
        constraint's state (Constraint.fork: each then follows the grammar on its own), and
        become sequences of their own. Returns them."""
        followers = [f for f in self.followers if not f.done]
        self.followers = []
        constraint = self.sampler.constraint
        for f in followers:
            f.leader, f.table = None, self.table.fork()
            if constraint is not None:
                f.sampler.constraint = constraint.fork()
        return followers
