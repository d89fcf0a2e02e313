"""`python -m app bench NAME`: every benchmark, each measured by the one protocol (protocol.py:
alternating rounds, medians, the record's header) into its JSON record, and drawn from it
(app/report/pages.py). `python -m app bench --help` lists them; `bench NAME --help` gives NAME's
options. `bench --stage S` (no NAME) is `bench stage --stage S`, what `make bench` runs.

A benchmark is a module with two functions: add_arguments(parser), and records(args), which
measures and yields (where, record) for each record (written here, then drawn); failures(record),
where a benchmark states claims, says which did not hold (the command then exits 1). A module is
imported when its benchmark runs, so one benchmark's imports cost no other command anything.
`--draw-only [RECORD ...]` draws a benchmark's pages and charts again from its records (by default
every one of its kinds under profiles/bench/) and measures nothing. A benchmark is not a test:
run it on a quiet machine; its page says which machine and code measured it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from app.args import one_line_errors


@dataclass(frozen=True)
class Benchmark:
    module: str                  # app.measure.NAME: add_arguments(parser), records(args), failures(record)?
    about: str                   # one line: what it measures, and where its record goes
    kinds: tuple[str, ...] = ()  # the kinds of record it writes that have a drawing (app/report/pages.py)


BENCHMARKS = {
    "stage": Benchmark("stage_bench", "one stage by the protocol (fixed prompt, greedy) into profiles/results/ "
                                      "(`make report` runs each)"),
    "vs-llama": Benchmark("compare", "the stages beside llama.cpp, thread for thread: "
                                     "profiles/bench/vs_llama_<model>", ("comparison",)),
    "ttft": Benchmark("ttft", "time to first token against the prompt's length, beside llama.cpp: "
                              "profiles/bench/ttft_<model>", ("ttft_sweep",)),
    "kernels": Benchmark("kernel_bench", "the decode kernels alone, per weight type, one core: "
                                         "profiles/bench/kernels", ("kernels",)),
    "prefetch": Benchmark("prefetch_bench", "which cache the kernels' software prefetch fills, how far ahead: "
                                            "profiles/bench/prefetch/<machine>", ("prefetch",)),
    "tp": Benchmark("tp_bench", "what splitting the model across MPI ranks costs: profiles/bench/tp_<model>", ("tp",)),
    "loadtest": Benchmark("loadtest", "1 to 32 clients against the server (and llama-server); --spec: with "
                                      "speculation: profiles/bench/batching, speculative_serve",
                          ("batching", "speculative_serve")),
    "soak": Benchmark("soak", "minutes of mixed traffic against the server, then what must still hold: "
                              "profiles/bench/soak", ("soak",)),
    "speculative": Benchmark("speculative", "what a verify pass costs and what prompt lookup buys: "
                                            "profiles/bench/speculative", ("speculative",)),
    "constrain": Benchmark("constrain_bench", "what a grammar's mask costs a decode step: profiles/bench/constrain",
                           ("constrain",)),
    "serve-cost": Benchmark("serve_cost", "one client through the server against `run`, streamed and whole: "
                                          "profiles/bench/serve_cost", ("serve_cost",)),
    "shared-core": Benchmark("shared_core", "decode on cores another program shares: profiles/bench/shared_core",
                             ("shared_core",)),
    "harness": Benchmark("harness_bench", "the harness's own assumptions (bandwidth probe, extrapolation): "
                                          "profiles/bench/harness"),
    "tiling": Benchmark("tiling_bench", "the tiling stage's tile sizes swept on the model's shapes: "
                                        "profiles/bench/tiling_sweep"),
    "dequantize": Benchmark("dequantize_bench", "every tensor dequantized to float32, ours and gguf-py's: "
                                                "profiles/bench/dequantize"),
    "gguf": Benchmark("gguf_bench", "opening a GGUF file and touching its weights, ours and gguf-py's: "
                                    "profiles/bench/gguf_open"),
    "tokenizer": Benchmark("tokenizer_bench", "~100 KB of English encoded, ours and llama.cpp's: "
                                              "profiles/bench/tokenizer"),
    "cuda-profile": Benchmark("cuda_profile", "the cuda stage per kernel (CUDA events) and copies per token: "
                                              "profiles/results/<machine>/<model>/cuda_profile"),
}


def module_of(name: str):
    return importlib.import_module(f"app.measure.{BENCHMARKS[name].module}")


def with_default(argv: list[str]) -> list[str]:
    """`bench --stage S ...` (options and no NAME) spelled `bench stage --stage S ...`."""
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        return ["bench", "stage", *argv[1:]]
    return argv


def parser_for(name: str) -> argparse.ArgumentParser:
    """NAME's own options (its module's add_arguments, and --draw-only where it draws)."""
    bench = BENCHMARKS[name]
    p = one_line_errors(argparse.ArgumentParser(prog=f"python -m app bench {name}", description=bench.about))
    module_of(name).add_arguments(p)
    if bench.kinds:
        p.add_argument("--draw-only", nargs="*", metavar="RECORD", default=None,
                       help="draw the pages and charts again from the records (default: every one of this "
                            "benchmark under profiles/bench/); measure nothing")
    return p


def drawn_again(bench: Benchmark, records: list[str]) -> list[Path]:
    """--draw-only: the records named (default: every one of the benchmark's kinds) drawn again."""
    from app.measure.protocol import BENCH_DIR
    from app.report import pages
    if not records:
        return pages.redraw(BENCH_DIR, bench.kinds)
    written = []
    for path in map(Path, records):
        written += pages.draw(json.loads(path.read_text()), path)
    return written


def run_benchmark(args) -> int:
    """`python -m app bench NAME ...`: NAME's options parsed, then its records measured, written and
    drawn (or, with --draw-only, drawn again); 1 where a claim it states did not hold."""
    from app.measure.protocol import shown, write_record
    from app.report import pages
    bench, module = BENCHMARKS[args.benchmark], module_of(args.benchmark)
    opts = parser_for(args.benchmark).parse_args(args.rest)
    opts.command_line = args.command_line
    if getattr(opts, "draw_only", None) is not None:
        for path in drawn_again(bench, opts.draw_only):
            print(f"drew {shown(path)}", file=sys.stderr)
        return 0
    failed = []
    for path, record in module.records(opts):
        if path is None:                             # measured, not written (bench stage --no-write)
            continue
        written = write_record(record, path, draw=pages.draw)
        for page in (p for p in written if p.suffix == ".md"):       # what it measured, as its page says it
            print(page.read_text())
        print("wrote " + ", ".join(shown(p) for p in written), file=sys.stderr)
        failed += getattr(module, "failures", lambda rec: [])(record)
    for line in failed:
        print(f"does not hold: {line}", file=sys.stderr)
    return 1 if failed else 0


def add_commands(sub):
    p = one_line_errors(sub.add_parser(
        "bench", help="measure: a stage (bench --stage S) or a benchmark (bench NAME; bench --help lists them)",
        description=__doc__ + "\nbenchmarks:\n" + "\n".join(f"  {n:<13} {b.about}" for n, b in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("benchmark", metavar="NAME", choices=list(BENCHMARKS), help="the benchmark (listed below)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="its options: bench NAME --help")
    p.set_defaults(func=run_benchmark)
