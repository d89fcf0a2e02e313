"""Decode kernels alone, per ggml type: how many weights per second one core unpacks and
multiplies, for the quantized stage's float kernels, the int8 stage's named-instruction
kernels and its loops (the variant int8-loops), and the fused stage's tiles (float vector
accumulators across blocks; its matmul is the one it runs for the output head). Behind
profiles/bench/kernels.md:

    python -m app bench kernels [--model smollm2 --model tinyllama-synthetic] [--passes 5]

Every 2-D weight of each model, grouped by type, multiplied by one activation row on one
thread (the int8 backends quantize the row once per call, as the stage does for q, k and v);
the figure is the least CPU time of `passes` passes over the group, so other work on a shared
machine inflates it less than wall time would.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from app.measure.protocol import BENCH_DIR, header
from app.measure.provenance import describe
from app.models import resolve
from common.gguf import GGUFFile
from stages import backend_class

BACKENDS = ("quantized", "int8", "int8-loops", "fused")


def bench_kernels(models, passes: int = 5, log=print, command: str | None = None) -> dict:
    backends = {name: backend_class(name)(threads=1) for name in BACKENDS}
    results = []
    for model in models:
        g = GGUFFile(resolve(model))
        groups = {}
        for t in g.tensors.values():
            if len(t.shape) == 2:
                groups.setdefault(t.type_name, []).append(backends["quantized"].prepare_matrix(t))
        rng = np.random.default_rng(0)
        for type_name, mats in groups.items():
            xs = {m.shape[1]: rng.standard_normal((1, m.shape[1])).astype(np.float32) for m in mats}
            for name, b in backends.items():
                b.matmul(xs[mats[0].shape[1]], mats[0])            # compile, or load from numba's cache
                best = math.inf
                for _ in range(passes):
                    t0 = time.process_time()
                    for m in mats:
                        b.matmul(xs[m.shape[1]], m)
                    best = min(best, time.process_time() - t0)
                n_w = sum(m.shape[0] * m.shape[1] for m in mats)
                n_b = sum(m.nbytes for m in mats)
                row = {"model": g.path.split("/")[-1], "type": type_name, "kernels": name, "matrices": len(mats),
                       "weights": n_w, "bytes": n_b, "cpu_s": best}
                results.append(row)
                log(f"{row['model']:<40} {type_name:<5} {name:<10} {n_w / best / 1e9:5.2f} Gweights/s "
                    f"{n_b / best / 1e9:5.2f} GB/s")
    return {"kind": "kernels", "passes": passes, "results": results, **header(command=command)}


def page(record: dict, source: str) -> str:
    m = record["machine"]
    lines = [
        "# Decode kernels per weight type, one core",
        "",
        f"_Generated from `{source}`; do not edit. Measured on {m.get('cpu', '?')} with "
        f"{describe([{'row': 'all', 'provenance': record.get('provenance')}])}, {record.get('time', '?')}: "
        f"`{record['command']}`._",
        "",
        "Every 2-D weight of the model of that type, times one activation row; the least CPU time of "
        f"{record['passes']} passes. quantized: float kernels (stages/kernels/dequant_dot.py); int8: the named "
        "instructions where the CPU has them (stages/kernels/int_dot.py); int8-loops: the same stage with plain "
        "integer loops; fused: the fused stage's tiles, one horizontal add per row (stages/kernels/int_tiles.py). "
        "Compare GB/s with the machine's read bandwidth (the roofline chart): a kernel below it "
        "is limited by its unpacking, not by memory.",
        "",
        "| model | type | kernels | matrices | Mweights | MiB | Gweights/s | GB/s of blocks | vs quantized |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r["model"], r["type"]): r["cpu_s"] for r in record["results"] if r["kernels"] == "quantized"}
    for r in record["results"]:
        s = r["cpu_s"]
        vs = base.get((r["model"], r["type"]))
        lines.append(f"| {r['model']} | {r['type']} | {r['kernels']} | {r['matrices']} | {r['weights'] / 1e6:,.0f} "
                     f"| {r['bytes'] / 2**20:,.0f} | {r['weights'] / s / 1e9:.2f} | {r['bytes'] / s / 1e9:.2f} "
                     f"| {f'{vs / s:.2f}x' if vs else '-'} |")
    return "\n".join(lines) + "\n"


def add_arguments(p):
    p.add_argument("--model", action="append", help="model name or path (repeatable; default: smollm2, "
                                                    "tinyllama-synthetic)")
    p.add_argument("--passes", type=int, default=5, help="passes per group; the fastest counts (default: %(default)s)")


def records(args):
    yield BENCH_DIR / "kernels.json", bench_kernels(args.model or ["smollm2", "tinyllama-synthetic"], args.passes,
                                                    log=lambda m: print(m, file=sys.stderr, flush=True),
                                                    command=args.command_line)
