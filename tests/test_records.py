"""Figures live in records: every table a reader sees is drawn from the committed JSON records and
nothing else (each is rebuilt here and compared), every record says what code it measured, and
prose quotes no measured figure without naming the record it comes from."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from app.measure.protocol import write_record
from app.report import charts
from app.report.pages import DRAWINGS, draw, page_for
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


def _kind(record: Path):
    rec = json.loads(record.read_text())
    return rec.get("kind") if isinstance(rec, dict) else None


PAGED = [r for r in sorted(BENCH.rglob("*.json")) if _kind(r) in DRAWINGS]


@pytest.mark.parametrize("record", PAGED, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_generated_pages_match_their_records(record):
    assert record.with_suffix(".md").read_text() == page_for(record), "redraw with `python -m app report --draw-only`"


def test_a_written_record_comes_back_as_its_own_page(tmp_path):
    """write_record with its drawing (every benchmark's last step): the record as written, and its
    page the one drawn from it, beside it."""
    record = json.loads(next((ROOT / "profiles" / "bench" / "prefetch").glob("*.json")).read_text())
    path = tmp_path / "prefetch" / "m.json"
    assert write_record(record, path, draw=draw) == [path, path.with_suffix(".md")]
    assert json.loads(path.read_text()) == record
    assert path.with_suffix(".md").read_text() == page_for(path)
    assert record["command"] in page_for(path)


def test_the_records_without_a_page_are_of_kinds_that_have_none():
    """A record has a generated page exactly where its kind has a drawing (app/report/pages.py), the
    load test's and the soak test's among them; no page stands without its record."""
    assert {_kind(r) for r in PAGED} >= {"comparison", "kernels", "batching", "soak", "speculative_serve"}
    for record in sorted(BENCH.rglob("*.json")):
        assert (page_for(record) is None) == (_kind(record) not in DRAWINGS), record.name
    for page in sorted(BENCH.rglob("*.md")):
        assert page.with_suffix(".json").exists(), f"{page.relative_to(ROOT)} has no record beside it"


def committed_folder() -> str:
    """The records folder the README's results table names."""
    return RECORDS_NAMED.search(dict(_tables())["README.md"]).group(1)


def committed_results():
    """The records of the README's results table, loaded as the report loads them."""
    return charts.load_results(ROOT / committed_folder(), expected=STAGES)


def test_ops_table_is_drawn_from_the_records():
    assert (ROOT / "profiles" / "ops.md").read_text() == charts.ops_markdown(committed_results())


def readme_answer() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(charts.ANSWER_BEGIN)[1].split(charts.ANSWER_END)[0].lstrip("\n")


def worked_decode_problems(answer: str, res) -> list[str]:
    """The README's worked number against the records it names, recomputed here: the weights' MB
    (the fewest any stage reads), the bandwidth (machine.json, the most threads), their quotient in
    ms, and the fastest stage's decode over it."""
    m = re.search(r"([\d,.]+) MB of weights ÷ ([\d.]+) GB/s = ([\d.]+) ms a token; the fastest stage here, (\w+), "
                  r"takes ([\d.]+) ms \(([\d.]+)× that floor\)", answer)
    if not m:
        return ["the answer does not work decode's floor out (bytes ÷ bandwidth = ms, the fastest stage against it)"]
    mb, gbs, floor, stage, ms, times = m.groups()
    bw = res.machine["bandwidth_gbs"][max(res.machine["bandwidth_gbs"], key=int)]
    best = min(res.stages, key=lambda r: r["decode_ms"])
    want = {"MB": (float(mb.replace(",", "")), min(r["weights_stream_bytes"] for r in res.stages) / 1e6, 0.05),
            "GB/s": (float(gbs), bw, 0.05), "floor": (float(floor), float(mb.replace(",", "")) / float(gbs), 0.01),
            "ms": (float(ms), best["decode_ms"], 0.005), "×": (float(times), float(ms) / float(floor), 0.05)}
    problems = [f"{k}: the README says {got}, the records give {exp:.4g}" for k, (got, exp, tol) in want.items()
                if abs(got - exp) > tol]
    return problems + ([f"the fastest stage is {best['stage']}, not {stage}"] if stage != best["stage"] else [])


def test_the_readmes_worked_number_is_drawn_from_the_records():
    """The README's first lines are what `make report` writes from the records its table names, and
    the arithmetic they show holds against those records (a planted bandwidth is caught)."""
    res = committed_results()
    assert readme_answer() == charts.answer(res, committed_folder()), \
        "the README's answer differs from what its records draw: `python -m app report --draw-only` redraws it"
    assert worked_decode_problems(readme_answer(), res) == []
    m = res.machine["bandwidth_gbs"]
    res.machine = dict(res.machine, bandwidth_gbs={k: v * 1.5 for k, v in m.items()})
    assert worked_decode_problems(readme_answer(), res)


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

# A measured figure: a number with a unit of time, of time per token, of a rate, or a speed-up or
# share. (Sizes are left alone: they follow from a model's shapes, which the prose shows the
# arithmetic of.)
_TIME = r"(?:ms|µs|us|ns|s|seconds?|minutes?|hours?)"
_UNIT = (rf"(?:{_TIME}(?:/(?:token|tok))?|(?:tokens?|tok|Gweights|weights)/s|[KMGT]i?B/s|[GMT]?FLOP/s|GOP/s"
         r"|x|×|%)")
FIGURE = re.compile(rf"(?<![\w.])~?(\d[\d,]*(?:\.\d+)?)\s?{_UNIT}(?![\w/])(?!\s*\d)")
CITED = re.compile(r"\[(profiles/[^\]\s:]+\.json): ([^\]]+)\]")
# Figures of other projects carry over, where the sentence gives them to their source: "the
# article" (its figures were measured on its machine, not here) no more than ARTICLE_REACH
# characters before the figure, with nothing in between that makes it ours.
ARTICLE = re.compile(r"\bthe article(?:'s)?\b", re.I)
ARTICLE_REACH = 80
OURS = re.compile(r"\b(?:ours?|we|here|this machine|this engine)\b|[;,]", re.I)


def figures(sentence: str) -> list[dict]:
    """Every figure of a sentence: its text, its number, the record citation that follows it
    (before the next figure) or None, and whether it is the article's."""
    found = list(FIGURE.finditer(sentence))
    out = []
    for i, m in enumerate(found):
        upto = found[i + 1].start() if i + 1 < len(found) else len(sentence)
        cite = CITED.search(sentence, m.end(), upto)
        before = [a for a in ARTICLE.finditer(sentence, 0, m.start())]
        between = sentence[before[-1].end():m.start()] if before else ""
        article = bool(before) and len(between) <= ARTICLE_REACH and not OURS.search(between)
        out.append({"figure": m.group(0), "number": m.group(1), "cited": cite.groups() if cite else None,
                    "article": article})
    return out


def sentences(text: str):
    for para in re.split(r"\n\s*\n", text):
        yield from re.split(r"(?<=[.;])\s+", " ".join(para.split()))


def uncited_figures(text: str) -> list[str]:
    """The figures of `text` that cite no record and are not the article's."""
    return [f"{f['figure']} in: {sentence[:160]}" for sentence in sentences(text) if "```" not in sentence
            for f in figures(sentence) if not f["cited"] and not f["article"]]


def _value(record: Path, key: str):
    value = json.loads(record.read_text())
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def citation_problems(text: str) -> tuple[int, list[str]]:
    """(citations checked, problems): each [profiles/....json: key] must follow a figure, name a
    record that is there and a key it has, and hold the figure's number at the digits shown."""
    checked, problems = 0, []
    for sentence in sentences(text):
        cited = {f["cited"]: f for f in figures(sentence) if f["cited"]}
        for m in CITED.finditer(sentence):
            checked += 1
            record, key = ROOT / m.group(1), m.group(2)
            f = cited.get(m.groups())
            if f is None:
                problems.append(f"{m.group(0)} follows no figure: {sentence[:160]}")
                continue
            try:
                value = float(_value(record, key))
            except (OSError, KeyError, IndexError, ValueError, TypeError) as e:
                problems.append(f"{m.group(0)}: no such record or key ({type(e).__name__}: {e})")
                continue
            digits = len(f["number"].split(".")[1]) if "." in f["number"] else 0
            if float(f["number"].replace(",", "")) != round(value, digits):
                problems.append(f"{f['figure']} but {m.group(1)} {key} = {value}")
    return checked, problems


def _prose():
    """(where, text) of the prose a reader reads as fact: the README outside its generated
    blocks, the notebooks' README, and the docstrings of the stage, kernel and engine modules."""
    text = (ROOT / "README.md").read_text()
    for begin, end in ((charts.TABLE_BEGIN, charts.TABLE_END), (charts.STAGES_BEGIN, charts.STAGES_END),
                       (charts.ANSWER_BEGIN, charts.ANSWER_END)):
        text = text.split(begin)[0] + text.split(end)[1]
    yield "README.md", text
    yield "notebooks/README.md", (ROOT / "notebooks" / "README.md").read_text()
    for path in sorted([*(ROOT / "stages").rglob("*.py"), *(ROOT / "common").rglob("*.py")]):
        yield path.relative_to(ROOT).as_posix(), ast.get_docstring(ast.parse(path.read_text())) or ""


def test_prose_quotes_no_measured_figure_without_its_record():
    uncited = [f"{where}: {u}" for where, text in _prose() for u in uncited_figures(text)]
    assert not uncited, "figures in prose must cite their record ([profiles/....json: key]):\n" + "\n".join(uncited)


def test_cited_figures_match_their_records():
    problems = [f"{where}: {p}" for where, text in _prose() for p in citation_problems(text)[1]]
    assert not problems, "\n".join(problems)


# planted sentences: each must be flagged, and its twin must pass
KERNELS = "profiles/bench/kernels.json"
UNCITED = [
    "Decode takes 12.5 ms/token on this machine.",
    "The fused stage reaches 170.6 tok/s with two threads.",
    "The probe reads 18.2 GiB/s from memory.",
    "The fused stage generates 170 tokens/s.",
    "A cold start takes 3 seconds.",
    "llama.cpp's decode is 1.7x faster than ours.",
    "Ours is 3.2x faster than the article's.",
    "The article measured 22.67 s/token, ours 0.9 s/token.",
    f"The naive stage takes 900 ms/token [{KERNELS}: passes] and tiling 500 ms/token.",
]
PASSING = [
    "The article measured 22.67 s/token with its naive loop.",
    "A cudaMalloc and a cudaFree around every op (the article's profile: cudaFree was 95.9% of all CUDA API time).",
    f"The kernels were timed over 5 passes [{KERNELS}: passes].",
    "A Q4_1 block holds 32 weights in 20 bytes, and the model has 30 layers.",
    f"The best of 5 x [{KERNELS}: passes] passes.",
]


@pytest.mark.parametrize("sentence", UNCITED)
def test_the_figure_scan_flags_an_uncited_figure(sentence):
    assert uncited_figures(sentence), sentence


@pytest.mark.parametrize("sentence", PASSING)
def test_the_figure_scan_passes_a_cited_or_outside_figure(sentence):
    assert not uncited_figures(sentence), uncited_figures(sentence)


def test_the_citation_check_reads_the_record():
    """On the committed kernels record: the figure it holds passes; another number, a missing key,
    a missing record and a citation with no figure before it are each flagged."""
    passes = json.loads((ROOT / KERNELS).read_text())["passes"]
    assert citation_problems(f"Timed over {passes} x [{KERNELS}: passes] passes.") == (1, [])
    assert citation_problems(f"Timed over {passes + 1} x [{KERNELS}: passes] passes.")[1]
    assert "no such record or key" in citation_problems(f"Timed over 5 x [{KERNELS}: no_such_key].")[1][0]
    assert "no such record or key" in citation_problems("Timed 5 x [profiles/bench/absent.json: passes].")[1][0]
    assert "follows no figure" in citation_problems(f"Timed as [{KERNELS}: passes] says.")[1][0]
    cpu_s = json.loads((ROOT / KERNELS).read_text())["results"][0]["cpu_s"]
    assert citation_problems(f"One pass took {cpu_s * 1e3:.1f} ms [{KERNELS}: results.0.cpu_s].")[1], \
        "a figure in ms against a key in seconds must differ"
    assert citation_problems(f"One pass took {cpu_s:.4f} s [{KERNELS}: results.0.cpu_s].") == (1, [])


def test_the_code_hash_follows_the_code_not_the_prose():
    from app.measure.provenance import code_only
    code = '"""A module."""\nX = 1  # why\n\n\ndef f(a):\n    """Doc."""\n    return a + X\n'
    prose = '"""Another text."""\nX = 1\n\ndef f(a):\n    """Other doc."""\n    # a comment\n    return a + X\n'
    assert code_only(code) == code_only(prose)
    assert code_only(code) != code_only(code.replace("a + X", "a - X"))
    assert code_only(code) != code_only(code.replace('"""Doc."""\n    ', 's = "Doc."\n    '))


def test_the_code_hash_is_the_same_with_its_memo_and_follows_an_edit(tmp_path):
    """code_hash keeps each file's code_only text by the sha256 of its bytes (tokenizing is slow):
    the same hash from the memo as without it, an edited file tokenized again, and a memo that
    holds a wrong text for a file's bytes does change it (the memo is trusted, so it is keyed by
    every byte)."""
    from app.measure.provenance import code_hash
    for top in ("stages", "common"):
        (tmp_path / top).mkdir()
    src = tmp_path / "stages" / "k.py"
    src.write_text('"""Doc."""\nX = 1  # why\n')
    (tmp_path / "common" / "c.cu").write_text("__global__ void f() {}\n")
    memo = tmp_path / "build" / "memo.json"
    plain = code_hash(tmp_path, memo_path=None)
    assert code_hash(tmp_path, memo) == plain and memo.exists()
    assert code_hash(tmp_path, memo) == plain                        # read from the memo
    src.write_text('"""Doc."""\nX = 2  # why\n')
    edited = code_hash(tmp_path, memo)
    assert edited != plain and edited == code_hash(tmp_path, memo_path=None)
    assert len(json.loads(memo.read_text())) == 1                     # only the file as it is now
    memo.write_text(json.dumps({k: "1 X\n54 =\n2 3" for k in json.loads(memo.read_text())}))
    assert code_hash(tmp_path, memo) != edited                        # planted: a wrong text is used
