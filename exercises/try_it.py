"""A chapter's "Try it" experiments: turn one knob, predict first, then measure.

    make try-it ch=02                     every experiment of chapter 02
    make try-it ch=02 exp=tile_k          one of them
    .venv/bin/python -m exercises.try_it 02 tile_k [--quick]
    .venv/bin/python -m exercises.try_it --list

Each experiment (a function of exercises/NN_name/experiments.py, marked @experiment) names its
knob (a constant, a flag, an environment variable), and its docstring is the chapter's prediction
(from the chapter's own model: bytes, multiply-adds, the floor), printed BEFORE it measures; then
it measures on this machine and prints a small table. The result lands on the screen and in
build/try_it/NN_name.json (this machine's id and the settings beside the figures; build/ is not
committed: your figures are yours). --quick runs the same code at small settings (the test suite
runs every experiment so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import app  # noqa: E402

app.configure_numba()

from exercises import harness  # noqa: E402
from exercises.harness import engine, step_ms  # noqa: E402,F401  (the experiments import them from here)

RESULTS = HERE.parent / "build" / "try_it"


@dataclass
class Experiment:
    """name: how the command names it; knob: what is turned, and where it lives in the code;
    predict: the chapter's prediction, written before anything is measured; run(quick) -> the
    measured rows [(label, value, unit)] and, optionally, 'note': what to compare."""
    name: str
    knob: str
    predict: str
    run: Callable[[bool], dict]
    model: bool = False                 # needs the default model (make model fetches it)


def experiment(knob: str, model: bool = False):
    """Marks the function below as one of its chapter's experiments, named after it: `knob`, what
    it turns and where that lives in the code; its docstring, the chapter's prediction, written
    before anything is measured; `model`, it runs the default model."""
    def mark(run: Callable[[bool], dict]):
        if not run.__doc__:
            raise ValueError(f"experiment {run.__name__}: its docstring is the prediction, and it has none")
        run.experiment = Experiment(run.__name__, knob, " ".join(run.__doc__.split()), run, model)
        return run
    return mark


def chapters() -> dict[str, Path]:
    return {p.parent.name[:2]: p.parent for p in sorted(HERE.glob("[0-9][0-9]_*/experiments.py"))}


def experiments(chapter: str) -> tuple[Path, list[Experiment]]:
    chapter = f"{int(chapter):02d}" if str(chapter).isdigit() else str(chapter)
    found = chapters()
    if chapter not in found:
        raise KeyError(f"chapter {chapter!r} has no experiments; these do: {', '.join(found)}")
    module = harness.load_file(found[chapter] / "experiments.py")
    return found[chapter], [f.experiment for f in vars(module).values()          # in the order written
                            if getattr(f, "__module__", None) == module.__name__ and hasattr(f, "experiment")]


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def run(chapter: str, name: str | None = None, quick: bool = False, out=print, results_dir: Path = RESULTS) -> list:
    """Run one chapter's experiments (or the one named): print each prediction, then measure and
    print, and write build/try_it/<folder>.json. Returns the records."""
    from app.measure.machine import machine_id
    folder, exps = experiments(chapter)
    if name is not None:
        exps = [e for e in exps if e.name == name]
        if not exps:
            raise KeyError(f"chapter {chapter} has no experiment {name!r}: "
                           f"{', '.join(e.name for e in experiments(chapter)[1])}")
    records = []
    for e in exps:
        out(f"== {folder.name} · {e.name}")
        out(f"knob:     {e.knob}")
        out(f"predict:  {e.predict}")
        out("          (write your own guess down before the numbers come)")
        t0 = time.perf_counter()
        result = e.run(quick)
        rows = result["rows"]
        for label, value, unit in rows:
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{folder.name} · {e.name}: {label} measured {value!r}, not a number")
        width = max(len(r[0]) for r in rows)
        out("measured:")
        for label, value, unit in rows:
            out(f"  {label:<{width}}  {_value(value):>10} {unit}")
        if result.get("note"):
            out(f"so:       {result['note']}")
        records.append({"experiment": e.name, "knob": e.knob, "prediction": e.predict,
                        "rows": [{"label": a, "value": b, "unit": c} for a, b, c in rows],
                        "note": result.get("note", ""), "seconds": time.perf_counter() - t0})
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{folder.name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    kept = {r["experiment"]: r for r in previous.get("experiments", [])} if previous.get("machine") == machine_id() \
        else {}
    kept.update({r["experiment"]: r for r in records})
    path.write_text(json.dumps({"chapter": folder.name, "machine": machine_id(), "quick": quick,
                                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                "experiments": list(kept.values())}, indent=1) + "\n")
    out(f"written: {harness.rel(path)}")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapter", nargs="?")
    ap.add_argument("name", nargs="?", help="one experiment (default: all of the chapter's)")
    ap.add_argument("--quick", action="store_true", help="small settings: seconds")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list or not args.chapter:
        for ch in chapters():
            folder, exps = experiments(ch)
            for e in exps:
                print(f"  {ch} {e.name:<18} {e.knob}")
        return 0
    try:
        run(args.chapter, args.name, args.quick)
    except (KeyError, FileNotFoundError) as e:
        print(e.args[0] if isinstance(e, KeyError) else e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
