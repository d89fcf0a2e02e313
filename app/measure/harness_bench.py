"""The measurement harness's own assumptions, measured (timing claims are benchmarks, not tests):

    python -m app bench harness                     # both, 5 rounds each
    python -m app bench harness --only bandwidth --rounds 3 --size-mib 128

  bandwidth       the roofline's read-bandwidth probe (app/measure/roofline.py) on all cores
                  against one: N threads should never read memory slower than one (a prange
                  body that summed with a scalar loop once measured the loop, not memory, and
                  came out below one thread). Per round: GB/s on 1 thread, then on N (the order
                  alternating between rounds), and their ratio.
  extrapolation   a stage timed on a few layers and extrapolated to all of them
                  (app/measure/bench.py measure_extrapolated) against the same stage timed
                  whole, on a model small enough to time whole (tiling on the default model).
                  Per round: both, the order alternating, and extrapolated / whole for TTFT and
                  decode.

Figures are the medians over the rounds of per-round ratios, so that another process taking a
core for one run moves one round, not the verdict. Each claim's record says whether it held
against the bound the suite once asserted (bandwidth ratio >= BANDWIDTH_FLOOR; extrapolated
within EXTRAPOLATION_BAND of whole); the command exits 1 where one does not. Writes
profiles/bench/harness.json (machine, code, every round). A benchmark, not a test: minutes, on a
quiet machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from app.measure import bench, roofline
from app.measure.protocol import BENCH_DIR, add_options, alternating, header, load_average, median
from app.models import resolve
from common.cpu import physical_cores
from common.generate import ParameterError

RECORD = BENCH_DIR / "harness.json"
BANDWIDTH_FLOOR = 0.85          # N threads' GB/s over one thread's: at least this
EXTRAPOLATION_BAND = 0.3        # |extrapolated / whole - 1|: at most this
CLAIMS = ("bandwidth", "extrapolation")


def both(rounds: int, first, second) -> list[tuple]:
    """(first(), second()) per round, in alternating rounds."""
    got = alternating(("first", "second"), rounds, lambda which, r: first() if which == "first" else second())
    return list(zip(got["first"], got["second"]))


def bandwidth(rounds: int, threads: int, size_mib: int) -> dict:
    a = np.ones(size_mib * 2**20 // 4, dtype=np.float32)       # past any cache, as the report's probe
    roofline.bandwidth_gbs(a, 1, reps=1), roofline.bandwidth_gbs(a, threads, reps=1)     # compiled, not timed
    pairs = both(rounds, lambda: roofline.bandwidth_gbs(a, 1, reps=5)[0],
                 lambda: roofline.bandwidth_gbs(a, threads, reps=10)[0])
    ratios = [many / one for one, many in pairs]
    ratio = median(ratios)
    return {"threads": threads, "array_mib": size_mib,
            "rounds": [{"gbs_1": one, f"gbs_{threads}": many, "ratio": many / one} for one, many in pairs],
            "gbs_1": median(p[0] for p in pairs), f"gbs_{threads}": median(p[1] for p in pairs),
            "ratio": ratio, "bound": f"ratio >= {BANDWIDTH_FLOOR}", "holds": ratio >= BANDWIDTH_FLOOR}


def extrapolation(rounds: int, model, stage: str, prompt_tokens: int, n_predict: int) -> dict:
    from stages import load
    engine = load(stage, resolve(model))
    pairs = both(rounds, lambda: bench.measure(engine, stage, prompt_tokens, n_predict),
                 lambda: bench.measure_extrapolated(engine, stage, prompt_tokens, n_predict))
    out = {"stage": stage, "model": Path(resolve(model)).name, "prompt_tokens": prompt_tokens, "n_predict": n_predict,
           "layers_measured": pairs[0][1]["extrapolated"]["layers_measured"], "n_layer": len(engine.layers),
           "rounds": [], "holds": True, "bound": f"|extrapolated / whole - 1| <= {EXTRAPOLATION_BAND}"}
    for whole, guessed in pairs:
        out["rounds"].append({f"{key}_{kind}": rec[key] for key in ("ttft_ms", "decode_ms")
                              for kind, rec in (("whole", whole), ("extrapolated", guessed))})
    for key in ("ttft_ms", "decode_ms"):
        ratio = median(r[f"{key}_extrapolated"] / r[f"{key}_whole"] for r in out["rounds"])
        out[f"{key}_ratio"] = ratio
        out["holds"] &= abs(ratio - 1) <= EXTRAPOLATION_BAND
    return out


def add_arguments(p):
    p.add_argument("--only", choices=CLAIMS, help="measure one claim (default: both)")
    add_options(p, rounds=5, out=RECORD)
    p.add_argument("--threads", type=int, default=physical_cores(), help="N for the bandwidth claim (default: cores)")
    p.add_argument("--size-mib", type=int, default=512, help="the bandwidth probe's array (default: %(default)s MiB)")
    p.add_argument("--stage", default="tiling", help="the extrapolation's stage (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=2, help="(default: %(default)s)")


def records(args):
    for name, value in (("--rounds", args.rounds), ("--threads", args.threads), ("--size-mib", args.size_mib),
                        ("--prompt-tokens", args.prompt_tokens), ("-n", args.n_predict)):
        if value < 1:
            raise ParameterError(f"{name} = {value}: must be an integer >= 1")
    if args.threads < 2 and args.only != "extrapolation":
        raise ParameterError(f"--threads = {args.threads}: the bandwidth claim compares 1 thread with N >= 2")
    rec = {"kind": "harness", "rounds": args.rounds, "order": "alternating (forward, backward, ...)",
           "load_average_before": load_average()}
    if args.only in (None, "bandwidth"):
        print(f"bandwidth: 1 and {args.threads} threads, {args.size_mib} MiB, {args.rounds} rounds", file=sys.stderr)
        rec["bandwidth"] = bandwidth(args.rounds, args.threads, args.size_mib)
    if args.only in (None, "extrapolation"):
        print(f"extrapolation: {args.stage}, {args.rounds} rounds", file=sys.stderr)
        rec["extrapolation"] = extrapolation(args.rounds, args.model, args.stage, args.prompt_tokens, args.n_predict)
    rec.update(load_average_after=load_average(), **header(command=args.command_line))
    for claim in CLAIMS:
        if claim in rec:
            c = rec[claim]
            ratios = ", ".join(f"{k} {v:.3f}" for k, v in c.items() if k.endswith("ratio"))
            print(f"{claim}: median ratio {ratios} ({c['bound']}): {'holds' if c['holds'] else 'DOES NOT HOLD'}",
                  file=sys.stderr)
    yield args.out, rec


def failures(rec: dict) -> list[str]:
    """The claims the record says do not hold."""
    return [f"{claim}: {rec[claim]['bound']} does not hold" for claim in CLAIMS
            if claim in rec and not rec[claim]["holds"]]
