"""The soak test's verdicts and table (app/measure/soak.py) on made-up records, and its committed
table redrawn from its committed record. The run itself is minutes of traffic: a benchmark, run
on a quiet machine (`make soak`), not part of the suite."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from app.measure import soak

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "profiles" / "bench" / "soak.json"

GOOD = {
    "requests": 40, "wall_s": 60.0, "deterministic": 10, "distinct": 6, "mismatches": [], "n_mismatches": 0,
    "statuses": {"greedy 200": 20, "greedy 503": 2, "bad_json 400": 3, "oversized 413": 2, "unknown_field 400": 1,
                 "abandoned -1": 4},
    "rss_mb": [[1.0, 300.0], [15.0, 340.0], [30.0, 345.0], [60.0, 350.0]],
    "health_after": {"kv_pages_free": 48, "kv_pages_total": 48, "running": 0, "waiting": 0, "preemptions": 5},
    "settings": {"seconds": 60, "warmup_share": 0.25, "rss_bound_mb": 48, "model": "m.gguf", "stage": "threads",
                 "clients": 4, "kv_pages": 48, "max_batch": 8},
    "provenance": {"commit": "abcdef1234"},
}


def planted(**changes) -> dict:
    rec = copy.deepcopy(GOOD)
    for path, value in changes.items():
        *head, last = path.split("__")
        d = rec
        for k in head:
            d = d[k]
        d[last] = value
    return rec


def test_a_clean_run_passes_every_check():
    assert soak.checks(copy.deepcopy(GOOD)) == {k: True for k in ("pages_all_free", "no_5xx_but_503",
                                                                  "expected_statuses", "rss_flat", "equal_alone")}


@pytest.mark.parametrize("changes,failing", [
    ({"health_after__kv_pages_free": 47}, "pages_all_free"),
    ({"health_after__running": 1}, "pages_all_free"),
    ({"statuses": dict(GOOD["statuses"], **{"greedy 500": 1})}, "no_5xx_but_503"),
    ({"statuses": dict(GOOD["statuses"], **{"greedy failed: ReadError: x": 1})}, "no_5xx_but_503"),
    ({"statuses": dict(GOOD["statuses"], **{"oversized 200": 1})}, "expected_statuses"),
    ({"statuses": dict(GOOD["statuses"], **{"bad_json 500": 1})}, "expected_statuses"),
    ({"rss_mb": [[1.0, 300.0], [15.0, 340.0], [60.0, 400.0]]}, "rss_flat"),
    ({"n_mismatches": 1}, "equal_alone"),
    ({"deterministic": 0}, "equal_alone"),
], ids=["a page held", "still running", "a 500", "a broken connection", "a big body taken", "bad JSON as 500",
        "memory grew", "a reply differs", "nothing compared"])
def test_each_check_flags_its_planted_failure(changes, failing):
    verdicts = soak.checks(planted(**changes))
    assert verdicts[failing] is False
    assert [k for k, ok in verdicts.items() if not ok] in ([failing], [failing, "expected_statuses"],
                                                           ["no_5xx_but_503", failing])


def test_the_warm_up_is_the_baseline_of_the_memory_check():
    rec = copy.deepcopy(GOOD)
    soak.checks(rec)
    assert rec["rss_growth_mb"] == 350.0 - 340.0          # the last sample in the first quarter (15 s of 60)


def test_the_table_says_what_each_check_saw():
    rec = copy.deepcopy(GOOD)
    rec["checks"] = soak.checks(rec)
    text = soak.page(rec, "soak.json")
    assert "| rss_flat | yes | +10.0 MiB after the warm-up (bound 48 MiB" in text
    assert "| abandoned | client left | 4 |" in text and "Preemptions: 5." in text
    rec = planted(health_after__kv_pages_free=40)
    rec["checks"] = soak.checks(rec)
    assert "| pages_all_free | **no** | 40 of 48 pages free" in soak.page(rec, "soak.json")


def test_the_committed_soak_table_is_drawn_from_its_record():
    rec = json.loads(RECORD.read_text())
    assert RECORD.with_suffix(".md").read_text() == soak.page(rec, "profiles/bench/soak.json"), \
        "redraw with `python -m app bench soak --draw-only`"
    assert rec["checks"] == soak.checks(copy.deepcopy(rec)), "the verdicts follow from the record's own figures"
