"""The helpers that keep other tests from passing vacuously (tests/util.py), each on a planted
case it must refuse and a twin it must let through."""

from __future__ import annotations

import numpy as np
import pytest

from tests.util import lacks, some, thread_counts


def test_thread_counts_refuse_to_compare_a_run_with_itself():
    """One thread in numba's pool: [1, 1] would compare a run with itself."""
    with pytest.raises(pytest.fail.Exception, match="NUMBA_NUM_THREADS=2 or more"):
        thread_counts(pool=1)
    assert thread_counts(pool=2) == [1, 2] and thread_counts(pool=8) == [1, 8]
    counts = thread_counts()                                 # this run's pool
    assert len(counts) == 2 and counts[0] == 1 < counts[1]


def test_a_check_over_an_empty_mask_fails():
    got, want = np.array([3, 1, 2]), np.array([0, 1, 0])
    nothing = np.zeros(3, dtype=bool)
    assert (got[nothing] == want[nothing]).all()              # what `some` is for: vacuously true
    with pytest.raises(AssertionError, match="would cover 0 positions"):
        some(nothing)
    with pytest.raises(AssertionError, match="would cover 1 positions .* at least 2"):
        some(np.array([False, True, False]), at_least=2)
    assert some(np.array([False, True, False])).tolist() == [False, True, False]


def test_a_missing_instruction_is_named_from_the_features_given():
    assert lacks("avx2", "f16c", have=frozenset({"avx2", "f16c", "fma"})) is None
    assert lacks("avx2", "f16c", have=frozenset({"avx2"}), then="loops") == \
        "this CPU has no F16C (LLVM's host features): loops"
