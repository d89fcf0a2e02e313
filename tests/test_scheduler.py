"""The scheduler (app/serve/scheduler.py) in the engine loop (app/serve/engine_loop.py) on
StubEngine (tests/stub_engine.py), stepped by hand; and the scheduler alone, planning steps
with no engine at all.

StubEngine's next token hashes every token the sequence's pages hold, so these checks see a
page lost, shared wrongly or recomputed wrongly as a different text. Each check is a function
that returns what it found wrong; it runs on the real Scheduler, which must pass, and on a
Scheduler (or engine loop) with one bug planted, which it must flag (as tests/test_emulator.py
does for the CUDA kernels):

    pages that follow need    a pool a quarter of every request's worst case at once completes
                              every request, greedy and seeded outputs equal to each alone,
                              preemptions counted, every page free at the end
    first in, first out       a request that cannot have its pages holds back the ones after it
    cancel                    running or waiting, its pages come back and nothing more is made
    the queue bound           exactly max_batch + max_queue requests are taken, the next refused
    a failing step            its requests end with an error, the others finish as alone
    n choices                 the prompt is computed once and its pages held once
    prompt log-probabilities  every position scored, even when the prompt is cached
    preempted choices, echo   n > 1 and echo in a pool too small: each as alone
    a step's rows             every decoding row in every step, prompts in chunks beside them
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from app.serve.engine_loop import EngineLoop
from app.serve.scheduler import QueueFull, Scheduler
from app.serve.sequence import Ask, Sequence
from common.generate import ContextError, Sampler, SamplingParams, log_softmax, token_logprobs
from tests.stub_engine import StubEngine

MAX_TOKENS = 60


def drain(loop, limit=20_000) -> int:
    n = 0
    while not loop.scheduler.idle:
        loop.step()
        n += 1
        assert n < limit, "the scheduler made no progress"
    return n


def make(cls, engine, **kw) -> EngineLoop:
    """An engine loop: `cls` itself, or one whose scheduler is `cls`."""
    return cls(engine, **kw) if issubclass(cls, EngineLoop) else EngineLoop(engine, scheduler=cls, **kw)


def request(prompt, max_tokens, on_event=None, **ask) -> Sequence:
    return Sequence(Ask(prompt, max_tokens, **ask), on_event)


def prompts(n=12, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(40) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def worst_case_pages(ps, max_tokens=MAX_TOKENS, page=16):
    return sum(-(-(len(p) + max_tokens) // page) for p in ps)


# ---- planted bugs ------------------------------------------------------------------------------

class ForgetsWhatItGenerated(Scheduler):
    """Preemption that recomputes the prompt alone (the tokens generated so far lost)."""

    def _preempt(self, req):
        super()._preempt(req)
        req.generated.clear()


class FreshSamplerOnResume(Scheduler):
    """Preemption that starts the sampler afresh (its random state lost)."""

    def _preempt(self, req):
        super()._preempt(req)
        req.sampler = Sampler(req.ask.params, stream=req.ask.choice)


class NeverPreempts(Scheduler):
    """A pool that runs out and never preempts: the sequences that cannot grow wait forever."""

    def _reserve(self, rows, may_preempt):
        return super()._reserve(rows, may_preempt=False)


class Overtakes(Scheduler):
    """Admission that lets a later request pass one that does not fit."""

    def _admit(self):
        admitted, skipped = [], []
        while self.waiting:
            before = len(self.waiting)
            admitted += super()._admit()
            if self.waiting and len(self.waiting) == before:
                skipped.append(self.waiting.popleft())
            elif not self.waiting:
                break
        self.waiting.extendleft(reversed(skipped))
        return admitted


class CancelIgnored(EngineLoop):
    def cancel(self, req):
        pass


class OffByOneQueue(Scheduler):
    def _bound(self):
        return super()._bound() + 1


class LeaksOnFailure(EngineLoop):
    """A failing step whose requests keep their pages."""

    def _finish(self, req, kind, value):
        if kind == "error":
            req.table = None                       # dropped, never released
        super()._finish(req, kind, value)


class NoForks(EngineLoop):
    """n choices as n separate requests: each computes the prompt again."""

    def submit(self, req, followers=()):
        super().submit(req)
        for f in followers:
            super().submit(f)


class ScoresFromCache(Scheduler):
    """Prompt log-probabilities with the prefix cache on: cached positions never scored."""

    def _admit(self):
        asked = {seq: seq.ask for seq in self.waiting}
        for seq in self.waiting:
            seq.ask = dataclasses.replace(seq.ask, prompt_logprobs=None)
        try:
            admitted = super()._admit()
        finally:
            for seq, ask in asked.items():
                seq.ask = ask
        return admitted


# ---- checks ------------------------------------------------------------------------------------

def pages_follow_need(cls, sampled: bool) -> list[str]:
    """12 requests in a quarter of their worst case: all complete, each equal to its output
    alone (a pool holding every worst case), preemptions counted, every page back."""
    ps = prompts()
    problems = []

    def run(pages, kind):
        engine = StubEngine()
        loop = make(kind, engine, kv_pages=pages, max_batch=12, max_queue=12, prefill_chunk=24)
        reqs, emitted = [], {}
        for i, p in enumerate(ps):
            params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i) if sampled else SamplingParams()
            seen = emitted.setdefault(i, [])
            reqs.append(request(prompt=p, max_tokens=MAX_TOKENS, params=params,
                                on_event=lambda k, v, seen=seen: seen.append(v.id if k == "token" else k)))
            loop.submit(reqs[-1])
        try:
            drain(loop, limit=3000)
        except AssertionError as e:
            problems.append(str(e))
        return loop, [emitted.get(i, []) for i in range(len(ps))]

    roomy, alone = run(worst_case_pages(ps), Scheduler)
    tight, crowd = run(worst_case_pages(ps) // 4, cls)
    if roomy.preemptions:
        problems.append("preempted with room for everyone")
    if tight.preemptions < 3:
        problems.append(f"only {tight.preemptions} preemptions in a quarter of the worst case")
    # what each request's client saw: its tokens, then "done"
    for i, (a, b) in enumerate(zip(alone, crowd)):
        if b != a:
            problems.append(f"request {i}: output differs from its output alone")
        if b[-1:] != ["done"] or len(b) != MAX_TOKENS + 1:
            problems.append(f"request {i}: {len(b) - 1} tokens, not {MAX_TOKENS}, then {b[-1:]}")
    if not sampled:
        engine = StubEngine()
        problems += [f"request {i}: not the stub's greedy text" for i, (p, b) in enumerate(zip(ps, crowd))
                     if b[:-1] != engine.reference(p, MAX_TOKENS)]
    if (tight.pool.n_free, tight.pool.reserved) != (tight.pool.n_pages, 0):
        problems.append(f"{tight.pool.n_pages - tight.pool.n_free} pages not returned, {tight.pool.reserved} reserved")
    if tight.stats()["preemptions"] != tight.preemptions:
        problems.append("the stats do not report the preemptions")
    return problems


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_pool_too_small_for_every_worst_case_completes_every_request(sampled):
    assert pages_follow_need(Scheduler, sampled) == []


@pytest.mark.parametrize("planted,sampled", [(ForgetsWhatItGenerated, False), (FreshSamplerOnResume, True)],
                         ids=["forgets-generated", "fresh-sampler"])
def test_the_preemption_check_flags_a_resume_that_loses_state(planted, sampled):
    assert any("differs from its output alone" in p for p in pages_follow_need(planted, sampled))


def test_the_preemption_check_flags_a_pool_that_never_preempts():
    assert any(p.startswith("the scheduler made no progress") for p in pages_follow_need(NeverPreempts, False))


def admission_order(cls) -> list[int]:
    """Three requests: a small one running, a big one that must wait for its pages, then a
    small one that would fit. The order in which they get their pages."""
    loop = make(cls, StubEngine(), kv_pages=6, max_batch=4, max_queue=4)
    first = request(prompt=list(range(30)), max_tokens=20)          # 2 pages + headroom: 3 of 6
    big = request(prompt=list(range(5, 70)), max_tokens=4)          # 5 pages: waits
    small = request(prompt=[1, 2, 3], max_tokens=4)                 # 1 page + headroom: would fit
    order = []
    for r in (first, big, small):
        loop.submit(r)
    while not loop.scheduler.idle:
        loop.step()
        order += [r.id for r in (first, big, small) if r.table is not None and r.id not in order]
    return [{first.id: "first", big.id: "big", small.id: "small"}[i] for i in order]


def test_admission_is_first_in_first_out_without_overtaking():
    assert admission_order(Scheduler) == ["first", "big", "small"]
    assert admission_order(Overtakes) == ["first", "small", "big"], "the planted overtaking is seen"


def cancellation(cls) -> list[str]:
    """A running request and a waiting one cancelled: both end 'cancelled', the running one
    makes no token after the next step boundary, and every page comes back."""
    loop = make(cls, StubEngine(), kv_pages=40, max_batch=1, max_queue=2)
    events = {"running": [], "waiting": []}
    running = request(prompt=[1, 2, 3], max_tokens=500, on_event=lambda k, v: events["running"].append(k))
    waiting = request(prompt=[4, 5, 6], max_tokens=5, on_event=lambda k, v: events["waiting"].append(k))
    loop.submit(running)
    loop.submit(waiting)
    for _ in range(3):
        loop.step()
    loop.cancel(running)
    loop.cancel(waiting)
    made = len(running.generated)
    for _ in range(3):
        loop.step()
    problems = []
    if events["running"][-1:] != ["done"] or len(running.generated) > made:
        problems.append(f"the running request went on: {len(running.generated) - made} tokens after cancel")
    if events["waiting"] != ["done"]:
        problems.append(f"the waiting request saw {events['waiting']}")
    if not loop.scheduler.idle or loop.pool.n_free != loop.pool.n_pages:
        problems.append("pages or requests left behind")
    return problems


def test_cancel_ends_running_and_waiting_requests_and_frees_their_pages():
    assert cancellation(Scheduler) == []
    assert cancellation(CancelIgnored) != []


def accepted(cls) -> int:
    loop = make(cls, StubEngine(), kv_pages=64, max_batch=3, max_queue=2)
    n = 0
    try:
        for _ in range(10):
            loop.submit(request(prompt=[1, 2], max_tokens=4))
            n += 1
    except QueueFull as e:
        assert "--max-queue" in str(e)
    return n


def test_the_queue_takes_exactly_max_batch_plus_max_queue():
    assert accepted(Scheduler) == 3 + 2
    assert accepted(OffByOneQueue) == 3 + 2 + 1, "the planted off-by-one is seen"


def test_choices_count_against_the_queue_bound():
    loop = EngineLoop(StubEngine(), kv_pages=64, max_batch=3, max_queue=1)
    loop.submit(request(prompt=[1], max_tokens=2), [request(prompt=[1], max_tokens=2, choice=c) for c in (1, 2)])
    with pytest.raises(QueueFull):
        loop.submit(request(prompt=[1], max_tokens=2), [request(prompt=[1], max_tokens=2, choice=1)])
    loop.submit(request(prompt=[1], max_tokens=2))


def failing_step(cls) -> list[str]:
    """A step that raises ends the requests in it with an error and gives back their pages;
    the request waiting behind them, and one submitted after, finish as alone; the failure is
    counted. (Every running sequence is in every step, so max_batch 1 keeps the others out.)"""
    engine = StubEngine(fail_on=49)          # never generated: the stub draws 0..48
    loop = make(cls, engine, kv_pages=16, max_batch=1, max_queue=4, prefill_chunk=8)
    events = {}

    def submit(name, prompt):
        r = request(prompt=prompt, max_tokens=20, on_event=lambda k, v: events.setdefault(name, []).append(k))
        loop.submit(r)
        return r
    submit("bad", [5] * 12 + [49])                          # its second chunk holds the planted token
    waiting = submit("waiting", [1, 2, 3])
    drain(loop)
    after = submit("after", [7, 8, 9])
    drain(loop)
    problems = []
    if events["bad"][-1:] != ["error"] or "token" in events["bad"]:
        problems.append(f"the failing request saw {events['bad']}")
    for name, r in (("waiting", waiting), ("after", after)):
        if events[name][-1] != "done" or r.generated != engine.reference(r.ask.prompt, 20):
            problems.append(f"the request {name} did not finish as alone")
    if loop.failures != 1 or loop.stats()["finished"]["error"] != 1:
        problems.append("the failure is not counted")
    if loop.pool.n_free != loop.pool.n_pages or loop.pool.reserved:
        problems.append("pages lost in the failure")
    return problems


def test_a_failing_step_ends_its_requests_and_the_others_carry_on():
    assert failing_step(Scheduler) == []
    assert "pages lost in the failure" in failing_step(LeaksOnFailure)


def choices(cls) -> tuple[int, int, list]:
    """3 choices of one 40-token prompt: how many times its positions were computed, the most
    pages held at once, and the choices' outputs."""
    engine = StubEngine()
    loop = make(cls, engine, kv_pages=64, max_batch=4, max_queue=4)
    prompt = list(range(1, 41))
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    reqs = [request(prompt=prompt, max_tokens=8, params=params, choice=c) for c in range(3)]
    loop.submit(reqs[0], reqs[1:])
    held = 0
    while not loop.scheduler.idle:
        loop.step()
        held = max(held, loop.pool.n_pages - loop.pool.n_free)
    computed = sum(1 for step in engine.steps for _, pos, _ in step if pos < len(prompt))
    return computed // len(prompt), held, [r.generated for r in reqs]


def test_n_choices_share_the_prompts_pages_and_draw_their_own_tokens():
    times, held, outs = choices(Scheduler)
    assert times == 1, "the prompt is computed once for all choices"
    assert held <= 3 + 3, "the prompt's 3 pages held once, a page of its own for each choice"
    assert len({tuple(o) for o in outs}) == 3, "seeded choices draw different tokens"
    alone = EngineLoop(StubEngine(), kv_pages=64)
    again = request(prompt=list(range(1, 41)), max_tokens=8, choice=2,
                    params=SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    alone.submit(again)
    drain(alone)
    assert again.generated == outs[2], "choice 2 draws what its stream draws alone"
    assert choices(NoForks)[0] == 3, "the planted version computes the prompt three times"


def prompt_scores(cls) -> list[str]:
    """The same 40-token prompt twice; the second, asking for its prompt's log-probabilities,
    finds the first's pages cached and must still score every position."""
    engine = StubEngine()
    loop = make(cls, engine, kv_pages=64)
    prompt = list(range(3, 43))
    first = request(prompt=prompt, max_tokens=2)
    loop.submit(first)
    drain(loop)
    got = []
    second = request(prompt=prompt, max_tokens=0, prompt_logprobs=2,
                     on_event=lambda k, v: got.append((k, v)))
    loop.submit(second)
    drain(loop)
    problems = []
    kinds = [k for k, _ in got]
    if kinds != ["prompt", "done"]:
        return [f"events {kinds}"]
    scores = got[0][1]
    if len(scores) != len(prompt) or scores[0] is not None:
        return [f"{len(scores)} scores for {len(prompt)} prompt tokens"]
    for j in range(1, len(prompt)):
        want = log_softmax(-0.5 * np.abs(np.arange(50) - engine.next_token(prompt[:j])))
        lp, top = scores[j]
        if abs(lp - want[prompt[j]]) > 1e-9 or top[0][0] != int(np.argmax(want)):
            problems.append(f"position {j}: {lp} and {top} where {want[prompt[j]]}")
    if got[1][1] != "length" or second.generated:
        problems.append("max_tokens 0 generated something")
    return problems


def test_the_prompts_log_probabilities_cover_every_position():
    assert prompt_scores(Scheduler) == []
    assert prompt_scores(ScoresFromCache) != []


class SentWithTheLastToken(Sequence):
    """A planted bug (the rule this code had): the prompt's scores sent only with the row of
    its last token."""

    def score(self, logits, start):
        super().score(logits, start)
        return start + len(logits) >= len(self.ask.prompt)


def scores_at_a_chunk_boundary(sequence) -> list[str]:
    """A 17-token prompt prefilled in chunks of 8: they end at 8 and 16, its last position but
    one, so its 17 scores are all known before its last token is computed (which then comes as
    a decoding row). Asked with max_tokens 0 and 3: 'prompt', then 'done', or 3 tokens and
    'done'."""
    problems = []
    for max_tokens in (0, 3):
        loop, got = EngineLoop(StubEngine(), kv_pages=16, prefill_chunk=8), []
        loop.submit(sequence(Ask(list(range(1, 18)), max_tokens, prompt_logprobs=1),
                             on_event=lambda k, v: got.append(k if k != "prompt" else (k, len(v)))))
        drain(loop)
        want = [("prompt", 17)] + ["token"] * max_tokens + ["done"]
        if got != want:
            problems.append(f"max_tokens {max_tokens}: events {got}, not {want}")
    return problems


def test_the_prompts_scores_are_sent_when_a_chunk_ends_at_its_last_position_but_one():
    assert scores_at_a_chunk_boundary(Sequence) == []
    assert scores_at_a_chunk_boundary(SentWithTheLastToken) != []


def test_what_can_never_fit_the_pool_is_refused_before_queueing():
    loop = EngineLoop(StubEngine(), kv_pages=4)
    loop.scheduler.check(10, 54)                                       # 64 positions: 4 pages
    with pytest.raises(ContextError, match=r"need 5 KV pages .* the server has 4 \(--kv-pages\)"):
        loop.scheduler.check(10, 55)
    with pytest.raises(ValueError, match="max_tokens"):
        loop.scheduler.check(10, 0)
    loop.scheduler.check(10, 0, score_only=True)


# ---- preempted while its choices wait, or while its prompt is scored ----------------------------

class DropsWaitingChoices(Scheduler):
    """A planted bug: preemption that forgets the choices still waiting to fork the sequence."""

    def _preempt(self, seq):
        seq.followers = []
        super()._preempt(seq)


class ScoresAgain(Sequence):
    """A planted bug: a prompt chunk computed again after a preemption is scored again."""

    def score(self, logits, start):
        if not self.prompt_scores:
            self.prompt_scores.append(None)
        for i, pos in enumerate(range(start, start + len(logits))):
            if pos + 1 < len(self.ask.prompt):
                self.prompt_scores.append(token_logprobs(logits[i], self.ask.prompt[pos + 1], self.ask.prompt_logprobs))
        return len(self.prompt_scores) >= len(self.ask.prompt)


def crowded_as_alone(kind: str, scheduler=Scheduler, sequence=Sequence) -> list[str]:
    """12 requests, each of 2 seeded choices (kind "n2") or asking for its prompt's
    log-probabilities (kind "echo"), in a pool a third of their worst case, prefilled in
    chunks of 4: every choice's events (tokens, prompt scores, end) equal what it gets with
    room for all, and the case this is about happened: a sequence preempted while its choices
    waited to fork it (n2), or before its prompt was all scored (echo)."""
    ps, n = prompts(), 24

    class Watched(scheduler):
        caught = 0

        def _preempt(self, seq):
            Watched.caught += bool(seq.followers) if kind == "n2" else seq.scoring
            super()._preempt(seq)

    def run(pages, cls):
        loop = EngineLoop(StubEngine(), kv_pages=pages, max_batch=24, max_queue=24, prefill_chunk=4, scheduler=cls)
        events = []

        def listener(seen):
            return lambda k, v: seen.append((k, v.id if k == "token" else v))
        for i, p in enumerate(ps):
            params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i)
            group = []
            for c in range(2 if kind == "n2" else 1):
                events.append([])
                group.append(sequence(Ask(p, n, params, choice=c, prompt_logprobs=2 if kind == "echo" else None),
                                      on_event=listener(events[-1])))
            loop.submit(group[0], group[1:])
        try:
            drain(loop, limit=5000)
        except AssertionError as e:
            return loop, events, [str(e)]
        return loop, events, []

    _, alone, problems = run(worst_case_pages(ps, n) * 2, Scheduler)
    tight, crowd, more = run(worst_case_pages(ps, n) // 3, Watched)
    problems += more
    if not Watched.caught:
        problems.append(f"the scene: no sequence preempted while {'its choices waited' if kind == 'n2' else 'scored'}")
    problems += [f"choice {i}: its events differ from those it has with room for all"
                 for i, (a, b) in enumerate(zip(alone, crowd)) if a != b]
    if (tight.pool.n_free, tight.pool.reserved) != (tight.pool.n_pages, 0):
        problems.append("pages not returned")
    return problems


@pytest.mark.parametrize("kind", ["n2", "echo"])
def test_preemption_keeps_waiting_choices_and_scores_each_prompt_position_once(kind):
    assert crowded_as_alone(kind) == []


def test_the_preemption_checks_flag_lost_choices_and_prompts_scored_twice():
    assert crowded_as_alone("n2", scheduler=DropsWaitingChoices) != []
    assert crowded_as_alone("echo", sequence=ScoresAgain) != []


# ---- the scheduler alone: steps planned with no engine -------------------------------------------

def simulate(scheduler, steps: int) -> list[list[tuple[int, int]]]:
    """Plan `steps` steps with no engine: each planned row's tokens are taken as computed (the
    pages take them), and a sequence whose context is then complete gets a made-up next token.
    The plans, as [(sequence id, rows)]."""
    plans = []
    for _ in range(steps):
        plan = scheduler.schedule()
        plans.append([(seq.id, n) for seq, n in plan.rows])
        for seq, n in plan.rows:
            seg = seq.segment(n)
            seq.table.append_slots(seg.tokens)
            if seg.logits:
                seq.generated.append(7)
    return plans


class WholePrompts(Scheduler):
    """A planted bug: a prompt prefilled whole, the budget ignored."""

    def _rows(self, seqs, budget):
        return super()._rows(seqs, 10 ** 9)


def prefill_beside_decoding(cls) -> list[str]:
    """Three sequences decoding, then a 100-token prompt arrives, prefill_chunk 16: each step
    plans the three decoding rows and 16 of the prompt's, until the prompt is in (7 steps), then
    four decoding rows."""
    from common.paged_kv import PagePool
    sched = cls(PagePool(1, 4, 64), n_ctx=4096, n_ctx_train=4096, max_batch=8, max_queue=8, prefill_chunk=16)
    decoding = [Sequence(Ask([1, 2, 3], 50)) for _ in range(3)]
    for seq in decoding:
        sched.add(seq)
    simulate(sched, 2)                                    # prefilled, decoding
    long = Sequence(Ask(list(range(100)), 5))
    sched.add(long)
    plans = simulate(sched, 8)
    d = [(seq.id, 1) for seq in decoding]
    want = [d + [(long.id, 16)]] * 6 + [d + [(long.id, 4)]] + [d + [(long.id, 1)]]
    return [] if plans == want else [f"planned {plans}"]


def test_the_scheduler_plans_prompt_chunks_beside_the_decoding_rows_without_an_engine():
    assert prefill_beside_decoding(Scheduler) == []
    assert prefill_beside_decoding(WholePrompts) != []
