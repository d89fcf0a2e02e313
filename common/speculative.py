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
  near-tie fall the other way (tests/test_speculative.py measures both). A server's batched
  step has no such gap: every row of it takes the same path (common/batch.py, row_block).
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
  (common/generate.py: standing), as the cache does.

The guesses:

* PromptLookup: the longest n-gram at the end of the text (n from n_max down to n_min) that
  occurred earlier in it, at its most recent occurrence; the guess is what followed it there.
  No model: text that copies itself (editing code, reciting a list from the prompt) is full of
  such matches, free text has few and short ones. NgramIndex keeps the search up to date as
  the text grows, a few dictionary lookups per step instead of a scan of the text.
* DraftModel: a smaller model with the same vocabulary (check_vocabulary) drafts k tokens one
  row at a time, its own KV cache rolled back like the target's.

How many, `allot`: a guess costs a row of the verify pass and a wrong one costs it for nothing,
so k follows what was measured. If a guess is kept with probability a, guess j is worth a^j
tokens (it counts only if the j-1 before it were kept), so k guesses yield E(k) = 1 + a + ... +
a^k tokens for a step that costs c(k+1) one-row steps (StepCost: the pass of k+1 rows timed on
this engine before the first step, then followed as the steps run); the k with the most tokens
per cost wins, and k = 0 is a plain step. In a server's step, every sequence's guesses compete
for rows of one pass: the most valuable guess rows are added while tokens per unit of step
time rise (app/serve/speculation.py). a is counted per kind of guess (per matched n-gram
length: long matches guess better) and drawn from what the counts allow (AcceptCounts), so a
kind that keeps failing stops guessing (free text is not slowed down), one that keeps matching
guesses long, and one seldom tried is still tried now and then.

Where it runs: `Speculator` is Session.generate's step strategy for one sequence over the
stage's arena (`python -m app run --spec`); `Guesser` is one sequence's part in a server's
batched step over the paged pool (`python -m app serve --spec`: app/serve/speculation.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from common.generate import ParameterError, Sampler, Session

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
    for a deterministic guess: q one-hot), and the kind of guess they were (AcceptCounts' key)."""
    tokens: list
    q: list | None = None
    key: object = None


class NgramIndex:
    """A text and, for every n-gram in it (n = 1..n_max) that has a token after it, the
    position of that token at its most recent occurrence. `extend` adds tokens (n_max entries
    each); `find` looks the text's ending up, longest first: PromptLookup's search in a few
    dictionary lookups, where a scan of the text would grow with it."""

    def __init__(self, n_max: int = LOOKUP_NGRAM[1], tokens=()):
        self.n_max = n_max
        self.tokens: list[int] = []
        self.after: dict[tuple, int] = {}        # n-gram -> the position after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens):
        for t in tokens:
            at = len(self.tokens)                # t's position: the n-grams ending just before it
            for n in range(1, min(self.n_max, at) + 1):
                self.after[tuple(self.tokens[at - n:at])] = at
            self.tokens.append(int(t))

    def find(self, k: int, n_min: int = 1) -> tuple[int, list]:
        """(n, k tokens that followed the most recent earlier occurrence of the text's last n
        tokens), for the longest n that occurred; (0, []) if none did. (The ending itself is not
        indexed yet: no token follows it.) What followed runs into the text's end when the match
        is recent: the guess then goes on as the copy would, the text repeating with the period
        L - at (the overlapping copy of an LZ77 decoder), so a list or a loop that repeats every
        few tokens is guessed k ahead, not only up to the end."""
        L = len(self.tokens)
        for n in range(min(self.n_max, L - 1), n_min - 1, -1):
            at = self.after.get(tuple(self.tokens[L - n:]))
            if at is not None:
                period = L - at
                return n, [self.tokens[at + i % period] for i in range(k)]
        return 0, []


class PromptLookup:
    """Guesses from the text itself: what followed the latest earlier occurrence of its ending."""
    name = "lookup"

    def __init__(self, n_min: int = LOOKUP_NGRAM[0], n_max: int = LOOKUP_NGRAM[1]):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths {n_min}..{n_max}: need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self.index = NgramIndex(n_max)

    def find(self, tokens, k: int) -> tuple[int, list]:
        """NgramIndex.find on this text: (n, k tokens guessed), (0, []) if nothing matched. The
        index follows the text: extended while the text only grew, built again when it changed."""
        tokens = list(tokens)
        have = self.index.tokens
        if len(tokens) < len(have) or tokens[:len(have)] != have:
            self.index = NgramIndex(self.n_max)
        self.index.extend(tokens[len(self.index.tokens):])
        return self.index.find(k, self.n_min)

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
        q = []
        for _ in range(k):
            drafting.last = None
            s.next_token(drafting)
            q.append(drafting.last)                # None: a greedy pick, which needs no q
        length.drafted_in((time.perf_counter() - t0) * 1e3 / k)
        dense = None
        if not sampler.params.greedy:
            n_vocab = self.engine.config.n_vocab
            dense = [dense_distribution(ids, probs, n_vocab) for ids, probs in q]
        return Draft(s.tokens[-k:], dense, "model")

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


def dense_distribution(ids, probs, n_vocab: int) -> np.ndarray:
    """A sampler's distribution (the ids it keeps, their probabilities) over the whole vocabulary."""
    p = np.zeros(n_vocab)
    p[ids] = probs
    return p


# ---- how many ---------------------------------------------------------------------------------

class StepCost:
    """What a verify pass of m rows costs, in one-row decode steps: measured on the engine before
    the first step (`calibrate`), then followed as the steps run (the machine's load changes,
    the context grows). The lesson's curve, which `python -m app bench speculative` records."""

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


class AcceptCounts:
    """Guesses kept and rejected, by kind of guess, older evidence fading (DECAY), so that a
    text that changes character is followed. A step's guesses are tried in order until the
    first rejection, so a step adds its kept guesses and at most one rejection: the counts of
    a geometric trial, whose rate is kept / (kept + rejected). `drafted` and `accepted` count
    every guess made and every one emitted, never decayed (what /metrics reports)."""

    PRIOR = (1.0, 2.0)        # Beta(1, 2) before any evidence: a guess is more likely wrong than right
    DECAY = 0.95

    def __init__(self):
        self.kept: dict = {}          # key -> (kept, rejected), decayed
        self.drafted = self.accepted = 0

    def rate(self, key) -> float:
        """The mean accept rate the counts give (PRIOR before any guess)."""
        kept, rejected = self.kept.get(key, (0.0, 0.0))
        return (kept + self.PRIOR[0]) / (kept + rejected + sum(self.PRIOR))

    def draw(self, key, rng, prior=PRIOR) -> float:
        """An accept rate drawn from what the counts allow (Beta(prior + kept, prior + rejected)):
        Thompson sampling, so a kind of guess seldom tried is still tried now and then."""
        kept, rejected = self.kept.get(key, (0.0, 0.0))
        return float(rng.beta(kept + prior[0], rejected + prior[1]))

    def observe(self, key, drafted: int, kept: int, emitted: int | None = None):
        """A step's guesses of one kind: made, kept by the rule (those after the first rejection
        were not tried), and emitted (kept and before the end of the text; default: kept)."""
        if drafted:
            k, r = self.kept.get(key, (0.0, 0.0))
            self.kept[key] = (self.DECAY * k + kept, self.DECAY * r + (kept < drafted))
            self.drafted += drafted
            self.accepted += kept if emitted is None else emitted


def allot(offers, rows: float, cost) -> list[int]:
    """How many guesses each sequence of a step makes (the module docstring's rule).

    offers: [(a, n)] per sequence: its accept rate and the guesses it has; rows: the step's
    worth without guesses (one per row: a decoding row makes its token, a prompt row does its
    share of the prompt); cost(extra): the step's time with `extra` guess rows. Guess j of a
    sequence is worth a^j. For each K the K most valuable guess rows are the best K to add;
    the K with the most worth per unit of time wins (0: nobody guesses). Where the step is
    compute-bound, a row costs what the step's rows cost on average, each worth 1, so a guess
    (worth a^j < 1) never pays: the rule guesses nothing there. Where rows are nearly free
    (memory-bound), a likely guess pays."""
    gains = sorted(((a ** j, i) for i, (a, n) in enumerate(offers) for j in range(1, n + 1)), reverse=True)
    best_k, best, worth = 0, rows / cost(0), float(rows)
    for k, (gain, _) in enumerate(gains, 1):
        worth += gain
        if worth / cost(k) > best:
            best_k, best = k, worth / cost(k)
    ks = [0] * len(offers)
    for _, i in gains[:best_k]:
        ks[i] += 1
    return ks


class DraftLength:
    """k per step for one sequence (the module docstring): the accept rate of each kind of
    guess, and the cost of a step with k guesses: a verify pass of k+1 rows (StepCost) plus the
    drafting, in one-row steps (per_guess: a draft model's step over the target's; prompt
    lookup costs nothing). The accept rate is drawn from the counts (AcceptCounts.draw) before
    k is chosen; the draw changes how many guesses are made, never which tokens come out."""

    PRIOR = AcceptCounts.PRIOR
    SEED = 0                  # the draws are reproducible: the same run makes the same steps

    def __init__(self, k_max: int = DRAFT_MAX, cost: StepCost | None = None):
        self.k_max = k_max
        self.cost = cost or StepCost()
        self.per_guess = 0.0
        self.counts = AcceptCounts()
        self.rng = np.random.default_rng(self.SEED)

    def rate(self, key) -> float:
        return self.counts.rate(key)

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
        return allot([(self.counts.draw(key, self.rng), available)], 1, self.step_cost)[0]

    def drafted_in(self, ms_per_guess: float):
        """A draft model's time per guess, as a share of the target's one-row step."""
        if self.cost.t1_ms:
            seen = ms_per_guess / self.cost.t1_ms
            self.per_guess = seen if not self.per_guess else 0.8 * self.per_guess + 0.2 * seen

    def observe(self, key, drafted: int, kept: int):
        """A step's guesses: made and kept (those after the first rejection were not tried)."""
        self.counts.observe(key, drafted, kept)


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
            p = dense_distribution(ids, probs, logits.shape[1])
            q = draft.q[i] if draft.q is not None else dense_distribution([d], [1.0], logits.shape[1])
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



# ---- one sequence over the arena: Session.generate's step ----------------------------------------

@dataclass
class Speculator:
    """Guesses, how many, and the rule: Session.generate's step strategy (common/generate.py:
    PlainStep is the other), appending 1..k+1 tokens per step."""
    drafter: object
    draft_max: int = DRAFT_MAX
    rule: object = accept                 # tests plant wrong rules here
    length: DraftLength = field(default=None)
    name = "speculative"

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
        cap = min(self.draft_max, room - 1, session.engine.n_ctx - len(session.tokens))
        draft = self.drafter.draft(session.tokens, cap, self.length, sampler) if cap > 0 else None
        t0 = time.perf_counter()
        if not draft:
            tok = session.next_token(sampler)
            self.length.cost.observe(1, (time.perf_counter() - t0) * 1e3)
            return [tok], 0, 0
        k = len(draft.tokens)
        kept, tok = session.verify(draft.tokens, lambda rows: self.rule(rows, draft, sampler, session.tokens))
        self.length.cost.observe(k + 1, (time.perf_counter() - t0) * 1e3)
        self.length.observe(draft.key, k, kept)
        return draft.tokens[:kept] + [tok], k, kept

    def close(self):
        self.drafter.close()


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


# ---- one sequence of a server's batch, over the paged pool ---------------------------------------

class Guesser:
    """One sequence's prompt lookup in a server's batched step (app/serve/speculation.py plans
    the step; app/serve/sequence.py runs its part):

        offer     what it could guess now (`found`: the lookup over its own context, prompt and
                  output so far) and an accept rate drawn from its own counts for that kind
        verify    the rule on its k+1 rows of the step's logits [k+1, n_vocab] -> the kept
                  guesses and the model's own token (the caller cuts them where the text ends
                  and gives the rest of the positions back: PageTable.truncate)

    Its counts start from the server's (`pooled`: every sequence's guesses), worth PRIOR_WEIGHT
    guesses of evidence, so a new sequence starts from what this server has seen and then
    follows its own text. `q`: the distributions the guesses were drawn from (a draft model's;
    None for lookup's deterministic guesses)."""

    PRIOR_WEIGHT = 3.0        # Beta(1, 2)'s weight: the pooled rate counts as 3 guesses

    def __init__(self, pooled: AcceptCounts, n_max: int = LOOKUP_NGRAM[1], rule=accept):
        self.pooled, self.rule = pooled, rule
        self.index = NgramIndex(n_max)
        self.counts = AcceptCounts()
        self.key = None
        self.found: list = []
        self.q = None

    def offer(self, context, k_max: int, rng) -> tuple[int, float]:
        """(how many guesses it has, up to k_max; their drawn accept rate); (0, 0) when the
        lookup finds nothing. The context only ever grows, so the index takes its new tokens."""
        self.index.extend(context[len(self.index.tokens):])
        n, self.found = self.index.find(k_max)
        if not self.found:
            return 0, 0.0
        self.key = ("ngram", n)
        return len(self.found), self.draw(rng)

    def draw(self, rng) -> float:
        """An accept rate for this kind of guess, from its own counts and the server's."""
        r = self.pooled.rate(self.key)
        return self.counts.draw(self.key, rng, (self.PRIOR_WEIGHT * r, self.PRIOR_WEIGHT * (1 - r)))

    def verify(self, rows: np.ndarray, guesses: list, sampler: Sampler, history) -> tuple[int, int]:
        """(guesses kept, the model's own token) by the rule; every token kept taken by the sampler."""
        q = self.q[:len(guesses)] if self.q is not None else None
        return self.rule(rows, Draft(list(guesses), q, self.key), sampler, history)

    def observe(self, drafted: int, kept: int, emitted: int):
        for counts in (self.counts, self.pooled):
            counts.observe(self.key, drafted, kept, emitted)

    def release(self):
        """The sequence ended or was preempted: what it holds besides its text goes back."""
