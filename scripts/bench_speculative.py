"""Speculative decoding measured: does verifying k guesses cost about one step, and what does
prompt lookup buy?

    python scripts/bench_speculative.py                       # the fastest CPU stage, 1 thread and all cores
    python scripts/bench_speculative.py --stage threads --threads 1 --rounds 5
    python scripts/bench_speculative.py --quick               # a minute: the script checked, not a measurement
    python scripts/bench_speculative.py --chart-only          # redraw the page and chart from the record

For each thread count, in --rounds alternating rounds (app/measure/speculative.py):

1. the time of one verify pass of k+1 rows over one plain decode step, k = 0..--k-max, at the
   end of a --context-token context; beside it the roofline's floor (the machine's bandwidth and
   peak, profiles/results/<machine>/machine.json) and llama.cpp's own pass on the same file;
2. greedy generation of exactly -n tokens for every committed prompt
   (app/measure/speculative_prompts.json: text that copies itself, and free text) by four engines
   whose order rotates from round to round: ours plain, ours with prompt lookup (--draft-max),
   llama.cpp plain and llama.cpp with llama-cpp-python's LlamaPromptLookupDecoding
   (num_pred_tokens = --draft-max), the same file, prompt ids and threads.

Writes profiles/bench/speculative.json (every measurement, settings, machine, code, load
average) and draws profiles/bench/speculative.md and profiles/speculative.png from it
(app/report/speculative.py). A benchmark, not a test: minutes, on a quiet machine. llama.cpp comes
from the optional llama-cpp-python (`make llama-cpp`); without it its columns are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from tqdm import tqdm  # noqa: E402

from app.measure import speculative as ms  # noqa: E402
from app.measure.bench import add_context, model_summary  # noqa: E402
from app.models import DEFAULT_MODEL, resolve  # noqa: E402
from app.report import speculative as page  # noqa: E402
from app.run import chosen_stage  # noqa: E402
from common import speculative as sp  # noqa: E402
from common.cpu import physical_cores  # noqa: E402
from stages import load  # noqa: E402

RECORD = ROOT / "profiles" / "bench" / "speculative.json"
CHART = ROOT / "profiles" / "speculative.png"


def draw(rec: dict, record: Path = RECORD) -> tuple[Path, Path]:
    """The page beside the record, the chart in profiles/ (beside a record kept elsewhere)."""
    chart = CHART if record.resolve() == RECORD.resolve() else record.with_suffix(".png")
    shown = record.relative_to(ROOT).as_posix() if record.is_relative_to(ROOT) else str(record)
    md = record.with_suffix(".md")
    md.write_text(page.page(rec, shown))
    page.chart(rec, chart)
    return md, chart


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_threads(args, model, stage: str, threads: int, prompts: dict, bar) -> dict:
    engine = load(stage, model, threads=threads)
    engine.warmup()
    tok = engine.tokenizer
    context = tok.encode(" ".join(prompts["free"] + prompts["copy"]) * 4)[:args.context]
    out = {"verify": {"k": list(range(args.k_max + 1))}, "runs": []}
    v = out["verify"]
    bar.set_postfix_str(f"{threads} thread(s): verify passes")
    v["ours_ms"] = ms.verify_times(engine, context, args.k_max, args.rounds)
    v["roofline"] = ms.roofline_prediction(engine, len(context), args.k_max, ms.ceilings(threads))
    llama = None if args.no_llama else ms.llama_for_verify(model, threads)
    if llama is not None:
        v["llama_ms"] = ms.llama_verify_times(llama, context, args.k_max, args.rounds)
        del llama
    engines = None if args.no_llama else ms.llama_engines(model, threads, args.draft_max)
    names = [ms.OURS, ms.OURS_LOOKUP] + ([ms.LLAMA, ms.LLAMA_LOOKUP] if engines else [])
    cost = sp.StepCost()                                # measured once, followed by every run after
    cost.calibrate(engine, args.draft_max + 1)
    out["calibrated"] = {"ratios": cost.ratios, "t1_ms": cost.t1_ms, "seconds": cost.calibrate_s}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]          # who goes first rotates
        for set_name, texts in prompts.items():
            for i, text in enumerate(texts):
                ids = tok.encode(text)
                for name in order:
                    bar.set_postfix_str(f"{threads} thread(s), round {r + 1}: {set_name} {i + 1}, {name}")
                    if name == ms.OURS:
                        res = ms.run_ours(engine, ids, args.n_predict)
                    elif name == ms.OURS_LOOKUP:
                        spec = sp.Speculator(sp.PromptLookup(), args.draft_max,
                                             length=sp.DraftLength(args.draft_max, cost))
                        res = ms.run_ours(engine, ids, args.n_predict, spec)
                    else:
                        res = ms.run_llama(engines[name], ids, args.n_predict)
                    out["runs"].append({"round": r, "set": set_name, "prompt": i, "engine": name,
                                        "n_tokens": len(res["tokens"]), **res})
                for run in out["runs"][-len(order):]:          # our lookup's text against our plain one's
                    if run["engine"] == ms.OURS_LOOKUP:
                        plain = next(x for x in out["runs"][-len(order):] if x["engine"] == ms.OURS)
                        run["parting"] = ms.parting(engine, ids, plain["tokens"], run["tokens"])
                    bar.update(1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="fastest", help="the stage (default: the fastest this machine runs, as "
                                                       "`make run` picks)")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--threads", default=None, help="thread counts (default: 1 and the physical cores)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--draft-max", type=int, default=10,
                   help="guesses per step at most, ours and llama-cpp-python's (default: %(default)s, its own)")
    p.add_argument("--k-max", type=int, default=16, help="verify passes of 1..k-max+1 rows (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="context before the verify passes (default: %(default)s)")
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even if it is installed")
    p.add_argument("--quick", action="store_true",
                   help="1 round, 1 thread, 2 prompts per set, 16 tokens, k up to 8: checks the script in about a "
                        "minute (the record says so; not a measurement to quote)")
    p.add_argument("--out", type=Path, default=RECORD, help="the record (default: profiles/bench/speculative.json)")
    p.add_argument("--chart-only", action="store_true", help="redraw the page and chart from the record")
    args = p.parse_args(argv)
    if args.chart_only:
        if not args.out.exists():
            p.error(f"no record at {args.out}: run the benchmark first")
        for path in draw(json.loads(args.out.read_text()), args.out):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    for name in ("rounds", "n_predict", "draft_max", "k_max", "context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    prompts = ms.prompt_sets()
    threads = sorted({1, physical_cores()})
    if args.quick:
        args.rounds, args.n_predict, args.k_max = 1, 16, 8
        prompts = {k: v[:2] for k, v in prompts.items()}
        threads = [1]
    if args.threads:
        threads = [int(t) for t in args.threads.split(",")]
    stage = chosen_stage(args.stage)
    model = resolve(args.model)
    start = loadavg()
    n_runs = len(threads) * args.rounds * sum(len(v) for v in prompts.values()) * (2 if args.no_llama else 4)
    rec = {"kind": "speculative", "model": model.name, "stage": stage, "threads": {}}
    t0 = time.perf_counter()
    with tqdm(total=n_runs, unit="run", desc="speculative", file=sys.stderr, dynamic_ncols=True) as bar:
        for t in threads:
            rec["threads"][str(t)] = measure_threads(args, model, stage, t, prompts, bar)
    rec["seconds"] = time.perf_counter() - t0
    rec["load_average"] = {"start": start, "end": loadavg()}
    from common.gguf import GGUFFile
    rec["model_info"] = model_summary(GGUFFile(model))
    add_context(rec, {"rounds": args.rounds, "n_predict": args.n_predict, "draft_max": args.draft_max,
                      "k_max": args.k_max, "context": args.context, "threads": threads, "quick": args.quick,
                      "sampling": "greedy", "ignore_eos": True,
                      "prompts": {k: len(v) for k, v in prompts.items()}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.part")
    tmp.write_text(json.dumps(rec, indent=1, default=float))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    for path in draw(rec, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
