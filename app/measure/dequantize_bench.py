"""Benchmark: dequantize every tensor of a GGUF model to float32 (what the naive..simd stages do
at load), median of a few runs, per ggml type; gguf-py's dequantize timed alongside when installed.

    python -m app bench dequantize [-m MODEL] [--runs 5] [--out profiles/bench/dequantize.json]

Single-threaded numpy. The first run also pays for page-faulting the mapped file in, so it is
reported separately and left out of the median.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from app.measure.protocol import BENCH_DIR, add_options, header, load_average
from app.models import resolve
from common.gguf import GGUFFile
from common.quants import dequantize_tensor


def time_model(f: GGUFFile, dequantize) -> tuple[float, dict]:
    """Seconds for the whole model, and per ggml type."""
    per_type = defaultdict(float)
    start = time.perf_counter()
    for t in f.tensors.values():
        t0 = time.perf_counter()
        dequantize(t)
        per_type[t.ggml_type.name] += time.perf_counter() - t0
    return time.perf_counter() - start, dict(per_type)


def gguf_py_dequantizer():
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ImportError:
        return None

    def dequantize(t):
        rows = t.rows()
        return gguf_dequantize(rows, GGMLQuantizationType(int(t.ggml_type))).reshape(t.shape)
    return dequantize


def bench(f: GGUFFile, dequantize, runs: int) -> dict:
    first, _ = time_model(f, dequantize)
    timings = [time_model(f, dequantize) for _ in range(runs)]
    totals = [s for s, _ in timings]
    types = sorted(timings[0][1])
    return {
        "first_run_s": round(first, 4),
        "median_s": round(statistics.median(totals), 4),
        "min_s": round(min(totals), 4),
        "runs_s": [round(s, 4) for s in totals],
        "median_s_by_type": {k: round(statistics.median(t[k] for _, t in timings), 4) for k in types},
    }


def add_arguments(p):
    add_options(p, out=BENCH_DIR / "dequantize.json")
    p.add_argument("--runs", type=int, default=5, help="timed runs after one warm-up run (default: %(default)s)")
    p.add_argument("--no-gguf-py", action="store_true", help="do not time gguf-py for comparison")


def records(args):
    path = resolve(args.model)
    with GGUFFile(path) as f:
        n_values = sum(t.n_elements for t in f.tensors.values())
        mix = defaultdict(lambda: {"tensors": 0, "values": 0, "bytes": 0})
        for t in f.tensors.values():
            m = mix[t.ggml_type.name]
            m["tensors"] += 1
            m["values"] += t.n_elements
            m["bytes"] += t.nbytes
        ours = bench(f, dequantize_tensor, args.runs)
        reference = None
        gguf_deq = None if args.no_gguf_py else gguf_py_dequantizer()
        if gguf_deq is not None:
            reference = bench(f, gguf_deq, max(1, min(args.runs, 3)))

    out_bytes = n_values * 4
    record = {
        "kind": "dequantize", "benchmark": "dequantize whole model to float32",
        "model": {"file": path.name, "size_bytes": path.stat().st_size, "values": n_values,
                  "type_mix": dict(mix)},
        "threads": 1, "load_average_1_5_15": load_average(),
        "ours": {**ours, "output_gb_per_s": round(out_bytes / ours["median_s"] / 1e9, 3)},
        "gguf_py": reference, **header(command=args.command_line),
    }
    print(f"{path.name}: {n_values / 1e6:.1f} M values -> {out_bytes / 2**20:.0f} MiB of float32")
    print(f"  common.quants: median {ours['median_s']:.3f} s over {args.runs} runs "
          f"(first run {ours['first_run_s']:.3f} s), {record['ours']['output_gb_per_s']:.2f} GB/s written")
    for k, v in ours["median_s_by_type"].items():
        print(f"    {k:<6} {v:.3f} s  ({mix[k]['tensors']} tensors, {mix[k]['values'] / 1e6:.1f} M values)")
    if reference:
        print(f"  gguf-py:       median {reference['median_s']:.3f} s "
              f"({reference['median_s'] / ours['median_s']:.1f}x ours)")
    print(f"  machine: {record['machine']['cpu']}, {record['machine']['logical_cpus']} logical cores, "
          f"load average {record['load_average_1_5_15']}")
    yield args.out, record
