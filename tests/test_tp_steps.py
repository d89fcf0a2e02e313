"""The tp stage's serving path in one process, its MPI replaced by fakes: a step of many sequences
as rank 0 sends it and another rank reads it back (stages/parallel/steps.py through the backend's
own _send and follow), the bytes each collective is counted as sending (stages/parallel/ranks.py:
the ring algorithms' figures, against a ring simulated here), and rank 0's server side
(app/serve/ranks.py: Lead) when a rank is lost. Each check runs on the code and on a planted bug
it must flag. tests/test_tp.py and tests/test_tp_serve.py run the same paths over real ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.serve.ranks import Lead
from common.batch import Batch, Segment
from common.paged_kv import PagePool, PageTable
from stages.parallel import steps
from stages.parallel.ranks import Ranks, RanksLost
from stages.tp import TensorParallelBackend

FIELDS = ("tokens", "positions", "slots", "row_seq", "tables", "seq_start", "seq_rows", "logit_rows", "copies",
          "seq_len", "n_rows", "row_block")


class Wire:
    """Broadcasts between a rank 0 and one other, in order: rank 0's go in, the other's come out."""

    def __init__(self):
        self.sent = []

    def rank(self, r: int):
        wire = self

        class Side:
            size, rank = 2, r

            def broadcast(self, x, where, forever=False):
                if r == 0:
                    wire.sent.append(x.copy())
                else:
                    got = wire.sent.pop(0)
                    assert got.shape == x.shape, f"{where}: {got.shape} words sent, {x.shape} read"
                    x[:] = got
                return x
        return Side()


def backend_on(ranks) -> TensorParallelBackend:
    """The tp backend of one rank, as far as sending and following steps goes (no model loaded)."""
    b = object.__new__(TensorParallelBackend)
    b.ranks, b.kv_width, b.kv_dtype = ranks, lambda config: 4, np.float32
    return b


def two_steps(pool) -> list:
    """A prompt of 700 tokens (longer than one broadcast), then two sequences decoding where one
    writes into the partial last page it shares with the other (a page copied)."""
    a = PageTable(pool)
    a.admit(list(range(700)), 720)
    first = Batch(pool, [Segment(a, list(range(700)))], row_block=8)
    b = a.fork()
    b.reserve_for(1)
    second = Batch(pool, [Segment(a, [1]), Segment(b, [2], all_logits=True)], row_block=8)
    assert len(second.copies) == 1, "the scene: a page copied"
    return [first, second]


def step_problems() -> list[str]:
    """Rank 0 sends each step (TensorParallelBackend._send) and then the end; the other rank
    (TensorParallelBackend.follow) runs what it reads: every field of every step as rank 0 built
    it, over a pool of rank 0's geometry; the long step in two broadcasts, the decode step in one."""
    pool = PagePool(1, 4, 64, 16)
    batches = two_steps(pool)
    wire = Wire()
    lead = backend_on(wire.rank(0))
    for batch in batches:
        TensorParallelBackend._send(lead, steps.pack(batch))
    TensorParallelBackend.end_steps(lead)
    counts = [len(wire.sent)]
    ran = []
    model = type("model", (), {"config": type("config", (), {"n_layer": 1})(), "forward_batch": ran.append})()
    other = backend_on(wire.rank(1))
    try:
        TensorParallelBackend.follow(other, model)
    except Exception as e:                                   # a planted bug may break the reading
        return [f"the other rank failed: {e!r}"]
    problems = [] if counts == [2 + 1 + 1] else [f"{counts[0]} broadcasts for a long step, a decode step and the end"]
    if len(ran) != len(batches) or wire.sent:
        problems.append(f"{len(ran)} steps run of {len(batches)}, {len(wire.sent)} broadcasts unread")
    for i, (want, got) in enumerate(zip(batches, ran)):
        problems += [f"step {i}: {name}" for name in FIELDS
                     if not np.array_equal(np.asarray(getattr(want, name)), np.asarray(getattr(got, name)))]
        if (got.pool.n_pages, got.pool.page_size) != (pool.n_pages, pool.page_size):
            problems.append(f"step {i}: a pool of {got.pool.n_pages} pages of {got.pool.page_size}")
    return problems


PACK = steps.pack


def tables_transposed(batch) -> np.ndarray:
    """A planted pack: the page tables written column by column."""
    words = PACK(batch)
    M, (S, W) = len(batch.tokens), batch.tables.shape
    at = len(steps.HEADER) + 4 * M
    words[at:at + S * W] = batch.tables.T.reshape(-1)
    return words


def copies_counted_once(real):
    """A planted length: a copy counted as one word, not two."""
    return lambda words: real(words) - int(words[steps.HEADER.index("copies")])


@pytest.mark.parametrize("planted", [None, "tables transposed", "copies counted once"])
def test_a_step_reaches_the_other_ranks_as_rank_0_built_it(monkeypatch, planted):
    if planted == "tables transposed":
        monkeypatch.setattr(steps, "pack", tables_transposed)
    elif planted == "copies counted once":
        monkeypatch.setattr(steps, "length", copies_counted_once(steps.length))
    problems = step_problems()
    assert (problems == []) == (planted is None), problems


# ---- what the collectives are counted as sending ---------------------------------------------------

class Done:
    def Test(self):
        return True


class Comm:
    """A communicator whose collectives complete at once (the bytes are what is checked)."""

    def __getattr__(self, name):
        return lambda *a, **k: Done()


def ranks_of(cls, rank: int, size: int) -> Ranks:
    r = object.__new__(cls)
    r.MPI = type("MPI", (), {"IN_PLACE": None, "SUM": None, "FLOAT": None})
    r.comm, r.rank, r.size, r.stats, r.seq, r.timeout, r.warming = Comm(), rank, size, {}, 0, 60.0, False
    return r


def ring_sent(counts, rank: int) -> int:
    """Values rank `rank` sends in a ring all-gather of pieces of counts[r] values from rank r:
    at step s (0 .. N-2) each rank passes on the piece it holds from s ranks before it."""
    n = len(counts)
    return sum(counts[(rank - s) % n] for s in range(n - 1))


def ring_allreduce_sent(values: int, n: int) -> float:
    """Values each rank sends in a ring all-reduce: a reduce-scatter and an all-gather, N-1 steps
    each, every step a 1/N share."""
    return 2 * (n - 1) * values / n


def stats_problems(cls) -> list[str]:
    """4 ranks: an all-reduce of 16 float32, an all-gather of 1, 2, 3 and 4 values, a broadcast
    of 10 int64; each rank's counts against a ring simulated here."""
    counts, problems = [1, 2, 3, 4], []
    for rank in range(4):
        r = ranks_of(cls, rank, 4)
        r.allreduce(np.zeros(16, np.float32), "x")
        r.allgather(np.zeros(counts[rank], np.float32), counts, "y")
        r.broadcast(np.zeros(10, np.int64), "z")
        got = {k: (v["calls"], v["payload_bytes"], v["sent_bytes"]) for k, v in r.snapshot().items()}
        want = {"allreduce": (1, 64, 4 * ring_allreduce_sent(16, 4)), "gather": (1, 40, 4 * ring_sent(counts, rank)),
                "broadcast": (1, 80, 80 if rank == 0 else 0)}
        if got != want:
            problems.append(f"rank {rank}: {got}, want {want}")
    return problems


class OwnPiece(Ranks):
    """Planted: an all-gather counted as sending everything but the rank's own piece."""

    def allgather(self, x, counts, where):
        out = super().allgather(x, counts, where)
        s = self.stats["gather"]
        s[3] += (counts[(self.rank + 1) % self.size] - counts[self.rank]) * 4
        return out


def test_the_bytes_sent_are_a_rings():
    assert stats_problems(Ranks) == []
    assert stats_problems(OwnPiece) != []


# ---- rank 0's server when a rank is lost -------------------------------------------------------------

class Scene:
    """What Lead reads of a server over 2 ranks: its loop's forward (raising RanksLost when told),
    stop and end_all, the backend's end_steps (raising when told) and the ranks' abort."""

    def __init__(self, size: int = 2):
        self.said = []
        scene = self

        class FakeRanks:
            lost, raise_on_loss = None, False

            def __init__(self):
                self.size = size

            def abort(self, message):
                scene.said.append(("abort", message))

        class Backend:
            ranks = FakeRanks()
            idle_loss = False

            def banner(self):
                return "tp: 2 ranks"

            def end_steps(self):
                if self.idle_loss:
                    self.ranks.lost = "rank 1 left while idle"
                    raise RanksLost(self.ranks.lost)
                scene.said.append(("end_steps",))

        class Loop:
            fails = False

            def forward(self, batch):
                if self.fails:
                    Backend.ranks.lost = "rank 1 (pid 7 on h) did not reach the all-reduce"
                    raise RanksLost(Backend.ranks.lost)
                return "logits"

            def stop(self):
                scene.said.append(("stop",))

            def end_all(self, message):
                scene.said.append(("end_all", message))
        self.backend, self.loop = Backend(), Loop()
        self.engine = type("engine", (), {"backend": self.backend})()


def lead_problems(lead_class) -> list[str]:
    """Over 2 ranks: a step runs as before; a lost rank in a step stops the loop, ends every
    request with an error naming the rank, and reaches the loop (no more steps); at the end,
    after a loss every rank is ended (abort), else the others are told the steps end, and a loss
    found only then (the server idle) ends every rank too. One rank: nothing changes."""
    problems = []
    s = Scene()
    lead = lead_class(s)
    if s.loop.forward(None) != "logits" or not s.backend.ranks.raise_on_loss:
        problems.append("a step over healthy ranks")
    s.loop.fails = True
    try:
        s.loop.forward(None)
        problems.append("a lost rank did not reach the engine loop")
    except RanksLost:
        pass
    lead.end()
    want = [("stop",), ("end_all", "the server cannot go on: rank 1 (pid 7 on h) did not reach the all-reduce"),
            ("abort", "the server cannot go on: rank 1 (pid 7 on h) did not reach the all-reduce")]
    if s.said != want:
        problems.append(f"a rank lost in a step: {s.said}")
    for idle_loss, want in ((False, [("end_steps",)]), (True, [("abort", "the server cannot go on: rank 1 left "
                                                                            "while idle")])):
        s = Scene()
        s.backend.idle_loss = idle_loss
        lead_class(s).end()
        if s.said != want:
            problems.append(f"the end, {'a rank lost while idle' if idle_loss else 'every rank there'}: {s.said}")
    one = Scene(size=1)
    forward = one.loop.forward
    lead_class(one).end()
    if one.loop.forward != forward or one.said:
        problems.append("one rank: the server changed")
    return problems


class Swallows(Lead):
    """Planted: a lost rank's error kept from the engine loop (it would go on stepping)."""

    def __init__(self, server):
        super().__init__(server)
        guarded = server.loop.forward

        def forward(batch):
            try:
                return guarded(batch)
            except RanksLost:
                return None
        server.loop.forward = forward


class EndsQuietly(Lead):
    """Planted: at the end the others are told the steps end, lost rank or not."""

    def end(self):
        if self.ranks is not None:
            try:
                self.backend.end_steps()
            except RanksLost:
                pass


@pytest.mark.parametrize("lead_class", [Lead, Swallows, EndsQuietly], ids=lambda c: c.__name__)
def test_a_lost_rank_ends_every_request_and_every_rank(lead_class, capsys):
    assert (lead_problems(lead_class) == []) == (lead_class is Lead)
