"""Run by tests/test_tp.py under `mpiexec -n N`: the tp stage on a model file, every rank alike.

    python tests/tp_model.py MODEL OUT.npz TOKENS SPLIT [--greedy N] [--plant-no-allreduce]
                             [--then die|stall|raise] [--batch [--plant-no-copies]]

Prefills TOKENS[:SPLIT], then decodes the rest one token at a time (both paths, the KV cache);
rank 0 writes to OUT.npz:

    logits      every position's logits
    greedy      N tokens chosen greedily after TOKENS (--greedy)
    wo, down    layer 0's row-parallel matmuls alone: x [M, K] (made-up activations, the same on every
                rank), each rank's product of its columns of x with its columns of Wo (W_down),
                all-reduced: `wo_x`, `wo_sum` (and `down_x`, `down_sum`)
    planted     with --plant-no-allreduce, the logits again with the all-reduces left out (each rank
                keeps its own partial sums: a planted bug the test's comparison must catch)
    batch       with --batch, the logits of steps of three sequences as a server runs them (rank 0
                builds each step, the others follow it: batch_steps), `single` the same rows from
                each sequence alone, `copies` the pages the steps copied, `broadcasts` the steps'
                broadcasts; --plant-no-copies: the following ranks skip the page copies

--then: afterwards rank 1 dies (SIGKILL), stalls, or raises an exception in the middle of a
decode step (in layer 1, while the others wait for it at an all-reduce), and the other ranks go
on to the next forward pass, where they must end the run naming it.
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

ROWS = 3                   # rows of the made-up activations of the row-parallel matmuls
PLANTED_ERROR = "the planted failure of rank 1, in the middle of a forward pass"


def logits(engine, tokens, split):
    engine.reset()
    rows = [engine.forward(tokens[:split], 0)] + [engine.forward(tokens[i:i + 1], i) for i in range(split, len(tokens))]
    engine.reset()
    return np.concatenate(rows)


def greedy(engine, tokens, n):
    engine.reset()
    out = [engine.greedy_next(tokens, 0)]
    for i in range(n - 1):
        out.append(engine.greedy_next([out[-1]], len(tokens) + i))
    engine.reset()
    return np.array(out)


def row_parallel(engine, name, cols):
    """x [ROWS, K] and the all-reduce of every rank's x[:, its columns] times its slice of the matrix."""
    b = engine.backend
    w = getattr(engine.layers[0], name)
    x = np.random.default_rng(7).normal(0, 1, (ROWS, getattr(b.shares[-1], cols)[1])).astype(np.float32)
    c0, c1 = getattr(b.share, cols)
    part = np.ascontiguousarray(b.matmul(np.ascontiguousarray(x[:, c0:c1]), w))
    return x, b.ranks.allreduce(part, f"the all-reduce of layer 0's {name} alone")


def batch_steps(engine, tokens, n_steps=3):
    """Rank 0: three sequences in steps, as a server runs them: A (tokens) and C prefilled in one
    step, B forked from A (n choices of one prompt: every page shared, the partial last one copied
    by the first sequence to write into it), then n_steps decode steps of all three, greedy (B
    starts from A's second choice). Returns [(a sequence's tokens up to a row, its prompt's length,
    the row's logits)] and the pages copied. The other ranks follow the steps and return ([], 0)."""
    from common.batch import Batch, Segment
    from common.paged_kv import PagePool, PageTable
    b, cfg = engine.backend, engine.config
    if b.ranks.rank != 0:
        b.follow(engine)
        return [], 0
    pool = PagePool(cfg.n_layer, b.kv_width(cfg), 32, 4, b.kv_dtype)
    seqs = {"a": list(tokens), "c": list(tokens[3:8])}
    tables = {name: PageTable(pool) for name in seqs}
    for name, t in tables.items():
        t.admit(seqs[name], len(seqs[name]) + n_steps + 1, use_cache=False)
    rows, copies, new = [], 0, {name: seq for name, seq in seqs.items()}
    prompts = {name: len(seq) for name, seq in seqs.items()}
    for step in range(n_steps + 1):
        names = list(new)
        for name in names:
            assert tables[name].reserve_for(len(new[name]))
        batch = Batch(pool, [Segment(tables[name], new[name]) for name in names], b.row_block)
        copies += len(batch.copies)
        logits = engine.forward_batch(batch)
        batch.finish()
        for name, row in zip(names, logits):
            rows.append((list(seqs[name]), prompts[name], row))
        if step == 0:                                             # B: n = 2 choices of A's prompt
            tables["b"], seqs["b"], prompts["b"] = tables["a"].fork(), list(seqs["a"]), prompts["a"]
            logits = np.concatenate([logits, logits[:1]])
            names.append("b")
        new = {name: [int(np.argsort(row)[-2 if name == "b" and step == 0 else -1])]
               for name, row in zip(names, logits)}
        for name, nxt in new.items():
            seqs[name] += nxt
    b.end_steps()
    return rows, copies


def single_rows(engine, rows):
    """The logits of the same rows, each sequence alone (forward: its prompt, then a token at a
    time), on every rank: rank 0's sequences reach the others first."""
    ranks = engine.backend.ranks
    seqs = ranks.allgather_json([r[:2] for r in rows], "the sequences of the steps")[0]
    out = []
    for seq, prompt in seqs:
        engine.reset()
        logits = engine.forward(seq[:prompt], 0, all_logits=False)
        for i in range(prompt, len(seq)):
            logits = engine.forward(seq[i:i + 1], i, all_logits=False)
        out.append(logits[0])
    engine.reset()
    return np.array(out)


def plant_raise(engine):
    """Rank 1 raises in the first decode step after the prompt, after layer 1's first piece of the
    stack (two pieces a layer), while the others go on to the all-reduce after it."""
    backend = engine.backend
    real, calls = backend._ran, []

    def ran(*args):
        real(*args)
        calls.append(1)
        if len(calls) == 2 * engine.config.n_layer + 3:
            raise RuntimeError(PLANTED_ERROR)
    backend._ran = ran


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("tokens")
    p.add_argument("split", type=int)
    p.add_argument("--greedy", type=int, default=0)
    p.add_argument("--plant-no-allreduce", action="store_true")
    p.add_argument("--then", choices=("die", "stall", "raise"))
    p.add_argument("--batch", action="store_true")
    p.add_argument("--plant-no-copies", action="store_true")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    engine = load("tp", args.model, threads=1)
    ranks = engine.backend.ranks
    if ranks.rank == 0:
        print(engine.backend.banner(), file=sys.stderr, flush=True)
    engine.warmup()
    out = {"logits": logits(engine, tokens, args.split),
           "kv_dim": np.array(engine.kv.k.shape[2]), "pids": np.array(ranks.pids)}
    out["wo_x"], out["wo_sum"] = row_parallel(engine, "wo", "q_rows")
    out["down_x"], out["down_sum"] = row_parallel(engine, "w_down", "ff")
    if args.greedy:
        out["greedy"] = greedy(engine, tokens, args.greedy)
    if args.batch:
        if args.plant_no_copies and ranks.rank != 0:
            from common.paged_kv import PagePool
            PagePool.copy_pages = lambda self, pairs: None
        rows, copies = batch_steps(engine, tokens)
        out["single"] = single_rows(engine, rows)
        out["batch"] = np.array([r[2] for r in rows]) if rows else out["single"]
        out["copies"] = np.array(copies)
        out["broadcasts"] = np.array(ranks.snapshot().get("broadcast", {}).get("calls", 0))
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
            elif args.then == "stall":
                time.sleep(300)
            else:
                plant_raise(engine)
        logits(engine, tokens, args.split)
        print("the run went on after the planted failure", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
