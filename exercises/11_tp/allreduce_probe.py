"""Run by chapter 11's experiment allreduce_size under `mpiexec -n 2`: the median time of one
all-reduce (the tp stage's own, stages/parallel/ranks.py) of R rows of D float32 values, for each
R given, after a barrier; rank 0 prints one JSON line {rows: microseconds}.

    mpiexec -n 2 python exercises/11_tp/allreduce_probe.py D REPS R1 R2 ...
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from stages.parallel.ranks import world  # noqa: E402


def main():
    D, reps, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]]
    ranks = world()
    ranks.warming = False
    out = {}
    for rows in sizes:
        x = np.ones((rows, D), np.float32)
        times = []
        for _ in range(reps + 1):                    # the first one warms the buffers up, not counted
            ranks.barrier("the barrier before an all-reduce")
            t0 = time.perf_counter()
            ranks.allreduce(x, "the probe's all-reduce")
            times.append(time.perf_counter() - t0)
        out[rows] = statistics.median(times[1:]) * 1e6
    if ranks.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
