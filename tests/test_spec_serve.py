"""Speculative decoding in the server's batched step (app/serve/speculation.py; Sequence.take,
the scheduler's plan, the engine loop's settle).

On StubEngine (tests/stub_engine.py: a sequence's next token hashes every token its pages
hold; with `copies` its text repeats itself, so prompt lookup guesses right and wrong), each
check returns what it found wrong, runs on the real code, which must pass, and on a planted
bug, which it must flag:

    a crowd           12 requests decoding together with guesses give each request's plain
                      greedy text, in fewer steps, guesses both kept and refused; every page
                      free at the end (planted: a rule that keeps every guess; a sequence that
                      never gives the refused positions back)
    preemption        a pool a quarter of the worst case: sequences preempted with guesses
                      planned lose nothing, every page comes back (planted: a rollback that
                      forgets the pages)
    sampling          k = 2 guesses per step under a sampler chain with a frequency penalty:
                      the first four tokens' joint distribution, chi-square against the exact
                      one (planted: three wrong rules)
    counts            guesses made and emitted, in /metrics and /health, exactly what a script
                      of right and wrong guesses makes (planted: counting kept guesses past the
                      end of the text)
    the rule          allot: nothing guessed where rows cost what they yield, guesses where
                      they are nearly free (planted: a policy that ignores the cost)

A draft model guessing (DraftSpeculation; the stub copying its text): the crowd and the
preemption give each request's plain text and every page of both pools back (planted: a rule
that keeps every guess, a draft that keeps its pages); sampled guesses keep the distribution
(chi-square, planted: two wrong rules).

On the default model, both batching stages (fused pads rows to 8, repack does not): greedy
text with guesses is plain serving's, token for token, alone and in a crowd, for copy-heavy
and free prompts; with the model's first two layers as the draft, in a crowd.
"""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pytest

from app.serve.engine_loop import EngineLoop
from app.serve.metrics import Metrics
from app.serve.scheduler import Scheduler
from app.serve.sequence import Ask, Sequence
from common import speculative as sp
from common.generate import Sampler, SamplingParams
from common.paged_kv import PageTable
from common.speculative import DraftGuesser, DraftSpeculation, Speculation, StepTime
from tests.stub_engine import StubEngine, StubServer
from tests.test_speculative import FreeRows, chi_square_p, keep_every_guess, resample_from_p

MAX_TOKENS = 48


def free_rows() -> StepTime:
    """A step costs the same whatever its rows, and nothing in the ledger: the rule then
    guesses all it can, so the checks' steps do not depend on this machine's speed."""
    return FreeRows()


class Calibrated(StepTime):
    """Step times that are the shape given, whatever the steps take (the planner's decisions
    then do not depend on this machine's speed)."""

    def observe(self, rows, forward_ms, step_ms):
        self.guess_rows = 0


def lookup(rule=sp.accept, draft_max: int = 8) -> Speculation:
    return Speculation(4096, draft_max, free_rows(), rule)


def prompts(n=12, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(40) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def serve(engine, asks, speculation=None, pages=400, max_batch=12, sequence=Sequence, scheduler=Scheduler):
    """Every ask through one engine loop, stepped by hand: (what each request's client saw,
    the loop, steps taken, problems). After every step, each running sequence must hold the
    pages of its positions and no more (refused guesses' pages given back at once)."""
    loop = EngineLoop(engine, kv_pages=pages, max_batch=max_batch, max_queue=len(asks), prefill_chunk=24,
                      speculation=speculation, scheduler=scheduler)
    seen = [[] for _ in asks]
    for ask, out in zip(asks, seen):
        loop.submit(sequence(ask, lambda k, v, out=out: out.append(v.id if k == "token" else (k, v))))
    steps, problems = 0, []
    try:
        while not loop.scheduler.idle:
            loop.step()
            steps += 1
            if steps > 5000:
                raise RuntimeError("no progress")
            held = {s.id: (len(s.table.pages), PageTable.pages_for(len(s.table), loop.pool.page_size))
                    for s in loop.scheduler.running if s.table is not None}
            problems += [f"step {steps}: sequence {i} holds {a} pages for {b} pages of positions"
                         for i, (a, b) in held.items() if a != b][:1]
    except Exception as e:                                  # a planted bug may break the loop itself
        problems.append(f"the loop failed: {e!r}")
    return seen, loop, steps, problems


def pages_back(loop) -> list[str]:
    p = loop.pool
    return [] if (p.n_free, p.reserved) == (p.n_pages, 0) else \
        [f"{p.n_pages - p.n_free} pages not returned, {p.reserved} reserved"]


# ---- planted bugs --------------------------------------------------------------------------------

class KeepsRefusedPositions(Sequence):
    """The refused guesses' positions stay in its pages (no PageTable.truncate)."""

    def take(self, logits):
        truncate = self.table.truncate
        self.table.truncate = lambda n: None
        try:
            return super().take(logits)
        finally:
            self.table.truncate = truncate


class ForgetsThePages(Sequence):
    """A rollback that forgets the tokens but leaves the pages and the prefix cache alone."""

    def take(self, logits):
        table = self.table
        table.truncate = lambda n: table.tokens.__delitem__(slice(n, None))
        try:
            return super().take(logits)
        finally:
            del table.truncate


def forgets_what_it_kept(logits, draft, sampler, history):
    """A WRONG rule, planted: the right rule, but the guesses it keeps are not counted as drawn
    (no Sampler.took), so the frequency penalty of the rows after them is wrong."""
    took = sampler.took
    kept_guesses = iter(draft.tokens)
    sampler.took = lambda tok: None
    try:
        kept, tok = sp.accept(logits, draft, sampler, history)
    finally:
        sampler.took = took
    for _ in range(kept):
        next(kept_guesses)
    took(tok)
    return kept, tok


# ---- greedy: a crowd, and preemption ---------------------------------------------------------------

def crowd_problems(rule=sp.accept, sequence=Sequence, pages=400) -> list[str]:
    """12 copy-heavy requests with guesses, against the same without: each client's tokens and
    end, step for step fewer, guesses kept and refused, every page back."""
    asks = [Ask(p, MAX_TOKENS) for p in prompts()]
    plain, plain_loop, plain_steps, _ = serve(StubEngine(copies=5), asks, None, pages=400)
    seen, loop, steps, problems = serve(StubEngine(copies=5), asks, lookup(rule), pages=pages, sequence=sequence)
    problems += [f"request {i}: not its plain text" for i, (a, b) in enumerate(zip(plain, seen)) if a != b]
    s = loop.stats()
    if not 0 < s["accepted"] < s["drafted"]:
        problems.append(f"{s['accepted']} of {s['drafted']} guesses kept: not both kept and refused")
    if pages >= 400 and steps >= plain_steps:                 # (preemption costs steps of its own)
        problems.append(f"{steps} steps with guesses, {plain_steps} without")
    if pages < 400 and loop.preemptions < 3:
        problems.append(f"only {loop.preemptions} preemptions in a quarter of the worst case")
    return problems + pages_back(loop) + pages_back(plain_loop)


def test_a_crowd_with_guesses_writes_each_requests_plain_text():
    assert crowd_problems() == []


@pytest.mark.parametrize("planted", ["keeps every guess", "keeps the refused positions"])
def test_the_crowd_check_flags_a_wrong_rule_and_a_missing_rollback(planted):
    rule, sequence = (keep_every_guess, Sequence) if planted == "keeps every guess" else \
        (sp.accept, KeepsRefusedPositions)
    assert any("not its plain text" in p or "failed" in p for p in crowd_problems(rule, sequence))


class Remembers(Scheduler):
    """The real scheduler, noting of each sequence it preempts how many guesses it had verified."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.preempted_guesses = []

    def _preempt(self, seq):
        self.preempted_guesses.append(sum(k + r for k, r in seq.guesser.counts.kept.values()))
        super()._preempt(seq)


def test_preemption_in_the_middle_of_speculation_loses_nothing_and_frees_every_page():
    """A quarter of the worst case: sequences whose guesses were verified (kept and refused,
    their refused positions given back) are preempted (the newest, when an older one needs its
    pages; guesses are planned after that, from the pages left), resume from what they emitted,
    and end as they would alone."""
    worst = sum(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts())
    asks = [Ask(p, MAX_TOKENS) for p in prompts()]
    alone, _, _, _ = serve(StubEngine(copies=5), asks, None, pages=worst)
    seen, loop, _, problems = serve(StubEngine(copies=5), asks, lookup(), pages=worst // 4, scheduler=Remembers)
    assert problems == [] and seen == alone
    assert loop.preemptions >= 3 and any(loop.scheduler.preempted_guesses), loop.scheduler.preempted_guesses
    assert pages_back(loop) == [] and loop.stats()["accepted"] > 0
    assert crowd_problems(pages=worst // 4) == []
    assert crowd_problems(sequence=ForgetsThePages, pages=worst // 4) != []       # the planted rollback


# ---- sampling: k = 2 guesses keep the distribution ------------------------------------------------

V = 5                              # the stub's vocabulary: tokens 0..4
DRAWS = 2000
BATCH = 250                        # sequences per engine loop (one page each)
CHAIN = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0, frequency_penalty=1.0)
PROMPT = [1, 3, 0, 2]


def stub_logits(engine, tokens) -> np.ndarray:
    """What StubEngine.forward_batch returns for a sequence holding `tokens` (its formula)."""
    slope = -0.5 * np.arange(engine.config.n_vocab, dtype=np.float32)
    return -np.abs(slope + 0.5 * engine.next_token(np.asarray(tokens, dtype=np.int64)))


def exact_joint(engine, n: int) -> np.ndarray:
    """P(t_1 .. t_n) [V]*n of the plain sampler after PROMPT, by enumeration."""
    out = np.zeros((V,) * n)

    def walk(path, drawn, prob):
        if len(path) == n:
            out[tuple(path)] = prob
            return
        s = Sampler(SamplingParams(**CHAIN))
        s.drawn = dict(drawn)
        ids, probs = s.distribution(stub_logits(engine, PROMPT + path), PROMPT + path)
        for t, q in zip(ids.tolist(), probs):
            walk(path + [t], {**drawn, t: drawn.get(t, 0) + 1}, prob * q)
    walk([], {}, 1.0)
    return out


class Guessing(Speculation):
    """Every decoding sequence guesses GUESS (as many as fit), with an accept rate of 0.9."""
    GUESS = [2, 2]

    def guesser(self):
        class Fixed(sp.Guesser):
            def offer(self, context, k_max, rng):
                self.key, self.found = "fixed", Guessing.GUESS[:k_max]
                return len(self.found), 0.9
        return Fixed(self.pooled, rule=self.rule)


def drawn_joint(rule) -> tuple[np.ndarray, dict]:
    """Counts [V]*4 of the first four tokens of DRAWS seeded requests, with guesses; the stats."""
    engine = StubEngine(n_vocab=V, low=0, high=V)
    counts, stats = np.zeros((V,) * 4, int), {"drafted": 0, "accepted": 0}
    for first in range(0, DRAWS, BATCH):                 # a batch at a time: the queue stays short
        asks = [Ask(PROMPT, 4, params=SamplingParams(seed=i, **CHAIN)) for i in range(first, first + BATCH)]
        seen, loop, _, problems = serve(engine, asks, Guessing(4096, 4, free_rows(), rule), pages=BATCH + 8,
                                        max_batch=BATCH)
        assert problems == []
        for out in seen:
            counts[tuple(out[:4])] += 1
        stats = {k: v + loop.stats()[k] for k, v in stats.items()}
    return counts, stats


def test_the_rule_with_two_guesses_keeps_the_plain_samplers_distribution():
    """The right rule passes the chi-square test (p > 0.001) with 2 guesses per step (the
    second verified after the first was kept) under penalties and top-k; each planted rule
    fails it (p < 1e-6) on the same draws."""
    exact = exact_joint(StubEngine(n_vocab=V, low=0, high=V), 4)
    assert exact.sum() == pytest.approx(1.0)
    counts, stats = drawn_joint(sp.accept)
    # guesses of 2 rows were made in every request's second step, and some of both were kept
    assert stats["drafted"] >= 2 * DRAWS and stats["accepted"] > DRAWS // 10, stats
    p_right = chi_square_p(counts, exact)
    assert p_right > 1e-3, f"the rule's draws fail the chi-square test (p = {p_right:.2g})"
    for name, rule in {"keeps every guess": keep_every_guess, "draws a rejection from p": resample_from_p,
                       "does not count its kept guesses as drawn": forgets_what_it_kept}.items():
        p_wrong = chi_square_p(drawn_joint(rule)[0], exact)
        assert p_wrong < 1e-6, f"a rule that {name} passed the chi-square test (p = {p_wrong:.2g})"


# ---- the counts ------------------------------------------------------------------------------------

class Scripted(Speculation):
    """Each sequence guesses two tokens of its own plain continuation (StubEngine), the second
    one wrong, unless the first is the end token (then both right: the second kept past the end
    of the text). `counts_kept`: a WRONG count, planted: guesses kept past the end counted as
    emitted."""

    def __init__(self, engine, *a, counts_kept: bool = False, **k):
        super().__init__(*a, **k)
        self.engine, self.counts_kept = engine, counts_kept

    def guesser(self):
        script, counts_kept = self.script, self.counts_kept

        class Script(sp.Guesser):
            def offer(self, context, k_max, rng):
                self.key, self.found = "script", script(context)[:k_max]
                return len(self.found), 0.9

            def observe(self, drafted, kept, emitted):
                super().observe(drafted, kept, kept if counts_kept else emitted)
        return Script(self.pooled, rule=self.rule)

    def script(self, context) -> list[int]:
        e = self.engine
        first = e.next_token(np.asarray(context, dtype=np.int64))
        after = e.next_token(np.asarray(list(context) + [first], dtype=np.int64))
        return [first, after if first == e.eos else (after + 1) % e.config.n_vocab]


def expected_counts(speculation: Scripted, ask: Ask) -> tuple[int, int]:
    """(guesses made, guesses emitted) for one request under Scripted, replayed: greedy keeps
    the guesses that are the engine's next tokens, adds the engine's own, and the text ends at
    its first end token or at max_tokens."""
    e = speculation.engine
    context = list(ask.prompt)
    generated = [e.next_token(np.asarray(context))]                # the prompt's step
    made = emitted = 0
    while generated[-1] not in ask.stop_ids and len(generated) < ask.max_tokens:
        room = min(speculation.draft_max, ask.max_tokens - len(generated) - 1)
        guesses = speculation.script(context + generated)[:max(room, 0)]
        out, ctx = [], context + generated
        for g in guesses:
            if g != e.next_token(np.asarray(ctx + out)):
                break
            out.append(g)
        kept = len(out)
        out.append(e.next_token(np.asarray(ctx + out)))
        cut = next((i + 1 for i, t in enumerate(out) if t in ask.stop_ids), len(out))
        made, emitted = made + len(guesses), emitted + min(kept, cut)
        generated += out[:cut]
    return made, emitted


def count_problems(counts_kept: bool = False) -> list[str]:
    """Requests of several lengths, one ending at an end token that comes among kept guesses;
    the counters in /metrics' registry and in stats() against expected_counts."""
    engine = StubEngine(eos=49, eos_at=30)       # a sequence holding 30 tokens or more: its next is 49
    asks = [Ask(list(range(1, 1 + n)), m, stop_ids=frozenset({49})) for n, m in ((3, 10), (5, 17), (7, 8), (9, 40))]
    speculation = Scripted(engine, 4096, 4, free_rows(), counts_kept=counts_kept)
    loop = EngineLoop(engine, kv_pages=200, max_batch=8, max_queue=8, speculation=speculation)
    metrics = Metrics(loop)
    loop.observer = metrics
    for ask in asks:
        loop.submit(Sequence(ask))
    while not loop.scheduler.idle:
        loop.step()
    want = tuple(map(sum, zip(*(expected_counts(speculation, ask) for ask in asks))))
    s = loop.stats()
    got = {"stats": (s["drafted"], s["accepted"]),
           "metrics": (metrics.drafted._value.get(), metrics.accepted._value.get())}
    problems = [f"{where}: {g} guesses made and emitted, expected {want}" for where, g in got.items() if g != want]
    if not want[0] > want[1] > 0:
        problems.append(f"the script made {want}: not a test of both")
    return problems


def test_guesses_made_and_emitted_are_counted_exactly():
    assert count_problems() == []
    assert count_problems(counts_kept=True) != []


def test_metrics_and_health_report_the_guesses(default_model_path):
    """Through HTTP: /metrics' counters and /health's, equal, and the page's fields there."""
    from prometheus_client.parser import text_string_to_metric_families
    with StubServer(default_model_path, copies=5, speculation=lookup()) as srv:
        body = {"prompt": "one two three one two three one two", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        srv.idle()
        health = httpx.get(srv.url + "/health").json()
        text = httpx.get(srv.url + "/metrics").text
    samples = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
    assert health["spec"] is True and 0 < health["accepted"] <= health["drafted"]
    assert samples["llm_spec_draft_tokens_total"] == health["drafted"]
    assert samples["llm_spec_accepted_tokens_total"] == health["accepted"]


def test_streamed_tokens_and_logprobs_are_plain_servings(default_model_path):
    """The same request streamed with and without speculation: the same chunks' text and, per
    token, the same log-probabilities (the verify rows are plain rows: the stub's logits depend
    only on the pages)."""
    from tests.stub_engine import tokenizer
    tok = tokenizer(str(default_model_path))
    prompt = tok.encode("one two three one two three one two")
    got = {}
    for name, spec in (("plain", None), ("lookup", lookup())):
        with StubServer(default_model_path, copies=5, low=300, high=340, speculation=spec) as srv:
            body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "logprobs": 2,
                    "stream": True}
            lines = [json.loads(x[6:]) for x in httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                     .text.splitlines() if x.startswith("data: {")]
            texts = "".join(c["choices"][0]["text"] for c in lines if c["choices"])
            lps = [x for c in lines if c["choices"] and c["choices"][0]["logprobs"]
                   for x in c["choices"][0]["logprobs"]["token_logprobs"]]
            got[name] = (texts, lps, srv.loop.stats()["drafted"])
    assert got["plain"][:2] == got["lookup"][:2] and len(got["plain"][1]) == 30
    assert got["plain"][2] == 0 and got["lookup"][2] > 0


# ---- a draft model in the server ----------------------------------------------------------------------

class CopyingDraft(StubEngine):
    """A draft model of the copying stub: always the token `copies` back (the target's rule
    three times in four), so its guesses are kept and refused."""

    def next_token(self, tokens) -> int:
        return int(tokens[-self.copies]) if len(tokens) >= self.copies else self.low


def drafted(rule=sp.accept, draft_max: int = 6, pages: int = 400, guesser=DraftGuesser, **draft):
    spec = DraftSpeculation(4096, CopyingDraft(copies=5, **draft), pages, draft_max, free_rows(), rule=rule)
    spec.guesser = lambda: guesser(spec.pooled, spec.rule, spec.pool)
    return spec


def test_a_draft_models_guesses_write_each_requests_plain_text_and_every_page_comes_back():
    """A crowd, then a pool a quarter of the worst case (preemption with guesses drafted): each
    request's plain text; guesses kept and refused; both pools' pages all back at the end."""
    asks = [Ask(p, MAX_TOKENS) for p in prompts()]
    worst = sum(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts())
    plain, _, _, _ = serve(StubEngine(copies=5), asks, None, pages=worst)
    for pages in (worst, worst // 4):
        spec = drafted()
        seen, loop, _, problems = serve(StubEngine(copies=5), asks, spec, pages=pages)
        assert problems == [] and seen == plain, pages
        s = loop.stats()
        assert 0 < s["accepted"] < s["drafted"], s
        assert pages_back(loop) == [] and (spec.pool.n_free, spec.pool.reserved) == (spec.pool.n_pages, 0)
        assert pages == worst or loop.preemptions >= 3
    seen, _, _, _ = serve(StubEngine(copies=5), asks, drafted(keep_every_guess), pages=worst)
    assert seen != plain                                                   # the planted rule is caught
    spec = drafted(guesser=KeepsItsDraftPages)
    serve(StubEngine(copies=5), asks, spec, pages=worst // 4)
    assert spec.pool.n_free < spec.pool.n_pages                            # so is a draft that keeps its pages


class KeepsItsDraftPages(DraftGuesser):
    """Planted: a sequence that ends or is preempted keeps its pages in the draft model's pool."""

    def release(self):
        pass


def test_a_draft_models_sampled_guesses_keep_the_distribution():
    """Guesses drawn from the draft model's own distribution (q: the stub's logits under the
    sequence's temperature and top-k), two per step: the chi-square test of the first four
    tokens passes with the rule and fails with the planted ones."""
    exact = exact_joint(StubEngine(n_vocab=V, low=0, high=V), 4)

    def joint(rule):
        counts = np.zeros((V,) * 4, int)
        for first in range(0, DRAWS, BATCH):
            asks = [Ask(PROMPT, 4, params=SamplingParams(seed=i, **CHAIN)) for i in range(first, first + BATCH)]
            spec = drafted(rule, draft_max=2, pages=BATCH + 8, n_vocab=V, low=0, high=V)
            seen, loop, _, problems = serve(StubEngine(n_vocab=V, low=0, high=V), asks, spec, pages=BATCH + 8,
                                            max_batch=BATCH)
            assert problems == [] and loop.stats()["drafted"] >= 2 * BATCH
            for out in seen:
                counts[tuple(out[:4])] += 1
        return counts
    p_right = chi_square_p(joint(sp.accept), exact)
    assert p_right > 1e-3, f"the rule's draws fail the chi-square test (p = {p_right:.2g})"
    for name, rule in {"keeps every guess": keep_every_guess, "draws a rejection from p": resample_from_p}.items():
        p_wrong = chi_square_p(joint(rule), exact)
        assert p_wrong < 1e-6, f"a rule that {name} passed the chi-square test (p = {p_wrong:.2g})"


# ---- the rule for how many ---------------------------------------------------------------------------

def greedy_everywhere(offers, rows, cost):
    """A WRONG policy, planted: every guess on offer, whatever it costs."""
    return [n for _, n in offers]


def allot_problems(allot) -> list[str]:
    problems = []
    offers = [(0.9, 8), (0.5, 8), (0.0, 8)]
    compute_bound = allot(offers, 16, lambda extra: 16.0 + extra)          # a row costs the average row
    if any(compute_bound):
        problems.append(f"guessed {compute_bound} where every row costs what it yields")
    nearly_free = allot(offers, 1, lambda extra: 1.0 + 0.05 * extra)
    if not nearly_free[0] > nearly_free[1] > nearly_free[2] == 0:
        problems.append(f"guessed {nearly_free} where rows are nearly free, by accept rates 0.9, 0.5, 0")
    return problems


def test_guesses_go_where_rows_are_nearly_free_and_likely_kept():
    assert allot_problems(sp.allot) == []
    assert allot_problems(greedy_everywhere) != []


def test_step_time_pads_to_the_row_block_interpolates_and_follows_the_steps():
    t = StepTime({1: 10.0, 8: 10.0, 16: 18.0, 32: 34.0}, row_block=8)
    assert t.forward_ms(1) == t.forward_ms(8) == 10.0 and t.forward_ms(9) == 18.0      # rows padded to 8
    assert t.forward_ms(24) == pytest.approx(26.0) and t.forward_ms(64) == pytest.approx(66.0)
    t.observe(16, 36.0, 40.0)                       # a plain step twice as slow: the shape scales
    assert t.scale == pytest.approx(2.0) and t.outside == pytest.approx(4.0)
    for ms in (35.0, 90.0):                         # the median of the last plain steps: a burst counts for nothing
        t.observe(16, ms, ms + 4.0)
    assert t.scale == pytest.approx(36.0 / 18.0)
    t.planned(8)
    t.observe(24, 2.0 * 30.0, 2.0 * 30.0 + 4.0)     # 24 rows with guesses: 30 at this scale, not 26: its point learns
    assert t.shape[24] == pytest.approx(28.0) and t.scale == pytest.approx(2.0)
    t.planned(8)
    t.observe(24, 2.0 * 30.0, 2.0 * 30.0 + 4.0)
    assert t.shape[24] == pytest.approx(30.0) and t.shape[32] == pytest.approx(34.0)
    for _ in range(2):                              # 10 rows (16, padded) dearer than 24 and 32 were:
        t.planned(2)                                # more rows never cost less
        t.observe(10, 2.0 * 40.0, 2.0 * 40.0 + 4.0)
    assert t.shape[16] == pytest.approx(40.0) and t.shape[24] == pytest.approx(30.0)
    assert t.shape_at(16) == t.shape_at(24) == t.shape_at(32) == pytest.approx(40.0) and t.shape_at(8) == 10.0
    assert StepTime()(5) == 5.0                     # nothing measured: every row a step (nothing guessed)


def test_calibration_gives_every_page_back():
    engine = StubEngine()
    loop = EngineLoop(engine, kv_pages=64)
    t = StepTime()
    t.calibrate_pool(loop.forward, loop.pool, 40)
    assert sorted(t.shape) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40]      # ROWS, and the most
    assert pages_back(loop) == []


class Clock:
    """perf_counter for common/speculative.py: seconds that pass only when a pass runs."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# ms of a pass of M rows on a made-up engine: 6 rows cheaper than 5 (another kernel takes them), and
# two bursts of other work, each in one round of the calibration
PASS_MS = {1: 2.0, 2: 2.1, 3: 2.2, 4: 2.3, 5: 3.0, 6: 2.5, 7: 3.2, 8: 3.3}
BURSTS = {(0, 4): 50.0, (1, 7): 30.0}          # (round, rows) -> ms more


def calibration_problems(monkeypatch, rounds: int = 3) -> list[str]:
    """The calibrated shape: each row count's pass at its cost without the bursts (the best of
    the rounds), and never less for more rows (6 rows cost what 5 do)."""
    clock = Clock()
    monkeypatch.setattr(sp, "time", clock)
    monkeypatch.setattr(StepTime, "ROUNDS", rounds)
    seen = {}

    def forward(batch):
        m = batch.n_rows
        r = seen[m] = seen.get(m, -1) + 1
        clock.now += (PASS_MS[m] + BURSTS.get((r, m), 0.0)) / 1e3
    loop = EngineLoop(StubEngine(), kv_pages=64)
    t = StepTime()
    t.calibrate_pool(forward, loop.pool, 8)
    want = {**PASS_MS, 6: PASS_MS[5]}
    return [f"{m} rows: {t.shape.get(m)} ms, not {w}" for m, w in want.items() if t.shape.get(m) != pytest.approx(w)]


def test_calibration_takes_the_best_round_and_more_rows_never_cost_less(monkeypatch):
    assert calibration_problems(monkeypatch) == []
    assert calibration_problems(monkeypatch, rounds=1) != [], "planted: one round, its burst kept"
    monkeypatch.setattr(sp, "max", lambda *a, **k: a[-1], raising=False)    # planted: no running max
    assert calibration_problems(monkeypatch) != []


# ---- what the planner decides: rows not free, prompt rows in the step, guesses dropped ---------------

class Offers(sp.Guesser):
    """Offers `n` guesses of `token`, kept with probability `a` (not drawn: the planner's input fixed)."""

    def __init__(self, pooled, n: int = 8, a: float = 0.9, rule=sp.accept, token: int = 2):
        super().__init__(pooled, rule=rule)
        self.n, self.a, self.token = n, a, token

    def offer(self, context, k_max, rng):
        self.key, self.found = "fixed", [self.token] * min(self.n, k_max)
        return len(self.found), (self.a if self.found else 0.0)


def offering(spec, n: int = 8, a: float = 0.9, prompt: int = 4, max_tokens: int = 100, generated: int = 1):
    seq = Sequence(Ask(list(range(3, 3 + prompt)), max_tokens))
    seq.generated = [5] * generated
    seq.guesser = Offers(spec.pooled, n, a)
    return seq


FLAT = {1: 10.0, 256: 10.0}                    # a step costs the same whatever its rows (memory-bound)
LINEAR = {1: 10.0, 256: 2560.0}                # every row costs what a row yields (compute-bound)
KNEE = {1: 10.0, 8: 10.0, 72: 90.0}            # free up to 8 rows, then 1.25 ms a row: the step's average


def plan_problems(make) -> list[str]:
    """Speculation.plan's decisions for given offers and step times (`make(shape, n_ctx)`: the
    Speculation): guesses where rows are free, none where each row costs what it yields; up to
    the knee of a memory-bound step for a sequence alone, none once 64 prompt rows ride in the
    step; never past max_tokens (the step's own token counts) or the context's end."""
    def planned(shape, seqs, rows, n_ctx=4096):
        spec = make(Calibrated(shape), n_ctx)
        for seq in seqs:
            seq.guesser = Offers(spec.pooled, seq.guesser.n, seq.guesser.a)
        spec.plan(seqs, rows)
        return [len(seq.guesses) for seq in seqs]

    def one(**kw):
        return offering(Speculation(4096), **kw)
    cases = [("rows free", FLAT, [one()], 1, 4096, [8]),
             ("rows cost what they yield", LINEAR, [one(), one(a=0.99)], 2, 4096, [0, 0]),
             ("alone, under the knee", KNEE, [one()], 1, 4096, [7]),
             ("64 prompt rows in the step", KNEE, [one()], 65, 4096, [0]),
             ("one token left to make", FLAT, [one(max_tokens=3, generated=2)], 1, 4096, [0]),
             ("three left", FLAT, [one(max_tokens=5, generated=2)], 1, 4096, [2]),
             ("two positions left", FLAT, [one(prompt=10, generated=2)], 1, 14, [2])]
    return [f"{what}: {got} guesses, want {want}" for what, shape, seqs, rows, n_ctx, want in cases
            if (got := planned(shape, seqs, rows, n_ctx)) != want]


class FreeExtraRows(Speculation):
    """Planted: a guess row costs nothing (the step's time without them)."""

    def cost(self, rows, guessing):
        return lambda extra: self.time(rows)


class NoRoomForItsOwnToken(Speculation):
    """Planted: guesses may fill max_tokens, leaving no room for the step's own token."""

    def plan(self, decoding, rows):
        offers = [seq.guesser.offer(seq.context, min(self.draft_max, seq.room, self.n_ctx - len(seq.context)),
                                    self.rng) for seq in decoding]
        self.fill(decoding, sp.allot([(a, n) for n, a in offers], rows,
                                     self.cost(rows, sum(n > 0 for n, _ in offers))))


@pytest.mark.parametrize("planted", [Speculation, FreeExtraRows, NoRoomForItsOwnToken], ids=lambda c: c.__name__)
def test_the_planner_guesses_only_where_rows_pay_and_room_is_left(planted):
    problems = plan_problems(lambda time, n_ctx: planted(n_ctx, 8, time))
    assert (problems == []) == (planted is Speculation), problems


def draft_plan_problems(spec_class=DraftSpeculation, plan=None) -> list[str]:
    """A draft model's guesses also cost its steps, ceil(guess rows / sequences guessing) of them:
    4 sequences decoding, 2 offering (accept rate 0.95) over free target rows. Draft steps of 0.5
    ms against a 1 ms step: no guesses pay; of 0.01 ms: they do. `spec_class`, `plan`: planted."""
    out = []
    for draft_ms, want in ((0.5, [0, 0, 0, 0]), (0.01, [8, 8, 0, 0])):
        spec = spec_class(4096, CopyingDraft(copies=5), 64, 8, Calibrated({1: 1.0, 256: 1.0}),
                          draft_time=Calibrated({1: draft_ms, 256: draft_ms}))
        seqs = [offering(spec, n=8 if i < 2 else 0, a=0.95) for i in range(4)]
        ks = []
        spec.fill = lambda decoding, given: ks.extend(given)        # the decision; no draft model run
        (plan or Speculation.plan)(spec, seqs, 4)
        if ks != want:
            out.append(f"draft steps of {draft_ms} ms: {ks}, want {want}")
    return out


class FreeDraftSteps(DraftSpeculation):
    """Planted: the draft model's steps cost nothing (prompt lookup's cost)."""
    cost = Speculation.cost


def over_every_sequence(spec, seqs, rows):
    """Planted: the draft steps counted over every decoding sequence, not those that guess."""
    offers = [seq.guesser.offer(seq.context, 8, spec.rng) for seq in seqs]
    spec.fill(seqs, sp.allot([(a, n) for n, a in offers], rows, spec.cost(rows, len(seqs))))


def test_a_draft_models_steps_count_in_what_a_guess_costs():
    assert draft_plan_problems() == []
    assert draft_plan_problems(FreeDraftSteps) != []
    assert draft_plan_problems(plan=over_every_sequence) != []


# ---- the default model: both batching stages -------------------------------------------------------

BATCHING_STAGES = ("fused", "repack")
N_REAL = 16
DRAFT_LAYERS = 24                  # of 30: a draft that both keeps and refuses on any CPU (the test below)


@pytest.fixture(scope="module", params=BATCHING_STAGES)
def batching_engine(request, default_model_path):
    from stages import load
    return request.param, load(request.param, default_model_path)


def test_greedy_text_with_guesses_is_plain_servings_alone_and_in_a_crowd(batching_engine):
    """Copy-heavy and free prompts (app/measure/speculative_prompts.json), each alone and all
    together: with guesses made wherever lookup finds some, each text is plain serving's, token
    for token; the guesses were both kept and refused."""
    from app.measure.speculative import prompt_sets
    stage, engine = batching_engine
    sets = prompt_sets()
    # four copy-heavy prompts (81 to 130 tokens; guesses kept and refused, one whose guesses are
    # all kept) and two free ones: a crowd where some decode with guesses while others still
    # prefill. Each prompt's rows are computed three times over (plain, crowd, alone), the most
    # of the test's time: not all eight copy prompts.
    texts = sets["copy"][:4] + sets["free"][:2]
    asks = [Ask(engine.tokenizer.encode(t), N_REAL) for t in texts]
    plain, _, _, _ = serve(engine, asks, None, pages=300)
    crowd, loop, _, problems = serve(engine, asks, lookup(draft_max=6), pages=300)
    assert problems == [] and pages_back(loop) == []
    s = loop.stats()
    assert 0 < s["accepted"] < s["drafted"], s
    for i, ask in enumerate(asks):
        alone, _, _, _ = serve(engine, [ask], lookup(draft_max=6), pages=300)
        assert crowd[i] == plain[i] == alone[0], f"{stage}, prompt {i}: {crowd[i]} / {alone[0]} / {plain[i]}"


def test_greedy_text_with_a_draft_models_guesses_is_plain_servings(batching_engine, default_model_path,
                                                                   tmp_path_factory):
    """The model's first 24 layers (of 30) guessing (app/draft_model.py) for a crowd of copy-heavy
    and free prompts: each text is plain serving's, token for token; guesses kept and refused; the
    pages of both models' pools all back. SmolLM2 cut short guesses right almost never until most
    of its layers are kept: with its first 2 layers, whether any guess was kept at all was the
    CPU's rounding (some on one CPU, none on another), so both outcomes are certain on any CPU only
    with most layers."""
    from app.draft_model import first_layers
    from app.measure.speculative import prompt_sets
    from stages import load
    stage, engine = batching_engine
    draft = load(stage, first_layers(default_model_path, DRAFT_LAYERS, tmp_path_factory.mktemp("draft")))
    sets = prompt_sets()
    asks = [Ask(engine.tokenizer.encode(t), N_REAL) for t in sets["copy"][:3] + sets["free"][:2]]
    plain, _, _, _ = serve(engine, asks, None, pages=300)
    spec = DraftSpeculation(engine.n_ctx, draft, 300, 4, free_rows())
    crowd, loop, _, problems = serve(engine, asks, spec, pages=300)
    assert problems == [] and pages_back(loop) == [] and spec.pool.n_free == spec.pool.n_pages
    s = loop.stats()
    assert 0 < s["accepted"] < s["drafted"], s
    for i in range(len(asks)):
        assert crowd[i] == plain[i], f"{stage}, prompt {i}: {crowd[i]} / {plain[i]}"


@pytest.mark.parametrize("args, message", [
    (["--spec", "lookup", "--model-draft", "d.gguf"], "--model-draft is for --spec draft"),
    (["--spec", "draft"], "--spec draft needs a draft model"),
    (["--spec", "draft", "--model-draft", "no/such/draft.gguf"], "no model file"),
    (["--model-draft", "OTHER"], "differ at token 9"),
])
def test_serve_spec_flags_are_refused_in_one_line_before_loading(args, message, default_model_path, tmp_path,
                                                                  monkeypatch, capsys):
    """Contradictions, a draft file missing or of another vocabulary: one line, exit 2, and no
    model's weights loaded."""
    import stages
    from app.cli import main
    from common.gguf import GGUFFile
    from tests.test_speculative import metadata_copy
    if "OTHER" in args:
        g = GGUFFile(default_model_path)
        other = metadata_copy(g, tmp_path / "other.gguf", {"tokenizer.ggml.tokens": lambda t: t[:9] + ["?"] + t[10:]})
        args = [other.path if a == "OTHER" else a for a in args]
    monkeypatch.setattr(stages, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["serve", "-m", str(default_model_path), "--stage", "repack", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


class Recorded(Speculation):
    """The real planner over Offers, noting each step's plan: (rows it was told, guesses per sequence)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log = []

    def guesser(self):
        return Offers(self.pooled)

    def plan(self, decoding, rows):
        super().plan(decoding, rows)
        self.log.append((rows, {seq.id: len(seq.guesses) for seq in decoding}))


def prompt_rows_problems(plan=None) -> list[str]:
    """A decodes alone over KNEE's step times (free up to 8 rows): it guesses 7. Then B arrives with
    a prompt of 64 + 66 tokens: in the step that admits B with its first 64 rows, and in the next
    with its other 64, A guesses nothing. `plan`: planted, a wrapper of Speculation.plan."""
    spec = Recorded(4096, 8, Calibrated(KNEE))
    if plan:
        spec.plan = plan(spec.plan)
    loop = EngineLoop(StubEngine(), kv_pages=100, max_batch=4, prefill_chunk=64, speculation=spec)
    a, b = Sequence(Ask([3, 4, 5, 6], 40)), Sequence(Ask(list(range(10, 140)), 4))
    loop.submit(a)
    loop.step()                                    # A's prompt
    loop.step()                                    # A decodes alone
    alone = spec.log[-1]
    loop.submit(b)
    loop.step()                                    # B admitted: its first chunk
    first = spec.log[-1]
    loop.step()                                    # B's second chunk
    second = spec.log[-1]
    got = [(rows, guesses.get(a.id)) for rows, guesses in (alone, first, second)]
    return [] if got == [(1, 7), (65, 0), (65, 0)] else [f"(rows told, A's guesses) at each step: {got}"]


def told_decoding_only(plan):
    """Planted: the planner told of the decoding rows only, not the prompt rows beside them."""
    return lambda decoding, rows: plan(decoding, len(decoding))


def test_prompt_rows_in_a_step_count_in_what_a_guess_costs():
    assert prompt_rows_problems() == []
    assert prompt_rows_problems(told_decoding_only) != []


class Watches(Scheduler):
    """The real scheduler, noting each step: the guesses planned, the rows each sequence feeds,
    its positions held, and the sequences preempted (wherever in the step)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log, self.preempted_in = [], []

    def schedule(self):
        planned = len(self.speculation.log)
        plan = super().schedule()
        guesses = self.speculation.log[-1][1] if len(self.speculation.log) > planned else {}
        self.log.append((guesses, {s.id: n for s, n in plan.rows}, {s.id: len(s.table) for s, _ in plan.rows}))
        return plan

    def _preempt(self, seq):
        self.preempted_in.append(len(self.log))
        super()._preempt(seq)


class PreemptsForGuesses(Watches):
    """Planted: guess rows reserved as any row is, preempting the newest sequence for them."""

    def _guess(self, planned):
        decoding = [seq for seq, _ in planned if self._decoding(seq)]
        if not decoding:
            return planned
        self.speculation.plan(decoding, sum(n for _, n in planned))
        return self._reserve([(seq, seq.decode_rows() if self._decoding(seq) else n) for seq, n in planned],
                             may_preempt=True)[0]


class NeverRight(Recorded):
    def guesser(self):
        return Offers(self.pooled, token=49)                # the stub never writes 49: every guess refused


def dropped_problems(scheduler) -> list[str]:
    """Two sequences of 8-token prompts over 4 pages of 16, each promised 2 (the pool all promised),
    guessing 8 tokens a step over free rows: once a sequence's guesses need a third page, the
    guesses are dropped (it feeds its one row) and nobody is preempted for them; the first
    preemption comes when the older one's own row needs that page (32 positions held). The
    texts are plain serving's."""
    asks = [Ask(list(range(1, 9)), 40), Ask(list(range(11, 19)), 40)]
    plain, _, _, _ = serve(StubEngine(), asks, None, pages=4)
    spec = NeverRight(4096, 8, free_rows())
    seen, loop, _, problems = serve(StubEngine(), asks, spec, pages=4, scheduler=scheduler)
    log = loop.scheduler.log
    a = min(log[1][1])                                  # the older sequence's id
    dropped = [held[a] for guesses, rows, held in log if guesses.get(a) and rows.get(a) == 1]
    if not dropped:
        problems.append("no guesses were dropped: the scene is not set")
    first = loop.scheduler.preempted_in[:1]
    if [log[i][2].get(a) for i in first] != [32]:
        problems.append(f"first preemption at step {first} (the older one holding "
                        f"{[log[i][2].get(a) for i in first]} positions), guesses dropped at {dropped}")
    if seen != plain:
        problems.append("not plain serving's texts")
    return problems


def test_guesses_without_pages_are_dropped_never_a_reason_to_preempt():
    assert dropped_problems(Watches) == []
    assert dropped_problems(PreemptsForGuesses) != []


# ---- the record's page -------------------------------------------------------------------------------

def test_the_page_holds_every_level_to_never_below_plain():
    """The lowest lookup / plain of the levels (free at 8 clients: 0.95x) is held to NEVER_BELOW,
    and named; the twin, every round of it at 1.0, meets it."""
    from app.measure import spec_serve
    from tests.test_generators import spec_record, spec_round
    rec = spec_record()
    text = spec_serve.page(rec, "r.json")
    assert "| every level: the lowest lookup / plain, decode (free, 8 client(s)) | 0.95x | >= 0.97x | no |" in text
    rec["levels"][1]["rounds"] = [spec_round(100, 100)] * 3
    text = spec_serve.page(rec, "r.json")
    assert "| every level: the lowest lookup / plain, decode (free, 8 client(s)) | 1.00x | >= 0.97x | yes |" in text
