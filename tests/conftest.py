"""Shared fixtures and markers for the whole test suite.

Markers:
    slow     long-running; skipped unless LLM_SLOW_TESTS=1 (`make test-all` sets it)
    gpu      needs an NVIDIA GPU and PyCUDA; skipped where there is none
    timeout  (pytest-timeout) every test has one: TIMEOUT_S unless it sets its own, SLOW_TIMEOUT_S
             for slow tests; past it the run stops with every thread's stack. Compiled code that
             holds the interpreter's lock (a numba loop) keeps pytest-timeout's watchdog from
             running, so a second one in C (faulthandler) ends the run GRACE_S later: a hang
             fails instead of stalling CI

Skips are printed with their reasons (`make test` runs -rs). In CI (the environment variable
CI set, as CI services do) a skip whose reason EXPECTED_SKIPS does not list fails its test: a
test that silently stops running is a check lost, so only what a machine without a GPU, the
CUDA toolkit or llama.cpp cannot run may skip there.
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
TIMEOUT_S = int(os.environ.get("LLM_TEST_TIMEOUT", "300"))
SLOW_TIMEOUT_S = 3 * 3600 // 4
GRACE_S = int(os.environ.get("LLM_TEST_TIMEOUT_GRACE", "60"))

# reason pattern -> why a machine may legitimately skip it
EXPECTED_SKIPS = {
    r"^gpu test: ": "no NVIDIA GPU, driver or PyCUDA (every gpu-marked test says which)",
    r"^nvcc not found": "no CUDA toolkit to compile the kernels with",
    r"^this machine can run the cuda stage": "the checks of the no-GPU messages, on a machine with a GPU",
    r"llama-cpp-python (is )?not installed": "llama.cpp is optional (`make baseline` installs it)",
    r"^slow test: ": "slow tests run with LLM_SLOW_TESTS=1 (`make test-all`)",
    r"\bthis CPU\b|reads x86 assembly": "vector instructions this CPU does not have",
    r"has no page \(only comparison and kernel records do\)": "records of a kind that has no page",
    r"^no headless browser: ": "Chromium and its driver are a system package (`make browser` installs them)",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def expected_skip(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS)


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not expected_skip(reason):
        report.outcome = "failed"
        report.longrepr = (f"unexpected skip in CI: {reason}\n(tests/conftest.py EXPECTED_SKIPS lists the skips "
                           f"allowed there: what a machine without a GPU, the CUDA toolkit or llama.cpp cannot run)")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model file (SmolLM2-135M-Instruct Q4_1); fails, not skips, if it is missing."""
    from app.models import DEFAULT_MODEL
    path = DEFAULT_MODEL.path
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `make model`", pytrace=False)
    return path
