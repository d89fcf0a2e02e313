"""What every exercise's check shares: loading a solution, comparing it with the stage's own code,
saying what failed and by how much, and timing it beside the stage and the stage before it.

A check (exercises/NN_name/check.py) is an `Exercise`: which functions the learner writes, each
beside the stage's own code adapted to the same signature (`reference`: the reference is imported,
never copied), the cases (random inputs of awkward shapes, drawn from a generator seeded by the
chapter's number: odd sizes, partial tiles, a block's edge), how one case is judged (`judge`), and
what is timed once every case passes (`timings`). `run_check` runs them in that order, as llm.c's
dev/cuda harness does: validate against the reference first, time only what is right.

Tolerances are derived, never measured: two float32 sums of the same n products, added in
different orders, each lie within gamma_n = n u / (1 - n u) (u = 2^-24) of the exact sum times the
sum of the products' magnitudes, so they differ by at most twice that (`sum_bound`). Integer
results (int8 blocks, bytes, plans, token ids) must be equal.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from numba.core.errors import NumbaPerformanceWarning
from numba.core.registry import CPUDispatcher

ROOT = Path(__file__).resolve().parent.parent
U = 2.0 ** -24                      # float32's unit roundoff


class Unwritten(Exception):
    """A solution that cannot be run: it lacks the functions the exercise asks for, or (a kernel in
    C) does not build."""


# ---- solutions -----------------------------------------------------------------------------------

def load_file(path: Path) -> SimpleNamespace:
    """The module at `path` (a learner's file, a test's alternative), imported under a name of its
    own so that two files defining the same function do not collide."""
    path = Path(path).resolve()
    try:
        rel = path.relative_to(ROOT).with_suffix("")
        name = "_".join(rel.parts)
    except ValueError:
        name = path.stem
    name = "solution_" + "".join(c if c.isalnum() else "_" for c in name)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise Unwritten(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                  # numba's cache and dataclasses look modules up by name
    spec.loader.exec_module(module)
    return module


def rel(path) -> str:
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def as_kernel(fn, **flags):
    """A learner's function as numba compiles it: itself if it is already @njit, else njit(fn)
    with the flags the stage's kernel uses (a plain Python loop would take minutes at the model's
    shapes)."""
    return fn if isinstance(fn, CPUDispatcher) else __import__("numba").njit(**flags)(fn)


def kernel_flags(kernel) -> dict:
    """The flags a numba kernel was compiled with that change what it computes or how it runs
    (fastmath, parallel): what a learner's version of it is compiled with."""
    return {k: v for k, v in kernel.targetoptions.items() if k in ("fastmath", "parallel")}


# ---- comparing -------------------------------------------------------------------------------------

def gamma(n: int) -> float:
    """The classic bound on the relative error of a float32 sum of n terms (Higham, eq. 3.4)."""
    return n * U / (1 - n * U)


def sum_bound(magnitudes, n: int):
    """How far two float32 sums of the same n products (any order, with or without fused
    multiply-adds) may lie apart: each within gamma_n times the sum of the products' magnitudes
    of the exact value, so 2 gamma_n apart at most. `magnitudes`: the sum of |products|, float64."""
    return 2.0 * gamma(n) * np.asarray(magnitudes, dtype=np.float64)


def _where(index) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def close(what: str, got, want, bound) -> str | None:
    """None if |got - want| <= bound everywhere (bound: a number or an array like want), else where
    the worst value is, by how much, and how many are over."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, want {want.shape}"
    if not np.all(np.isfinite(got)):
        i = np.unravel_index(np.flatnonzero(~np.isfinite(got))[0], got.shape)
        return f"{what}{_where(i)} is {got[i]} (NaN or infinite); want {want[i]:.6g}"
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), diff.shape)
    over = diff > bound
    if not over.any():
        return None
    i = np.unravel_index(np.argmax(np.where(over, diff / np.maximum(bound, 1e-300), -1)), diff.shape)
    return (f"{what}{_where(i)}: got {got[i]:.7g}, want {want[i]:.7g}, |diff| {diff[i]:.3g} > bound {bound[i]:.3g} "
            f"({int(over.sum())} of {over.size} values over)")


def worst_ratio(got, want, bound) -> str:
    """'max |diff| D (bound B)' for a passing case: how close it came."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), diff.shape)
    i = np.unravel_index(np.argmax(diff), diff.shape) if diff.size else ()
    return f"max |diff| {diff[i]:.2g} (bound there {bound[i]:.2g})" if diff.size else "empty"


def exact(what: str, got, want) -> str | None:
    """None if got equals want value for value (integers, bytes, bits), else the first difference."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, want {want.shape}"
    if got.dtype != want.dtype and not (got.dtype.kind in "iub" and want.dtype.kind in "iub"):
        return f"{what}: dtype {got.dtype}, want {want.dtype}"
    same = (got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else got == want
    if np.all(same):
        return None
    i = np.unravel_index(np.flatnonzero(~same)[0], got.shape)
    return f"{what}{_where(i)}: got {got[i]!r}, want {want[i]!r} ({int((~same).sum())} of {same.size} differ)"


def same_bytes(got, want: np.ndarray, sizes: str, where, dtype_hint: str = "") -> tuple[str | None, str]:
    """A layout the learner wrote (uint8 bytes) against the stage's, byte for byte: (the failure or
    None, a note on a pass). `sizes`: how the right length is made up, said when the length is
    wrong; `where(offset)`: the first wrong byte in words (its group, block, field, row)."""
    got = np.asarray(got)
    if got.dtype != np.uint8:
        return f"the result is {got.dtype}: return uint8 bytes{dtype_hint}", ""
    got = got.reshape(-1)
    if got.size != want.size:
        return f"{got.size} bytes, want {want.size} = {sizes}", ""
    diff = np.flatnonzero(got != want)
    if diff.size:
        o = int(diff[0])
        return f"byte {o}: got {got[o]}, want {want[o]} ({where(o)}); {diff.size} of {want.size} bytes differ", ""
    return None, f"{want.size} bytes, every one equal"


# ---- timing ----------------------------------------------------------------------------------------

def best_seconds(fn, reps: int = 5, warm: bool = True) -> float:
    """The fastest of `reps` calls (the first call compiles or warms the caches and is not counted):
    the least noisy figure on a shared machine."""
    if warm:
        fn()
    best = math.inf
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Timing:
    """One row of a check's timing table. `who`: 'yours', 'stage', 'previous' (the stage this
    lesson builds on: the others are compared with it) or 'other' (shown for scale); `work`:
    what the seconds bought, as (amount, unit), e.g. (flops, 'GFLOP/s')."""
    label: str
    seconds: float
    who: str
    work: tuple | None = None
    unit: str = "ms"                # how the seconds print: 'ms', 'us' (per call), or 'steps' (a count)


# ---- a check -----------------------------------------------------------------------------------------

@dataclass
class Case:
    """One judged input: `name` says what is awkward about it (it is what a failure prints)."""
    name: str
    inputs: dict = field(default_factory=dict)


class Exercise:
    """The common shape of a check (see the module docstring). Subclasses set the class fields and
    write cases(), judge() and timings()."""

    chapter = "00"
    title = ""                       # what the learner writes, in a few words
    folder = ""                      # exercises/NN_name
    file = ""                        # the starting file in that folder
    reference: dict = {}             # {each function (or class) the learner writes: the stage's own code}
    reference_code = ""              # where the stage's own code is: 'stages/tiling.py: make_tiled_matmul'
    timing_note = ""                 # what the timing table measures
    baseline = "the previous stage"  # what the 'previous' row of the timing table is
    isolated = False                 # run the whole check in a child process (a barrier that hangs, a kernel crash)
    stuck = "a loop that never ends"  # what an isolated check that does not finish most likely means

    @property
    def starting_file(self) -> Path:
        return ROOT / self.folder / self.file

    @property
    def names(self) -> tuple:
        """The functions (or classes) the learner writes."""
        return tuple(self.reference)

    def load(self, path: Path) -> SimpleNamespace:
        """The solution in the file at `path`, with the functions the exercise asks for (a Python
        module by default; an exercise in another language builds and wraps its file here, raising
        Unwritten with what is wrong)."""
        return load_file(path)

    def untimed(self) -> str | None:
        """None where this machine can time the exercise, else why not (the timing is then skipped
        and the reason printed)."""
        return None

    def prepare(self, solution: SimpleNamespace) -> SimpleNamespace:
        """The solution's functions as the check calls them: where the stage's own is a numba kernel,
        compiled with its flags (kernel_flags); else as given."""
        return SimpleNamespace(**{name: as_kernel(getattr(solution, name), **kernel_flags(stage))
                                  if isinstance(stage, CPUDispatcher) else getattr(solution, name)
                                  for name, stage in self.reference.items()})

    def cases(self, rng: np.random.Generator, quick: bool) -> list[Case]:
        """The judged inputs, drawn from `rng` (cases_of seeds it)."""
        raise NotImplementedError

    def judge(self, sol, case: Case) -> tuple[str | None, str]:
        """(a failure message or None, a note on a pass such as how close it came)."""
        raise NotImplementedError

    def timings(self, sol, quick: bool) -> list[Timing]:
        raise NotImplementedError


def cases_of(ex: Exercise, quick: bool) -> list[Case]:
    """The exercise's cases, drawn from a generator seeded by its chapter's number: the same
    inputs every run."""
    return ex.cases(np.random.default_rng(int(ex.chapter)), quick)


def solution_for(ex: Exercise, which) -> tuple[SimpleNamespace, str]:
    """`which`: 'reference' (the stage's own code), None (the learner's file) or a path."""
    if which == "reference":
        return SimpleNamespace(**ex.reference), f"the stage's own code ({ex.reference_code})"
    path = ex.starting_file if which is None else Path(which)
    if not path.exists():
        raise Unwritten(f"{path} does not exist")
    module = ex.load(path)
    missing = [n for n in ex.names if not hasattr(module, n)]
    if missing:
        raise Unwritten(f"{rel(path)} has no {', '.join(missing)}: the exercise asks for "
                        f"{', '.join(ex.names)} (see the starting file {rel(ex.starting_file)})")
    found = SimpleNamespace(**{n: getattr(module, n) for n in ex.names})
    found.load_notes = getattr(module, "load_notes", ())         # what loading it took (a build), said once
    return found, rel(path)


def _raised(e: BaseException, origin: str = "") -> str:
    """What an exception in the solution says to its author: where in their file it came from."""
    if isinstance(e, NotImplementedError):
        return (f"it raised NotImplementedError({str(e)!r}): the function is not written yet "
                f"(the starting file raises this until you replace the `raise` with your code)")
    tb = traceback.extract_tb(e.__traceback__)
    theirs = [f for f in tb if origin and rel(f.filename) == origin]
    where = f" (at {origin}:{theirs[-1].lineno}: {theirs[-1].line})" if theirs else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"it raised {type(e).__name__}: {first}{where}"


def run_check(ex: Exercise, which=None, time_it: bool = True, quick: bool = False, out=print) -> bool:
    """Judge every case in order, stop at the first failure; then, if all pass and time_it, the
    timing table. Prints as it goes; True if every case passed."""
    out(f"Chapter {ex.chapter} · {ex.title}")
    try:
        raw, origin = solution_for(ex, which)
    except Unwritten as e:
        for i, line in enumerate(str(e).splitlines()):          # a compiler's errors run over several lines
            out(("  FAIL  " if i == 0 else "        ") + line)
        return False
    except Exception as e:                          # a syntax error in the learner's file, an import
        out(f"  FAIL  loading the solution: {_raised(e)}")
        return False
    out(f"  checking:   {origin}")
    for note in getattr(raw, "load_notes", ()):
        out(f"              {note}")
    out(f"  reference:  {ex.reference_code}")
    sol = raw if which == "reference" else ex.prepare(raw)     # the stage's code runs as it is
    cases = cases_of(ex, quick)
    out(f"Correctness: {len(cases)} cases, seeded (the same inputs every run)")
    width = max(len(c.name) for c in cases)
    for case in cases:
        try:
            with warnings.catch_warnings():         # 'parallel=True but no prange' while a function is unwritten
                warnings.simplefilter("ignore", NumbaPerformanceWarning)
                failure, note = ex.judge(sol, case)
        except Exception as e:
            failure, note = _raised(e, origin), ""
        if failure:
            out(f"  FAIL  {case.name}")
            for line in failure.splitlines():
                out(f"        {line}")
            out(f"Stopped at the first failing case. Fix it and run the check again: make exercise ch={ex.chapter}")
            return False
        out(f"  ok    {case.name:<{width}}  {note}")
    out(f"All {len(cases)} cases match the stage's own code.")
    if time_it and ex.untimed():
        for i, line in enumerate(ex.untimed().splitlines()):
            out(("Not timed: " if i == 0 else "  ") + line)
    elif time_it:
        show_timings(ex, ex.timings(sol, quick), out)
    return True


def show_timings(ex: Exercise, rows: list[Timing], out=print):
    """The table: each row's time, its rate, and how many times faster than the previous stage."""
    if all(r.unit == "steps" for r in rows):
        out(f"Counted ({ex.timing_note}):")
    else:
        out(f"Timing ({ex.timing_note}; the best of several runs; other programs on this machine add noise):")
    prev = next((r for r in rows if r.who == "previous"), None)
    width = max(len(r.label) for r in rows)
    for r in rows:
        if r.unit == "steps":
            shown = f"{r.seconds:8.0f} steps"
        elif r.unit == "us":
            shown = f"{r.seconds * 1e6:8.2f} us"
        elif r.seconds < 1e-3:
            shown = f"{r.seconds * 1e6:8.1f} us"
        else:
            shown = f"{r.seconds * 1e3:8.2f} ms"
        rate = f"  {r.work[0] / r.seconds / 1e9:7.2f} {r.work[1]}" if r.work and r.seconds > 0 else ""
        speed = ""
        if prev is not None and r.who in ("yours", "stage") and r.seconds > 0:
            speed = f"  {prev.seconds / r.seconds:5.2f}x {ex.baseline}"
        out(f"  {r.label:<{width}}  {shown}{rate}{speed}")


def median(xs):
    return statistics.median(xs)


EXP_ULPS = 8    # exp's error in float32 ulp: libm's is under 1, the stages' polynomial under 7
                # (tests/test_fused.py holds fast_exp within 4e-7 relative)


def attention_bound(q, k, v, scale: float) -> float:
    """How far two float32 computations of one softmax(q k^T scale) v may lie apart, for queries
    q [R, hd] against keys and values k, v [T, hd] (every query seeing at most all T of them).

    Each score is a float32 sum of hd products then scaled: within (gamma_hd + u) S of exact, S the
    largest scale * sum_d |q_d k_td|; so the two computations' scores differ by delta = 2 (gamma_hd
    + u) S at most, which moves each probability by a factor within e^(+-2 delta), and the output,
    a convex combination of value rows, by (e^(2 delta) - 1) max|v|. On top, each computation
    rounds its own exps (EXP_ULPS), its sum of T of them (gamma_T), its division, and its weighted
    sum of T value rows (gamma_T+1): another 2 (gamma_T+1 + gamma_T + (EXP_ULPS + 2) u) max|v|."""
    q64, k64 = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k, np.float64))
    T, hd = k64.shape
    S = float(scale) * float((q64 @ k64.T).max()) if T else 0.0
    delta = 2 * (gamma(hd) + U) * S
    vmax = float(np.abs(v).max()) if T else 0.0
    return vmax * (math.expm1(2 * delta) + 2 * (gamma(T + 1) + gamma(T) + (EXP_ULPS + 2) * U))


# ---- the default model, for the checks and experiments that run it ---------------------------------

@functools.cache
def engine(stage: str, n_ctx: int | None = None, **env):
    """A stage loaded on the default model, warmed up; one per (stage, settings) per process.
    Raises FileNotFoundError naming `make model` when the model is not there."""
    import os

    from app.models import DEFAULT_MODEL
    from stages import load
    if not DEFAULT_MODEL.path.exists():
        raise FileNotFoundError(f"this experiment runs the default model, {rel(DEFAULT_MODEL.path)}, which is "
                                "not there: `make model` fetches it")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        model = load(stage, DEFAULT_MODEL.path, n_ctx=n_ctx)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    model.backend.warmup()
    return model


def step_ms(model, context: int, reps: int = 3) -> float:
    """One decode step's time at `context` positions: the text's first context - 1 tokens in the
    cache (or, without a cache, the whole text each time), best of reps."""
    tokens = [(i * 37) % 1000 + 100 for i in range(context)]
    if model.uses_kv_cache:
        model.reset()
        model.forward(tokens[:-1], 0, all_logits=False)
        run = lambda: model.forward(tokens[-1:], context - 1, all_logits=False)    # noqa: E731
    else:
        run = lambda: model.forward(tokens, 0, all_logits=False)                    # noqa: E731
    best = best_seconds(run, reps, warm=False)
    model.reset()
    return best * 1e3
