"""Your solutions, as pytest tests: one test per chapter's exercise, each running that chapter's
check on your file (the cases only; `make exercise ch=NN` times it too).

    .venv/bin/python -m pytest exercises/test_yours.py -k 02        # chapter 02's
    .venv/bin/python -m pytest exercises/test_yours.py              # every one (the unwritten ones fail)

A failing test prints the check's report: which case, where and by how much. (The project's own
suite, `make test`, checks the starting files and the stages' code instead: tests/test_exercises.py.)
"""

from __future__ import annotations

import pytest

from exercises import check


@pytest.mark.parametrize("chapter", list(check.folders()))
def test_your_solution(chapter):
    lines = []
    if not check.run(chapter, None, time_it=False, out=lines.append):
        pytest.fail("\n".join(lines), pytrace=False)
