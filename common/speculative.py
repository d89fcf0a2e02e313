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

The guesses, one interface (`Guesser`: what a sequence could guess now, how likely each guess is
kept, the rule on its rows, what its guesses did), two kinds:

* PromptLookup: the longest n-gram at the end of the text (n from n_max down to n_min) that
  occurred earlier in it, at its most recent occurrence; the guess is what followed it there.
  No model: text that copies itself (editing code, reciting a list from the prompt) is full of
  such matches, free text has few and short ones. NgramIndex keeps the search up to date as
  the text grows, a few dictionary lookups per step instead of a scan of the text.
* DraftGuesser: a smaller model with the same vocabulary (check_vocabulary) drafts k tokens one
  row at a time over its own pages, every guessing sequence's row in one call of the draft
  model per guess (DraftSpeculation), rolled back like the target's.

How many, one rule for one sequence and for a server's batch (`Speculation.plan`, `allot`): a
guess costs a row of the step and a wrong one costs it for nothing, so k follows what was
measured. If a guess is kept with probability a, guess j is worth a^j tokens (it counts only if
the j-1 before it were kept), so k guesses yield E(k) = 1 + a + ... + a^k tokens; every other
row of the step (another sequence's newest token, a row of a prompt) is worth one. The step
takes the K most valuable guess rows for the K that gives the most tokens per unit of step time,
the time of a step of M rows measured on this engine (`StepTime`: passes of 1..max rows timed
before the first step, then followed as the steps run, with the time a step spends outside its
pass). While the step reads weights and its rows are nearly free (memory-bound: one sequence, a
small batch), a likely guess pays; once it is compute-bound a row costs about the step's average
row, worth one token, and no guess (worth a^j < 1) pays: nothing is guessed. vLLM's n-gram
proposer guesses the same k at any load (its docs note it can run slower than none at high
load); TensorRT-LLM's policy drafts 5 tokens at batch <= 4, 3 up to 32 and none above, constants
that fit one GPU and one model. Here the same shape comes out of the measured step times and
each sequence's own accept rate, on whatever machine runs it.

a is counted per sequence and kind of guess (per matched n-gram length: long matches guess
better), a new sequence starting from what the others' guesses did (AcceptCounts), and drawn
from what the counts allow (Thompson sampling), so a kind seldom tried is still tried now and
then. What keeps guessing from costing more than a little: each sequence keeps a ledger
(`Guesser.credit`, in tokens) of what its guesses gained, measured: the tokens they added less
what their rows cost, the step's time beyond a plain step of its other rows (StepTime.extra;
at most CHARGE times the price the step times put on them when planned, so a burst of other
work does not stop a sequence whose guesses pay). It starts at CREDIT_START and earns
EXPLORE a step; a sequence guesses no more rows than its ledger can pay for at the step times'
price, and none while it is spent: free text, where guesses keep failing, stops guessing
after losing about CREDIT_START tokens and then tries again a little (EXPLORE of a token a
step), whatever the step times or the accept rate got wrong.

Where it runs, the same planner and the same decisions: `python -m app serve --spec` plans
every decoding sequence of the server's step after admission (app/serve/scheduler.py), runs
them in the one batched pass, settles each in Sequence.take (app/serve/sequence.py);
`python -m app run --spec` is a batch of one (`Speculator`: Session.generate's step over the
stage's arena).
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass

import numpy as np

from common.batch import Batch, Segment, padded
from common.generate import ParameterError, Sampler, SamplingParams, Session
from common.paged_kv import PagePool, PageTable

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


# ---- the rule ---------------------------------------------------------------------------------

@dataclass
class Draft:
    """k guessed tokens, the distribution each was drawn from (a [n_vocab] float64 array; None
    for a deterministic guess: q one-hot), and the kind of guess they were (AcceptCounts' key)."""
    tokens: list
    q: list | None = None
    key: object = None


def dense_distribution(ids, probs, n_vocab: int) -> np.ndarray:
    """A sampler's distribution (the ids it keeps, their probabilities) over the whole vocabulary."""
    p = np.zeros(n_vocab)
    p[ids] = probs
    return p


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


# ---- how likely a guess is kept ---------------------------------------------------------------

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


# ---- the guesses ------------------------------------------------------------------------------

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


class Guesser:
    """One sequence's guesses, whoever makes them (PromptLookup, DraftGuesser):

        offer     (how many it could guess now, up to k_max; how likely each is kept), the rate
                  drawn from its own counts for this kind of guess (`key`), the server's (`pooled`:
                  every sequence's) as their prior, worth PRIOR_WEIGHT guesses; (0, 0) while its
                  ledger is spent
        verify    the rule on its k+1 rows [k+1, n_vocab] -> (kept guesses, the model's own token)
        observe   what a step's guesses did: made, kept, emitted (its counts, the pooled ones,
                  and its ledger gains the emitted ones)
        charge    what its guess rows of the last step cost, measured, in tokens (its ledger pays)
        release   the sequence ended or was preempted: what it holds besides its text goes back

    `found`: the guesses the planner takes the first k of; `q`: the distributions they were
    drawn from (a draft model's sampled guesses; None for deterministic ones). `credit`: the
    ledger (the module docstring)."""

    PRIOR_WEIGHT = 3.0        # Beta(1, 2)'s weight: the pooled rate counts as 3 guesses
    CREDIT_START = 1.0        # tokens a sequence may lose to guesses before it has gained any
    EXPLORE = 0.01            # tokens of credit earned per step: how often a stopped sequence tries again
    CREDIT_MAX = 4.0          # gains kept in the ledger: what it may spend on guesses after a run of good ones

    def __init__(self, pooled: AcceptCounts, rule=accept):
        self.pooled, self.rule = pooled, rule
        self.counts = AcceptCounts()
        self.key = None
        self.found: list = []
        self.q = None
        self.credit = self.CREDIT_START
        self.last_drafted = 0     # its guesses in the last step (what that step's charge is shared by)

    def offer(self, context, k_max: int, rng) -> tuple[int, float]:
        self.found, self.q = [], None
        self.credit = min(self.credit + self.EXPLORE, self.CREDIT_MAX)
        if self.credit <= 0:
            return 0, 0.0
        n = self.look(context, k_max)
        return (n, self.draw(rng)) if n else (0, 0.0)

    def look(self, context, k_max: int) -> int:
        """How many guesses it could make now (up to k_max), their kind set in `key`."""
        raise NotImplementedError

    def draw(self, rng) -> float:
        """An accept rate for this kind of guess, from its own counts and the server's."""
        r = self.pooled.rate(self.key)
        return self.counts.draw(self.key, rng, (self.PRIOR_WEIGHT * r, self.PRIOR_WEIGHT * (1 - r)))

    def verify(self, rows: np.ndarray, guesses: list, sampler: Sampler, history) -> tuple[int, int]:
        """(guesses kept, the model's own token) by the rule; every token kept taken by the sampler."""
        q = self.q[:len(guesses)] if self.q is not None else None
        return self.rule(rows, Draft(list(guesses), q, self.key), sampler, history)

    def observe(self, drafted: int, kept: int, emitted: int):
        self.learn(drafted, kept, emitted)
        self.credit = min(self.credit + emitted, self.CREDIT_MAX)
        self.last_drafted = drafted

    def learn(self, drafted: int, kept: int, emitted: int):
        """The accept counts, its own and the pooled ones, learn what a step's guesses did."""
        for counts in (self.counts, self.pooled):
            counts.observe(self.key, drafted, kept, emitted)

    def charge(self, tokens: float):
        self.credit -= tokens
        self.last_drafted = 0

    def release(self):
        """The sequence ended or was preempted: what it holds besides its text goes back."""


class PromptLookup(Guesser):
    """Guesses from the text itself: what followed the latest earlier occurrence of its ending
    (NgramIndex). The kind of guess is the length of the match: ("ngram", n)."""

    def __init__(self, pooled: AcceptCounts | None = None, rule=accept, n_min: int = LOOKUP_NGRAM[0],
                 n_max: int = LOOKUP_NGRAM[1]):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths {n_min}..{n_max}: need 1 <= n_min <= n_max")
        super().__init__(pooled if pooled is not None else AcceptCounts(), rule)
        self.n_min, self.n_max = n_min, n_max
        self.index = NgramIndex(n_max)

    def find(self, tokens, k: int) -> tuple[int, list]:
        """NgramIndex.find on this text: (n, k tokens guessed), (0, []) if nothing matched. The
        index follows the text: extended while the text only grew (a sequence's context does),
        built again when it is shorter or ends otherwise (a text rolled back and written again)."""
        have = self.index.tokens
        if len(tokens) < len(have) or (have and tokens[len(have) - 1] != have[-1]):
            self.index = NgramIndex(self.n_max)
        self.index.extend(tokens[len(self.index.tokens):])
        return self.index.find(k, self.n_min)

    def look(self, context, k_max: int) -> int:
        n, self.found = self.find(context, k_max)
        self.key = ("ngram", n)
        return len(self.found)


class DraftGuesser(Guesser):
    """One sequence's guesses from a draft model (DraftSpeculation runs the model): its pages in
    the draft model's pool hold the first `valid` positions of its context (caught up before it
    drafts), then the guesses it fed; `sampler` draws sampled guesses (the sequence's
    temperature, top-k, top-p and min-p; its own random numbers) and keeps what each was drawn
    from, the rule's q."""

    def __init__(self, pooled: AcceptCounts, rule, pool: PagePool):
        super().__init__(pooled, rule)
        self.table = PageTable(pool)
        self.valid = 0
        self.sampler = None
        self.key = "model"

    def look(self, context, k_max: int) -> int:
        self.key = "model"
        return k_max

    def feed(self, context) -> list:
        """The tokens the next draft step runs for it: its context past what its pages hold and
        agree with (the first step; its last guesses dropped), else its newest guess."""
        if not self.found:
            held = self.table.tokens
            same = 0
            for a, b in zip(held[:min(self.valid, len(context) - 1)], context):
                if a != b:
                    break
                same += 1
            self.valid = same
            self.table.truncate(same)
            return list(context[same:])
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
        self.q = (self.q or []) + [dense_distribution(ids, probs, len(logits))]

    def verify(self, rows, guesses, sampler, history):
        kept, tok = super().verify(rows, guesses, sampler, history)
        self.valid = min(len(self.table), len(history) + kept)       # its context and the kept guesses
        self.table.truncate(self.valid)
        return kept, tok

    def release(self):
        self.table.release()
        self.valid = 0


# ---- what a step costs ------------------------------------------------------------------------

def keep(recent: list, value: float, most: int, first: int = 0):
    """Append value to a list of the last `most` figures, the first `first` of it staying."""
    recent.append(value)
    if len(recent) > most:
        del recent[first]

def expected_tokens(k: int, a: float) -> float:
    """Tokens a sequence's step with k guesses yields when each is kept with probability a."""
    return float(sum(a ** j for j in range(k + 1)))


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


class StepTime:
    """t(M): the ms of a step of M rows, the one model of step times (one sequence's or a
    server's). Three parts:

        shape     the forward pass of M rows: timed once before the first step (`calibrate`:
                  every row count of ROWS up to the most a step can take, in rounds, the best of
                  each, and a pass of more rows never counted cheaper; padded to the row block:
                  a stage that pads rows costs the same for every M in a block), then learned
                  from the steps with guesses: each row count a point of its own, the median of
                  its calibration and its last steps but never below the calibration, and no more
                  rows cheaper than it; between points interpolated, past the last by its slope.
                  (The calibration is the best of a quiet moment: a pass takes no less. A step
                  below it was divided by a scale that a busier moment left too high; learned,
                  it would flatten the shape, price guess rows at nothing, and a guess priced at
                  nothing is charged nothing: nothing would stop it.)
        scale     what a step takes now against the shape (the machine may be busier): the
                  median of the last steps without guesses
        outside   the step's time outside its pass (planning, sampling, events): the median of
                  the last steps

    Medians, so that a step a burst of other work slowed counts for nothing, and a guess row
    that costs more than its calibration said (taken in a quiet moment, or flattened by noise)
    costs more after two steps. The plain step a guess is weighed against is never learned from
    the guesses themselves, so a dear guess row is seen as dear, not as a busier machine.
    Without a calibration every row costs a step: nothing is guessed. The planner tells it each
    step's guess rows (`planned`) before the step runs; `last` is the last step observed, what
    the planner charges that step's guesses by (`extra`)."""

    RECENT = 5                # steps a figure is the median of (with the calibration, for a point)
    ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
    ROUNDS = 3

    def __init__(self, shape: dict | None = None, row_block: int = 1):
        self.shape = dict(shape or {})          # rows -> ms of the forward pass at scale 1
        self.points = {m: [t] for m, t in self.shape.items()}      # rows -> its calibration and last steps
        self._envelope = None                   # the shape's points, each the most up to it (shape_at)
        self.row_block = row_block
        self.scales: list[float] = []           # the last steps without guesses: ms / shape
        self.outsides: list[float] = []         # the last steps: ms outside the pass
        self.scale, self.outside = 1.0, 0.0     # their medians
        self.guess_rows = 0                     # of the step about to run
        self.last = None                        # (rows, ms) of the last step observed
        self.calibrate_s = 0.0

    @property
    def calibrated(self) -> bool:
        return len(self.shape) >= 2

    def shape_at(self, rows: int) -> float:
        """The shape at `rows` rows (padded to the row block): between its points interpolated,
        past the last by its slope, and never less than at fewer rows (each point taken as the
        most of the points up to it, so a point that a noisy step lowered lowers nothing)."""
        if self._envelope is None:
            top, self._envelope = 0.0, {}
            for k in sorted(self.shape):
                self._envelope[k] = top = max(top, self.shape[k])
        env, m = self._envelope, padded(max(rows, 1), self.row_block)
        if m in env:
            return env[m]
        known = list(env)
        i = bisect.bisect(known, m)
        lo, hi = (known[-2], known[-1]) if i == len(known) else (known[max(i - 1, 0)], known[i])
        if lo == hi or m < known[0]:
            return env[known[0]]
        return env[lo] + (env[hi] - env[lo]) * (m - lo) / (hi - lo)

    def forward_ms(self, rows: int) -> float:
        """A pass of `rows` rows, now."""
        return self.scale * self.shape_at(rows)

    def __call__(self, rows: int) -> float:
        """A step of `rows` rows. Uncalibrated: `rows` steps."""
        if not self.calibrated:
            return float(rows)
        return self.forward_ms(rows) + self.outside

    def planned(self, guess_rows: int):
        self.guess_rows = guess_rows

    def observe(self, rows: int, forward_ms: float, step_ms: float):
        """A step ran: its rows (the planned guess rows among them), its pass's ms and its whole ms."""
        guess_rows, self.guess_rows = self.guess_rows, 0
        if not self.calibrated:
            return
        m = padded(max(rows, 1), self.row_block)
        if guess_rows:                          # a point of the shape, against what the plain step takes now
            seen = self.points.setdefault(m, [self.shape_at(m)])
            keep(seen, forward_ms / self.scale, self.RECENT + 1, first=1)      # its calibration stays
            self.shape[m], self._envelope = max(statistics.median(seen), seen[0]), None
        else:
            keep(self.scales, forward_ms / self.shape_at(m), self.RECENT)
            self.scale = statistics.median(self.scales)
        keep(self.outsides, max(step_ms - forward_ms, 0.0), self.RECENT)
        self.outside = statistics.median(self.outsides)
        self.last = (rows, step_ms)

    def extra(self, rows: int, step_ms: float) -> float:
        """What a step's guess rows cost, measured, in tokens: the step's ms beyond a plain step
        of its other `rows` rows now, at the rate that step makes them (rows tokens in t(rows))."""
        plain = self(rows)
        return (step_ms - plain) * rows / plain

    # ---- calibration ----------------------------------------------------------------------------
    def calibrate(self, run, max_rows: int):
        """Time run(m), a forward pass of m rows, for every m of ROWS up to max_rows and max_rows
        itself (within ROWS; padded to the row block), ROUNDS times each, round after round (a
        burst of other work falls on one round of a few row counts, not on every round of one);
        the best of each, never less for more rows. The best: what a pass takes when nothing
        else runs, for every m alike; what the machine's load adds now is the scale's, and what
        the guess rows really add, the steps teach the shape."""
        t0 = time.perf_counter()
        most = [max_rows] if max_rows <= self.ROWS[-1] else []
        sizes = sorted({padded(m, self.row_block) for m in [*self.ROWS, *most] if m <= max_rows})
        if len(sizes) < 2:
            return
        ms = dict.fromkeys(sizes, float("inf"))
        for _ in range(self.ROUNDS):
            for m in sizes:
                t = time.perf_counter()
                run(m)
                ms[m] = min(ms[m], (time.perf_counter() - t) * 1e3)
        top = 0.0
        self.shape = {m: (top := max(top, t)) for m, t in sorted(ms.items())}
        self.points, self._envelope = {m: [t] for m, t in self.shape.items()}, None
        self.scales, self.outsides, self.scale, self.outside = [], [], 1.0, 0.0
        self.calibrate_s = time.perf_counter() - t0

    def calibrate_arena(self, engine, max_rows: int, start: int = 0):
        """One sequence over the stage's arena: a plain step (greedy_next) for one row, a pass
        of every row's logits for more, at positions start.. (past what the cache holds, where
        nothing is read: the next step writes over them). A stage without a cache recomputes the
        whole text at every step, so k more rows add k to its length: nearly free (not timed:
        its passes take seconds); the steps then measure it."""
        if not engine.uses_kv_cache:
            self.shape = {1: 1.0, max_rows: 1.0}
            self.points, self._envelope = {m: [t] for m, t in self.shape.items()}, None
            return

        def run(m):
            if m == 1:
                engine.greedy_next([0], start)
            else:
                engine.forward([0] * m, start, all_logits=True)
        self.calibrate(run, min(max_rows, engine.n_ctx - start))

    def calibrate_pool(self, forward, pool: PagePool, max_rows: int):
        """A server's step: forward(Batch) for M rows of one sequence at positions 0.., M up to
        max_rows and what the pool can hold, every row's logits; its pages are given back."""
        table = PageTable(pool)
        most = max_rows
        while most > 1 and PageTable.pages_for(padded(most, self.row_block), pool.page_size) > pool.n_available:
            most //= 2
        if table.admit([0], padded(most, self.row_block)) is None:
            return

        def run(m):
            table.truncate(0)
            table.reserve_for(m)
            forward(Batch(pool, [Segment(table, [0] * m, all_logits=True)], self.row_block))
        try:
            self.calibrate(run, most)
        finally:
            table.release()


# ---- the planner: one for a server's step and for one sequence ---------------------------------

class Speculation:
    """Prompt lookup's guesses for the decoding sequences of a step (`plan`), the measured step
    times (`time`), and the counts of guesses made and kept (`pooled`: every sequence's, the
    prior a new sequence starts from; its `drafted` and `accepted` are /metrics' counters).
    A decoding sequence, to the planner: `context` (its tokens, the newest not yet in its cache),
    `room` (tokens it may still make), `guesser`, `sampler`; the plan sets its `guesses`.
    `rule`: accept (tests plant wrong ones); `seed`: the accept-rate draws are reproducible."""

    CHARGE = 2.0              # a step's charge within [0, price x CHARGE]: as far either side of its price

    def __init__(self, n_ctx: int, draft_max: int = DRAFT_MAX, time: StepTime | None = None, rule=accept,
                 n_max: int = LOOKUP_NGRAM[1], seed: int = 0):
        self.n_ctx, self.draft_max, self.rule, self.n_max = n_ctx, draft_max, rule, n_max
        self.time = time or StepTime()
        self.pooled = AcceptCounts()
        self.rng = np.random.default_rng(seed)
        self.guessed: list[Guesser] = []        # who guessed in the last step planned
        self.priced, self.made = 0.0, 0         # the price of its guesses when planned (tokens), how many

    def guesser(self) -> Guesser:
        """One sequence's part (app/serve/sequence.py: Sequence.guesser; Speculator's one)."""
        return PromptLookup(self.pooled, self.rule, n_max=self.n_max)

    def plan(self, decoding: list, rows: int):
        """Set each decoding sequence's `guesses` for the next step, whose other rows number
        `rows` (the module docstring's rule), each offer cut to what its ledger can pay at the
        step times' price; first the last step's guesses are charged what they cost."""
        self.charge()
        offers = []
        for seq in decoding:
            cap = min(self.draft_max, seq.room - 1, self.n_ctx - len(seq.context))
            n, a = seq.guesser.offer(seq.context, cap, self.rng) if cap > 0 and seq.guesser else (0, 0.0)
            while n and self.price(rows, n) > seq.guesser.credit:
                n -= 1
            offers.append((n, a))
        ks = allot([(a, n) for n, a in offers], rows, self.cost(rows, sum(n > 0 for n, _ in offers)))
        self.fill(decoding, ks)
        made = sum(len(seq.guesses) for seq in decoding)
        self.guessed = [seq.guesser for seq in decoding if seq.guesses]
        self.priced, self.made = (self.price(rows, made) if made else 0.0), made
        self.time.planned(made)

    def price(self, rows: int, extra: int) -> float:
        """What `extra` guess rows would cost a step of `rows` other rows, in tokens, by the step
        times: the time they add, at the rate the step without them makes its rows."""
        cost = self.cost(rows, 1)
        plain = cost(0)
        return (cost(extra) - plain) * rows / plain

    def charge(self):
        """The last step's guess rows, measured (StepTime.extra of the step last observed),
        charged to the sequences that guessed in it, by the guesses each made. What a step is
        charged stays between nothing and CHARGE times its price when planned, as far below it
        as above (a burst of other work costs a sequence no more than twice what its guesses
        should have; a price the step times got wrong is still corrected, up to twice over each
        step, while they learn)."""
        guessed, self.guessed = self.guessed, []
        step, self.time.last = self.time.last, None
        made = sum(g.last_drafted for g in guessed)           # (guesses without pages were dropped)
        if step is None or not made or step[0] <= made:
            return
        rows, ms = step
        priced = self.priced * made / self.made
        tokens = min(max(self.time.extra(rows - made, ms), 0.0), priced * self.CHARGE)
        for g in guessed:
            g.charge(tokens * g.last_drafted / made)

    def cost(self, rows: int, guessing: int):
        """cost(extra): a step of rows + extra rows (prompt lookup costs nothing more)."""
        return lambda extra: self.time(rows + extra)

    def fill(self, decoding: list, ks: list[int]):
        """Each sequence's guesses for the step: the first k of what it found."""
        for seq, k in zip(decoding, ks):
            seq.guesses = list(seq.guesser.found[:k]) if k else []

    def calibrate_draft(self, max_rows: int):
        """A draft model's steps, timed (DraftSpeculation); prompt lookup has none."""


class DraftSpeculation(Speculation):
    """A draft model's guesses for the decoding sequences (`--spec draft --model-draft FILE`): the
    same rule for how many (allot), where a step's guesses also cost the draft model's steps,
    ceil(extra rows / sequences offering) of them at `draft_time` (calibrated like the
    target's); then the draft steps run batched, every guessing sequence's rows in one call of
    the draft model per guess, over its own page pool (`pages` of it)."""

    def __init__(self, n_ctx: int, draft, pages: int, draft_max: int = DRAFT_MAX, time: StepTime | None = None,
                 draft_time: StepTime | None = None, rule=accept, seed: int = 0):
        super().__init__(n_ctx, draft_max, time, rule, seed=seed)
        cfg = draft.config
        self.draft = draft
        self.pool = PagePool(cfg.n_layer, draft.backend.kv_width(cfg), pages, dtype=draft.backend.kv_dtype)
        self.draft_time = draft_time or StepTime(row_block=draft.backend.row_block)

    def guesser(self) -> DraftGuesser:
        return DraftGuesser(self.pooled, self.rule, self.pool)

    def cost(self, rows: int, guessing: int):
        def cost(extra: int) -> float:
            steps = -(-extra // max(guessing, 1))
            return self.time(rows + extra) + steps * (self.draft_time(guessing)
                                                             if self.draft_time.calibrated else 0)
        return cost

    def calibrate_draft(self, max_rows: int):
        self.draft_time.calibrate_pool(self.draft.forward_batch, self.pool, max(max_rows, 2))

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


# ---- one sequence over the arena: Session.generate's step ----------------------------------------

class One:
    """The one decoding sequence of `run --spec`, as the planner sees a server's: the session's
    tokens, the tokens it may still make, its guesser, sampler and the step's guesses."""

    def __init__(self, session: Session, guesser: Guesser):
        self.session, self.guesser = session, guesser
        self.room, self.sampler, self.guesses = 0, None, []

    @property
    def context(self) -> list:
        return self.session.tokens


class Speculator:
    """Session.generate's step strategy (common/generate.py: PlainStep is the other): the planner
    over a batch of one, each step 1..k+1 tokens. `speculation`: Speculation (prompt lookup) or
    DraftSpeculation; its step times are measured over this engine's arena (`prepare`)."""
    name = "speculative"

    def __init__(self, speculation: Speculation):
        self.speculation = speculation
        self.one = None

    def prepare(self, session: Session):
        """Before the prompt is fed: the step times of this engine, measured where the session's
        cache ends (StepTime.calibrate_arena, and the draft model's), once; its guesser."""
        spec = self.speculation
        spec.n_ctx = session.engine.n_ctx
        if not spec.time.calibrated:
            spec.time.calibrate_arena(session.engine, spec.draft_max + 1, session.n_cached)
            spec.calibrate_draft(2)
        self.one = None

    def step(self, session: Session, sampler: Sampler, room: int) -> tuple[list, int, int]:
        """One decode step: (the tokens appended, at most `room`; guesses made; guesses kept)."""
        spec = self.speculation
        if self.one is None or self.one.session is not session:
            self.one = One(session, spec.guesser())
        one = self.one
        one.room, one.sampler = room, sampler
        t0 = time.perf_counter()
        spec.plan([one], 1)
        guesses, one.guesses = one.guesses, []
        t1 = time.perf_counter()
        if not guesses:
            tok = session.next_token(sampler)
            now = time.perf_counter()
            spec.time.observe(1, (now - t1) * 1e3, (now - t0) * 1e3)
            return [tok], 0, 0
        ruled = []

        def rule(rows):
            t = time.perf_counter()
            out = one.guesser.verify(rows, guesses, sampler, session.tokens)
            ruled.append(time.perf_counter() - t)
            return out
        kept, tok = session.verify(guesses, rule)
        now = time.perf_counter()
        one.guesser.observe(len(guesses), kept, kept)
        spec.time.observe(len(guesses) + 1, (now - t1 - sum(ruled)) * 1e3, (now - t0) * 1e3)
        return guesses[:kept] + [tok], len(guesses), kept

    def close(self):
        if self.one is not None:
            self.one.guesser.release()
            self.one = None


def from_flags(mode: str, draft_max: int = DRAFT_MAX, draft_engine=None, target=None) -> Speculator | None:
    """The Speculator for `run --spec MODE` (lookup | draft | off: None); `target`: the engine it
    serves (the draft's vocabulary checked against it)."""
    if mode == "off":
        return None
    n_ctx = target.n_ctx if target is not None else 0        # set from the session's engine (prepare)
    if mode == "lookup":
        return Speculator(Speculation(n_ctx, draft_max))
    if mode == "draft":
        if draft_engine is None:
            raise ParameterError("--spec draft needs a draft model: give --model-draft FILE (a smaller model "
                                 "with the same vocabulary)")
        if target is not None:
            check_vocabulary(target.gguf, draft_engine.gguf)
        pages = PageTable.pages_for(draft_engine.n_ctx + draft_max + 1) + 1
        return Speculator(DraftSpeculation(n_ctx, draft_engine, pages, draft_max))
    raise ParameterError(f"--spec {mode!r}: must be lookup, draft or off")
