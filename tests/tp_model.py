"""Run by tests/test_tp.py under `mpiexec -n N`: the tp stage on a model file, every rank alike.

    python tests/tp_model.py MODEL OUT.npz TOKENS SPLIT [--plant-no-allreduce] [--then die|stall]

Prefills TOKENS[:SPLIT], then decodes the rest one token at a time (both paths, the KV cache);
rank 0 writes the logits to OUT.npz as `logits`, and with --plant-no-allreduce the same run again
with the all-reduces left out (each rank keeps its own partial sums: a planted bug the test's
comparison must catch) as `planted`. --then: afterwards rank 1 dies (SIGKILL) or stalls, and the
other ranks go on to the next forward pass, where they must end the run naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import app  # noqa: E402

app.configure_numba()

import numpy as np  # noqa: E402

from stages import load  # noqa: E402


def logits(engine, tokens, split):
    engine.reset()
    rows = [engine.forward(tokens[:split], 0)] + [engine.forward(tokens[i:i + 1], i) for i in range(split, len(tokens))]
    engine.reset()
    return np.concatenate(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("tokens")
    p.add_argument("split", type=int)
    p.add_argument("--plant-no-allreduce", action="store_true")
    p.add_argument("--then", choices=("die", "stall"))
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    engine = load("tp", args.model, threads=1)
    ranks = engine.backend.ranks
    if ranks.rank == 0:
        print(engine.backend.banner(), file=sys.stderr, flush=True)
    engine.warmup()
    out = {"logits": logits(engine, tokens, args.split),
           "kv_dim": np.array(engine.kv.k.shape[2]), "pids": np.array(ranks.pids)}
    if args.plant_no_allreduce:
        ranks.allreduce = lambda x, where: x
        out["planted"] = logits(engine, tokens, args.split)
    if ranks.rank == 0:
        np.savez(args.out, **out)
    if args.then:
        ranks.barrier("the barrier before the planted failure")
        if ranks.rank == 1:
            if args.then == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(300)
        logits(engine, tokens, args.split)
        print("the run went on after the planted failure", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
