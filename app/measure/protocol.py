"""The measurement protocol, written once: what every benchmark (`python -m app bench NAME`,
app/measure/benchmarks.py lists them) shares. A benchmark measures one round of each of its
conditions; this module orders the rounds, takes the medians, stamps the record and writes it
(app/report/pages.py draws its page and charts from it).

    order(items, r)                 the conditions in round r: forward in even rounds, backward in odd
                                    ones (rotate=True: the first moves one place every round)
    alternating(items, rounds, one) {item: [one(item, r) for each round r]}, each round in order(...)
    median(xs)                      the median of the finite figures (nan where there is none)
    paired(a, b, names)             two conditions' rounds side by side: a ratio is taken within a round
    header(settings, command)       what every record carries beside its figures: the machine that
                                    measured it (machine.py), the code (provenance.py), when, and how
    write_record(record, path, draw)   the record as JSON (whole or not at all), then what is drawn from it
    run_child(cmd, what)            one measurement in a fresh process (its own peak RSS, page faults and
                                    JIT warm-up): the JSON object it prints last
    add_options(parser, ...)        the options benchmarks share: -m/--model, --rounds, --out

Why rounds: on a shared machine a single figure moves by tens of percent from one run to the
next. Measuring every condition once per round, in an order reversed every other round, puts a
burst of other work on several conditions alike; a ratio taken within a round cancels a drift of
the machine's speed. A page quotes medians over rounds, and ratios as the median of the rounds'
ratios.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import statistics
import subprocess
import time
from pathlib import Path

from app import ROOT
from app.measure.machine import machine_info
from app.measure.provenance import provenance
from app.models import DEFAULT_MODEL

BENCH_DIR = ROOT / "profiles" / "bench"         # the benchmarks' records, each beside its page


def order(items, r: int, rotate: bool = False) -> list:
    """The conditions in round r (counted from 0): forward in even rounds, backward in odd ones;
    rotate: the one that goes first moves one place every round (several conditions, none
    always last)."""
    items = list(items)
    if rotate:
        k = r % len(items) if items else 0
        return items[k:] + items[:k]
    return items if r % 2 == 0 else items[::-1]


def alternating(items, rounds: int, one, rotate: bool = False) -> dict:
    """{item: [one(item, r) for r in range(rounds)]}: every item measured once a round, the
    rounds in order(items, r, rotate)."""
    out = {item: [] for item in items}
    for r in range(rounds):
        for item in order(items, r, rotate):
            out[item].append(one(item, r))
    return out


def median(xs) -> float:
    """The median of the finite numbers in xs; nan where there is none (a figure not measured)."""
    xs = [float(x) for x in xs if isinstance(x, numbers.Real) and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def paired(a: list, b: list, names: tuple[str, str]) -> list[tuple]:
    """The rounds of two conditions (named `names`) side by side. A ratio is taken within a round,
    so both need every round: one missing would pair the rest out of step (zip would drop it
    without a word)."""
    if len(a) != len(b):
        raise ValueError(f"{names[0]} has {len(a)} rounds and {names[1]} {len(b)}: the ratios pair them round by "
                         f"round, so both need every round (measure them again)")
    return list(zip(a, b))


def header(settings: dict | None = None, command: str | None = None) -> dict:
    """What every record carries beside its figures: machine, code (commit, uncommitted changes,
    code hash), time, and where given the settings and the command that measured it."""
    out = {"machine": machine_info(), "provenance": provenance(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if settings is not None:
        out["settings"] = settings
    if command is not None:
        out["command"] = command
    return out


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work's share of the cores, as a reader checks."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def shown(path: Path) -> str:
    """A record's path as a page names it: relative to the repository where it is inside it."""
    path = Path(path)
    return path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else str(path)


def write_record(record: dict, path: Path, draw=None) -> list[Path]:
    """The record written to `path` as JSON (through a temporary file: a record is whole or not
    there), then draw(record, path) where given (app/report/pages.py's draw: its page and
    charts). Returns the files written, the record first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record, indent=1, default=float) + "\n")
    os.replace(part, path)
    return [path, *(draw(record, path) if draw else [])]


def run_child(cmd: list, what: str, mark: str | None = None, timeout: float | None = None) -> dict:
    """Run one measurement in a fresh process (from the repository root) and return the JSON
    object it prints on its last line (mark: on its last line that starts with it). A failure
    raises RuntimeError with the command's last words."""
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if mark is None or ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(mark or ""):])


def add_options(p, rounds: int | None = None, out: Path | None = None, model: bool = True):
    """The options benchmarks share, each spelled and explained once: -m/--model, --rounds (where
    given: its default), --out (where given: the record's default path)."""
    if model:
        p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path),
                       help="GGUF file or model name (default: the default model)")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds (default: %(default)s)")
    if out is not None:
        p.add_argument("--out", type=Path, default=out, help=f"the record (default: {shown(out)})")
