"""Run by tests/test_tp.py under `mpiexec -n N`: the ranks' collectives alone (no model, no
numba), in a scenario that tests a failure path: `python tests/tp_ranks.py SCENARIO`.

    healthy     every rank all-reduces and gathers; rank 0 prints the sums as JSON
    stall       rank 1 sleeps at its first all-reduce (it stops answering); the others time out
    leave       rank 1 exits with an error before its first all-reduce
    leave-late  the same, where rank 0's deadline (LLM_TP_TIMEOUT) passes before the grace it gives a
                leaving rank (its grace made far longer here, so the order is certain, not timed), and it
                must still name the rank that left
    kill        rank 1 is killed (SIGKILL) before its first all-reduce
    no-start    rank 1 exits before MPI starts
    transport   every rank reaches the all-reduce and none sees it complete (a planted transport
                failure: the collective's request never completes; the notices still pass)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.parallel import ranks as R  # noqa: E402


class StuckCollectives:
    """The communicator, but a collective it starts never completes (point-to-point still works)."""

    class Never:
        def Test(self):
            return False

    def __init__(self, comm):
        self.comm = comm

    def Iallreduce(self, *args, **kwargs):
        return self.Never()

    def __getattr__(self, name):
        return getattr(self.comm, name)


def main(scenario: str) -> int:
    launched = R._env_int(R.LAUNCHER_RANK)
    if scenario == "no-start" and launched == 1:
        print("rank 1: exiting before MPI starts", file=sys.stderr, flush=True)
        return 3
    w = R.world()
    w.warming = False
    if scenario == "leave-late" and w.rank == 0:
        R.GRACE_S = 20 * R.timeout_s()   # a leaving rank is named once the deadline has passed, not before
    if w.rank == 0:
        print(w.banner(), file=sys.stderr, flush=True)
    import numpy as np
    if w.rank == 1:
        if scenario == "stall":
            time.sleep(120)
        elif scenario in ("leave", "leave-late"):
            print("rank 1: an error of its own", file=sys.stderr, flush=True)
            return 2
        elif scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "transport":
        w.comm = StuckCollectives(w.comm)
    x = np.full(5, w.rank + 1.0, dtype=np.float32)
    w.allreduce(x, ("the all-reduce after layer {}'s attention", 0))
    g = w.allgather(np.full(w.rank + 1, float(w.rank), np.float32), [r + 1 for r in range(w.size)], "the gather")
    if w.rank == 0:
        print(json.dumps({"sum": x.tolist(), "gathered": g.tolist(), "stats": w.snapshot()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
