"""Where the group kernels' software prefetch should put the lines ahead, on this machine: repack's
decode kernel (stages/kernels/repacked.py, one activation row) streaming a matrix larger than the
caches, compiled once per choice of cache level and distance (and once with no software prefetch,
the hardware prefetchers alone), on one thread and on two (each its half of the rows, as the
stages split a matmul). Behind profiles/bench/prefetch/<machine id>.md:

    python -m app bench prefetch [--mib 128] [--rounds 9]

A benchmark, not a test: a few minutes, on a quiet machine.

The choices run in alternating rounds (the order reversed every other round) and the figure is
the median round, so a burst of other work on a shared machine falls on every choice alike; the
figure in brackets beside it is that choice's round-by-round speed over the one the kernels make
for the type on this CPU (repacked.GROUP_PREFETCH), the median.
"""

from __future__ import annotations

import sys
import time

import numba
import numpy as np

from app.measure.machine import machine_id
from app.measure.protocol import BENCH_DIR, alternating, header, median
from app.measure.provenance import describe
from common.gguf import GGMLType
from stages.kernels import repacked
from stages.kernels.q8 import new_packs, quantize_row
from stages.kernels.toolkit import BLOCK_BYTES, block_values

# (cache level, bytes ahead): none, into L1 (prefetcht0) and into L2 (prefetcht1), near to far
CHOICES = ((0, 0), (1, 1024), (1, 4096), (1, 16384), (2, 4096), (2, 16384), (2, 32768), (2, 65536))
TYPES = ("Q4_K", "Q6_K", "Q4_1", "Q8_0")
K = 2048                    # a row of TinyLlama's width


def _kernel():
    """repack's kernel over rows split in `parts` halves, one thread each, compiled now (the
    prefetch choice repacked.GROUP_PREFETCH holds at this moment is built into it)."""
    @numba.njit(parallel=True)
    def run(kind, w, row_bytes, p32, pk, out, n_rows, parts):
        per = (n_rows // parts + 7) // 8 * 8
        for i in numba.prange(parts):
            r0 = i * per
            repacked.group_gemm(kind, w, 0, row_bytes, p32, pk, 1, out, 0, r0, min(n_rows, r0 + per))
    return run


@numba.njit
def _one_row(x, K):
    p32, pk = new_packs(1, K)
    quantize_row(x, 0, K, True, True, p32, pk)
    return p32, pk


def bench_prefetch(mib: int = 128, rounds: int = 9, log=print, command: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    p32, pk = _one_row(rng.standard_normal(K).astype(np.float32), K)
    now = repacked.GROUP_PREFETCH
    kernels = {}
    try:
        for choice in CHOICES:
            repacked.GROUP_PREFETCH = dict.fromkeys(now, choice)
            kernels[choice] = _kernel()
            kernels[choice](int(GGMLType.Q4_0), np.zeros(8 * 18 * 8, np.uint8), 18 * 8, p32, pk,
                            np.zeros((1, 8), np.float32), 8, 1)                    # compile it now
    finally:
        repacked.GROUP_PREFETCH = now
    results = []
    for type_name in TYPES:
        kind = int(GGMLType[type_name])
        row_bytes = K // block_values(kind) * BLOCK_BYTES[kind]
        n_rows = (mib << 20) // row_bytes // 8 * 8
        w = repacked.repack(rng.integers(0, 256, size=(n_rows, row_bytes), dtype=np.uint8), kind).reshape(-1)
        out = np.zeros((1, n_rows), np.float32)
        chosen = now[kind]
        for threads in (1, 2):
            def timed(c, r, threads=threads):
                t0 = time.perf_counter()
                kernels[c](kind, w, row_bytes, p32, pk, out, n_rows, threads)
                return (time.perf_counter() - t0) * 1e3
            ms = alternating(CHOICES, rounds, timed)
            for c in CHOICES:
                med = median(ms[c])
                row = {"type": type_name, "threads": threads, "level": c[0], "bytes_ahead": c[1], "ms": ms[c],
                       "gb_per_s": w.nbytes / med / 1e6,
                       "chosen": c == chosen, "vs_chosen": median(a / b for a, b in zip(ms[chosen], ms[c]))}
                results.append(row)
                log(f"{type_name:5} {threads} thread(s) {label(c):>16}: {row['gb_per_s']:6.1f} GB/s "
                    f"({row['vs_chosen']:.2f}x the chosen)")
    return {"kind": "prefetch", "matrix_mib": mib, "row_values": K, "rounds": rounds,
            "results": results, **header(command=command)}


def cell(row: dict) -> str:
    text = f"{row['gb_per_s']:.1f} ({row['vs_chosen']:.2f}x)"
    return f"**{text}**" if row["chosen"] else text


def signature(machine: dict) -> str:
    sig = machine.get("cpu_signature") or {}
    return f"{sig.get('vendor', '?')} family {sig.get('family', '?')} model {sig.get('model', '?')}"


def label(choice) -> str:
    level, ahead = choice
    return "none" if not level else f"L{level}, {ahead // 1024} KiB ahead"


def page(record: dict, source: str) -> str:
    m = record["machine"]
    types = list(dict.fromkeys(r["type"] for r in record["results"]))
    choices = list(dict.fromkeys((r["level"], r["bytes_ahead"]) for r in record["results"]))
    lines = [
        "# The group kernels' software prefetch: which cache, how far ahead",
        "",
        f"_Generated from `{source}`; do not edit. Measured on {m.get('cpu', '?')} ({signature(m)}, "
        f"{m.get('physical_cores', '?')} cores) with "
        f"{describe([{'row': 'all', 'provenance': record.get('provenance')}])}, {record.get('time', '?')}: "
        f"`{record['command']}`._",
        "",
        f"Repack's decode kernel (one activation row) over a {record['matrix_mib']} MiB matrix of each type, rows of "
        f"{record['row_values']} values, larger than the caches: GB/s of weight blocks read, the median of "
        f"{record['rounds']} alternating rounds; in brackets, each choice's speed over the one the kernels "
        "make for that type on this CPU (in bold; stages/kernels/repacked.py: GROUP_PREFETCH), the median of "
        "the rounds' ratios. "
        "L1: prefetcht0; L2: prefetcht1; none: the hardware prefetchers alone.",
        "",
        "| type | threads | " + " | ".join(label(c) for c in choices) + " |",
        "|---|---:|" + "---:|" * len(choices),
    ]
    for t in types:
        for threads in (1, 2):
            rows = {(r["level"], r["bytes_ahead"]): r for r in record["results"]
                    if r["type"] == t and r["threads"] == threads}
            if not rows:
                continue
            cells = [cell(rows[c]) if c in rows else "-" for c in choices]
            lines.append(f"| {t} | {threads} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_arguments(p):
    p.add_argument("--mib", type=int, default=128, help="each matrix's size, larger than the caches "
                                                      "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds (default: %(default)s)")


def records(args):
    record = bench_prefetch(args.mib, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True),
                            command=args.command_line)
    yield BENCH_DIR / "prefetch" / f"{machine_id(record['machine'])}.json", record
