"""Speculative decoding: guess k tokens cheaply, check them all in one forward pass.

A decode step reads every weight to make one token, two flops per weight. A forward pass of
k+1 rows reads the weights once too, and while the k+1 rows stay below the machine's ridge
point (the roofline, app/measure/roofline.py) it should cost about one step. So guess the next
k tokens cheaply, run the model once over the newest token and the k guesses, and keep the
guesses it agrees with:

    text      x_1 .. x_n           x_n sampled last, not yet in the KV cache
    draft     d_1 .. d_k           prompt lookup or a draft model (below)
    verify    one forward of the k+1 rows [x_n, d_1 .. d_k] at positions n-1 .. n+k-1
              -> p_0 .. p_k        the model's distribution after x_n, after d_1, ..., after d_k
    accept    the longest prefix of guesses the model agrees with, then one token of its own
              (at the first disagreement, or after the k-th guess): 1 to k+1 tokens per pass
    rollback  the K/V rows of the rejected guesses lie past the sequence's new end: the arena
              never reads there (Session.truncate is bookkeeping), the paged pool gives their
              pages back (PageTable.truncate)

The rule, `accept`:

* greedy: d_i is kept while it is the argmax of p_{i-1}; the first argmax that differs is the
  model's own token, and after k kept guesses the argmax of p_k comes free. The text is the one
  plain greedy decoding writes, token for token, where the stage's k+1-row pass gives its
  one-row step's numbers; a stage whose multi-row kernels sum in another order (the 8-bit
  stages' integer tiles, whose activations are rounded again at every layer) may let a
  near-tie fall the other way (tests/test_speculative.py measures both).
* sampling (Leviathan et al. 2023, Chen et al. 2023): d_i, drawn from the draft's distribution
  q, is kept with probability min(1, p(d_i) / q(d_i)); on rejection the token is drawn from
  norm(max(0, p - q)). Every emitted token then has exactly the distribution p of the plain
  sampler. A deterministic draft (prompt lookup) has q one-hot at d_i: keep it with probability
  p(d_i), else draw from p without d_i. p is the sampler's own distribution
  (Sampler.distribution: penalties, top-k, top-p, min-p, temperature) with the history the
  plain sampler would see at that position. The random numbers differ from the plain loop's,
  so a seed gives another text, drawn from the same distribution.
* under a constraint (common/constrain: the sampler's grammar), each row's distribution is
  masked where the guesses kept before it leave the grammar, since each kept guess moves the
  matcher on (Sampler.took): a guess the grammar forbids is rejected like any other. Tokens
  kept past the grammar's end are not emitted, and the matcher takes them back
  (Constraint.rollback), as the cache does.

The guesses:

* PromptLookup: the longest n-gram at the end of the text (n from n_max down to n_min) that
  occurred earlier in it, at its most recent occurrence; the guess is what followed it there.
  No model: text that copies itself (editing code, reciting a list from the prompt) is full of
  such matches, free text has few and short ones.
* DraftModel: a smaller model with the same vocabulary (check_vocabulary) drafts k tokens one
  row at a time, its own KV cache rolled back like the target's.

How many, `DraftLength`: a guess costs a row of the verify pass and a wrong one costs it for
nothing, so k is chosen by what was measured. If a guess is kept with probability a, k guesses
yield E(k) = 1 + a + ... + a^k tokens for a step that costs c(k+1) one-row steps (StepCost: the
pass of k+1 rows timed on this engine before the first step, then followed as the steps run);
the k with the most tokens per cost wins, and k = 0 is a plain step. a is counted per kind of
guess (per matched n-gram length: long matches guess better) and drawn from what the counts
allow, so a kind that keeps failing stops guessing (free text is not slowed down), one that
keeps matching guesses long, and one seldom tried is still tried now and then.

Where it runs: `generate` (one sequence over the stage's arena: `python -m app run --spec`),
and for a server, one sequence of a batch over the paged pool: `verify_segment` is its part of
the step ([x_n, d_1 .. d_k], every row's logits: common/batch.py), `settle` applies the rule to
its k+1 rows of the step's logits and drops the rejected positions (PageTable.truncate) before
`Batch.finish` registers the full pages; admission must reserve draft_max more positions than
it generates (tests/test_speculative.py runs exactly that against plain paged decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from common.generate import Generation, ParameterError, Sampler, Session, check_fits, check_n_predict

DRAFT_MAX = 16            # --draft-max: guesses per step at most (the verify pass has one row more)
LOOKUP_NGRAM = (1, 4)     # n-gram lengths prompt lookup matches, shortest and longest


class VocabularyMismatch(ParameterError):
    """A draft model that does not tokenize like the target: the message names the first difference."""


def check_vocabulary(target, draft):
    """Raise VocabularyMismatch unless two GGUF files (GGUFFile) tokenize alike: the same
    tokenizer model, token list, BOS and EOS ids, and the same number of logits, so that a
    guessed id means the same text to both models and their distributions line up."""
    from common.model import LlamaConfig
    where = f"the draft model {draft.path} and the target {target.path}"
    fix = "; a draft model must share the target's tokenizer (a smaller model of the same family)"
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        a, b = target.metadata.get(key), draft.metadata.get(key)
        if a != b:
            raise VocabularyMismatch(f"{where} differ in {key}: {b!r} against {a!r}{fix}")
    tt, dt = target.metadata.get("tokenizer.ggml.tokens"), draft.metadata.get("tokenizer.ggml.tokens")
    if tt is None or dt is None:
        raise VocabularyMismatch(f"{where}: {'the target' if tt is None else 'the draft'} has no token list "
                                 f"(tokenizer.ggml.tokens){fix}")
    nt, nd = LlamaConfig.from_gguf(target).n_vocab, LlamaConfig.from_gguf(draft).n_vocab
    if len(tt) != len(dt) or nt != nd:
        raise VocabularyMismatch(f"{where} differ in size: {len(dt)} tokens and {nd} logits against {len(tt)} "
                                 f"and {nt}{fix}")
    for i, (a, b) in enumerate(zip(tt, dt)):
        if a != b:
            raise VocabularyMismatch(f"{where} differ at token {i}: {b!r} against {a!r}{fix}")


# ---- the guesses ------------------------------------------------------------------------------

@dataclass
class Draft:
    """k guessed tokens, the distribution each was drawn from (a [n_vocab] float64 array; None
    for a deterministic guess: q one-hot), and the kind of guess they were (DraftLength's key)."""
    tokens: list
    q: list | None = None
    key: object = None


class PromptLookup:
    """Guesses from the text itself: what followed the latest earlier occurrence of its ending."""
    name = "lookup"

    def __init__(self, n_min: int = LOOKUP_NGRAM[0], n_max: int = LOOKUP_NGRAM[1]):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths {n_min}..{n_max}: need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max

    def find(self, tokens, k: int) -> tuple[int, list]:
        """(n, up to k tokens that followed the most recent earlier occurrence of the text's last
        n tokens), for the longest n that occurred; (0, []) if none did."""
        t = np.asarray(tokens, dtype=np.int64)
        L = len(t)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            # windows starting at 0 .. L-n-1: each ends before the text does, so a token follows it
            windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)          # [L-n, n]
            hits = np.flatnonzero((windows == t[L - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return n, t[start:start + k].tolist()
        return 0, []

    def draft(self, tokens, k_max: int, length: DraftLength, sampler: Sampler) -> Draft | None:
        n, follow = self.find(tokens, k_max)
        k = length.choose(("ngram", n), len(follow)) if follow else 0
        return Draft(follow[:k], None, ("ngram", n)) if k else None

    def close(self):
        pass


class DraftModel:
    """Guesses from a smaller model of the same vocabulary: k one-row steps over its own KV
    cache, which keeps what the target accepted and forgets the rest."""
    name = "draft"

    def __init__(self, engine, target=None):
        if target is not None:
            check_vocabulary(target.gguf, engine.gguf)
        self.engine = engine
        self.session = Session(engine)
        self._sampler = None

    def _sampler_like(self, sampler: Sampler) -> _Recording:
        """The target's sampling settings, its own random numbers (seeded from the target's)."""
        if self._sampler is None or self._sampler.params is not sampler.params:
            self._sampler = _Recording(sampler.params, int(sampler.rng.integers(2**63)))
        return self._sampler

    def draft(self, tokens, k_max: int, length: DraftLength, sampler: Sampler) -> Draft | None:
        s = self.session
        k = min(k_max, self.engine.n_ctx - len(tokens))
        k = length.choose("model", k) if k > 0 else 0
        if not k:
            return None
        same = 0                                   # keep the cached prefix the target agreed with
        for a, b in zip(s.tokens, tokens):
            if a != b:
                break
            same += 1
        s.truncate(same)
        s.tokens += list(tokens[same:])
        drafting = self._sampler_like(sampler)
        t0 = time.perf_counter()
        out, q = [], []
        for _ in range(k):
            drafting.last = None
            tok = s._next(drafting)
            s.tokens.append(tok)
            out.append(tok)
            q.append(drafting.last)                # None: a greedy pick, which needs no q
        length.drafted_in((time.perf_counter() - t0) * 1e3 / k)
        dense = None
        if not sampler.params.greedy:
            n_vocab = self.engine.config.n_vocab
            dense = [_dense(ids, probs, n_vocab) for ids, probs in q]
        return Draft(out, dense, "model")

    def close(self):
        self.session.reset()


class _Recording(Sampler):
    """A sampler that keeps the distribution it last drew from (the draft's q)."""

    def __init__(self, params, seed: int):
        super().__init__(params)
        self.rng = np.random.default_rng(seed)
        self.last = None

    def __call__(self, logits, history=()):
        ids, probs = self.distribution(logits, history)
        self.last = (ids, probs)
        tok = int(ids[0]) if self.params.greedy else int(ids[self.rng.choice(len(ids), p=probs)])
        self.took(tok)
        return tok


def _dense(ids, probs, n_vocab: int) -> np.ndarray:
    p = np.zeros(n_vocab)
    p[ids] = probs
    return p


# ---- how many ---------------------------------------------------------------------------------

class StepCost:
    """What a verify pass of m rows costs, in one-row decode steps: measured on the engine before
    the first step (`calibrate`), then followed as the steps run (the machine's load changes,
    the context grows). The lesson's curve, which scripts/bench_speculative.py records."""

    SMOOTH = 0.2              # weight of a new step time in the running figures
    ROWS = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33)    # row counts timed; the others interpolated

    def __init__(self, ratios: dict | None = None, t1_ms: float | None = None):
        self.ratios = dict(ratios or {})          # rows -> cost in one-row steps
        self.t1_ms = t1_ms
        self.calibrate_s = 0.0

    def calibrate(self, engine, max_rows: int, start: int = 0):
        """Time passes of 1..max_rows rows at positions start.. (past what the cache holds, where
        nothing is read: the next pass writes over them). Call it before a sequence's tokens are
        fed, or with start = the positions its cache holds."""
        t0 = time.perf_counter()
        if not engine.uses_kv_cache:
            # every step recomputes the whole text, so k more rows add k to its length: nearly
            # free (not timed here: a pass of a stage without a cache takes seconds); the steps
            # measure it as they run
            self.ratios, self.t1_ms = {1: 1.0, max_rows: 1.0}, None
            return
        rows = [m for m in self.ROWS if m <= max_rows and start + m <= engine.n_ctx] + [1]

        def timed(m: int) -> float:
            t = time.perf_counter()
            if m == 1:
                engine.greedy_next([0], start)
            else:
                engine.forward([0] * m, start, all_logits=True)
            return (time.perf_counter() - t) * 1e3

        timed(1)                                    # first touch: caches, pages
        ms = {}
        for m in rows:                              # one row first and last: the faster one counts
            ms[m] = min(ms.get(m, float("inf")), timed(m))
        self.t1_ms = ms[1]
        self.ratios = {m: t / ms[1] for m, t in ms.items()}
        self.calibrate_s = time.perf_counter() - t0

    @property
    def calibrated(self) -> bool:
        return bool(self.ratios)

    def __call__(self, rows: int) -> float:
        if rows in self.ratios:
            return self.ratios[rows]
        known = sorted(self.ratios)
        if len(known) < 2:
            return float(rows)                      # nothing measured: as if every row cost a step
        lo = max([m for m in known if m < rows], default=known[0])
        hi = min([m for m in known if m > rows], default=known[-1])
        if lo == hi:                                # past the last measured: its slope per row
            lo, hi = known[-2], known[-1]
        slope = (self.ratios[hi] - self.ratios[lo]) / (hi - lo)
        return self.ratios[lo] + slope * (rows - lo)

    def observe(self, rows: int, ms: float):
        if self.t1_ms is None:
            if rows == 1:
                self.t1_ms = ms
                self.ratios[1] = 1.0
            return
        if rows == 1:
            self.t1_ms = (1 - self.SMOOTH) * self.t1_ms + self.SMOOTH * ms
        else:
            seen = ms / self.t1_ms
            self.ratios[rows] = seen if rows not in self.ratios else \
                (1 - self.SMOOTH) * self.ratios[rows] + self.SMOOTH * seen


class DraftLength:
    """k per step (the module docstring): the accept rate of each kind of guess, and the cost of
    a step with k guesses: a verify pass of k+1 rows (StepCost) plus the drafting, in one-row
    steps (per_guess: a draft model's step over the target's; prompt lookup costs nothing).

    The accept rate is not known, only counted, so it is drawn from what the counts allow (a
    Beta distribution over kept and rejected guesses: Thompson sampling) before k is chosen: a
    kind of guess seldom tried still drafts now and then, and one that keeps failing almost
    never does. The draw changes how many guesses are made, never which tokens come out."""

    PRIOR = (1.0, 2.0)        # Beta(1, 2) before any evidence: a guess is more likely wrong than right
    DECAY = 0.95              # older evidence fades, so a text that changes character is followed
    SEED = 0                  # the draws are reproducible: the same run makes the same steps

    def __init__(self, k_max: int = DRAFT_MAX, cost: StepCost | None = None):
        self.k_max = k_max
        self.cost = cost or StepCost()
        self.per_guess = 0.0
        self.kept = {}            # key -> (kept, rejected), decayed
        self.rng = np.random.default_rng(self.SEED)

    def rate(self, key) -> float:
        """The mean accept rate the counts give (PRIOR before any guess)."""
        kept, rejected = self.kept.get(key, (0.0, 0.0))
        return (kept + self.PRIOR[0]) / (kept + rejected + sum(self.PRIOR))

    @staticmethod
    def expected(k: int, a: float) -> float:
        """Tokens a step with k guesses yields when each is kept with probability a."""
        return float(sum(a ** j for j in range(k + 1)))

    def step_cost(self, k: int) -> float:
        return self.cost(k + 1) + k * self.per_guess

    def choose(self, key, available: int) -> int:
        """Guesses to make now (0: a plain step), when `available` could be made."""
        available = min(available, self.k_max)
        if available <= 0:
            return 0
        kept, rejected = self.kept.get(key, (0.0, 0.0))
        a = self.rng.beta(kept + self.PRIOR[0], rejected + self.PRIOR[1])
        return max(range(available + 1), key=lambda k: self.expected(k, a) / self.step_cost(k))

    def drafted_in(self, ms_per_guess: float):
        """A draft model's time per guess, as a share of the target's one-row step."""
        if self.cost.t1_ms:
            seen = ms_per_guess / self.cost.t1_ms
            self.per_guess = seen if not self.per_guess else 0.8 * self.per_guess + 0.2 * seen

    def observe(self, key, drafted: int, kept: int):
        """A step's guesses: made and kept (those after the first rejection were not tried)."""
        if drafted:
            k, r = self.kept.get(key, (0.0, 0.0))
            self.kept[key] = (self.DECAY * k + kept, self.DECAY * r + (kept < drafted))


# ---- the rule ---------------------------------------------------------------------------------

def accept(logits: np.ndarray, draft: Draft, sampler: Sampler, history) -> tuple[int, int]:
    """logits [k+1, n_vocab]: the verify pass's rows p_0 .. p_k (the module docstring). Returns
    (guesses kept, the model's own next token). Each token kept is counted as drawn
    (Sampler.took) before the next row's distribution is taken, as plain decoding would have."""
    history = list(history)
    k = len(draft.tokens)
    rng = sampler.rng

    def settled(i, tok):
        sampler.took(tok)
        return i, tok
    for i, d in enumerate(draft.tokens):
        ids, probs = sampler.distribution(logits[i], history)
        if sampler.params.greedy:
            if int(ids[0]) != d:
                return settled(i, int(ids[0]))
        else:
            p = _dense(ids, probs, logits.shape[1])
            q = draft.q[i] if draft.q is not None else _dense([d], [1.0], logits.shape[1])
            if not rng.random() < min(1.0, p[d] / q[d]):
                residual = np.maximum(p - q, 0.0)
                nz = np.flatnonzero(residual)
                if len(nz) == 0:                   # p == q: a rejection cannot happen; rounding
                    nz, residual = ids, p
                return settled(i, int(nz[rng.choice(len(nz), p=residual[nz] / residual[nz].sum())]))
        sampler.took(d)
        history.append(d)
    ids, probs = sampler.distribution(logits[k], history)
    return settled(k, int(ids[0]) if sampler.params.greedy else int(ids[rng.choice(len(ids), p=probs)]))


# ---- one sequence ----------------------------------------------------------------------------

@dataclass
class Speculator:
    """Guesses, how many, and the rule: `step` appends 1..k+1 tokens to a Session."""
    drafter: object
    draft_max: int = DRAFT_MAX
    rule: object = accept                 # tests plant wrong rules here
    length: DraftLength = field(default=None)

    def __post_init__(self):
        if self.length is None:
            self.length = DraftLength(self.draft_max)

    def prepare(self, session: Session):
        """Measure the step costs on this engine once (StepCost.calibrate), where the session's
        cache ends: before its tokens are fed, or past those it holds."""
        if not self.length.cost.calibrated:
            self.length.cost.calibrate(session.engine, self.draft_max + 1, session.n_cached)

    def step(self, session: Session, sampler: Sampler, room: int) -> tuple[list, int, int]:
        """One decode step: (the tokens appended, at most `room`; guesses made; guesses kept)."""
        e = session.engine
        cap = min(self.draft_max, room - 1, e.n_ctx - len(session.tokens))
        draft = self.drafter.draft(session.tokens, cap, self.length, sampler) if cap > 0 else None
        t0 = time.perf_counter()
        if not draft:
            tok = session._next(sampler)
            session.tokens.append(tok)
            self.length.cost.observe(1, (time.perf_counter() - t0) * 1e3)
            return [tok], 0, 0
        k, n = len(draft.tokens), len(session.tokens)
        start = session.n_cached if e.uses_kv_cache else 0
        rows = e.forward(session.tokens[start:] + draft.tokens, start, all_logits=True)[-(k + 1):]   # [k+1, V]
        self.length.cost.observe(k + 1, (time.perf_counter() - t0) * 1e3)
        kept, tok = self.rule(rows, draft, sampler, session.tokens)
        out = draft.tokens[:kept] + [tok]
        session.tokens += out
        session.n_cached = n + kept           # the cache holds x_1..x_n, d_1..d_kept; tok is not in it
        self.length.observe(draft.key, k, kept)
        return out, k, kept

    def close(self):
        self.drafter.close()


# ---- one sequence of a batch, over the paged pool (what a server's scheduler calls) --------------

def verify_segment(table, last: int, draft: Draft):
    """The step's Segment for one sequence: its newest token and the guesses, every row's logits."""
    from common.batch import Segment
    return Segment(table, [last] + list(draft.tokens), all_logits=True)


def settle(table, logits: np.ndarray, draft: Draft, sampler: Sampler, history) -> list:
    """After the batched step, before Batch.finish: the rule on this sequence's k+1 rows of logits
    [k+1, n_vocab], its rejected positions given back (PageTable.truncate). Returns the tokens it
    gained, kept guesses then the model's own; the last of them is not in its pages yet."""
    kept, tok = accept(logits, draft, sampler, history)
    table.truncate(len(table) - (len(draft.tokens) - kept))
    return list(draft.tokens[:kept]) + [tok]


def from_flags(mode: str, draft_max: int = DRAFT_MAX, draft_engine=None, target=None) -> Speculator | None:
    """The Speculator for `--spec MODE` (lookup | draft | off: None)."""
    if mode == "off":
        return None
    if mode == "lookup":
        return Speculator(PromptLookup(), draft_max)
    if mode == "draft":
        if draft_engine is None:
            raise ParameterError("--spec draft needs a draft model: give --model-draft FILE (a smaller model "
                                 "with the same vocabulary)")
        return Speculator(DraftModel(draft_engine, target), draft_max)
    raise ParameterError(f"--spec {mode!r}: must be lookup, draft or off")


def generate(session: Session, new_tokens, n_predict: int, sampler: Sampler | None = None,
             spec: Speculator | None = None, stop_ids=(), on_token=None, ignore_eos: bool = False) -> Generation:
    """Session.generate with speculative steps: the same arguments and Generation (drafted and
    accepted counted). A step that emits several tokens has its time shared among them in
    decode_ms, so their mean is the time per token (the median of a mix of steps is no rate)."""
    sampler = sampler or Sampler()
    spec = spec or Speculator(PromptLookup())
    new_tokens = list(new_tokens)
    if not new_tokens and not session.tokens:
        raise ParameterError("the prompt is empty (no tokens): give at least one token to continue from")
    n_predict = check_n_predict(n_predict)
    check_fits(len(session.tokens) + len(new_tokens), n_predict, session.engine.n_ctx,
               session.engine.config.n_ctx_train)
    gen = Generation(prompt_tokens=list(session.tokens) + new_tokens)
    session.tokens += new_tokens
    stop_ids = set() if ignore_eos else set(stop_ids)
    spec.prepare(session)                          # measured once, before the timed region
    t_prev = time.perf_counter()
    first = session._next(sampler)                 # the prompt's pass and the first token: TTFT
    session.tokens.append(first)
    gen.ttft_ms = (time.perf_counter() - t_prev) * 1e3
    t_prev = time.perf_counter()
    pending = [first]
    while True:
        for tok in pending:
            gen.tokens.append(tok)
            if on_token:
                on_token(tok)
        if pending[-1] in stop_ids or sampler.ended:
            gen.stop_reason = "eog"
            break
        if len(gen.tokens) >= n_predict:
            gen.stop_reason = "length"
            break
        pending, drafted, kept = spec.step(session, sampler, n_predict - len(gen.tokens))
        stop = next((i for i, t in enumerate(pending) if t in stop_ids), len(pending) - 1)
        over = sampler.constraint.ended_at(len(pending)) if sampler.constraint is not None else None
        stop = stop if over is None else min(stop, over)       # where the grammar's text ended
        if stop + 1 < len(pending):                # a guess kept past a stop token: not emitted
            dropped = len(pending) - stop - 1
            session.truncate(len(session.tokens) - dropped)
            if sampler.constraint is not None:     # the grammar took them too: taken back
                sampler.constraint.rollback(dropped)
            pending = pending[:stop + 1]
        now = time.perf_counter()
        gen.decode_ms += [(now - t_prev) * 1e3 / len(pending)] * len(pending)
        t_prev = now
        gen.drafted += drafted
        gen.accepted += min(kept, len(pending))
    return gen
