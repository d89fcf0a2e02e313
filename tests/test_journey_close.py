"""The running total: every stage's chapter (01 to 13) closes on the journey chart with its own
stage highlighted (notebooks/nb/journey.py), before its findings and anything after them; the
sentence the close writes is the records' figures over the floor the README's table uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.report import charts
from stages import STAGES, info
from tests.test_records import committed_results

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "notebooks" / "src"


def close_problems(stage: str, source: str) -> list[str]:
    """What is wrong with a chapter's close: the journey not called once, for another stage, or
    after the findings that end the chapter (or after a section for the reader's own work)."""
    calls = re.findall(r'^findings\["running total"\] = nb\.journey\("([^"]+)"\)$', source, re.M)
    if calls != [stage]:
        return [f"the chapter calls the journey close for {calls or 'no stage'}, not once for {stage}"]
    at = source.index("nb.journey(")
    later = [m for m in ("findings.show()", "## Your turn", "## Try it") if m in source and source.index(m) < at]
    return [f"the journey comes after '{m}'" for m in later]


@pytest.mark.parametrize("stage", [s for s in STAGES if 1 <= info(s).number <= 13])
def test_every_stage_chapter_closes_on_the_journey(stage):
    source = (SRC / f"{info(stage).chapter}.py").read_text()
    assert close_problems(stage, source) == []


@pytest.mark.parametrize("plant", ["missing", "another stage", "after the findings"])
def test_the_close_check_catches_a_planted_chapter(plant):
    source = (SRC / f"{info('kv_cache').chapter}.py").read_text()
    call = 'findings["running total"] = nb.journey("kv_cache")'
    planted = {"missing": source.replace(call, ""),
               "another stage": source.replace(call, call.replace("kv_cache", "simd")),
               "after the findings": source.replace(call, "") + "\n" + call + "\n"}[plant]
    assert close_problems("kv_cache", planted)


def test_the_close_says_where_the_stage_stands_on_the_floor(monkeypatch):
    """On the committed records: the sentence is the stage's decode and TTFT over the floors of
    charts.floors (the README's "× floor" columns), and a stage with no record (cuda on a CPU)
    is said to be missing, never drawn as zero."""
    import importlib

    import matplotlib
    matplotlib.use("Agg")
    # the modules (nb.journey and nb.measure are functions of theirs)
    journey, measure = (importlib.import_module(f"notebooks.nb.{m}") for m in ("journey", "measure"))
    res = committed_results()
    monkeypatch.setattr(journey, "recorded", lambda results_root=None: measure.Recorded(res, "the records"))
    monkeypatch.setattr(journey, "md", lambda text: None)
    bandwidth = res.machine["bandwidth_gbs"][max(res.machine["bandwidth_gbs"], key=int)]
    floor = min(r["weights_stream_bytes"] for r in res.stages) / (bandwidth * 1e9) * 1e3   # the README's decode floor
    rec = res.stages[-1]
    said = journey.journey(rec["stage"])
    assert said.startswith(f"{rec['stage']}: decode {rec['decode_ms']:,.1f} ms")
    assert f"{charts._ratio(rec['decode_ms'] / floor)}× the floor" in said
    missing = next((s for s in STAGES if s not in res.names), None)
    if missing:
        assert "not in these records" in journey.journey(missing)
