"""Sweep the tiling stage's tile sizes on the default model's own matmul shapes.

    python -m app bench tiling [--rows 16] [--quick]

For each (TILE_I, TILE_J, TILE_K) it times the blocked matmul on every weight shape of the
model, weighted by how often a forward pass uses it (30 layers x q,k,v,o,gate,up,down at
`--rows` prompt rows, plus the output head at one row), and records the sweep in
profiles/bench/tiling_sweep.json. The naive textbook loop is timed on the same shapes for
the ratio. The chosen sizes are written by hand into stages/tiling.py with the reasoning.
"""

from __future__ import annotations

import itertools
import statistics
import time

import numpy as np
from tqdm import tqdm

from app.measure.protocol import BENCH_DIR, header
from app.models import DEFAULT_MODEL
from common.gguf import GGUFFile
from common.model import LlamaConfig
from stages.naive import matmul_textbook
from stages.tiling import make_tiled_matmul


def model_shapes(cfg: LlamaConfig, rows: int):
    """(M, K, N, uses per forward pass) of every matmul in one forward pass."""
    d, kv, ff = cfg.n_embd, cfg.kv_dim, cfg.n_ff
    q = cfg.n_head * cfg.head_dim
    layer = [(rows, d, q, 1), (rows, d, kv, 2), (rows, q, d, 1), (rows, d, ff, 2), (rows, ff, d, 1)]
    return [(m, k, n, c * cfg.n_layer) for m, k, n, c in layer] + [(1, d, cfg.n_vocab, 1)]


def time_forward_matmuls(fn, shapes, reps: int) -> float:
    """Median over reps of the weighted sum of one call per shape (seconds per forward)."""
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32), c)
            for m, k, n, c in shapes]
    fn(data[0][0][:1], data[0][1][:, :8].copy())          # compile
    totals = []
    for _ in range(reps):
        total = 0.0
        for a, b, c in data:
            t0 = time.perf_counter()
            fn(a, b)
            total += (time.perf_counter() - t0) * c
        totals.append(total)
    return statistics.median(totals)


def add_arguments(p):
    p.add_argument("--rows", type=int, default=16, help="prompt rows M for the layer matmuls (default 16)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a smaller grid")


def records(args):
    cfg = LlamaConfig.from_gguf(GGUFFile(DEFAULT_MODEL.path))
    shapes = model_shapes(cfg, args.rows)
    grid_i, grid_j, grid_k = ([4, 8], [16, 64], [64, 256]) if args.quick else \
        ([1, 4, 8, 16], [8, 16, 64, 256], [32, 64, 256, 1024])
    naive_s = time_forward_matmuls(matmul_textbook, shapes, args.reps)
    print(f"naive: {naive_s * 1e3:.0f} ms of matmuls per forward pass ({args.rows} rows)")
    results = []
    for ti, tj, tk in tqdm(list(itertools.product(grid_i, grid_j, grid_k)), desc="tile sizes"):
        s = time_forward_matmuls(make_tiled_matmul(ti, tj, tk, cache=False), shapes, args.reps)
        results.append({"tile_i": ti, "tile_j": tj, "tile_k": tk, "seconds": s, "speedup_vs_naive": naive_s / s})
    results.sort(key=lambda r: r["seconds"])
    for r in results[:8]:
        print(f"  {r['tile_i']:>3} x {r['tile_j']:>4} x {r['tile_k']:>5}: {r['seconds'] * 1e3:7.0f} ms  "
              f"{r['speedup_vs_naive']:.2f}x naive")
    yield BENCH_DIR / "tiling_sweep.json", {"kind": "tiling_sweep", "rows": args.rows, "shapes": shapes,
                                             "naive_seconds": naive_s, "sweep": results,
                                             **header(command=args.command_line)}
