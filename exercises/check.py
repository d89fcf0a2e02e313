"""Check a chapter's exercise: your function against the stage's own code, then timed beside it.

    make exercise ch=02                                   your file: exercises/02_tiling/...
    .venv/bin/python -m exercises.check 02                the same
    .venv/bin/python -m exercises.check 02 --solution reference     the stage's own code (passes)
    .venv/bin/python -m exercises.check 02 --solution path/to/other.py
    .venv/bin/python -m exercises.check --list            every exercise

--no-time stops after the cases; --quick times small shapes. Exit status 0 when every case
passes, 1 when one fails (the message says which case, where and by how much), 2 for a chapter
with no exercise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import app  # noqa: E402

app.configure_numba()

from exercises import harness  # noqa: E402

CHILD_TIMEOUT_S = 180           # an isolated check (a barrier that may never return) is stopped after this


def folders() -> dict[str, Path]:
    """{'02': exercises/02_tiling, ...}: every folder with a check."""
    return {p.parent.name[:2]: p.parent for p in sorted(HERE.glob("[0-9][0-9]_*/check.py"))}


def exercise(chapter: str) -> harness.Exercise:
    """The Exercise of chapter '02' (or '2')."""
    chapter = f"{int(chapter):02d}" if str(chapter).isdigit() else str(chapter)
    found = folders()
    if chapter not in found:
        raise KeyError(f"chapter {chapter!r} has no exercise; these do: {', '.join(found)}")
    return harness.load_file(found[chapter] / "check.py").EXERCISE


def run(chapter: str, solution=None, time_it: bool = True, quick: bool = False, out=print) -> bool:
    """The check of one chapter in this process (or, for an isolated one, a child process)."""
    ex = exercise(chapter)
    if ex.isolated and not getattr(run, "inside", False):
        return _in_child(ex, chapter, solution, time_it, quick, out)
    return harness.run_check(ex, solution, time_it=time_it, quick=quick, out=out)


def _in_child(ex, chapter, solution, time_it, quick, out) -> bool:
    """Run the check in a child process with a time limit: a wrong barrier can wait forever, a
    wrong pointer in a kernel can end the process."""
    cmd = [sys.executable, "-m", "exercises.check", chapter, "--inside"]
    cmd += (["--solution", str(solution)] if solution is not None else []) + ([] if time_it else ["--no-time"])
    cmd += ["--quick"] if quick else []
    try:
        done = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        for line in text.splitlines():
            out(line)
        out(f"  FAIL  the check did not finish in {CHILD_TIMEOUT_S} s: {ex.stuck}")
        return False
    for line in done.stdout.splitlines():
        out(line)
    if done.returncode not in (0, 1):
        out(f"  FAIL  the check's process ended with status {done.returncode}:")
        for line in done.stderr.strip().splitlines()[-8:]:
            out(f"        {line}")
        return False
    return done.returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapter", nargs="?", help="the chapter's number: 01 .. 14")
    ap.add_argument("--solution", help="'reference' (the stage's own code) or a file; default: your file")
    ap.add_argument("--no-time", action="store_true", help="stop after the cases")
    ap.add_argument("--quick", action="store_true", help="time small shapes (seconds)")
    ap.add_argument("--list", action="store_true", help="list the exercises")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list or not args.chapter:
        for ch, folder in folders().items():
            ex = exercise(ch)
            print(f"  {ch}  {ex.title:<64} {harness.rel(ex.starting_file)}")
        if not args.chapter:
            print("\ncheck one: make exercise ch=NN")
        return 0
    run.inside = args.inside
    try:
        ok = run(args.chapter, args.solution, time_it=not args.no_time, quick=args.quick)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
