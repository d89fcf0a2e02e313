"""Stages side by side with llama.cpp, measured in one run: the comparison behind
profiles/bench/vs_llama_<model>.md.

    python -m app bench vs-llama                                   # SmolLM2 and TinyLlama's geometry
    python -m app bench vs-llama --model smollm2 --rounds 5
    python -m app bench vs-llama --engines threads,int8,int8-loops,llama.cpp --threads 1,2
    python -m app bench vs-llama --llama-quantize Q4_K_M      # each model made Q4_K_M by llama-quantize first

Every measurement is one record of the one harness (app/measure/bench.py: `bench stage` or
`baseline` in a fresh process), so a row here and a row of `make report` are the same kind of
figure, measured in alternating rounds (protocol.py) and compared as ratios within a round; the
page quotes medians over the rounds. llama.cpp comes from the optional llama-cpp-python (`make
llama-cpp`); without it its rows are left out, and said to be. A benchmark, not a test: it takes
minutes, and the page says which machine and code it measured.

    rows       each engine once (single-threaded stages) or at each --threads count
               (stages the registry marks `parallel`, and llama.cpp): "int8@2", "llama.cpp@1"
    per round  prompt of `prompt_tokens` ids (TTFT), then `n_predict` tokens (decode median)
    ratios     per round: row / llama.cpp at the same thread count, and row / the stage it
               builds on at the same thread count (where both were measured); median of rounds
    floor      the decode floor per token: file bytes / the machine's measured read bandwidth
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from app.measure import roofline
from app.measure.baseline import llama_cpp_version
from app.measure.bench import BASELINE, stage_in_child
from app.measure.protocol import BENCH_DIR, alternating, header, median, paired
from app.measure.provenance import describe
from app.models import resolve
from common.cpu import physical_cores
from common.generate import ParameterError
from common.gguf import GGUFFile
from common.model import LlamaConfig, n_params
from stages import REGISTRY, info
from stages.registry import Tokens

PROMPT_TOKENS = 128          # TTFT at a prompt long enough for prefill to be a matrix-matrix product
N_CTX = 2048                 # our default context, and llama.cpp's for the same cache
DEFAULT_ENGINES = ("simd", "kv_cache", "quantized", "threads", "int8", "fused", "repack", BASELINE)
MODELS = ("smollm2", "tinyllama-synthetic")          # what is measured unless --model says


def rows_for(engines, thread_counts) -> list[dict]:
    """[{row, engine, threads}]: single-threaded stages once, the others at every count."""
    rows = []
    for e in engines:
        multi = e == BASELINE or info(e).parallel
        for t in (thread_counts if multi else (1,)):
            rows.append({"row": f"{e}@{t}", "engine": e, "threads": t})
    return rows


def n_predict_for(engine: str) -> int:
    return Tokens().report if engine == BASELINE else info(engine).tokens.report


def compare(model, engines=DEFAULT_ENGINES, thread_counts=(1,), rounds: int = 3, prompt_tokens: int = PROMPT_TOKENS,
            log=print, command: str | None = None) -> dict:
    """Measure every row in `rounds` alternating rounds; the comparison record."""
    path = resolve(model)
    with GGUFFile(path) as g:
        params, file_size = n_params(LlamaConfig.from_gguf(g)), g.file_size
    rows = {r["row"]: r for r in rows_for(engines, thread_counts)}
    log(f"warming numba's cache (not measured): {', '.join(e for e in engines if e != BASELINE)}")
    for e in dict.fromkeys(r["engine"] for r in rows.values() if r["engine"] != BASELINE):
        stage_in_child(e, path, 4, 2, threads=max(thread_counts), n_ctx=N_CTX)
    log("measuring read bandwidth (app/measure/roofline.py) ...")
    ceilings = roofline.measure(threads=max(thread_counts))

    def one(row: str, k: int) -> dict:
        r, n = rows[row], n_predict_for(rows[row]["engine"])
        log(f"  round {k + 1}/{rounds}: {row} (prompt {prompt_tokens}, {n} tokens)")
        rec = stage_in_child(r["engine"], path, prompt_tokens, n, threads=r["threads"], n_ctx=N_CTX)
        log(f"    TTFT {rec['ttft_ms']:.0f} ms, decode {rec['decode_ms']:.1f} ms/token, "
            f"peak RSS {rec['peak_rss_mb']:.0f} MiB")
        return rec
    runs = alternating(rows, rounds, one)
    bandwidth = {str(t): v for t, v in ceilings["bandwidth_gbs"].items()}
    return {
        "kind": "comparison", "model": path.name, "n_params": params, "file_size": file_size,
        "synthetic": "synthetic" in path.name.lower(),
        "settings": {"prompt_tokens": prompt_tokens, "n_predict": {e: n_predict_for(e) for e in engines},
                     "threads": list(thread_counts), "rounds": rounds, "n_ctx": N_CTX,
                     "sampling": "greedy, EOS ignored", "order": "alternating (forward, backward, ...)"},
        "rows": list(rows.values()), "runs": runs,
        "bandwidth_gbs": bandwidth,
        "decode_floor_ms": {t: file_size / (bw * 1e9) * 1e3 for t, bw in bandwidth.items()},
        **header(command=command),
    }


def summary(record: dict) -> dict:
    """{row: figures} computed from the runs: medians over rounds, and the median of the per-round
    ratios against llama.cpp and against the stage each row builds on (same thread count)."""
    runs = record["runs"]
    out = {}
    for r in record["rows"]:
        row, t = r["row"], r["threads"]
        recs = runs[row]
        s = {"engine": r["engine"], "threads": t, "rounds": len(recs),
             "decode_ms": median(x["decode_ms"] for x in recs), "ttft_ms": median(x["ttft_ms"] for x in recs),
             "peak_rss_mb": median(x["peak_rss_mb"] for x in recs)}
        for name, other in (("llama_cpp", f"{BASELINE}@{t}"),
                            ("builds_on", None if r["engine"] == BASELINE else _builds_on_row(record, r))):
            if other and other in runs and other != row:
                pairs = paired(recs, runs[other], (row, other))
                for key in ("decode_ms", "ttft_ms"):
                    s[f"{key}_over_{name}"] = median(a[key] / b[key] for a, b in pairs)
                s[f"{name}_row"] = other
        floor = record["decode_floor_ms"].get(str(t))
        if floor:
            s["decode_over_floor"] = s["decode_ms"] / floor
        first = runs[record["rows"][0]["row"]][0]["tokens"]
        n = min(len(first), len(recs[0]["tokens"]))         # rows may generate different counts
        s["same_tokens_as_first_row"] = recs[0]["tokens"][:n] == first[:n]
        out[row] = s
    return out


def _builds_on_row(record: dict, r: dict) -> str | None:
    """The row of the stage this row's stage builds on, at the same thread count (or at 1)."""
    parent = info(r["engine"]).variant_of or info(r["engine"]).builds_on
    names = {x["row"] for x in record["rows"]}
    for t in (r["threads"], 1):
        if f"{parent}@{t}" in names:
            return f"{parent}@{t}"
    return None


def _num(x, digits=1) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def page(record: dict, source: str) -> str:
    """The markdown page for one comparison record (source: the record's path, as shown)."""
    s = summary(record)
    st = record["settings"]
    m = record["machine"]
    lines = [
        f"# {record['model']}: the stages beside llama.cpp",
        "",
        f"_Generated from `{source}` by `python -m app report` (or the benchmark that measured it); "
        f"do not edit. Measured on {m.get('cpu', '?')} ({m.get('physical_cores', '?')} cores) with "
        f"{describe([{'row': 'all', 'provenance': record.get('provenance')}])}, {record.get('time', '?')}._",
        "",
        f"{record['n_params'] / 1e6:,.0f}M parameters"
        + (" (SYNTHETIC weights: the geometry and type mix of the real model, random values)" if record["synthetic"]
           else "") + f"; prompt {st['prompt_tokens']} tokens, then "
        + ", ".join(f"{e} {n}" for e, n in st["n_predict"].items()) + f" tokens generated; {st['sampling']}; "
        f"{st['rounds']} rounds, {st['order']}. Figures are medians over the rounds; a ratio is the median of "
        f"the ratios measured within each round. `{record['command']}`",
        "",
        "| row | TTFT (ms) | decode (ms/token) | decode / llama.cpp | TTFT / llama.cpp | decode / the stage it "
        "builds on | decode / bandwidth floor | peak RSS (MiB) | same greedy tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    first = record["rows"][0]["row"]
    for row, f in s.items():
        parent = f"{_num(f['decode_ms_over_builds_on'], 2)} ({f['builds_on_row']})" \
            if "decode_ms_over_builds_on" in f else "-"
        lines.append(f"| {row} | {_num(f['ttft_ms'])} | {_num(f['decode_ms'])} "
                     f"| {_num(f.get('decode_ms_over_llama_cpp'), 2)} | {_num(f.get('ttft_ms_over_llama_cpp'), 2)} "
                     f"| {parent} | {_num(f.get('decode_over_floor'), 2)} | {_num(f['peak_rss_mb'], 0)} "
                     f"| {'yes' if f['same_tokens_as_first_row'] else 'no'} |")
    floors = ", ".join(f"{_num(record['decode_floor_ms'][t])} ms at {t} thread(s) "
                       f"({_num(record['bandwidth_gbs'][t])} GB/s)" for t in record["decode_floor_ms"])
    lines += ["", f"Bandwidth floor (the file read once per token at the read bandwidth measured in the same "
                  f"run): {floors}. \"Same greedy tokens\": the row's first round generated the tokens of "
                  f"{first}'s first round, as far as both went (int8-activation engines may differ at "
                  f"near-ties).", ""]
    return "\n".join(lines)


# ---- the benchmark: `python -m app bench vs-llama` -------------------------------------------------

def add_model_arguments(p):
    """The options vs-llama and ttft share: which models, how many rounds, llama.cpp or not."""
    p.add_argument("--model", action="append", help=f"model name or path (repeatable; default: {', '.join(MODELS)})")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("--no-llama", action="store_true", help=f"leave {BASELINE} out even if it is installed")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR, help="where the records and pages go (default: "
                                                                   "profiles/bench)")
    p.add_argument("--llama-quantize", metavar="RECIPE", default=None,
                   help="measure each model as llama.cpp's llama-quantize makes it with RECIPE (e.g. Q4_K_M): built "
                        "from llama-cpp-python's sources and run once (app/measure/llama_tools.py)")


def add_arguments(p):
    add_model_arguments(p)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated stages, variants or {BASELINE} (default: %(default)s)")
    p.add_argument("--threads", default=None,
                   help="thread counts for the parallel stages and llama.cpp (default: 1 and the physical cores)")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="prompt length (default: %(default)s)")


def engines_to_measure(text: str, known, baselines) -> list[str]:
    """The engines asked for (comma-separated), llama.cpp's left out where it is not installed."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in baselines and e not in known]
    if unknown:
        raise ParameterError(f"unknown engines {unknown}; the stages and variants are {', '.join(known)}, and "
                             f"{', '.join(baselines)}")
    return engines


def without_llama(engines: list[str], baselines, args) -> list[str]:
    """engines less llama.cpp's where --no-llama says so or llama-cpp-python is not installed (said)."""
    if any(e in baselines for e in engines) and (args.no_llama or llama_cpp_version() is None):
        print("llama.cpp rows left out: " + ("--no-llama" if args.no_llama else
                                             "llama-cpp-python is not installed (`make llama-cpp`)"), file=sys.stderr)
        return [e for e in engines if e not in baselines]
    return engines


def models_to_measure(args):
    """Each model: a name or file, or the copy llama-quantize made of it (--llama-quantize), announced."""
    for model in args.model or MODELS:
        if args.llama_quantize:
            from app.measure.llama_tools import quantized
            model = str(quantized(resolve(model), args.llama_quantize))
        print(f"{model}:", file=sys.stderr)
        yield model


def record_path(prefix: str, model: str, record: dict, out_dir: Path) -> Path:
    """out_dir/<prefix>_<model>.json: the model's short name where it was measured by one, else its file's stem."""
    return out_dir / f"{prefix}_{model if model in MODELS else Path(record['model']).stem}.json"


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def records(args):
    engines = without_llama(engines_to_measure(args.engines, REGISTRY, (BASELINE,)), (BASELINE,), args)
    threads = tuple(int(t) for t in args.threads.split(",")) if args.threads else tuple(sorted({1, physical_cores()}))
    for model in models_to_measure(args):
        record = compare(model, engines, threads, args.rounds, args.prompt_tokens, log=log,
                         command=args.command_line)
        yield record_path("vs_llama", model, record, args.out_dir), record
