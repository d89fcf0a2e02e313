"""Shared fixtures and markers for the whole test suite.

Markers:
    slow   long-running; skipped unless LLM_SLOW_TESTS=1 (`make test-all` sets it)
    gpu    needs an NVIDIA GPU and PyCUDA; skipped where there is none
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model file (SmolLM2-135M-Instruct Q4_1); fails, not skips, if it is missing."""
    from common.app.models import DEFAULT_MODEL
    path = DEFAULT_MODEL.path
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `make model`", pytrace=False)
    return path
