"""`python -m app compile`: the CPU stages' (and variants') kernels compiled now, into numba's on-disk cache
(NUMBA_CACHE_DIR; the Makefile sets .numba_cache), several stages at a time, each in its own
process.

numba compiles a kernel the first time it is called with new argument types, on one core, and
writes the result to disk; a later process loads it instead. The layer stacks of the fused,
repack and prefill stages are the slowest to compile (each job's seconds are printed). A run that
meets them one by one (the test suite, a notebook) compiles them one after another on one core;
this compiles them side by side, one stage per core, and `make test` runs it first.

Each stage runs what its callers run: a prompt and a few decode steps (the single-sequence
path, `generate`), then two sequences through the engine loop, one prompt in chunks beside the
other's decode (the batched path the server takes).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from app.models import resolve

PROMPTS = ("The quick brown fox jumps over the lazy dog. Then it", "Once upon a time")
# Started first, in this order: the three layer stacks (repack's two, one per K/V type, then prefill's
# and fused's: each stage's stack is its own compile, stages/kernels/layer_stack.py's with_steps),
# then threads before int8, whose kernels build on threads' (run side by side, both would compile
# them).
SLOWEST = ("repack", "prefill", "fused", "threads", "int8")
STEPS = 3             # decode steps: one is enough to compile; a few go through the same code again


def exercise(stage: str, model) -> None:
    """Compile what a stage's single-sequence and batched paths call, by calling them, for
    each K/V type the stage stores (kv_types)."""
    before = os.environ.get("LLM_KV_TYPE")
    try:
        for kv in kv_types(stage):
            if kv is not None:
                os.environ["LLM_KV_TYPE"] = kv
            _exercise(stage, model)
    finally:
        if before is None:
            os.environ.pop("LLM_KV_TYPE", None)
        else:
            os.environ["LLM_KV_TYPE"] = before


def kv_types(stage: str) -> tuple:
    """The K/V types a stage's backend takes (its module's KV_TYPES, chosen by LLM_KV_TYPE):
    repack's float16 and float32 are two layer stacks to numba (chapter 10 runs both); (None,)
    for a stage with one."""
    from stages import backend_class
    return tuple(getattr(importlib.import_module(backend_class(stage).__module__), "KV_TYPES", (None,)))


def _exercise(stage: str, model) -> None:
    from app.serve.engine_loop import EngineLoop
    from app.serve.sequence import Ask, Sequence
    from common.generate import generate
    from stages import info, load

    engine = load(stage, model)
    generate(engine, engine.tokenizer.encode(PROMPTS[1]), STEPS)
    if not info(stage).kv_cache:
        return                         # a stage that recomputes keeps no pages: no batched path
    loop = EngineLoop(engine, kv_pages=16, prefill_chunk=5)
    for text in PROMPTS:
        loop.submit(Sequence(Ask(engine.tokenizer.encode(text), STEPS)))
    while not loop.scheduler.idle:
        loop.step()


def compile_jobs() -> list[str]:
    """The jobs: the CPU stages that run here, each with its variants (they share most of its
    kernels, which one process then compiles once), as comma-separated names; the slowest to
    compile first (SLOWEST; so the last to finish is a short one)."""
    from stages import STAGES, VARIANTS, info, unavailable_reason
    cpu = [s for s in STAGES if s != "cuda" and unavailable_reason(s) is None]
    jobs = {s: [s] + [v for v in VARIANTS if info(v).variant_of == s and unavailable_reason(v) is None]
            for s in cpu}
    return [",".join(jobs[s]) for s in in_compile_order(cpu)]


def in_compile_order(stages: list[str]) -> list[str]:
    """The stages in the order their jobs start: SLOWEST's first, in its order, then the rest."""
    return [s for s in SLOWEST if s in stages] + [s for s in stages if s not in SLOWEST]


def compile_all(jobs: list[str], model: str, at_once: int) -> int:
    """Each job (comma-separated stages) in a process of its own (`compile --one`), `at_once`
    at a time; prints a line per job, in the jobs' order. Returns the number that failed."""
    def one(job):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "app", "compile", "--one", job, "-m", model],
                              capture_output=True, text=True)
        return job, proc, time.perf_counter() - t0

    failed = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        for job, proc, seconds in pool.map(one, jobs):
            if proc.returncode:
                failed += 1
                print(f"  {job:<16} failed ({proc.returncode}):\n{proc.stderr.strip()}", file=sys.stderr)
            else:
                print(f"  {job:<16} {seconds:6.1f} s")
    print(f"compiled {len(jobs) - failed} of {len(jobs)} jobs in {time.perf_counter() - t0:.1f} s "
          f"({at_once} at a time; cache: {os.environ.get('NUMBA_CACHE_DIR', 'next to the sources')})")
    return failed


def _cmd_compile(args):
    model = str(resolve(args.model))
    if args.one:
        for stage in args.one.split(","):
            exercise(stage, model)
        return
    jobs = args.stages.split(",") if args.stages else compile_jobs()
    if compile_all(jobs, model, max(1, args.jobs)):
        raise SystemExit(1)


def add_commands(sub):
    from app.measure.machine import physical_cores
    s = sub.add_parser("compile", help="compile every CPU stage's kernels into numba's disk cache, in parallel",
                       description="Compile the CPU stages' kernels now, one stage per process, JOBS at a time, "
                                   "into numba's on-disk cache (NUMBA_CACHE_DIR), so that later runs load them "
                                   "instead of compiling them one after another on one core.")
    s.add_argument("-m", "--model", default=None, help="the GGUF file whose shapes to run (default: the default model)")
    s.add_argument("--stages", default=None, help="comma-separated stages, one process each "
                        "(default: every CPU stage that runs here, its variants in its process)")
    s.add_argument("--jobs", type=int, default=physical_cores(),
                   help="stages compiled at once (default: the physical cores)")
    s.add_argument("--one", default=None, metavar="STAGE", help=argparse.SUPPRESS)    # the worker: one job
    s.set_defaults(func=_cmd_compile)

