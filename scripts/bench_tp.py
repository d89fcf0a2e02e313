"""What splitting a model across ranks costs: the tp stage as N MPI ranks of one thread each
against the stage it builds on in one process with N threads (app/measure/tp_bench.py says how).

    python scripts/bench_tp.py                                  # SmolLM2 and the synthetic TinyLlama
    python scripts/bench_tp.py --model smollm2 --rounds 1 -n 8  # a quick look
    python scripts/bench_tp.py --chart-only                     # redraw the pages and charts

Each condition runs in fresh processes (`mpiexec -n N` for tp), rounds in alternating order.
Where network namespaces can be made (root, Linux: app/netns.py), tp at 2 ranks also runs across
a link, one rank in each of two namespaces joined by a veth pair (--link no leaves it out).
Writes profiles/bench/tp_<model>.json, the page drawn from it (.md) and its chart (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import app  # noqa: E402

app.configure_numba()

from tqdm import tqdm  # noqa: E402

from app import netns  # noqa: E402
from app.measure import tp_bench  # noqa: E402
from app.measure.machine import machine_info  # noqa: E402
from app.measure.provenance import provenance  # noqa: E402
from app.models import MODELS, resolve  # noqa: E402
from app.report.pages import redraw_pages  # noqa: E402
from stages import info  # noqa: E402

OUT = ROOT / "profiles" / "bench"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MARK = "TP_RESULT "
RUN_TIMEOUT_S = 1800


def record_path(model: str) -> Path:
    name = model if model in MODELS else Path(model).stem
    return OUT / f"tp_{name}.json"


LINK = "veth"              # the link between the two namespaces, as the page names it
LINK_HOW = ("in two network namespaces joined by a veth pair, one rank in each (app/netns.py): MPICH's UCX over "
            "TCP through the kernel's network stack, a link whose latency is the stack's, with no wire")


def run_condition(stage: str, n: int, model: Path, args, hosts=None) -> dict:
    """One condition in fresh processes: the worker's result (rank 0's line on stdout). hosts:
    app.netns.TwoHosts, to run tp's ranks across its link."""
    threads = 1 if stage == "tp" else n
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", stage, "--threads", str(threads),
           "--model", str(model), "--prompt-tokens", str(args.prompt_tokens), "-n", str(args.n_predict)]
    if args.ctx_size:
        cmd += ["--ctx-size", str(args.ctx_size)]
    if stage == "tp":
        launch = [*hosts.mpiexec(), "-f", str(hosts.hosts)] if hosts else [str(MPIEXEC)]
        cmd = [*launch, "-n", str(n)] + cmd
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    run = json.loads(lines[-1][len(MARK):])
    if hosts:
        run["link"] = LINK
    return run


def linked(args) -> bool:
    """Whether tp at 2 ranks also runs across the namespaces' link (--link; auto: where they can be made)."""
    if args.link == "no" or 2 not in args.ranks:
        return False
    why = netns.missing()
    if why and args.link == "yes":
        raise SystemExit(f"--link yes: {why}")
    if why:
        print(f"tp across a link left out: {why}", file=sys.stderr)
    return why is None


def measure(model: str, args) -> Path:
    path = resolve(model)
    base = info("tp").builds_on
    conds = [(base, n, False) for n in args.ranks] + [("tp", n, False) for n in args.ranks]
    conds += [("tp", 2, True)] if linked(args) else []
    runs = []
    bar = tqdm(total=len(conds) * args.rounds, desc=f"tp bench {path.name}", unit="run")
    with tempfile.TemporaryDirectory() as folder, \
            (netns.TwoHosts(folder, f"llm-tp-bench-{os.getpid()}") if any(c[2] for c in conds) else nullcontext()) \
            as hosts:
        for rnd in range(args.rounds):
            for stage, n, link in (conds if rnd % 2 == 0 else conds[::-1]):
                bar.set_postfix_str(f"round {rnd + 1}: {stage} {n}{' ' + LINK if link else ''}")
                run = run_condition(stage, n, path, args, hosts if link else None)
                run["round"] = rnd
                runs.append(run)
                bar.update(1)
    bar.close()
    record = {"kind": "tp", "model": path.name, "base_stage": base, "runs": runs,
              "settings": {"prompt_tokens": args.prompt_tokens, "n_predict": args.n_predict, "rounds": args.rounds,
                           "ranks": args.ranks, "ctx_size": args.ctx_size},
              "link": {"name": LINK, "how": LINK_HOW} if any(c[2] for c in conds) else None,
              "network": {"latency_us_assumed": args.latency_us, "links_gbit": list(tp_bench.LINKS_GBIT)},
              "machine": machine_info(), "provenance": provenance(),
              "command": "python scripts/bench_tp.py " + " ".join(sys.argv[1:]),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = record_path(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out


def draw(out: Path):
    tp_bench.chart(json.loads(out.read_text()), out.with_suffix(".png"))


def worker(args) -> int:
    result = tp_bench.run_worker(args.worker, resolve(args.model), args.threads, args.prompt_tokens, args.n_predict,
                                 args.ctx_size)
    if result is not None:
        print(MARK + json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="model name or path (repeatable; default: smollm2, "
                                                    "tinyllama-synthetic)")
    p.add_argument("--ranks", default="1,2", help="rank counts N, comma-separated (default: %(default)s): tp with N "
                                                  "ranks, the base stage with N threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds, in alternating order (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens generated (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context (default: the model's, at most 2048)")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="a network round trip the page assumes for the projection across machines (default: "
                        "%(default)s us; an assumption, recorded as one)")
    p.add_argument("--link", choices=("auto", "yes", "no"), default="auto",
                   help="tp at 2 ranks also across two network namespaces joined by a veth pair (root; default: "
                        "%(default)s, where they can be made)")
    p.add_argument("--chart-only", action="store_true", help="redraw the pages and charts from the records")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if len(args.model or []) != 1:
            p.error("--worker takes one --model")
        args.model = args.model[0]
        return worker(args)
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",")})
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: give rank counts such as 1,2")
    if min(args.ranks) < 1 or args.rounds < 1 or args.n_predict < 2 or args.prompt_tokens < 1:
        p.error("--ranks >= 1, --rounds >= 1, -n >= 2 and --prompt-tokens >= 1")
    outs = [record_path(m) for m in (args.model or ["smollm2", "tinyllama-synthetic"])] if args.chart_only else \
        [measure(m, args) for m in (args.model or ["smollm2", "tinyllama-synthetic"])]
    redraw_pages(OUT)
    for out in outs:
        draw(out)
        print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
