"""Batched decode on the default model: a sequence's numbers do not depend on its neighbours.

Every CPU stage with a KV cache runs sequences through the engine loop (app/serve/engine_loop.py,
stepped by hand): a sequence alone, then the same sequence admitted mid-way among others at
other positions, its prompt prefilled in other chunks. Its logits at every step must be the
same bits, and so its greedy tokens, for every stage (int8 included: its batched rows all take
the same path too). And a sequence preempted for want of pages, recomputed later, goes on with
the logits it would have had.

Against the single-sequence path (`generate`, what `run -p` does): the batched rows go through
the multi-row kernels, the single path's decode through the one-row kernels, which sum in
another order; so the logits agree within rounding, and a greedy token may differ only where
the single path's top two candidates are nearly tied. The test measures those margins and
shows them (pytest -s prints them).
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

from app.serve.engine_loop import EngineLoop
from app.serve.sequence import Ask, Sequence
from common.generate import generate
from notebooks.nb.measure import KeepLogits
from stages import backend_class, info, load
from tests.stub_engine import StubBackend
from tests.util import cpu_stages

STAGES = [s for s in cpu_stages() if info(s).kv_cache]
N_TOKENS = 6
DEFAULT_TOLERANCE = 5e-3          # logits: float rounding (as tests/test_stages.py)
NEAR_TIE = 0.25                   # logits: where 8-bit rounding may swap the top two (test_stages.py)
PROMPTS = {
    "a": "The quick brown fox jumps over the lazy dog. Then it",
    "b": "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books about",
    "c": "1, 2, 3, 4,",
    "d": "The capital of France is",
}


def tolerance(stage: str) -> float:
    module = importlib.import_module(backend_class(stage).__module__)
    return getattr(module, "LOGIT_TOLERANCE", DEFAULT_TOLERANCE)


@pytest.fixture(scope="module", params=STAGES)
def stage_engine(request, default_model_path):
    """(stage, engine), one stage at a time: pytest runs every test of a stage before loading the next."""
    return request.param, load(request.param, default_model_path)


def submit(sched, engine, name, max_tokens=N_TOKENS):
    req = Sequence(Ask(engine.tokenizer.encode(PROMPTS[name]), max_tokens))
    sched.submit(req)
    req.sampler = KeepLogits()
    return req


def drain(sched, steps=None):
    n = 0
    while not sched.scheduler.idle and (steps is None or n < steps):
        sched.step()
        n += 1


def test_a_sequence_does_not_depend_on_its_neighbours(stage_engine):
    stage, engine = stage_engine
    alone = EngineLoop(engine, kv_pages=64, prefill_chunk=64)
    a = submit(alone, engine, "a")
    drain(alone)

    crowd = EngineLoop(engine, kv_pages=64, prefill_chunk=5)    # prompts cut into chunks of 5
    others = [submit(crowd, engine, "b", max_tokens=2 * N_TOKENS), submit(crowd, engine, "c")]
    drain(crowd, steps=6)                                      # b prefilling or decoding, c decoding
    a2 = submit(crowd, engine, "a")
    others.append(submit(crowd, engine, "d"))
    drain(crowd)
    assert a2.generated == a.generated and len(a.generated) == N_TOKENS
    assert len(a2.sampler.logits) == len(a.sampler.logits)
    for i, (x, y) in enumerate(zip(a.sampler.logits, a2.sampler.logits)):
        assert np.array_equal(x, y), f"{stage}: step {i}: max |diff| {np.abs(x - y).max()}"
    assert all(len(r.generated) == r.ask.max_tokens for r in others)
    assert crowd.pool.n_free == crowd.pool.n_pages and crowd.pool.reserved == 0


def test_batched_tokens_follow_the_single_sequence_path_up_to_near_ties(stage_engine):
    """Teacher-forced: the single path's logits (prefill, then decode one token at a time, as
    `generate` does) over prompt + the batch's tokens; at each step the batch's pick must be
    the single path's best, or within the stage's tie margin of it (float stages: twice their
    logit tolerance; int8: NEAR_TIE, as test_stages allows it against the reference)."""
    stage, engine = stage_engine
    sched = EngineLoop(engine, kv_pages=64)
    reqs = [submit(sched, engine, name, max_tokens=N_TOKENS + 2) for name in PROMPTS]
    drain(sched)
    tol = tolerance(stage)
    margin = 2 * tol if tol <= DEFAULT_TOLERANCE else NEAR_TIE
    for name, req in zip(PROMPTS, reqs):
        engine.reset()                                         # the prompt, then one token at a time
        single = [engine.forward(req.ask.prompt, 0, all_logits=False)[0]]
        for i, t in enumerate(req.generated[:-1]):
            single.append(engine.forward([t], len(req.ask.prompt) + i)[0])
        single = np.stack(single)
        batched = np.stack(req.sampler.logits)
        assert np.isfinite(batched).all()
        apart = np.abs(single - batched).max()
        assert apart <= tol, f"{stage} '{name}': logits apart by {apart}"
        behind = single.max(axis=1) - single[np.arange(len(req.generated)), req.generated]
        for i in np.flatnonzero(behind > 0):
            top2 = np.sort(single[i])[-2:]
            print(f"{stage} '{name}' step {i}: batch picked {req.generated[i]}, the single path "
                  f"{int(single[i].argmax())}; {behind[i]:.4f} behind (its top two {top2[1] - top2[0]:.4f} apart)")
        assert (behind <= margin).all(), f"{stage} '{name}': batch picks behind the single path by {behind}"
        if tol <= DEFAULT_TOLERANCE and not (behind > 0).any():
            engine.reset()
            assert generate(engine, req.ask.prompt, len(req.generated), ignore_eos=True).tokens == req.generated


def test_prefix_pages_are_shared_and_give_the_same_numbers(default_model_path):
    """A second request with the same prompt adopts the first one's full prompt pages (counted)
    and computes only the rest; its logits are the first one's, bit for bit."""
    engine = load("threads" if "threads" in STAGES else STAGES[-1], default_model_path)
    sched = EngineLoop(engine, kv_pages=64)
    first = submit(sched, engine, "b", max_tokens=4 * N_TOKENS)
    drain(sched, steps=2)                                      # prefilled, decoding
    n_prompt = len(first.ask.prompt)
    full = n_prompt // sched.pool.page_size
    assert full >= 1 and sched.pool.n_cached >= full
    second = submit(sched, engine, "b")
    sched.step()
    assert sched.pool.n_shared == full, "the second request shares the first one's full prompt pages"
    used = sched.pool.n_pages - sched.pool.n_free
    own = [p for p in second.table.pages if p not in first.table.pages]
    assert used == len(first.table.pages) + len(own)
    drain(sched)
    for x, y in zip(first.sampler.logits, second.sampler.logits):
        assert np.array_equal(x, y)
    assert first.generated[:N_TOKENS] == second.generated


def test_a_preempted_sequence_goes_on_with_the_logits_it_would_have_had(default_model_path):
    """A pool far too small for every request's worst case at once (app/serve/scheduler.py
    preempts the newest sequence and later recomputes its prompt and generated tokens): every
    request completes with the logits, bit for bit, and so the tokens, it has alone;
    preemptions are counted; every page comes back."""
    engine = load("threads" if "threads" in STAGES else STAGES[-1], default_model_path)
    # prompts of 16 tokens: admitted with one page of room beyond them (2 pages), a sequence wants
    # a third after 17 tokens, when the pool has none left for the second one: that one is
    # preempted with 17 tokens generated, recomputed, and generates 7 more
    texts = [f"Request {i}: the sea is wide and deep, and the ships on it" for i in range(4)]
    n = 24

    def run(pages, texts):
        sched = EngineLoop(engine, kv_pages=pages, max_batch=len(texts), prefill_chunk=16)
        reqs = []
        for t in texts:
            req = Sequence(Ask(engine.tokenizer.encode(t), n))
            sched.submit(req)
            req.sampler = KeepLogits()
            reqs.append(req)
        drain(sched)
        assert sched.pool.n_free == sched.pool.n_pages and sched.pool.reserved == 0
        return sched, reqs
    worst = sum(-(-(len(engine.tokenizer.encode(t)) + n) // 16) for t in texts)
    tight, crowd = run(worst // 3 + 1, texts)
    assert tight.preemptions >= 1 and tight.stats()["preemptions"] == tight.preemptions
    assert sum(r.preemptions for r in crowd) == tight.preemptions
    for t, req in zip(texts, crowd):
        _, (alone,) = run(64, [t])
        assert req.generated == alone.generated and len(req.generated) == n
        assert all(np.array_equal(x, y) for x, y in zip(req.sampler.logits, alone.sampler.logits)), t


class StubEngine:
    """An engine shape for the loop's own tests: uniform logits, and it notes which thread
    ran each step."""

    class config:
        n_layer, kv_dim, n_vocab, n_ctx_train = 1, 4, 8, 64

    backend = StubBackend

    n_ctx = 64

    def __init__(self):
        self.threads = []

    def forward_batch(self, batch):
        self.threads.append(threading.get_ident())
        return np.zeros((len(batch.logit_rows), self.config.n_vocab), dtype=np.float32)


def test_the_engine_loop_steps_in_the_thread_that_calls_run():
    """run() is the loop in the caller's thread (the one that loaded and warmed the engine,
    EngineLoop.run says why), returns when keep_going() turns false, and ends what is left
    with an error, not silently."""
    engine = StubEngine()
    sched = EngineLoop(engine, kv_pages=8)
    events = {}

    def request(i):
        return Sequence(Ask([1, 2], 3), on_event=lambda kind, v: events.setdefault(i, []).append(kind))

    done = request(0)
    sched.submit(done)
    sched.run(keep_going=lambda: "done" not in events.get(0, []))
    assert set(engine.threads) == {threading.get_ident()}
    assert events[0] == ["token"] * 3 + ["done"]

    left = request(1)
    sched.submit(left)
    sched.run(keep_going=lambda: False)
    assert events[1] == ["error"] and sched.scheduler.idle
