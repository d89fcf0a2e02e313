"""The application on top of the stages, grouped by what a user does:

    cli.py, run.py, chat.py      `python -m app run | chat | stages | ...`: generate with one stage
    args.py                      the flags every command shares (stage, model, sampling) and their checks
    models.py, inspect_gguf.py   fetch a model once; look inside a GGUF file
    serve/                       the OpenAI-compatible server: HTTP, continuous batching, metrics, page
    measure/                     the one measurement harness, counters, machine, roofline, llama.cpp
    report/                      `make report`: the records drawn into charts, tables, pages, lessons
    cuda_emulator/               the cuda stage's kernels (or a learner's) on the CPU, every access checked

It imports the engine (common/) and the stages (stages/); neither imports it.

Entry points (`python -m app`, the scripts, the notebooks, the tests) call `configure_numba()`
before anything imports numba: where numba keeps its compiled kernels (numba_cache.py: saved
safely beside other processes), and the threading layers it may choose. Importing the engine or
a stage changes neither.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# OpenMP where numba has it, else its own workqueue: both give every iteration of a parallel loop
# its own thread, which the fused stage's barriers need (stages/fused.py); TBB last, where
# neither exists (that stage then says it cannot run).
THREADING_LAYERS = ("omp", "workqueue", "tbb")


def configure_numba():
    """numba's on-disk cache in .numba_cache/ (so only the first run of a stage compiles) and
    the threading layers above, unless the environment already says otherwise. Works before
    numba is imported (through its environment variables) and after (through its config).

    A CPU named for numba to compile for (NUMBA_CPU_NAME=haswell: the AVX2-only path on any x86
    machine) means that CPU's features: numba would otherwise add this machine's own (AVX-512,
    VNNI) to the name, so an empty NUMBA_CPU_FEATURES is set unless one is given.

    The cache's saves hold a lock (app/numba_cache.py): processes compiling at once would
    otherwise hand each other's machine code out."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", " ".join(THREADING_LAYERS))
    if os.environ.get("NUMBA_CPU_NAME"):
        os.environ.setdefault("NUMBA_CPU_FEATURES", "")
    if "numba" in sys.modules:
        import numba
        numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
        numba.config.THREADING_LAYER_PRIORITY = os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split()
        if os.environ.get("NUMBA_CPU_NAME"):
            numba.config.CPU_NAME = os.environ["NUMBA_CPU_NAME"]
            numba.config.CPU_FEATURES = os.environ["NUMBA_CPU_FEATURES"]
    from app.numba_cache import lock_saves
    lock_saves()                                           # imports numba, configured by now
