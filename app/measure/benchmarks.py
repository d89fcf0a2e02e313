"""`python -m app bench NAME`: every benchmark, each measured by the one protocol (protocol.py:
alternating rounds, medians, the record's header) into its JSON record, and drawn from it
(app/report/pages.py). `python -m app bench --help` lists them; `bench NAME --help` gives NAME's
options. `bench --stage S` (no NAME) is `bench stage --stage S`, what `make bench` runs.

A benchmark is two functions in its module: add_arguments(parser), and records(args), which
measures and yields (where, record) for each record (written here, then drawn); failures(record),
where a benchmark states claims, says which did not hold (the command then exits 1).
`--draw-only [RECORD ...]` draws a benchmark's pages and charts again from its records (by default
every one of its kinds under profiles/bench/) and measures nothing. A benchmark is not a test:
run it on a quiet machine; its page says which machine and code measured it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app import run
from app.measure import (
    compare,
    constrain_bench,
    cuda_profile,
    dequantize_bench,
    gguf_bench,
    harness_bench,
    kernel_bench,
    loadtest,
    prefetch_bench,
    shared_core,
    soak,
    speculative,
    tiling_bench,
    tokenizer_bench,
    tp_bench,
    ttft,
)
from app.measure.protocol import BENCH_DIR, shown, write_record
from app.report import pages


@dataclass(frozen=True)
class Benchmark:
    about: str                                   # one line: what it measures, and where the record goes
    add_arguments: Callable                      # (parser): its options
    records: Callable                            # (args): measures; yields (where, record), or (None, record)
    kinds: tuple[str, ...] = ()                  # the kinds of record it writes that have a drawing
    failures: Callable = lambda record: []       # (record): the claims it states that did not hold


def of(module, about: str, kinds=()) -> Benchmark:
    return Benchmark(about, module.add_arguments, module.records, tuple(kinds),
                     getattr(module, "failures", Benchmark.failures))


BENCHMARKS = {
    "stage": Benchmark("one stage by the protocol (fixed prompt, greedy) into profiles/results/ (`make report` "
                       "runs each)", run.add_bench_arguments, run.bench_records),
    "vs-llama": of(compare, "the stages beside llama.cpp, thread for thread: profiles/bench/vs_llama_<model>",
                   ["comparison"]),
    "ttft": of(ttft, "time to first token against the prompt's length, beside llama.cpp: "
                     "profiles/bench/ttft_<model>", ["ttft_sweep"]),
    "kernels": of(kernel_bench, "the decode kernels alone, per weight type, one core: profiles/bench/kernels",
                  ["kernels"]),
    "prefetch": of(prefetch_bench, "which cache the kernels' software prefetch fills, how far ahead: "
                                   "profiles/bench/prefetch/<machine>", ["prefetch"]),
    "tp": of(tp_bench, "what splitting the model across MPI ranks costs: profiles/bench/tp_<model>", ["tp"]),
    "loadtest": of(loadtest, "1 to 32 clients against the server (and llama-server); --spec: with speculation: "
                             "profiles/bench/batching, speculative_serve", ["batching", "speculative_serve"]),
    "soak": of(soak, "minutes of mixed traffic against the server, then what must still hold: profiles/bench/soak",
               ["soak"]),
    "speculative": of(speculative, "what a verify pass costs and what prompt lookup buys: "
                                   "profiles/bench/speculative", ["speculative"]),
    "constrain": of(constrain_bench, "what a grammar's mask costs a decode step: profiles/bench/constrain",
                    ["constrain"]),
    "shared-core": of(shared_core, "decode on cores another program shares: profiles/bench/shared_core",
                      ["shared_core"]),
    "harness": of(harness_bench, "the harness's own assumptions (bandwidth probe, extrapolation): "
                                 "profiles/bench/harness"),
    "tiling": of(tiling_bench, "the tiling stage's tile sizes swept on the model's shapes: "
                               "profiles/bench/tiling_sweep"),
    "dequantize": of(dequantize_bench, "every tensor dequantized to float32, ours and gguf-py's: "
                                       "profiles/bench/dequantize"),
    "gguf": of(gguf_bench, "opening a GGUF file and touching its weights, ours and gguf-py's: "
                           "profiles/bench/gguf_open"),
    "tokenizer": of(tokenizer_bench, "~100 KB of English encoded, ours and llama.cpp's: profiles/bench/tokenizer"),
    "cuda-profile": of(cuda_profile, "the cuda stage per kernel (CUDA events) and copies per token: "
                                     "profiles/results/<machine>/<model>/cuda_profile"),
}


def with_default(argv: list[str]) -> list[str]:
    """`bench --stage S ...` (options and no NAME) spelled `bench stage --stage S ...`."""
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        return ["bench", "stage", *argv[1:]]
    return argv


def drawn_again(bench: Benchmark, records: list[str]) -> list[Path]:
    """--draw-only: the records named (default: every one of the benchmark's kinds) drawn again."""
    if not records:
        return pages.redraw(BENCH_DIR, bench.kinds)
    written = []
    for path in map(Path, records):
        written += pages.draw(json.loads(path.read_text()), path)
    return written


def run_benchmark(args) -> int:
    bench = BENCHMARKS[args.benchmark]
    if getattr(args, "draw_only", None) is not None:
        for path in drawn_again(bench, args.draw_only):
            print(f"drew {shown(path)}", file=sys.stderr)
        return 0
    failed = []
    for path, record in bench.records(args):
        if path is None:                             # measured, not written (bench stage --no-write)
            continue
        written = write_record(record, path, draw=pages.draw)
        for page in (p for p in written if p.suffix == ".md"):       # what it measured, as its page says it
            print(page.read_text())
        print("wrote " + ", ".join(shown(p) for p in written), file=sys.stderr)
        failed += bench.failures(record)
    for line in failed:
        print(f"does not hold: {line}", file=sys.stderr)
    return 1 if failed else 0


def add_commands(sub):
    p = run.one_line_errors(sub.add_parser(
        "bench", help="measure: a stage (bench --stage S) or a benchmark (bench NAME; bench --help lists them)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    names = p.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, bench in BENCHMARKS.items():
        b = run.one_line_errors(names.add_parser(name, help=bench.about, description=bench.about))
        bench.add_arguments(b)
        if bench.kinds:
            b.add_argument("--draw-only", nargs="*", metavar="RECORD", default=None,
                           help="draw the pages and charts again from the records (default: every one of this "
                                "benchmark under profiles/bench/); measure nothing")
        b.set_defaults(func=run_benchmark)
