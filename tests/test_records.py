"""Figures live in records: every table a reader sees is drawn from the committed JSON records and
nothing else (each is rebuilt here and compared), every record says what code it measured, and
prose quotes no measured figure without naming the record it comes from."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from app.report import charts
from app.report.pages import page_for
from app.report.report import too_large
from stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "profiles" / "bench"
RECORDS_NAMED = re.compile(r"Records: `([^`]+)/`")


def _tables():
    """(the text that holds a results table, its block) for the README and each model's results.md."""
    readme = (ROOT / "README.md").read_text()
    yield "README.md", readme.split(charts.TABLE_BEGIN)[1].split(charts.TABLE_END)[0].lstrip("\n")
    for path in sorted((ROOT / "profiles").glob("*/results.md")):
        yield path.relative_to(ROOT).as_posix(), path.read_text().rstrip("\n") + "\n"


@pytest.mark.parametrize("where, block", list(_tables()), ids=lambda x: x if x.endswith(".md") else "")
def test_results_tables_are_drawn_from_the_committed_records(where, block):
    folder = RECORDS_NAMED.search(block)
    assert folder, f"{where}: the table does not name its records"
    res = charts.load_results(ROOT / folder.group(1))
    params = (res.stages[0].get("model_info") or {}).get("n_params") if res.stages else None
    why = {s: "too slow on a model this size; --stages names it to measure it" for s in too_large(params or 0)}
    res = charts.load_results(ROOT / folder.group(1), expected=STAGES, why_missing=why)
    assert block == charts.caption(res, folder.group(1)) + charts.results_table(res), \
        f"{where} differs from what its records draw: `make report --draw-only` redraws it"
    assert "commit " in block and "code " in block, f"{where}: the caption should say which code was measured"


@pytest.mark.parametrize("record", sorted(BENCH.rglob("*.json")), ids=lambda p: p.relative_to(BENCH).as_posix())
def test_generated_pages_match_their_records(record):
    page = page_for(record)
    if page is None:
        pytest.skip(f"{record.name} has no page (only comparison and kernel records do)")
    assert record.with_suffix(".md").read_text() == page, "redraw with `python -m app report --draw-only`"


def test_the_load_test_table_is_drawn_from_its_record(tmp_path):
    from scripts.loadtest import draw
    draw(json.loads((BENCH / "batching.json").read_text()), tmp_path / "batching.png", tmp_path / "batching.md")
    assert (tmp_path / "batching.md").read_text() == (BENCH / "batching.md").read_text(), \
        "redraw with `python scripts/loadtest.py --chart-only`"


def test_ops_table_is_drawn_from_the_records():
    block = dict(_tables())["README.md"]
    res = charts.load_results(ROOT / RECORDS_NAMED.search(block).group(1), expected=STAGES)
    assert (ROOT / "profiles" / "ops.md").read_text() == charts.ops_markdown(res)


def test_every_committed_record_says_what_code_it_measured():
    missing = []
    for path in sorted((ROOT / "profiles").rglob("*.json")):
        rec = json.loads(path.read_text())
        kinds = ("stage", "baseline", "machine", "comparison", "kernels")
        if isinstance(rec, dict) and rec.get("kind") in kinds:
            p = rec.get("provenance") or {}
            if not (p.get("code_hash") and "commit" in p and "dirty" in p):
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"records without provenance (measure them again): {missing}"


# ---- prose ------------------------------------------------------------------------------------

# A measured figure: a number with a unit of time, rate or speed-up. (Sizes are left alone: they
# follow from a model's shapes, which the prose shows the arithmetic of.)
FIGURE = re.compile(r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|s|seconds|minutes|GB/s|GFLOP/s|GOP/s|"
                    r"tokens/s|Gweights/s|x|×|%)(?![\w/])(?!\s*\d)")
CITED = re.compile(r"\[(profiles/[^\]\s:]+\.json): ([^\]]+)\]")
ARTICLE = re.compile(r"article|llama\.cpp's|ggml's", re.I)     # figures of other projects carry over


def _prose():
    """(where, paragraph) of the prose a reader reads as fact: the README outside its generated
    blocks, the notebooks' README, and the docstrings of the stage, kernel and engine modules."""
    text = (ROOT / "README.md").read_text()
    for begin, end in ((charts.TABLE_BEGIN, charts.TABLE_END), (charts.STAGES_BEGIN, charts.STAGES_END)):
        text = text.split(begin)[0] + text.split(end)[1]
    docs = [("README.md", text), ("notebooks/README.md", (ROOT / "notebooks" / "README.md").read_text())]
    for path in sorted([*(ROOT / "stages").rglob("*.py"), *(ROOT / "common").rglob("*.py")]):
        docs.append((path.relative_to(ROOT).as_posix(), ast.get_docstring(ast.parse(path.read_text())) or ""))
    for where, doc in docs:
        for para in re.split(r"\n\s*\n", doc):
            yield where, " ".join(para.split())


def _value(record: Path, key: str):
    value = json.loads(record.read_text())
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def test_prose_quotes_no_measured_figure_without_its_record():
    uncited = []
    for where, para in _prose():
        for sentence in re.split(r"(?<=[.;])\s+", para):
            if ARTICLE.search(sentence) or "```" in sentence:
                continue
            figures = FIGURE.findall(sentence)
            if figures and not CITED.search(sentence):
                uncited.append(f"{where}: {sentence[:160]}")
    assert not uncited, "figures in prose must cite their record ([profiles/....json: key]):\n" + "\n".join(uncited)


def test_cited_figures_match_their_records():
    for where, para in _prose():
        for m in re.finditer(r"(\d[\d,]*(?:\.\d+)?)\D{0,12}" + CITED.pattern, para):
            number, record, key = m.group(1), ROOT / m.group(2), m.group(3)
            digits = len(number.split(".")[1]) if "." in number else 0
            assert float(number.replace(",", "")) == round(float(_value(record, key)), digits), \
                f"{where}: {number} but {record.name} {key} = {_value(record, key)}"


def test_the_code_hash_follows_the_code_not_the_prose():
    from app.measure.provenance import code_only
    code = '"""A module."""\nX = 1  # why\n\n\ndef f(a):\n    """Doc."""\n    return a + X\n'
    prose = '"""Another text."""\nX = 1\n\ndef f(a):\n    """Other doc."""\n    # a comment\n    return a + X\n'
    assert code_only(code) == code_only(prose)
    assert code_only(code) != code_only(code.replace("a + X", "a - X"))
    assert code_only(code) != code_only(code.replace('"""Doc."""\n    ', 's = "Doc."\n    '))
