"""Chapter 11's experiments (run: make try-it ch=11): the split's work per rank, in one process, and
the all-reduce the split costs, between two real ranks (`mpiexec -n 2`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from exercises.harness import best_seconds, load_file
from exercises.try_it import experiment
from stages.parallel.ranks import mpi_missing
from stages.parallel.split import plan

_check = load_file(__file__.replace("experiments", "check"))
PROBE = Path(__file__).resolve().parent / "allreduce_probe.py"
D, H, HKV, HD, F = 576, 9, 3, 64, 1536                 # SmolLM2's layer


@experiment("N, the ranks a layer is split over (stages/parallel/split.py plan): each rank's time for its share")
def rank_time(quick):
    """a rank's time follows its share of the layer's multiply-adds; SmolLM2's 3 KV heads split over 2
    ranks as 1 and 2, so at N = 2 rank 1 has twice rank 0's attention and the same feed-forward, and
    the step waits for it at the all-reduce: the slowest rank takes more than half of one process's
    time; at N = 3 the shares are equal, each near a third"""
    M = 4 if quick else 32
    rng = np.random.default_rng(0)
    x, w = _check.check_input(rng, M, D), _check.layer(rng, D, H, HKV, HD, F)
    cfg = SimpleNamespace(n_head=H, n_head_kv=HKV, head_dim=HD, n_ff=F, n_vocab=1)
    reps = 3 if quick else 9
    whole = best_seconds(lambda: _check.stage_partial(x, w, plan(cfg, 1)[0]), reps)
    rows = [("one process: the whole layer", whole * 1e3, "ms")]
    for n in (2, 3):
        times = [best_seconds(lambda s=s: _check.stage_partial(x, w, s), reps) for s in plan(cfg, n)]
        rows += [(f"N = {n}, rank {r} ({s.n_kv_heads} KV head(s), {s.ff[1] - s.ff[0]} hidden units)", t * 1e3, "ms")
                 for r, (s, t) in enumerate(zip(plan(cfg, n), times))]
        rows.append((f"N = {n}: the slowest rank over one process", max(times) / whole, "x"))
    return {"rows": rows, "note": f"one layer of SmolLM2's shapes in float32, {M} rows, the ranks one after "
                                  "another in this process (the stage runs them at once, one core each)"}


@experiment("the rows in one all-reduce (a decode token: 1; a prompt: hundreds), between 2 ranks of mpiexec")
def allreduce_size(quick):
    """an all-reduce first pays a round trip between the processes, a few microseconds through
    shared memory on one machine, whatever it carries; one token's hidden state (576 floats, 2.25
    KiB) costs about that, 16 rows (36 KiB) little more; only hundreds of rows (a prompt) cost in
    proportion to their bytes. Decode pays two round trips per layer, 60 for SmolLM2's 30 layers"""
    missing = mpi_missing()
    if missing:
        raise RuntimeError(f"this experiment runs 2 MPI ranks: {missing}")
    sizes = (1, 16, 256) if quick else (1, 4, 16, 64, 256, 1024)
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, str(PROBE), str(D),
           str(20 if quick else 200), *map(str, sizes)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"mpiexec -n 2 ended with status {done.returncode}: {done.stderr.strip()[-400:]}")
    us = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    rows = [(f"{r} row(s) of {D} floats ({r * D * 4 / 1024:g} KiB)", us[r], "us") for r in sizes]
    big = sizes[-1]
    rows.append((f"{big} rows: bytes per second", big * D * 4 / (us[big] * 1e-6) / 1e9, "GB/s"))
    rows.append((f"{big} rows over 1 row", us[big] / us[1], "x"))
    return {"rows": rows, "note": "the median of many all-reduces, each after a barrier, 2 ranks on this machine"}
