"""The stages side by side with llama.cpp on the same file, in one run of alternating rounds.

    python scripts/bench_vs_llama.py                                   # SmolLM2 and TinyLlama's geometry
    python scripts/bench_vs_llama.py --model smollm2 --rounds 5
    python scripts/bench_vs_llama.py --engines threads,int8,int8-loops,llama.cpp --threads 1,2
    python scripts/bench_vs_llama.py --llama-quantize Q4_K_M      # each model made Q4_K_M by llama-quantize first
    python scripts/bench_vs_llama.py --llama-quantize Q4_K_M --ttft-lengths 128,512,1024,2048 --threads 2
                                        # TTFT (and decode at that context) against the prompt's length:
                                        # repack, prefill, llama.cpp with flash attention off and on

Writes profiles/bench/vs_llama_<model>.json (every measurement, each a record of the one harness,
app/measure/bench.py) and the page drawn from it, vs_llama_<model>.md; with --ttft-lengths,
profiles/bench/ttft_<model>.json and .md instead (app/measure/ttft.py: one process per engine and
round, every length in it; the integer peak measured in the same run). What is measured and how the
ratios are formed: app/measure/compare.py. llama.cpp comes from the optional llama-cpp-python
(`make llama-cpp`); without it its rows are left out, and said to be.
A benchmark, not a test: it takes minutes, and the page says which machine and code it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from app.measure import compare  # noqa: E402
from app.measure.baseline import llama_cpp_version  # noqa: E402
from app.measure.bench import BASELINE  # noqa: E402
from app.report.pages import redraw_pages  # noqa: E402
from common.cpu import physical_cores  # noqa: E402
from stages import REGISTRY  # noqa: E402

OUT_DIR = ROOT / "profiles" / "bench"
MODELS = ("smollm2", "tinyllama-synthetic")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help=f"model name or path (repeatable; default: {', '.join(MODELS)})")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("--engines", default=",".join(compare.DEFAULT_ENGINES),
                   help=f"comma-separated stages, variants or {BASELINE} (default: %(default)s)")
    p.add_argument("--threads", default=None,
                   help="thread counts for the parallel stages and llama.cpp (default: 1 and the physical cores)")
    p.add_argument("--prompt-tokens", type=int, default=compare.PROMPT_TOKENS,
                   help="prompt length (default: %(default)s)")
    p.add_argument("--no-llama", action="store_true", help=f"leave {BASELINE} out even if it is installed")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the record and page go (default: %(default)s)")
    p.add_argument("--llama-quantize", metavar="RECIPE", default=None,
                   help="measure each model as llama.cpp's llama-quantize makes it with RECIPE (e.g. Q4_K_M): built "
                        "from llama-cpp-python's sources and run once (app/measure/llama_tools.py)")
    p.add_argument("--ttft-lengths", default=None, metavar="N,N,...",
                   help="measure TTFT at these prompt lengths instead (engines default: repack,prefill,llama.cpp,"
                        "llama.cpp+fa; one thread count)")
    args = p.parse_args(argv)
    if args.ttft_lengths:
        return sweep(p, args)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e != BASELINE and e not in REGISTRY]
    if unknown:
        p.error(f"unknown engines {unknown}; the stages and variants are {', '.join(REGISTRY)}, and {BASELINE}")
    if BASELINE in engines and (args.no_llama or llama_cpp_version() is None):
        print(f"{BASELINE} rows left out: " + ("--no-llama" if args.no_llama else
                                               "llama-cpp-python is not installed (`make llama-cpp`)"), file=sys.stderr)
        engines.remove(BASELINE)
    threads = tuple(int(t) for t in args.threads.split(",")) if args.threads else tuple(sorted({1, physical_cores()}))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for model in args.model or MODELS:
        model = model_to_measure(model, args)
        record = compare.compare(model, engines, threads, args.rounds, args.prompt_tokens,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_record(record, model, args.out_dir, "vs_llama")
    return 0


def model_to_measure(model: str, args) -> str:
    """A model name or file, or the copy llama-quantize made of it (--llama-quantize), announced."""
    if args.llama_quantize:
        from app.measure.llama_tools import quantized
        from app.models import resolve
        model = str(quantized(resolve(model), args.llama_quantize))
    print(f"{model}:", file=sys.stderr)
    return model


def write_record(record: dict, model: str, out_dir: Path, prefix: str):
    """The record as out_dir/<prefix>_<model>.json; its page redrawn and printed."""
    stem = model if model in MODELS else Path(record["model"]).stem
    path = out_dir / f"{prefix}_{stem}.json"
    path.write_text(json.dumps(record, indent=1, default=float))
    for page in redraw_pages(out_dir):
        if page.stem == path.stem:
            print(page.read_text())
            print(f"wrote {path} and {page}", file=sys.stderr)


def sweep(p, args) -> int:
    """--ttft-lengths: app/measure/ttft.py's comparison of every engine at every prompt length."""
    from app.measure import ttft
    lengths = [int(n) for n in args.ttft_lengths.split(",")]
    chosen = args.engines if args.engines != ",".join(compare.DEFAULT_ENGINES) else ",".join(ttft.DEFAULT_ENGINES)
    engines = [e.strip() for e in chosen.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ttft.BASELINES and e not in REGISTRY]
    if unknown:
        p.error(f"unknown engines {unknown}; the stages are {', '.join(REGISTRY)}, and {', '.join(ttft.BASELINES)}")
    if args.no_llama or llama_cpp_version() is None:
        print("llama.cpp rows left out: " + ("--no-llama" if args.no_llama else "llama-cpp-python is not installed "
                                             "(`make llama-cpp`)"), file=sys.stderr)
        engines = [e for e in engines if e not in ttft.BASELINES]
    threads = int(args.threads) if args.threads else physical_cores()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for model in args.model or MODELS:
        model = model_to_measure(model, args)
        record = ttft.compare(model, engines, lengths, threads, args.rounds,
                              log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_record(record, model, args.out_dir, "ttft")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
