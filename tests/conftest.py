"""Shared fixtures and markers for the whole test suite.

Markers:
    slow     long-running; skipped unless LLM_SLOW_TESTS=1 (`make test-all` sets it)
    gpu      needs an NVIDIA GPU and PyCUDA; skipped where there is none
    needs    needs(NAME): reads a file `make test` fetches first (FIXTURE_FILES: the default model,
             llama.cpp's vocab files); a test using the default_model_path fixture needs "model"
    timeout  (pytest-timeout) every test has one: TIMEOUT_S unless it sets its own, SLOW_TIMEOUT_S
             for slow tests; past it the run stops with every thread's stack. Compiled code that
             holds the interpreter's lock (a numba loop) keeps pytest-timeout's watchdog from
             running, so a second one in C (faulthandler) ends the run GRACE_S later: a hang
             fails instead of stalling CI

Skips are printed with their reasons (`make test` runs -rs). In CI (the environment variable
CI set, as CI services do) a skip whose reason EXPECTED_SKIPS does not describe, whole, fails:
a test that silently stops running is a check lost, so only what a machine without a GPU, the
CUDA toolkit, llama.cpp or a vector instruction cannot run may skip there. That holds for a skip
at collection too (a module-level `pytest.importorskip`: the whole module would vanish), which
fails the run there. Expected failures are strict (pyproject.toml: an xfail that passes fails),
and in CI only a strict xfail marker whose test ran and failed counts as one: `pytest.xfail()`
called inside a test, or `xfail(run=False)`, is a skip by another name.

A fixture file that is missing (`pytest tests/` without `make test`'s set-up) is one message
naming the make target: a skip with that reason outside CI, and in CI one failure, the other
tests that need it skipped behind it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
from pathlib import Path

import pytest

import app

app.configure_numba()                  # the test run is an entry point: numba's cache and threading layers

ROOT = Path(__file__).resolve().parent.parent
# A hang detector, not a speed bound: the first test to run a fused stage's batch path compiles
# its whole layer stack with a cold cache, minutes on a slow 2-core machine (it passed 300 s there)
TIMEOUT_S = int(os.environ.get("LLM_TEST_TIMEOUT", "600"))
SLOW_TIMEOUT_S = 3 * 3600 // 4
GRACE_S = int(os.environ.get("LLM_TEST_TIMEOUT_GRACE", "60"))

# reason pattern -> why a machine may legitimately skip it. A pattern describes the whole reason
# (re.fullmatch): a sentence that merely contains "this CPU" is not one of these.
EXPECTED_SKIPS = {
    r"gpu test: .+": "no NVIDIA GPU, driver or PyCUDA (every gpu-marked test says which)",
    r"nvcc not found \(the CUDA toolkit is not installed\)": "no CUDA toolkit to compile the kernels with",
    r"this machine can run the cuda stage": "the checks of the no-GPU messages, on a machine with a GPU",
    r"llama-cpp-python (is )?not installed\b.*": "llama.cpp is optional (`make baseline` installs it)",
    r"slow test: set LLM_SLOW_TESTS=1 \(or `make test-all`\) to run it": "slow tests run with `make test-all`",
    # tests/util.py decides these from LLVM's view of the CPU, not from the probe under test
    r"this CPU has no [A-Za-z0-9+, -]+ \(LLVM's host features\)(: .+)?": "vector instructions this CPU lacks",
    r"numba's target [\w+,.-]+ has no [A-Za-z0-9+, -]+ \(LLVM's features of that CPU\)(: .+)?":
        "vector instructions the CPU numba is told to compile for lacks (the AVX2-only run)",
    r"numba's target is set \(NUMBA_CPU_NAME=.*, NUMBA_CPU_FEATURES=.*\): it compiles for that, not this CPU":
        "a portable numba target (no host-only instructions)",
    r"the check reads x86 assembly; this is an? \S+ machine": "assembly checks of x86 code, on another machine",
    r"numba compiles for a CPU with VNNI, where the stage keeps repack's kernel .+":
        "the AVX2-only kernel's checks where numba compiles for VNNI (`make test-avx2` runs them for haswell)",
    r"no headless browser: .+": "Chromium and its driver are a system package (`make browser` installs them)",
    r"no matrix unit: .+": "the amx stage needs AMX tiles (Intel Xeon, 4th generation on) and Linux's permission",
    r"no network namespaces here: .+": "two hosts on one machine need Linux, root and the `ip` command "
                                       "(`make iproute2` installs it): a container may refuse them",
}


def _fixture_files() -> dict:
    """The files `make test` fetches before the suite: name -> (the file whose presence says it
    is complete, the make target that fetches it, what it is)."""
    from app.models import DEFAULT_MODEL, VOCAB_DIR
    return {"model": (DEFAULT_MODEL.path, "make model", "the default model"),
            "vocab": (VOCAB_DIR / ".complete", "make vocab", "llama.cpp's vocab-only GGUF files")}


FIXTURE_FILES = _fixture_files()
# a test using one of these fixtures needs that file (a test module may add its own NEEDS_BY_FIXTURE)
NEEDS_BY_FIXTURE = {"default_model_path": "model"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def expected_skip(reason: str) -> bool:
    return any(re.fullmatch(pattern, reason, re.S) for pattern in EXPECTED_SKIPS)


def missing_fixture_message(name: str) -> str | None:
    """None if fixture file `name` is there, else the one message that says how to get it."""
    path, target, what = FIXTURE_FILES[name]
    if path.exists():
        return None
    shown = path.parent if path.name.startswith(".") else path      # a folder's completion stamp: the folder
    try:
        shown = shown.relative_to(ROOT)
    except ValueError:
        pass
    return f"{what} ({shown}) missing: run `{target}` (`make test` fetches it before the suite)"


def needed_files(item) -> set:
    names = {name for m in item.iter_markers("needs") for name in m.args}
    by_fixture = {**NEEDS_BY_FIXTURE, **getattr(getattr(item, "module", None), "NEEDS_BY_FIXTURE", {})}
    names |= {need for fixture, need in by_fixture.items() if fixture in getattr(item, "fixturenames", ())}
    unknown = names - set(FIXTURE_FILES)
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: needs({', '.join(sorted(unknown))}): "
                                f"tests/conftest.py FIXTURE_FILES knows {', '.join(FIXTURE_FILES)}")
    return names


def _gpu_missing_reason() -> str | None:
    """None if the cuda stage can run here, else why not (PyCUDA, driver, GPU, nvcc)."""
    from stages.cuda import CudaBackend
    return CudaBackend.unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LLM_SLOW_TESTS") != "1":
        skip_slow = pytest.mark.skip(reason="slow test: set LLM_SLOW_TESTS=1 (or `make test-all`) to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items:
        reason = _gpu_missing_reason()   # only probed when some gpu test was collected
        if reason:
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            seconds = SLOW_TIMEOUT_S if "slow" in item.keywords else TIMEOUT_S
            item.add_marker(pytest.mark.timeout(seconds, method="thread"))
    for item in items:
        item.stash[_MISSING] = [m for m in map(missing_fixture_message, sorted(needed_files(item))) if m]


_MISSING = pytest.StashKey[list]()          # the missing fixture files' messages, per test
_REPORTED_ONCE = pytest.StashKey[bool]()    # skipped behind the one CI failure for its missing file
_failed_for: set = set()                     # the messages already reported as a failure (CI)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A missing fixture file: skip with its message; in CI the first test that needs it fails
    with that message instead and the rest skip behind it, so the run says it once. (A test
    skipped anyway, slow or gpu, keeps its own reason.)"""
    if item.get_closest_marker("skip") is not None:
        return
    for message in item.stash.get(_MISSING, []):
        if in_ci() and message not in _failed_for:
            _failed_for.add(message)
            pytest.fail(f"{message}; the other tests that need it are skipped", pytrace=False)
        if in_ci():
            item.stash[_REPORTED_ONCE] = True
        pytest.skip(message)


_terminal_fd = None              # stderr as it was before pytest captured it: where a dump must go


def pytest_configure(config):
    global _terminal_fd
    _terminal_fd = os.dup(sys.__stderr__.fileno())      # capture is suspended while plugins configure


def pytest_unconfigure(config):
    if _terminal_fd is not None:
        os.close(_terminal_fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The C watchdog: every thread's stack and exit, if the test outlives its timeout by GRACE_S."""
    marker = item.get_closest_marker("timeout")
    seconds = marker.args[0] if marker and marker.args else TIMEOUT_S
    faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True, file=_terminal_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


ALLOWED_IN_CI = ("(tests/conftest.py EXPECTED_SKIPS lists the skips allowed there: what a machine without a GPU, "
                 "the CUDA toolkit, llama.cpp or a vector instruction cannot run)")


def xfail_problem(item, call, report) -> str | None:
    """Why an xfail outcome does not count as an expected failure in CI, or None if it does:
    only a strict xfail marker whose test ran and failed does."""
    if report.passed:                                           # XPASS of a marker someone made non-strict
        return f"an expected failure passed in CI: {report.wasxfail} (xfail markers are strict)"
    marker = item.get_closest_marker("xfail")
    if call.excinfo is not None and call.excinfo.errisinstance(pytest.xfail.Exception):
        return (f"xfail without running the test, in CI: {report.wasxfail} (pytest.xfail() or "
                f"xfail(run=False) is a skip by another name)")
    if marker is None or not marker.kwargs.get("strict", item.config.getini("xfail_strict")):
        return f"a non-strict xfail in CI: {report.wasxfail} (only strict xfail markers are allowed there)"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not in_ci():
        return
    if hasattr(report, "wasxfail"):
        problem = xfail_problem(item, call, report)
    elif report.skipped and not item.stash.get(_REPORTED_ONCE, False):
        reason = skip_reason(report)
        problem = None if expected_skip(reason) else f"unexpected skip in CI: {reason}\n{ALLOWED_IN_CI}"
    else:
        problem = None
    if problem:
        report.outcome = "failed"
        report.longrepr = problem


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A skip while collecting (a module-level importorskip or skip) drops every test of the
    module before any of them can report: in CI it is judged like a test's skip, and an
    unexpected one is a collection error, which fails the run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci():
        reason = skip_reason(report)
        if not expected_skip(reason):
            report.outcome = "failed"
            report.longrepr = (f"unexpected skip in CI, at collection: {reason}\n(none of {collector.nodeid}'s tests "
                               f"would run) {ALLOWED_IN_CI}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model file (SmolLM2-135M-Instruct Q4_1). A test that uses it needs "model":
    if the file is missing, pytest_runtest_setup has skipped it (or, in CI, failed once)."""
    path = FIXTURE_FILES["model"][0]
    if not path.exists():                     # only reachable from a fixture of another fixture file
        pytest.fail(missing_fixture_message("model"), pytrace=False)
    return path


@pytest.fixture(scope="session")
def tok(default_model_path):
    """The default model's tokenizer (a module may define its own `tok`)."""
    from common.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_model_path)


@pytest.fixture(scope="session")
def ll(tok):
    """The default model's vocabulary as llguidance takes it (common/constrain)."""
    from common.constrain import ll_tokenizer
    return ll_tokenizer(tok)


def pytest_terminal_summary(terminalreporter):
    """Seconds per notebook and its slowest cells, in pytest's summary (also with -q). Each
    chapter's test records them on its report (tests/test_notebooks.py: run_chapter), so they
    reach the summary from a pytest-xdist worker as from the one process."""
    rows = [value for reports in terminalreporter.stats.values() for r in reports
            if getattr(r, "when", None) == "call"
            for key, value in getattr(r, "user_properties", ()) if key == "notebook"]
    if not rows:
        return
    terminalreporter.write_sep("-", "notebooks (seconds, kernel start included; their slowest cells)")
    for name, seconds, cells in sorted(rows):
        terminalreporter.write_line(f"{seconds:7.1f}  {name}")
        for cell_s, first in cells:
            terminalreporter.write_line(f"         {cell_s:6.1f}  {first}")
    terminalreporter.write_line(f"{sum(r[1] for r in rows):7.1f}  all")
