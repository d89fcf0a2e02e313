"""The server over MPI ranks (the tp stage under `mpiexec -n N`): rank 0 serves, the others follow.

Rank 0 runs all that a server runs (HTTP, the scheduler, the sampler); its backend sends every
step's batch to the other ranks in one broadcast (stages/tp.py: forward_layers_batch). The others
load the model, warm up as rank 0 does, then run each step rank 0 runs (`follow`) and never
listen for HTTP. mpiexec passes Ctrl-C and SIGTERM to every rank: only rank 0 acts on them (its
drain); the others stop when it ends the steps, and every rank exits 0.

A rank lost while serving (it stalled, failed with an error of its own, or its network failed:
stages/parallel/ranks.py names it after LLM_TP_TIMEOUT at most) ends every request in flight
with an error naming it; the server says it cannot go on and ends every rank (exit status 1): a
layer split over ranks cannot run without each of them. A rank killed outright is seen by mpiexec first (MPICH's
hydra ends every rank of a job one of whose processes died, and names it by its pid: the
banner maps pids to ranks), so there the clients see their connections close.
"""

from __future__ import annotations

import signal
import sys
import traceback

from stages import backend_class, load
from stages.parallel.ranks import RanksLost

# A rank failed on its own waits this long for rank 0 to tell its clients and end every rank: its
# exit would be seen by mpiexec, which ends every rank at once (its leaving at exit lasts GRACE_S).
LINGER_S = 30.0


def follows(stage: str) -> bool:
    """True on the ranks that follow rank 0's steps (tp's ranks > 0)."""
    return not backend_class(stage).reporting_process()


def follow(stage: str, args):
    """A rank other than 0: the engine loaded and warmed up as rank 0's (build), then every
    step rank 0 runs, until it ends them."""
    from app.models import resolve
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # rank 0 drains; its end of the steps ends this
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = load(stage, resolve(args.model), n_ctx=args.ctx_size, threads=args.threads)
    engine.warmup()
    try:
        engine.backend.follow(engine)
    except Exception:                                     # its own error: rank 0 names it to its clients
        traceback.print_exc()
        engine.backend.ranks.leave_now(LINGER_S)
        raise SystemExit(1) from None


class Lead:
    """Rank 0's side: says over how many ranks it serves, turns a lost rank into the end of every
    request and of the server, and ends the steps at the end (end). Nothing where one process
    serves."""

    def __init__(self, server):
        backend, loop = server.engine.backend, server.loop
        self.ranks = getattr(backend, "ranks", None)
        self.backend = backend
        if self.ranks is None or self.ranks.size == 1:
            self.ranks = None
            return
        self.ranks.raise_on_loss = True
        forward = loop.forward

        def guarded(batch):
            try:
                return forward(batch)
            except RanksLost as e:                        # every request ends, naming the rank; no more steps
                loop.stop()
                loop.end_all(f"the server cannot go on: {e}")
                raise
        loop.forward = guarded
        print(f"serving over {self.ranks.size} MPI ranks ({backend.banner()})", file=sys.stderr, flush=True)

    def end(self):
        """The other ranks stop following (they exit 0); after a lost rank, every rank ends (exit 1)."""
        if self.ranks is None:
            return
        if not self.ranks.lost:
            try:
                return self.backend.end_steps()
            except RanksLost:                             # one was lost while the server was idle
                pass
        self.ranks.abort(f"the server cannot go on: {self.ranks.lost}")
