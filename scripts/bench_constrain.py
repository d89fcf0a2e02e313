"""Constrained decoding measured: what a grammar's mask costs a decode step, at batch 1 and 8.

    python scripts/bench_constrain.py                     # the stage the server batches through, all cores
    python scripts/bench_constrain.py --stage repack --threads 2 --rounds 5
    python scripts/bench_constrain.py --quick --out /tmp/constrain.json   # a check of the script, minutes
    python scripts/bench_constrain.py --page-only         # redraw the page from the record

What is measured: app/measure/constrain_bench.py. Writes profiles/bench/constrain.json (every
measurement, settings, machine, code, load average before and after) and draws
profiles/bench/constrain.md from it. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from app.measure import constrain_bench as cb  # noqa: E402
from app.measure.bench import add_context  # noqa: E402
from app.models import DEFAULT_MODEL, resolve  # noqa: E402
from app.report.pages import page_for  # noqa: E402
from app.run import chosen_stage, fastest_stage  # noqa: E402
from stages import load  # noqa: E402

RECORD = ROOT / "profiles" / "bench" / "constrain.json"


def loadavg() -> list:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def draw(record: Path) -> Path:
    page = record.with_suffix(".md")
    page.write_text(page_for(record))
    return page


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default=None, help="the stage (default: the one the server batches through, as "
                                                  "`python -m app serve` picks)")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--threads", type=int, default=None, help="threads (default: the stage's, the physical cores)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens a reply at most (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="1 round of 24-token replies: checks the script (the "
                                                        "record says so; not a measurement to quote)")
    p.add_argument("--out", type=Path, default=RECORD, help="the record (default: profiles/bench/constrain.json)")
    p.add_argument("--page-only", action="store_true", help="redraw the page from the record, measure nothing")
    args = p.parse_args(argv)
    if args.page_only:
        print(f"wrote {draw(args.out)}")
        return 0
    if args.quick:
        args.rounds, args.n_predict = 1, 24
    stage = chosen_stage(args.stage or fastest_stage(serving=True))
    model = resolve(args.model)
    before = loadavg()
    engine = load(stage, model, threads=args.threads)
    engine.warmup()
    measured = cb.measure(engine, args.rounds, args.n_predict, progress=lambda text: print(text, file=sys.stderr))
    settings = {"stage": stage, "threads": engine.backend.threads, "model": Path(model).name, "rounds": args.rounds,
                "n_predict": args.n_predict, "quick": args.quick, "batch": cb.BATCH}
    rec = {"kind": "constrain", "command": "python scripts/bench_constrain.py " + " ".join(argv or sys.argv[1:]),
           "n_vocab": engine.config.n_vocab, "load_average_before": before, **measured}
    add_context(rec, settings)
    rec["load_average_after"] = loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {args.out} and {draw(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
