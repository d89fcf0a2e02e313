"""Chapter 14's check: your admission and reservation inside the server's scheduler, against the
server's own (app/serve/scheduler.py's Scheduler), on the same traffic, planned with no engine
(each planned row's tokens taken as computed, a made-up next token after a context completes, a
sequence released at its max_tokens): every step's rows, preemptions and queue must be the same.
Then the steps each needs to serve a burst of requests, beside a server that runs one sequence at
a time (the chapters before: one user)."""

from __future__ import annotations

import random

from app.serve.scheduler import Scheduler
from app.serve.sequence import Ask, Sequence
from common.paged_kv import PagePool
from exercises.harness import Case, Exercise, Timing

STEP_LIMIT = 5000


def traffic(seed: int, n: int, prompt: tuple, tokens: tuple, spread: int) -> list[tuple[int, int, int]]:
    """[(arrival step, prompt length, max_tokens)], seeded."""
    rng = random.Random(seed)
    return sorted((rng.randrange(spread + 1), rng.randint(*prompt), rng.randint(*tokens)) for _ in range(n))


class Differs(Exception):
    """A step planned otherwise than the server's."""


def simulate(cls, arrivals, n_pages, page_size=16, max_batch=8, prefill_chunk=32, expect=None):
    """Plan steps until every request is served: [(rows, preempted, waiting)] per step, each
    sequence named by its arrival index; the scheduler's final state. With `expect` (the server's
    log on the same traffic), stop at the first step planned otherwise: Differs, saying how."""
    pool = PagePool(1, 4, n_pages, page_size)
    sched = cls(pool, n_ctx=4096, n_ctx_train=4096, max_batch=max_batch, max_queue=len(arrivals) + 8,
                prefill_chunk=prefill_chunk)
    index, log, pending = {}, [], list(arrivals)
    rng = random.Random(0)
    for step in range(STEP_LIMIT):
        while pending and pending[0][0] <= step:
            _, n_prompt, n_tokens = pending.pop(0)
            seq = Sequence(Ask([rng.randrange(1, 50) for _ in range(n_prompt)], n_tokens))
            sched.check(n_prompt, n_tokens)
            index[seq] = len(index)
            sched.add(seq)
        if sched.idle and not pending:
            break
        try:
            plan = sched.schedule()
        except NotImplementedError:
            raise
        except Exception as e:
            if expect is None:
                raise
            want = expect[step] if step < len(expect) else "nothing (all served)"
            raise Differs(f"step {step}: the step's planning raised {type(e).__name__}: {e}\n(a sequence "
                          f"in the plan without pages? one preempted after it was planned must leave it); "
                          f"the server planned rows, preempted, waiting = {want}") from e
        log.append(([(index[s], n) for s, n in plan.rows], [index[s] for s in plan.preempted],
                    [index[s] for s in sched.waiting]))
        if expect is not None:
            _compare(step, log[-1], expect[step] if step < len(expect) else None)
        for seq, n in plan.rows:
            seg = seq.segment(n)
            seq.table.append_slots(seg.tokens)
            if seg.logits:
                seq.generated.append(len(seq.context) * 7 % 50 + 1)
                if seq.end_reason():
                    sched.release(seq)
    return log, sched, pool


def _compare(step, got, want):
    if want is None:
        raise Differs(f"step {step}: planned {got[0]}; the server had served every request by then")
    for what, g, w in (("rows [(sequence, rows)]", got[0], want[0]), ("preempted", got[1], want[1]),
                       ("waiting", got[2], want[2])):
        if g != w:
            raise Differs(f"step {step}: {what} {g}, the server's {w}")


class Batching(Exercise):
    chapter = "14"
    title = "batching: the scheduler's admit-or-preempt decision"
    folder = "exercises/14_batching"
    file = "admit_or_preempt.py"
    reference = {"AdmitOrPreempt": Scheduler}
    reference_code = "app/serve/scheduler.py: Scheduler._reserve, Scheduler._admit"

    def cases(self, rng, quick):
        # (rng unused: each traffic has a seed of its own)
        return [
            Case("a pool for everyone: 5 requests at once, all admitted, nobody preempted",
                 dict(arrivals=traffic(1, 5, (5, 30), (5, 20), 0), n_pages=64)),
            Case("max_batch 2, 6 waiting: admitted oldest first as places free",
                 dict(arrivals=traffic(2, 6, (5, 20), (3, 12), 0), n_pages=64, max_batch=2)),
            Case("the oldest waiting does not fit yet: the small ones behind it wait too (no overtaking)",
                 dict(arrivals=[(0, 60, 30), (1, 100, 20), (1, 4, 4), (1, 4, 4)], n_pages=12)),
            Case("short prompts, long answers, 12 pages: sequences outgrow their pages, the newest is preempted "
                 "and comes back first", dict(arrivals=traffic(4, 8, (3, 10), (40, 60), 0), n_pages=12, preempts=True)),
            Case("arrivals while others decode, prompts in chunks of 16 beside them",
                 dict(arrivals=traffic(5, 10, (20, 70), (5, 25), 30), n_pages=24, prefill_chunk=16)),
            Case("a pool of 5 pages: preempted again and again, every request still finishes",
                 dict(arrivals=traffic(6, 5, (2, 6), (30, 45), 3), n_pages=5, max_batch=4, preempts=True)),
        ]

    def judge(self, sol, case):
        c = dict(case.inputs)
        arrivals, n_pages, preempts = c.pop("arrivals"), c.pop("n_pages"), c.pop("preempts", False)
        want, _, _ = simulate(Scheduler, arrivals, n_pages, **c)
        if preempts and not any(p for _, p, _ in want):
            raise RuntimeError(f"case {case.name!r} was meant to preempt and the server's scheduler did not")
        try:
            got, sched, pool = simulate(sol.AdmitOrPreempt, arrivals, n_pages, expect=want, **c)
        except Differs as e:
            return (f"{e}\n(sequences by arrival: {[(i, a[1], a[2]) for i, a in enumerate(arrivals)]} as "
                    f"(index, prompt tokens, max_tokens); a pool of {n_pages} pages of 16 positions)"), ""
        if len(got) != len(want):
            return f"served in {len(got)} steps, the server in {len(want)}", ""
        if not sched.idle or pool.n_free != pool.n_pages:
            return f"after the last step: idle {sched.idle}, {pool.n_free} of {pool.n_pages} pages free", ""
        preemptions = sum(len(p) for _, p, _ in want)
        return None, f"{len(want)} steps alike, {preemptions} preemptions"

    def timings(self, sol, quick):
        n = 8 if quick else 32
        arrivals = traffic(13, n, (20, 60), (16, 48), 0)
        worst = sum(-(-(p + t) // 16) for _, p, t in arrivals)
        pages = worst // 3
        self.timing_note = (f"steps to serve {n} requests arriving at once (prompts of 20-60 tokens, 16-48 to "
                            f"generate) with {pages} pages of 16 positions, a third of their worst case; a decode "
                            "step of 8 rows costs about one of 1 while the weights' bytes bound it (chapter 14)")
        steps = {}
        for name, cls, batch in (("yours", sol.AdmitOrPreempt, 8), ("stage", Scheduler, 8), ("one", Scheduler, 1)):
            steps[name] = len(simulate(cls, arrivals, pages, max_batch=batch)[0])
        return [Timing("yours, 8 at a time", steps["yours"], "yours", unit="steps"),
                Timing("the server's, 8 at a time", steps["stage"], "stage", unit="steps"),
                Timing("one sequence at a time (the chapters before)", steps["one"], "previous", unit="steps")]


EXERCISE = Batching()
