"""Speculative decoding (common/speculative.py): the guesses, how many, the rule, the rollback.

* Prompt lookup on crafted sequences: the longest n-gram, its most recent occurrence; the
  index that keeps the search up to date gives what a scan of the text gives (a planted index
  that keeps first occurrences is caught).
* How many guesses, the planner over one sequence, simulated (step times and accept rates made
  up, noisy): a kind that keeps failing stops guessing, one that keeps matching guesses long (a
  rate that never learns, planted, is caught); never below 0.97x plain decoding over step costs
  from nearly free rows to a step per row and accept rates from 0 to 0.9, with a wrong accept
  rate (the ledger stops it; planted without the ledger: caught) and a calibration that prices
  guess rows at a fifth of their cost (the shape learns; planted: the scale learned from every
  step, caught).
* The rule keeps the model's distribution: many seeded draws of the next two tokens on a tiny
  model, a chi-square test against the plain sampler's distribution (deterministic guesses, a
  draft model's guesses, the whole sampler chain); planted wrong rules must fail it.
* Greedy text identical to plain decoding on the default model: a float stage exactly (with the
  margin that makes it so measured), the 8-bit-activation stage exactly or at measured
  near-ties; guesses right, wrong and mixed, so kept and rolled-back positions both happen; a
  rule that keeps every guess, planted, must change the text.
* The rollback: the arena (Session.truncate), the paged pool (PageTable.truncate: pages and
  reservation given back, no registered page left holding rejected tokens; a planted truncate
  that forgets is caught). Speculation in the server's batched step: tests/test_spec_serve.py.
* The draft model: vocabulary checks, and its greedy text.
* The command line: --spec, --draft-max, --model-draft and the --json fields.
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from common import speculative as sp
from common.generate import ParameterError, Sampler, SamplingParams, Session, generate
from common.gguf import GGUFFile, GGUFWriter, ValueType
from common.paged_kv import PagePool, PageTable
from stages import load

COPY_PROMPT = ("Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
               "kiwi, lemon, mango.\nRepeat: apple, banana,")
FREE_PROMPT = "The weather today is"
N_GEN = 20
FLOAT_STAGE = "threads"          # float activations, the quantized weights: fast, and exact in float32
ROUNDING_STAGE = "fused"         # activations rounded to 8 bits (int8's numerics)
NEAR_TIE = 0.25                  # logits: as tests/test_stages.py allows int8 at a near-tie


class FreeRows(sp.StepTime):
    """Every step costs the same whatever its rows (so a guess costs nothing in the ledger
    either), whatever the steps take: the planner then guesses all it is offered, so the tests'
    steps do not depend on this machine's speed."""

    def __init__(self, ms: float = 1.0):
        super().__init__({1: ms, 1 << 16: ms})

    def observe(self, rows, forward_ms, step_ms):
        self.guess_rows = 0


def always_guessing(guesser: sp.Guesser, draft_max=8, rule=sp.accept) -> sp.Speculator:
    """The one sequence guessing with `guesser` (its rule set to `rule`) over FreeRows."""
    spec = sp.Speculation(4096, draft_max, FreeRows(), rule)
    guesser.pooled, guesser.rule = spec.pooled, rule
    spec.guesser = lambda: guesser
    return sp.Speculator(spec)


def always_drafting(draft_engine, draft_max=8, rule=sp.accept) -> sp.Speculator:
    """A draft model's guesses, every one it may make (its steps cost nothing either)."""
    pages = PageTable.pages_for(draft_engine.n_ctx + draft_max + 1) + 1
    return sp.Speculator(sp.DraftSpeculation(4096, draft_engine, pages, draft_max, FreeRows(), FreeRows(0.0), rule))


class Scripted(sp.Guesser):
    """Guesses read from a script (position -> token), every `wrong`-th one replaced by another token."""

    def __init__(self, script, wrong: int | None = None, n_vocab: int = 49152):
        super().__init__(sp.AcceptCounts())
        self.script, self.wrong, self.n_vocab = list(script), wrong, n_vocab

    def look(self, context, k_max):
        n = len(context)
        self.key = "scripted"
        self.found = [t if self.wrong is None or (n + j) % self.wrong else (t + 1) % self.n_vocab
                      for j, t in enumerate(self.script[n:n + k_max])]
        return len(self.found)


def keep_every_guess(logits, draft, sampler, history):
    """A WRONG rule, planted: every guess kept, then the model's pick after them."""
    ids, probs = sampler.distribution(logits[len(draft.tokens)], list(history) + list(draft.tokens))
    return len(draft.tokens), int(ids[0]) if sampler.params.greedy else int(ids[sampler.rng.choice(len(ids), p=probs)])


# ---- prompt lookup -------------------------------------------------------------------------------

def test_lookup_proposes_what_followed_the_longest_recent_match():
    look = sp.PromptLookup(n_min=1, n_max=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    text = [5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2]
    assert look.find(text, 4) == (2, [3, 7, 1, 2])         # [1, 2] last seen at 6, not at 1
    assert look.find(text + [3], 4) == (3, [7, 1, 2, 3])   # [1, 2, 3]: the 3-gram beats the shorter ones
    assert look.find(text + [3], 2) == (3, [7, 1])         # at most k
    assert look.find([4, 4, 4, 4], 3) == (3, [4, 4, 4])    # runs into the end: the text repeats
    assert look.find([7, 1, 2, 1, 2], 5) == (2, [1, 2, 1, 2, 1])   # with the period it has (2 here)
    assert look.find([1, 2, 3, 4], 3) == (0, [])           # nothing occurred before
    assert look.find([6], 3) == (0, [])
    assert sp.PromptLookup(n_min=2, n_max=3).find([5, 1, 2, 1], 3) == (0, [])     # n_min = 2: a single 1 does not count
    with pytest.raises(ValueError, match="n_min <= n_max"):
        sp.PromptLookup(n_min=3, n_max=2)


def scanned(tokens, k: int, n_min: int, n_max: int) -> tuple[int, list]:
    """The search NgramIndex keeps up to date, done the slow way: a scan of the whole text, and
    the copy token by token (a guess that runs past the text's end reads the guesses before it)."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)     # each ends before the text does
        hits = np.flatnonzero((windows == t[L - n:]).all(axis=1))
        if len(hits):
            text = t.tolist()
            for i in range(k):
                text.append(text[int(hits[-1]) + n + i])
            return n, text[L:]
    return 0, []


class KeepsTheFirst(sp.NgramIndex):
    """A WRONG index, planted: an n-gram seen again keeps its first occurrence, not its latest."""

    def extend(self, tokens):
        for t in tokens:
            at = len(self.tokens)
            for n in range(1, min(self.n_max, at) + 1):
                self.after.setdefault(tuple(self.tokens[at - n:at]), at)
            self.tokens.append(int(t))


def index_mismatches(index_class) -> int:
    """Texts of a few symbols (many matches, of every length), grown a token at a time, cut
    short (the index is built again) and grown again: how often the index and the scan differ."""
    rng = np.random.default_rng(0)
    look = sp.PromptLookup(n_min=1, n_max=4)
    look.index = index_class(4)
    wrong = 0
    for _ in range(20):
        text = rng.integers(0, 4, 60).tolist()
        for L in list(range(1, 61)) + list(range(30, 45)):
            if len(look.index.tokens) > L:                     # what PromptLookup.find does, with this class
                look.index = index_class(4)
            look.index.extend(text[len(look.index.tokens):L])
            wrong += look.index.find(5) != scanned(text[:L], 5, 1, 4)
    return wrong


def test_the_index_finds_what_a_scan_of_the_text_finds():
    assert index_mismatches(sp.NgramIndex) == 0
    assert index_mismatches(KeepsTheFirst) > 0                   # the planted index is caught
    look = sp.PromptLookup(n_min=1, n_max=4)
    assert [look.find(t, 3) for t in ([1, 2, 3, 1, 2], [1, 2, 3, 1, 2, 3], [5, 2, 5])] == \
        [(2, [3, 1, 2]), (3, [1, 2, 3]), (1, [2, 5, 2])]       # grown, then another text: built again
    index = sp.NgramIndex(3, [1, 2, 3, 1, 2])
    assert index.find(4) == (2, [3, 1, 2, 3]) and index.find(4, n_min=3) == (0, [])


def test_lookup_offers_what_it_found_and_the_planner_takes_what_pays():
    spec = sp.Speculation(4096, 8, FreeRows())
    seq = Sim(spec.guesser(), [1, 2, 3, 4, 5, 1, 2])
    spec.plan([seq], 1)
    assert seq.guesses == [3, 4, 5, 1, 2, 3, 4, 5] and seq.guesser.key == ("ngram", 2)
    seq = Sim(spec.guesser(), [1, 2, 3])
    spec.plan([seq], 1)
    assert seq.guesses == []


# ---- how many guesses: the planner over one sequence, simulated -----------------------------------

class Sim:
    """A decoding sequence as the planner sees it (a server's Sequence, run's One)."""

    def __init__(self, guesser, context=(0,) * 8, room: int = 10**6):
        self.guesser, self.context, self.room = guesser, list(context), room
        self.guesses, self.sampler = [], None


class Offered(sp.Guesser):
    """Guesses of one kind, 16 on offer at every step (prompt lookup on a text that copies
    itself throughout, or a draft model)."""

    def look(self, context, k_max):
        self.key, self.found = "kind", [0] * k_max
        return k_max


class Unlimited(Offered):
    """The ledger never charged: the accept rate and the step times alone decide."""

    def charge(self, tokens):
        pass


class Stubborn(Offered):
    """A WRONG accept rate, planted: what the guesses did never reaches the counts (its own
    or the pooled ones), so the rate stays the prior's; the ledger still sees the tokens."""

    def learn(self, drafted, kept, emitted):
        pass


class StubbornUnlimited(Stubborn):
    """Planted on top: the ledger never charged (nothing stops a guess the rate favours)."""

    def charge(self, tokens):
        pass


class EveryStepScales(sp.StepTime):
    """The WRONG rule of step times, planted: every step moves the scale (the plain step a
    guess is weighed against learned from the guesses too), the shape never learns."""

    def observe(self, rows, forward_ms, step_ms):
        self.guess_rows = 0
        sp.keep(self.scales, forward_ms / self.shape_at(rows), self.RECENT)
        self.last = (rows, step_ms)


def simulated(rate: float, true_ms, calibrated=None, guesser=Offered, time_class=sp.StepTime, steps: int = 400,
              noise: float = 0.0, seed: int = 1) -> tuple[float, float, float]:
    """One sequence decoding `steps` steps under the planner, each guess kept with probability
    `rate` (the first refusal ends the step's run), a pass of m rows taking true_ms(m) ms times
    (1 + noise x a standard normal), the step times calibrated as calibrated(m) (default: the
    truth). Returns (tokens per ms over plain decoding's, share of steps that guessed, guesses
    per guessing step)."""
    rng = np.random.default_rng(seed)
    time = time_class({m: (calibrated or true_ms)(m) for m in sp.StepTime.ROWS if m <= 17})
    spec = sp.Speculation(10**6, 16, time, seed=seed)
    seq = Sim(guesser(spec.pooled))
    ms = tokens = guessed = made = 0
    for _ in range(steps):
        spec.plan([seq], 1)
        guesses, seq.guesses = seq.guesses, []
        kept = 0
        while kept < len(guesses) and rng.random() < rate:
            kept += 1
        t = true_ms(len(guesses) + 1) * max(0.2, 1 + noise * rng.standard_normal())
        if guesses:
            seq.guesser.observe(len(guesses), kept, kept)
            guessed, made = guessed + 1, made + len(guesses)
        time.observe(len(guesses) + 1, t, t)
        ms, tokens = ms + t, tokens + kept + 1
    return tokens / ms * true_ms(1), guessed / steps, made / max(guessed, 1)


def nearly_free(m):                 # a memory-bound step: a row adds a tenth of a step
    return 1.0 + 0.1 * (m - 1)


def fused_small_cpu(m):             # a verify pass as measured for the fused stage on a small CPU
    return 1.0 + 0.45 * (m - 1)


def knee(m):                        # free up to 4 rows, then each row most of a step (a kernel's third pair)
    return 1.0 + 0.05 * (min(m, 4) - 1) + 0.8 * max(m - 4, 0)


def every_row_a_step(m):            # compute-bound: no guess can pay
    return float(m)


def test_guesses_that_keep_failing_stop_and_those_that_match_grow():
    """The accept rate decides (the ledger set aside): a kind of guess that keeps failing is
    seldom tried, one that keeps matching guesses long; a rate that never learns (planted)
    keeps guessing."""
    _, failing, _ = simulated(0.1, fused_small_cpu, guesser=Unlimited)
    assert failing < 0.1, f"free text: guessed on {failing:.0%} of the steps"
    _, share, k = simulated(0.97, fused_small_cpu, guesser=Unlimited)
    assert share > 0.9 and k >= 6, (share, k)
    _, stuck, _ = simulated(0.1, fused_small_cpu, guesser=StubbornUnlimited)
    assert stuck > 0.2, "the planted rate that never learns should keep guessing"


CASES = [(cost, rate) for cost in (nearly_free, fused_small_cpu, knee, every_row_a_step)
         for rate in (0.0, 0.1, 0.3, 0.6, 0.9)]


def losses(guesser=Offered, time_class=sp.StepTime, calibrated=None, noise: float = 0.3) -> list[str]:
    """Every case of CASES simulated with step times that wander by `noise`: the cases slower
    than 0.97x plain decoding."""
    out = []
    for cost, rate in CASES:
        speed, share, _ = simulated(rate, cost, calibrated and calibrated(cost), guesser, time_class, noise=noise)
        if speed < 0.97:
            out.append(f"{cost.__name__}, accept rate {rate}: {speed:.3f}x plain, guessed on {share:.0%} of steps")
    return out


def test_speculation_never_costs_more_than_three_percent():
    """Over step costs from nearly free rows to rows that each cost a step, and accept rates
    from 0 to 0.9, with step times wandering by 30%: never below 0.97x plain decoding, and
    where guesses are likely and rows cheap, far above it. It holds with a wrong accept rate
    (planted: one that never learns), the ledger stopping it; and with a calibration that
    prices every guess row at a half or a fifth of its cost, the shape learning the truth and
    the ledger charging what the steps took. Without the ledger (planted), the wrong rate
    loses; with the scale learned from every step (planted: the plain step weighed against
    guesses inflated by them), the calibration at a fifth loses."""
    assert losses() == []
    assert simulated(0.9, nearly_free, noise=0.3)[0] > 2.0
    assert losses(Stubborn) == []
    assert losses(StubbornUnlimited) != []

    def cheaper(by: float):                     # guess rows at a part of their cost
        return lambda cost: lambda m: cost(1) + (cost(m) - cost(1)) / by
    assert losses(calibrated=cheaper(2)) == [] and losses(calibrated=cheaper(5)) == []
    assert losses(time_class=EveryStepScales, calibrated=cheaper(5)) != []


def test_step_time_learns_a_dear_guess_row_and_weighs_it_against_the_plain_step():
    """Calibrated: 5 rows cost what 1 does; the steps say 5 rows take 15 ms and 1 row 10: the
    shape at 5 follows, the plain step stays 10 ms, and 4 guess rows beside one sequence's row
    cost half a token. The planted rule (scale from every step) weighs them against a plain step
    inflated by the guesses, its shape never learning: it prices them far lower."""
    for time_class, right in ((sp.StepTime, True), (EveryStepScales, False)):
        t = time_class({1: 10.0, 8: 10.0, 16: 18.0})
        for _ in range(60):
            t.observe(1, 10.0, 10.0)
            t.planned(4)
            t.observe(5, 15.0, 15.0)
        price = sp.Speculation(4096, 8, t).price(1, 4)
        if right:
            assert t.forward_ms(1) == pytest.approx(10.0) and t.forward_ms(5) == pytest.approx(15.0, rel=0.01)
            assert price == pytest.approx(0.5, rel=0.02)
        else:
            assert price < 0.35



class LearnsBelowCalibration(sp.StepTime):
    """The WRONG rule, planted: a point of the shape learned from the steps may fall below its
    calibration (the median of its calibration and its last steps, whatever they say)."""

    def observe(self, rows, forward_ms, step_ms):
        guess_rows = self.guess_rows
        super().observe(rows, forward_ms, step_ms)
        m = sp.padded(max(rows, 1), self.row_block)
        if guess_rows and self.calibrated:
            self.shape[m], self._envelope = statistics.median(self.points[m]), None


def test_a_busy_moment_never_prices_a_guess_row_at_nothing():
    """Calibrated (a quiet moment): 1 row 10 ms, 2 rows 11. Five plain steps in a busy moment
    (16 ms) leave the scale at 1.6; then the machine is quiet again and the sequence guesses
    every step, so no plain step corrects the scale: its 2-row steps (11 ms) read 6.9 ms of
    shape, below the calibration. The shape keeps 11 at 2 rows, so a guess row still costs a
    tenth of a token. The planted rule learns 6.9: the shape flat, the guess priced at nothing,
    and then charged nothing, whatever it takes."""
    for time_class, right in ((sp.StepTime, True), (LearnsBelowCalibration, False)):
        t = time_class({1: 10.0, 2: 11.0, 4: 13.0})
        for _ in range(5):
            t.observe(1, 16.0, 16.0)
        for _ in range(10):
            t.planned(1)
            t.observe(2, 11.0, 11.0)
        price = sp.Speculation(4096, 8, t).price(1, 1)
        assert (price == pytest.approx(0.1)) if right else price == 0.0, (time_class.__name__, price)


# ---- the rule keeps the distribution: a tiny model, many draws, a chi-square test -----------------

V, D, H, HKV, HD, FF = 8, 16, 2, 1, 8, 32
TINY_STAGE = "kv_cache"
N_DRAWS = 2000
PROMPT = [1, 2, 3, 4]
CHAIN = dict(temp=0.8, top_k=6, top_p=0.95, min_p=0.02, repeat_penalty=1.5, repeat_last_n=4)
PLAIN = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)


def write_tiny(path, seed: int, n_layer: int = 1, tokens=None):
    """A llama model of V tokens, D wide, F32 random weights (spread-out next-token distributions)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path)
    U32 = ValueType.UINT32
    w.add("general.architecture", "llama")
    for key, value in (("context_length", 64), ("embedding_length", D), ("block_count", n_layer),
                       ("feed_forward_length", FF), ("attention.head_count", H), ("attention.head_count_kv", HKV)):
        w.add(f"llama.{key}", value, U32)
    w.add("llama.attention.layer_norm_rms_epsilon", 1e-5, ValueType.FLOAT32)
    w.add("tokenizer.ggml.model", "llama")
    w.add("tokenizer.ggml.tokens", tokens or [f"t{i}" for i in range(V)])

    def m(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    w.add_tensor("token_embd.weight", m(V, D, s=1.0))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    w.add_tensor("output.weight", m(V, D, s=0.4))
    for i in range(n_layer):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + name + ".weight", np.ones(D, np.float32))
        for name, shape in (("attn_q", (H * HD, D)), ("attn_k", (HKV * HD, D)), ("attn_v", (HKV * HD, D)),
                            ("attn_output", (D, H * HD)), ("ffn_gate", (FF, D)), ("ffn_up", (FF, D)),
                            ("ffn_down", (D, FF))):
            w.add_tensor(p + name + ".weight", m(*shape))
    w.write()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, draft): two tiny models of one vocabulary, different weights."""
    d = tmp_path_factory.mktemp("tiny")
    target = load(TINY_STAGE, write_tiny(d / "target.gguf", seed=1))
    draft = load(TINY_STAGE, write_tiny(d / "draft.gguf", seed=2))
    return target, draft


def exact_two(engine, params: dict) -> np.ndarray:
    """P(a, b) [V, V]: the plain sampler's distribution of the next two tokens after PROMPT."""
    s = Sampler(SamplingParams(**params))
    engine.reset()
    first = engine.forward(PROMPT, 0, all_logits=False)[0]
    ids, probs = s.distribution(first, PROMPT)
    out = np.zeros((V, V))
    for a, pa in zip(ids, probs):
        engine.reset()
        row = engine.forward(PROMPT + [int(a)], 0, all_logits=False)[0]
        ids_b, probs_b = s.distribution(row, PROMPT + [int(a)])
        out[a, ids_b] = pa * probs_b
    return out


def drawn_two(engine, spec, params: dict, n: int = N_DRAWS, seed: int = 7) -> np.ndarray:
    """Counts [V, V] of the next two tokens after PROMPT, each draw made by speculative steps (one
    guess at most, then a plain step if one token came), rolled back to PROMPT after each."""
    session = Session(engine)
    session.tokens = list(PROMPT[:-1])
    engine.forward(session.tokens, 0, all_logits=False)         # the cache holds all but the newest
    session.n_cached = len(session.tokens)
    session.tokens.append(PROMPT[-1])
    sampler = Sampler(SamplingParams(seed=seed, **params))
    counts = np.zeros((V, V), int)
    for _ in range(n):
        out = []
        while len(out) < 2:
            tokens, _, _ = spec.step(session, sampler, 2 - len(out))
            out += tokens
        counts[out[0], out[1]] += 1
        session.truncate(len(PROMPT))
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts under the distribution (cells expected under 5 pooled into one); 0
    if a pair the distribution rules out was drawn."""
    from scipy.stats import chisquare
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].sum():
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


class Fixed(sp.Guesser):
    """A deterministic guess: always the same token (q one-hot at it)."""

    def __init__(self, token: int):
        super().__init__(sp.AcceptCounts())
        self.token = token

    def look(self, context, k_max):
        self.key, self.found = "fixed", [self.token] * k_max
        return k_max


def resample_from_p(logits, draft, sampler, history):
    """A WRONG rule, planted: keep with probability min(1, p/q), but on rejection draw from p
    itself instead of norm(max(0, p - q))."""
    history = list(history)
    for i, d in enumerate(draft.tokens):
        ids, probs = sampler.distribution(logits[i], history)
        p = sp.dense_distribution(ids, probs, logits.shape[1])
        q = draft.q[i] if draft.q is not None else sp.dense_distribution([d], [1.0], logits.shape[1])
        if not sampler.rng.random() < min(1.0, p[d] / q[d]):
            return i, int(ids[sampler.rng.choice(len(ids), p=probs)])
        history.append(d)
    ids, probs = sampler.distribution(logits[len(draft.tokens)], history)
    return len(draft.tokens), int(ids[sampler.rng.choice(len(ids), p=probs)])


def raw_softmax(logits, draft, sampler, history):
    """A WRONG rule, planted: the right rule, against the softmax of the raw logits instead of the
    sampler chain's distribution (no penalty, top-k, top-p, min-p or temperature)."""
    raw = Sampler(SamplingParams(seed=0, **PLAIN))
    raw.rng = sampler.rng
    return sp.accept(logits, draft, raw, history)


def best_second(engine) -> int:
    """The second most likely first token: a guess that is kept about as often as rejected."""
    engine.reset()
    row = engine.forward(PROMPT, 0, all_logits=False)[0]
    engine.reset()
    return int(np.argsort(-row)[1])


@pytest.mark.parametrize("case", ["lookup-like guess", "draft model", "sampler chain"])
def test_speculative_sampling_keeps_the_plain_samplers_distribution(tiny, case):
    """The rule's twin and its planted failures on the same draws: the right rule passes the
    chi-square test (p > 0.001), every wrong one fails it (p < 1e-6)."""
    target, draft = tiny
    params = CHAIN if case == "sampler chain" else PLAIN
    exact = exact_two(target, params)
    assert exact.sum() == pytest.approx(1.0)

    def guessing(rule=sp.accept):
        if case == "draft model":
            return always_drafting(draft, 1, rule)
        return always_guessing(Fixed(best_second(target)), 1, rule)

    wrong = {"keeps every guess": keep_every_guess, "draws a rejection from p": resample_from_p}
    if case == "sampler chain":
        wrong["verifies against the raw softmax"] = raw_softmax
    p_right = chi_square_p(drawn_two(target, guessing(), params), exact)
    assert p_right > 1e-3, f"{case}: the rule's draws fail the chi-square test (p = {p_right:.2g})"
    for name, rule in wrong.items():
        p_wrong = chi_square_p(drawn_two(target, guessing(rule), params), exact)
        assert p_wrong < 1e-6, f"{case}: a rule that {name} passed the chi-square test (p = {p_wrong:.2g})"


def test_plain_draws_pass_the_same_test(tiny):
    """The test's own twin: the plain sampler, drawing the two tokens one at a time, passes."""
    target, _ = tiny
    sampler = Sampler(SamplingParams(seed=3, **PLAIN))
    counts = np.zeros((V, V), int)
    for _ in range(N_DRAWS):
        gen = generate(target, PROMPT, 2, sampler, ignore_eos=True)
        counts[gen.tokens[0], gen.tokens[1]] += 1
    assert chi_square_p(counts, exact_two(target, PLAIN)) > 1e-3


def test_a_draft_models_guesses_are_kept_at_min_one_p_over_q(tiny):
    """One step with one guess from the draft model: the share kept is E_q[min(1, p/q)] = sum min(p, q)."""
    target, draft = tiny
    engine_p = exact_two(target, PLAIN).sum(axis=1)                       # p of the first token
    draft_q = exact_two(draft, PLAIN).sum(axis=1)
    spec = always_drafting(draft, 1)
    session = Session(target)
    target.reset()
    target.forward(PROMPT[:-1], 0, all_logits=False)
    session.tokens, session.n_cached = list(PROMPT), len(PROMPT) - 1
    sampler = Sampler(SamplingParams(seed=5, **PLAIN))
    kept = 0
    for _ in range(N_DRAWS):
        _, drafted, k = spec.step(session, sampler, 2)
        assert drafted == 1
        kept += k
        session.truncate(len(PROMPT))
    want = np.minimum(engine_p, draft_q).sum()
    assert abs(kept / N_DRAWS - want) < 4 * np.sqrt(want * (1 - want) / N_DRAWS), (kept / N_DRAWS, want)


# ---- greedy: the text plain decoding writes ------------------------------------------------------

@pytest.fixture(scope="module")
def float_engine(default_model_path):
    return load(FLOAT_STAGE, default_model_path, threads=1)


def plain_and_logits(engine, prompt, n):
    """Plain greedy tokens and, for each, the one-row logits it was the argmax of."""
    gen = generate(engine, prompt, n, ignore_eos=True)
    engine.reset()
    rows = [engine.forward(prompt, 0, all_logits=False)[0]]
    for i, t in enumerate(gen.tokens[:-1]):
        rows.append(engine.forward([t], len(prompt) + i, all_logits=False)[0])
    engine.reset()
    return gen.tokens, np.array(rows)


def spec_tokens(engine, prompt, n, spec):
    gen = Session(engine).generate(prompt, n, Sampler(), ignore_eos=True, step=spec)
    assert len(gen.tokens) == n and len(gen.decode_ms) == n - 1
    return gen


def test_greedy_is_plain_decoding_on_a_float_stage(float_engine):
    """Lookup guesses (mostly right), a script of the right text with every third guess wrong,
    and a guess that is always wrong: the same text as plain decoding, token for token. Why
    exactly: the verify pass's rows differ from the one-row steps' by rounding only, and the
    smallest gap between the top two candidates along the text is measured far above it."""
    e = float_engine
    prompt = e.tokenizer.encode(COPY_PROMPT)
    plain, rows = plain_and_logits(e, prompt, N_GEN)
    runs = {"lookup": sp.PromptLookup(), "every third wrong": Scripted(prompt + plain, wrong=3),
            "always wrong": Scripted(prompt + [7] * (N_GEN + 1))}
    for name, drafter in runs.items():
        gen = spec_tokens(e, prompt, N_GEN, always_guessing(drafter))
        assert gen.tokens == plain, f"{name}: {gen.tokens} differs from plain {plain}"
        kept_some, rejected_some = gen.accepted > 0, gen.accepted < gen.drafted
        assert {"lookup": kept_some, "every third wrong": kept_some and rejected_some,
                "always wrong": gen.accepted == 0 and gen.drafted > 0}[name], (name, gen.drafted, gen.accepted)
    # the margin: one verify pass over the whole text against the one-row steps
    e.reset()
    e.forward(prompt[:-1], 0, all_logits=False)
    verify = e.forward(prompt[-1:] + plain[:-1], len(prompt) - 1, all_logits=True)
    e.reset()
    diff = float(np.abs(verify - rows).max())
    top2 = np.sort(rows, axis=1)[:, -2:]
    gap = float((top2[:, 1] - top2[:, 0]).min())
    assert diff < gap / 10, f"rounding {diff:.2e} is not far below the smallest top-2 gap {gap:.2e}"


def test_a_rule_that_keeps_every_guess_changes_the_text(float_engine):
    """The planted failure the identity test must catch: with wrong guesses kept, not plain's text."""
    e = float_engine
    prompt = e.tokenizer.encode(COPY_PROMPT)
    plain = generate(e, prompt, N_GEN, ignore_eos=True).tokens
    gen = spec_tokens(e, prompt, N_GEN, always_guessing(Scripted(prompt + plain, wrong=3), rule=keep_every_guess))
    assert gen.tokens != plain


def path_difference(engine, prompt, tokens, rows: int) -> np.ndarray:
    """Per position, max |logit| difference between one-row steps and passes of `rows` rows over
    the same text (teacher forcing): how far the stage's two paths part by rounding."""
    engine.reset()
    one = [engine.forward(prompt, 0, all_logits=False)[0]]
    for i, t in enumerate(tokens[:-1]):
        one.append(engine.forward([t], len(prompt) + i, all_logits=False)[0])
    engine.reset()
    engine.forward(prompt, 0, all_logits=False)
    seq, start, many = prompt[-1:] + tokens[:-1], len(prompt) - 1, []
    for j in range(0, len(seq), rows):                 # the prompt's last row again, then the text
        many.append(engine.forward(seq[j:j + rows], start + j, all_logits=True))
    engine.reset()
    return np.abs(np.concatenate(many) - np.array(one)).max(axis=1)


def test_greedy_with_rounded_activations_is_plain_decoding_or_a_near_tie(default_model_path):
    """The fused stage rounds activations to 8 bits, and its multi-row pass (integer tiles of 4
    rows) sums in another order than its one-row step; each rounding to 8 bits can then fall the
    other way, so the two paths' logits part by far more than float rounding (measured here,
    within the stage's LOGIT_TOLERANCE). The texts must agree, or part at a token where the plain
    step's pick led by no more than that measured difference: a near-tie, shown with its gap."""
    from stages.fused import LOGIT_TOLERANCE
    e = load(ROUNDING_STAGE, default_model_path, threads=1)
    for text in (COPY_PROMPT, FREE_PROMPT):
        prompt = e.tokenizer.encode(text)
        plain, rows = plain_and_logits(e, prompt, N_GEN)
        apart = path_difference(e, prompt, plain, 5)
        assert apart.max() <= LOGIT_TOLERANCE
        gen = spec_tokens(e, prompt, N_GEN, always_guessing(sp.PromptLookup()))
        part = next((i for i, (a, b) in enumerate(zip(plain, gen.tokens)) if a != b), None)
        print(f"\n{ROUNDING_STAGE}, {text[:24]!r}: one-row and 5-row passes part by up to {apart.max():.3f} logits; "
              + ("the texts agree" if part is None else
                 f"the texts part at token {part}, where plain's pick led by "
                 f"{rows[part, plain[part]] - rows[part, gen.tokens[part]]:.3f}"))
        if part is not None:
            gap = float(rows[part, plain[part]] - rows[part, gen.tokens[part]])
            assert 0 <= gap <= apart.max(), f"parted at token {part} where plain's pick led by {gap:.3f} logits"
    # the planted failure this check must catch: wrong guesses kept part the text far from a tie
    wrong = spec_tokens(e, prompt, N_GEN, always_guessing(Scripted(prompt + [7] * (N_GEN + 1)),
                                                          rule=keep_every_guess)).tokens
    part = next(i for i, (a, b) in enumerate(zip(plain, wrong)) if a != b)
    assert rows[part, plain[part]] - rows[part, wrong[part]] > apart.max()


def test_a_stop_token_among_kept_guesses_ends_the_text_there(float_engine):
    e = float_engine
    prompt = e.tokenizer.encode(COPY_PROMPT)
    plain = generate(e, prompt, N_GEN, ignore_eos=True).tokens
    stop = plain[10]
    want = plain[:plain.index(stop) + 1]
    session = Session(e)
    gen = session.generate(prompt, N_GEN, Sampler(), stop_ids={stop}, step=always_guessing(Scripted(prompt + plain)))
    assert gen.tokens == want and gen.stop_reason == "eog"
    assert session.tokens == prompt + want and session.n_cached <= len(session.tokens)
    assert gen.accepted <= gen.drafted and len(gen.decode_ms) == len(want) - 1


def test_the_arena_rolls_back_by_bookkeeping(float_engine):
    """Session.truncate: rejected positions are forgotten, and what follows is computed as if they
    had never been there (the same logits as a fresh run over the kept tokens)."""
    e = float_engine
    prompt = e.tokenizer.encode(FREE_PROMPT)
    s = Session(e)
    s.generate(prompt, 6, ignore_eos=True)
    s.truncate(len(prompt) + 2)
    assert len(s.tokens) == len(prompt) + 2 and s.n_cached <= len(prompt) + 2
    kept = list(s.tokens)
    again = s.generate([], 3, ignore_eos=True).tokens
    fresh = generate(e, kept, 3, ignore_eos=True).tokens
    assert again == fresh
    with pytest.raises(ValueError, match="cannot truncate"):
        s.truncate(len(s.tokens) + 1)


# ---- the paged pool --------------------------------------------------------------------------------

P = 4


def stale_registrations(table: PageTable, given_back=()) -> list[int]:
    """Registered pages holding tokens the sequence no longer has: its own pages, referenced by it
    alone, whose key is not what it now holds there (their slots are about to be overwritten),
    and pages it gave back that are still registered under its rejected tokens."""
    pool, out = table.pool, []
    for key, (_, page) in pool._nodes.items():
        if page in table.pages:
            i = table.pages.index(page)
            if pool.refs[page] == 1 and tuple(table.tokens[i * P:(i + 1) * P]) != key[1]:
                out.append(page)
        elif page in given_back:
            out.append(page)
    return out


def naive_truncate(table: PageTable, n: int):
    """A WRONG rollback, planted: the tokens forgotten, the pages and the prefix cache left alone."""
    del table.tokens[n:]


def fill(table, tokens):
    table.append_slots(tokens)
    table.register_full_pages()


@pytest.mark.parametrize("n", [6, 3])
@pytest.mark.parametrize("truncate, planted", [(PageTable.truncate, False), (naive_truncate, True)],
                         ids=["truncate", "planted-naive"])
def test_paged_rollback_gives_pages_back_and_unregisters_rejected_ones(truncate, planted, n):
    pool = PagePool(n_layer=1, kv_dim=2, n_pages=8, page_size=P)
    t = PageTable(pool)
    assert t.admit([1, 2, 3], 3 + 9) is not None                 # 3 pages promised
    fill(t, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])                     # 3 pages, 2 of them full and registered
    assert len(t.pages) == 3 and pool.n_cached == 2
    beyond = t.pages[PageTable.pages_for(n, P):]
    truncate(t, n)                                               # positions n.. were rejected guesses
    stale = stale_registrations(t, beyond)
    if planted:
        assert stale, "the planted rollback left a page registered under tokens the sequence no longer has"
        return
    assert not stale and t.tokens == [1, 2, 3, 4, 5, 6][:n]
    assert len(t.pages) == PageTable.pages_for(n, P) and t.reserved + len(t.pages) == 3
    assert pool.n_free == pool.n_pages - len(t.pages)
    fill(t, list(range(60, 60 + 12 - n)))                        # grows again into what it gave back
    assert not stale_registrations(t) and pool.n_cached == 3
    t.release()
    assert pool.n_free == 8 and pool.reserved == 0


def test_a_shared_page_is_left_to_its_sharer_and_copied_before_writing():
    pool = PagePool(n_layer=1, kv_dim=2, n_pages=8, page_size=P)
    a = PageTable(pool)
    a.admit([1, 2, 3, 4, 5], 12)
    fill(a, [1, 2, 3, 4, 5, 6, 7, 8])
    b = PageTable(pool)
    assert b.admit([1, 2, 3, 4, 5, 6, 7, 8, 9], 12) == 8          # both full pages by reference
    shared = b.pages[1]
    b.truncate(6)                                                # b's guesses 7, 8 rejected
    assert pool._node_of_page.get(shared) is not None and shared in a.pages   # still a's, still registered
    b.append_slots([70])
    assert b.pages[1] != shared and pool.copies == 1             # copied, a's page untouched


# ---- the draft model -----------------------------------------------------------------------------

def metadata_copy(src: GGUFFile, path, change=None):
    """A GGUF holding src's metadata only (what the vocabulary check reads), one key changed."""
    w = GGUFWriter(path)
    for key, value in src.metadata.items():
        if key == "general.alignment":
            continue
        if change and key in change:
            value = change[key](value)
        w.add(key, value, src.metadata_types[key], src.array_types.get(key))
    w.write()
    return GGUFFile(path)


def test_vocabulary_check_names_the_first_difference(default_model_path, tmp_path):
    g = GGUFFile(default_model_path)
    sp.check_vocabulary(g, metadata_copy(g, tmp_path / "same.gguf"))            # the twin: no error
    tokens = "tokenizer.ggml.tokens"
    cases = {
        "differ at token 5: 'x'": {tokens: lambda t: t[:5] + ["x"] + t[6:]},
        "differ in size": {tokens: lambda t: t[:-1]},
        "differ in tokenizer.ggml.model": {"tokenizer.ggml.model": lambda _: "llama"},
        "differ in tokenizer.ggml.eos_token_id": {"tokenizer.ggml.eos_token_id": lambda i: i + 1},
    }
    for i, (message, change) in enumerate(cases.items()):
        with pytest.raises(sp.VocabularyMismatch, match=message) as raised:
            sp.check_vocabulary(g, metadata_copy(g, tmp_path / f"other{i}.gguf", change))
        assert "same family" in str(raised.value) and isinstance(raised.value, ParameterError)


@pytest.fixture(scope="module")
def first_layers_draft(default_model_path, tmp_path_factory):
    from app.draft_model import first_layers
    return first_layers(default_model_path, 8, tmp_path_factory.mktemp("draft"))


def test_a_draft_model_of_the_first_layers_gives_plain_greedy_text(float_engine, first_layers_draft):
    e = float_engine
    draft = load(FLOAT_STAGE, first_layers_draft, threads=1)
    assert draft.config.n_layer == 8 and draft.config.n_vocab == e.config.n_vocab
    prompt = e.tokenizer.encode(COPY_PROMPT)
    plain = generate(e, prompt, N_GEN, ignore_eos=True).tokens
    gen = spec_tokens(e, prompt, N_GEN, always_drafting(draft, 4))
    assert gen.tokens == plain and gen.drafted > 0


def test_from_flags_refuses_what_cannot_run():
    assert sp.from_flags("off") is None
    lookup = sp.from_flags("lookup", 4).speculation
    assert lookup.draft_max == 4 and isinstance(lookup.guesser(), sp.PromptLookup)
    with pytest.raises(ParameterError, match="--model-draft"):
        sp.from_flags("draft")
    with pytest.raises(ParameterError, match="lookup, draft or off"):
        sp.from_flags("telepathy")


# ---- the command line ------------------------------------------------------------------------------

def spec_count_problems(rec: dict) -> list[str]:
    """A lookup run on a prompt made to be copied: it guessed (drafted > 0: a run that never
    guessed would pass any bound below), kept some, never more than it guessed, and never more
    than the tokens after the first. (How many it guesses per step follows the step costs it
    measures, so the counts themselves are no fixed figure.)"""
    drafted, accepted, made = rec["drafted"], rec["accepted"], len(rec["tokens"])
    problems = []
    if not (isinstance(drafted, int) and isinstance(accepted, int)):
        problems.append(f"counts {drafted!r}, {accepted!r}")
    elif not 0 < accepted <= drafted:
        problems.append(f"{accepted} of {drafted} guesses kept")
    elif accepted > made - 1:
        problems.append(f"{accepted} guesses kept among {made - 1} tokens after the first")
    return problems


def test_the_spec_count_check_refuses_a_run_that_never_guessed():
    ok = {"drafted": 9, "accepted": 6, "tokens": list(range(16))}
    assert spec_count_problems(ok) == []
    for planted in ({"drafted": 0, "accepted": 0}, {"accepted": 10}, {"drafted": 40, "accepted": 16}):
        assert spec_count_problems(dict(ok, **planted)) != [], planted


def test_run_spec_lookup_json_has_the_counts_and_plain_text(default_model_path):
    from tests.test_cli import run
    common = ("run", "--stage", FLOAT_STAGE, "-t", "1", "-m", str(default_model_path), "-p", COPY_PROMPT,
              "-n", "16", "--json")
    recs = {}
    for mode in ("off", "lookup"):
        p = run(*common, "--spec", mode, "--draft-max", "4")
        assert p.returncode == 0, p.stderr
        recs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    off, look = recs["off"], recs["lookup"]
    assert off["spec"] == "off" and off["drafted"] == off["accepted"] == 0
    assert look["spec"] == "lookup" and look["draft_max"] == 4
    assert spec_count_problems(look) == []
    assert look["tokens"] == off["tokens"]                       # greedy: the same text
    assert look["tokens_per_s_mean"] > 0 and look["spec_calibrate_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--spec", "draft"], "--spec draft needs a draft model: give --model-draft FILE"),
    (["--spec", "lookup", "--model-draft", "d.gguf"], "--model-draft is for --spec draft"),
    (["--spec", "lookup", "--chat"], "--spec runs with -p, not --chat"),
])
def test_contradicting_spec_flags_are_one_line_before_loading(args, message, capsys):
    from app.cli import main
    assert main(["run", "--stage", FLOAT_STAGE, "-m", "never/opened.gguf", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1


def test_draft_max_must_be_a_count(capsys):
    from app.cli import main
    with pytest.raises(SystemExit) as stopped:
        main(["run", "-m", "never/opened.gguf", "--draft-max", "0"])
    assert stopped.value.code == 2
    assert "draft_max (--draft-max) = 0: must be an integer >= 1" in capsys.readouterr().err


def test_a_draft_model_of_another_vocabulary_is_refused_before_loading(default_model_path, tmp_path):
    from tests.test_cli import run
    g = GGUFFile(default_model_path)
    other = metadata_copy(g, tmp_path / "other.gguf", {"tokenizer.ggml.tokens": lambda t: t[:9] + ["?"] + t[10:]})
    p = run("run", "--stage", FLOAT_STAGE, "-m", str(default_model_path), "-p", "Hi", "-n", "2",
            "--model-draft", other.path)
    assert p.returncode == 2 and "differ at token 9" in p.stderr and "Traceback" not in p.stderr
    assert "loading" not in p.stderr


# ---- the benchmark's page, from a record made up here ----------------------------------------------

def made_up_record(verify_ratio_at_4: float) -> dict:
    """Two rounds, one prompt per set; ours plain 10 tokens/s, lookup 30 then 20 (copy), llama.cpp's lookup 15."""
    k = list(range(6))
    ours_ms = [[10.0 * (1 + (verify_ratio_at_4 - 1) * i / 4) for i in k]] * 2
    runs = []
    for r, lookup_tps in enumerate((30.0, 20.0)):
        for set_name in ("copy", "free"):
            for engine, tps in ((OURS_ENGINES[0], 10.0), (OURS_ENGINES[1], lookup_tps if set_name == "copy" else 9.6),
                                (OURS_ENGINES[2], 12.0), (OURS_ENGINES[3], 15.0)):
                runs.append({"round": r, "set": set_name, "prompt": 0, "engine": engine, "n_tokens": 11,
                             "decode_s": 10 / tps, "tokens": [1] * 11, "drafted": 8, "accepted": 6,
                             "parting": {"at": 3, "gap": 0.2} if engine == OURS_ENGINES[1] and r == 1 else None})
    roof = {"ratio": [1.0] * 6, "ms": [5.0] * 6, "ridge_rows": 3.0, "bytes": 1e8, "flops_per_token": 2.7e8,
            "bandwidth_gbs": 30.0, "peak_gflops": 90.0, "threads": 1, "source": "made up"}
    return {"kind": "speculative", "model": "m.gguf", "stage": "fused", "settings": {
        "rounds": 2, "n_predict": 11, "draft_max": 10, "k_max": 5, "context": 64, "quick": False},
        "machine": {"cpu": "a CPU", "physical_cores": 2}, "provenance": {"code_hash": "abc", "commit": "0" * 40,
                                                                        "dirty": False},
        "load_average": {"start": "0.1", "end": "0.2"},
        "threads": {"1": {"verify": {"k": k, "ours_ms": ours_ms, "roofline": roof}, "runs": runs}}}


OURS_ENGINES = ("ours", "ours, lookup", "llama.cpp", "llama.cpp, lookup")


def test_the_page_computes_medians_of_round_ratios_and_the_claims_verdict():
    from app.report import speculative as page
    assert OURS_ENGINES == page.ENGINES
    rec = made_up_record(1.2)
    runs = rec["threads"]["1"]["runs"]
    assert page.throughput(runs, "copy", "ours, lookup") == pytest.approx([30.0, 20.0])
    assert page.ratio(runs, "copy", "ours, lookup", "ours") == pytest.approx(2.5)      # median of 3.0 and 2.0
    assert page.ratio(runs, "free", "ours, lookup", "ours") == pytest.approx(0.96)
    assert page.accept_rate(runs, "copy") == pytest.approx(0.75)
    assert page.same_text(runs, "copy") == "parted in 1 of 2, at a lead of at most 0.200 logits"
    (row,) = page.claim_rows(rec, "r.json")
    assert row.measured == pytest.approx(1.2) and row.verdict == "reproduced"
    (row,) = page.claim_rows(made_up_record(2.9), "r.json")                # the twin: far from one step
    assert row.measured == pytest.approx(2.9) and row.verdict == "reversed"
    text = page.page(rec, "r.json")
    assert "| copy | 1 | ours, lookup / ours | 2.50x | 2.00x | yes |" in text
    assert "| free | 1 | ours, lookup / ours | 0.96x | 0.97x | no |" in text        # below 0.97x plain: missed


def test_the_chart_is_drawn_from_the_record(tmp_path):
    from app.report.pages import draw
    record = tmp_path / "speculative.json"
    record.write_text(json.dumps(made_up_record(1.5)))
    md, png = draw(json.loads(record.read_text()), record)
    assert md == tmp_path / "speculative.md" and png == tmp_path / "speculative.png" and png.stat().st_size > 0


def test_the_rule_counts_every_token_it_keeps_as_drawn():
    """Frequency and presence penalties read what the completion drew (Sampler.drawn): the rule
    counts each guess it keeps before the next row's distribution is taken, and the token it
    adds, as plain decoding would have. Here the penalty is what rejects the third guess."""
    n_vocab = 8
    logits = np.zeros((4, n_vocab), np.float32)
    logits[:, 3] = 1.0                                  # every row prefers token 3 by 1.0 ...
    logits[:, 5] = 0.9                                  # ... token 5 next
    sampler = Sampler(SamplingParams(temp=0, frequency_penalty=0.06))
    kept, tok = sp.accept(logits, sp.Draft([3, 3, 3], None, "scripted"), sampler, [1, 2])
    # drawn 3 twice: 1.0 - 2 x 0.06 = 0.88 < 0.9, so row 2 picks 5 and the third guess is refused
    assert (kept, tok) == (2, 5)
    assert sampler.drawn == {3: 2, 5: 1}
    plain = Sampler(SamplingParams(temp=0, frequency_penalty=0.06))
    assert [plain(logits[i], [1, 2]) for i in range(3)] == [3, 3, 5]      # what plain decoding draws
    assert plain.drawn == sampler.drawn
