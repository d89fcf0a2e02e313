"""The lessons ledger (app/report/lessons.py): every claim of the article has its row, every measured
figure is recomputed here from the records the row names, and each verdict follows from the
figures (reproduced; same direction, larger or smaller; reversed; not measured here with the reason),
on the committed records and on records made up for each case."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from app.cli import main
from app.models import DEFAULT_MODEL, MODELS
from app.report import lessons

ROOT = Path(__file__).resolve().parent.parent
IDS = ["ram_balloon", "page_faults", "ipc_naive", "tiling_speedup", "simd_speedup", "kv_decode_speedup",
       "kv_ttft_unchanged", "quantized_ttft_speedup", "cuda_decode_speedup", "cuda_ttft_slower", "end_to_end",
       "ttft_decode_different", "precision_loss_small"]
KEYS = {"id", "article", "measured", "unit", "verdict", "why", "records"}


@pytest.fixture(scope="module")
def committed():
    """`python -m app lessons --json` on the committed records."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["lessons", "--json"]) == 0
    return json.loads(out.getvalue())


def test_every_claim_has_its_row(committed):
    rows = committed["rows"]
    assert [r["id"] for r in rows] == IDS
    for r in rows:
        assert KEYS <= set(r), r["id"]
        assert r["verdict"] in lessons.VERDICTS and r["why"]
        if r["verdict"] == "not measured here":
            assert r["measured"] is None
        else:
            assert isinstance(r["measured"], float) and r["records"]
            assert (r["verdict"] == "reproduced") == (r["band"][0] <= r["measured"] <= r["band"][1]), r["id"]
            if r["unit"] == "x" and r["verdict"] != "reproduced" and r["article"] not in (None, 1.0):
                # a ratio outside its band: on the article's side of 1 or not, beyond its figure or short of it
                same = (r["measured"] > 1) == (r["article"] > 1)
                further = abs(math.log(r["measured"])) > abs(math.log(r["article"]))
                assert r["verdict"] == (("same direction, larger" if further else "same direction, smaller")
                                        if same else "reversed"), r["id"]
        assert r["id"] in lessons.LABELS, f"{r['id']} has no label for the chart (lessons.LABELS)"


def test_every_stage_ratio_is_recomputed_from_the_records_it_names(committed):
    ratios = [r for r in committed["rows"] if "metric" in r]
    assert {r["id"] for r in ratios} >= {"tiling_speedup", "simd_speedup", "kv_decode_speedup", "kv_ttft_unchanged",
                                         "quantized_ttft_speedup", "cuda_decode_speedup", "cuda_ttft_slower",
                                         "end_to_end"}
    checked = 0
    for r in ratios:
        assert r["metric"] in ("ttft_ms", "decode_ms") and r["from_stage"]
        if r["measured"] is None:
            continue
        first, second = (json.loads((ROOT / p).read_text()) for p in r["records"])
        assert (first["stage"], second["stage"]) == (r["from_stage"], r["to_stage"])
        assert r["measured"] == pytest.approx(first[r["metric"]] / second[r["metric"]], rel=1e-12), r["id"]
        checked += 1
    assert checked >= 5, "the committed records should give most stage ratios"


def page_machine(text: str) -> str:
    """The machine a lessons page says it was drawn from."""
    m = re.search(r"from the records of machine `([^`]+)`", text)
    assert m, "the page does not say which machine's records it was drawn from"
    return m.group(1)


def test_the_committed_page_is_the_ledger_of_the_committed_records():
    """Redrawn from the records of the machine the page names (whatever machine runs the test:
    one with records of its own would otherwise draw another page)."""
    page = ROOT / "profiles" / "lessons.md"
    if not page.exists():
        pytest.skip("profiles/lessons.md is not committed yet: `make report` (or --draw-only) writes it")
    text = page.read_text()
    machine = page_machine(text)
    assert (lessons.RESULTS_DIR / machine).is_dir(), f"the page names machine {machine}, which has no records"
    sources = lessons.find_sources(machine=machine)
    assert sources.machine == machine
    assert text == lessons.markdown(lessons.ledger(sources), sources)


def test_the_page_is_compared_with_the_machine_it_names(tmp_path):
    """Two machines' records, and a page drawn from the second: redrawn from the machine the page
    names it is the same page; from the first machine's records it is not (what the test above
    would have done on a machine with records of its own)."""
    write(tmp_path / "a" / DEFAULT_MODEL.path.stem, [record(s, t, d) for s, t, d in BASE])
    write(tmp_path / "b" / DEFAULT_MODEL.path.stem, [record(s, t, d * (2 if s == "simd" else 1)) for s, t, d in BASE])
    drawn = lessons.find_sources(tmp_path, machine="b")
    page = lessons.markdown(lessons.ledger(drawn), drawn)
    assert page_machine(page) == "b"
    again = lessons.find_sources(tmp_path, machine=page_machine(page))
    assert lessons.markdown(lessons.ledger(again), again) == page
    other = lessons.find_sources(tmp_path, machine="a")
    assert lessons.markdown(lessons.ledger(other), other) != page


# ---- made-up records, one case each ----------------------------------------------------------

def record(stage, ttft, decode, **extra):
    return {"kind": "stage", "stage": stage, "model": "m.gguf", "ttft_ms": ttft, "decode_ms": decode,
            "tokens_per_s": 1e3 / decode, "n_prompt": 32, "n_generated": 4, "weights_mb": 600.0,
            "peak_rss_mb": 900.0, "settings": {"prompt_tokens": 32, "n_predict": 4, "threads": 1},
            "model_info": {"file_size": 100 * 2**20, "n_params": 150_000_000, "name": "made up"},
            "provenance": {"commit": "0" * 40, "dirty": False, "code_hash": "c" * 16}, **extra}


def write(folder: Path, recs: list[dict]):
    folder.mkdir(parents=True, exist_ok=True)
    for r in recs:
        (folder / f"{r['stage']}.json").write_text(json.dumps(r))


def rows_of(tmp_path) -> dict:
    return {r.id: r for r in lessons.ledger(lessons.find_sources(tmp_path, machine="m"))}


BASE = [("naive", 8000, 8000), ("tiling", 4000, 4000), ("simd", 150, 3880), ("kv_cache", 150, 366),
        ("quantized", 37.5, 200), ("cuda", 30, 71), ("int8", 20, 67)]


@pytest.fixture
def default_dir(tmp_path):
    return tmp_path / "m" / DEFAULT_MODEL.path.stem


def test_verdicts_follow_the_bands(tmp_path, default_dir):
    # the article's own figures, give or take: reproduced; simd's 26x: the article's way, far larger
    write(default_dir, [record(s, t, d) for s, t, d in BASE if s != "simd"] + [record("simd", 150, 4000 / 26.0)])
    rows = rows_of(tmp_path)
    assert rows["tiling_speedup"].verdict == "reproduced" and rows["tiling_speedup"].measured == 2.0
    assert rows["simd_speedup"].verdict == "same direction, larger"
    assert rows["simd_speedup"].measured == pytest.approx(26.0) and "reverses" in rows["simd_speedup"].why
    assert rows["kv_ttft_unchanged"].verdict == "reproduced"
    assert rows["quantized_ttft_speedup"].verdict == "reproduced" and rows["quantized_ttft_speedup"].measured == 4.0
    assert rows["cuda_ttft_slower"].verdict == "reversed"                  # the stage without the mistakes is faster
    assert rows["end_to_end"].to_stage == "int8"                           # the fastest recorded stage
    assert rows["end_to_end"].measured == pytest.approx(8000 / 67)
    assert rows["end_to_end"].verdict == "reproduced"


def test_ttft_and_decode_as_different_problems(tmp_path, default_dir):
    """The prefill stage's TTFT gain over repack against its decode gain: 2x against 1x is two
    problems; the same gain in both (planted) reverses the claim; without a prefill record, not measured."""
    write(default_dir, [record("repack", 100, 20)])
    assert rows_of(tmp_path)["ttft_decode_different"].verdict == "not measured here"
    write(default_dir, [record("repack", 100, 20), record("prefill", 50, 20)])
    row = rows_of(tmp_path)["ttft_decode_different"]
    assert row.verdict == "reproduced" and row.measured == pytest.approx(2.0)
    write(default_dir, [record("repack", 100, 20), record("prefill", 50, 10)])
    assert rows_of(tmp_path)["ttft_decode_different"].verdict == "reversed"


def test_missing_records_are_not_measured_and_say_which(tmp_path, default_dir):
    write(default_dir, [record(s, t, d) for s, t, d in BASE if s != "cuda"])
    rows = rows_of(tmp_path)
    for rid in ("cuda_decode_speedup", "cuda_ttft_slower"):
        assert rows[rid].verdict == "not measured here" and rows[rid].measured is None
        assert "cuda" in rows[rid].why and rows[rid].records == []
    ppl = rows["precision_loss_small"]
    assert ppl.verdict == "not measured here" and "--compare" in ppl.why


def test_ipc_is_not_made_up_without_a_pmu(tmp_path, default_dir):
    reason = "perf_event_open(instructions): No such file or directory: this machine exposes no hardware PMU"
    write(default_dir, [record("naive", 8000, 8000, counters={"pmu": {"available": False, "reason": reason}})])
    row = rows_of(tmp_path)["ipc_naive"]
    assert row.verdict == "not measured here" and row.why == reason and row.measured is None
    pmu = {"available": True, "instructions": 98_000, "cycles": 100_000, "ipc": 0.98, "cache_references": 10,
           "cache_misses": 5, "cache_miss_rate": 0.5}
    write(default_dir, [record("naive", 8000, 8000, counters={"pmu": pmu})])
    row = rows_of(tmp_path)["ipc_naive"]
    assert row.verdict == "reproduced" and row.measured == 0.98


def test_page_faults_come_from_the_cold_start(tmp_path, default_dir):
    write(default_dir, [record("naive", 8000, 8000)])
    assert "predates" in rows_of(tmp_path)["page_faults"].why
    pages = 600 * 2**20 // 4096                                            # one fault per page of float32
    cold = {"eviction": {"resident_after": 0.0},
            "load": {"minor_faults": pages, "major_faults": 300, "wall_ms": 2000.0},
            "first_forward": {"minor_faults": 100, "major_faults": 0, "wall_ms": 500.0}}
    write(default_dir, [record("naive", 8000, 8000, cold_start=cold)])
    row = rows_of(tmp_path)["page_faults"]
    assert row.measured == pages + 400 and row.verdict == "reproduced"     # the article's count scaled to 600 MiB
    assert f"{(pages + 400) / 2.5:,.0f} a second" in row.why


def test_the_article_workload_is_preferred_where_measured(tmp_path, default_dir):
    write(default_dir, [record(s, t, d) for s, t, d in BASE])
    article = tmp_path / "m" / lessons.article_folder_name(MODELS["tinyllama-synthetic"].path.stem)
    write(article, [record("simd", 9000, 9000, settings={"prompt_tokens": 512}),
                    record("kv_cache", 9000, 850, settings={"prompt_tokens": 512})])
    rows = rows_of(tmp_path)
    kv = rows["kv_decode_speedup"]
    assert kv.records[0].startswith(str(article)) and kv.measured == pytest.approx(9000 / 850)
    assert kv.verdict == "reproduced" and "article's workload" in kv.why
    assert rows["tiling_speedup"].records[0].startswith(str(default_dir))   # not in the article's folder: default


def test_precision_loss_reads_the_perplexity_record(tmp_path, default_dir):
    write(default_dir, [record(s, t, d) for s, t, d in BASE])
    ppl = {"kind": "perplexity", "model": "m.gguf", "text": "t.txt", "ctx": 512, "reference_stage": "quantized",
           "rounds_activations": ["int8"],
           "rows": [{"row": "quantized", "weights": "the file's own", "ppl": 20.0},
                    {"row": "int8", "weights": "the file's own", "ppl": 20.1},
                    {"row": "quantized on Q4_0", "weights": "requantized to Q4_0", "ppl": 21.6},
                    {"row": "quantized on Q4_K", "weights": "requantized to Q4_K", "ppl": 20.8}]}
    (default_dir / "perplexity.json").write_text(json.dumps(ppl))
    row = rows_of(tmp_path)["precision_loss_small"]
    assert row.measured == pytest.approx(8.0) and row.verdict == "same direction, larger"   # Q4_0: +8%
    assert "Q4_0" in row.why and "int8 activations +0.50%" in row.why and "Q4_1" in row.why


def test_the_page_and_chart_are_written(tmp_path, default_dir):
    write(default_dir, [record(s, t, d) for s, t, d in BASE])
    sources = lessons.find_sources(tmp_path, machine="m")
    text = lessons.markdown(lessons.ledger(sources), sources)
    assert text.count("\n| ") == len(IDS) + 1 and "**reproduced**" in text
    out = tmp_path / "out"
    out.mkdir()
    lessons.chart(lessons.ledger(sources), out / "lessons.png")
    assert (out / "lessons.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LARGER, SMALLER = "same direction, larger", "same direction, smaller"


@pytest.mark.parametrize("measured, band, article, unit, said", [
    (2.31, [1.33, 3.0], 2.0, "x", "reproduced"),
    (33.3, [0.9, 1.18], 1.03, "x", LARGER),                 # SIMD: the article's 3% became 33x
    (102.0, [7.07, 15.9], 10.6, "x", LARGER),               # a KV cache that beat the article's 10.6x
    (1.10, [2.67, 6.0], 4.0, "x", SMALLER),                 # quantized TTFT: faster, by less
    (0.5, [2.67, 6.0], 4.0, "x", "reversed"),               # a speed-up that slowed down
    (1.5, [0.56, 0.88], 0.70, "x", "reversed"),             # the GPU's TTFT: faster, not slower
    (0.3, [0.56, 0.88], 0.70, "x", LARGER),                 # slower still
    (0.95, [0.56, 0.88], 0.70, "x", SMALLER),
    (1.4, [0.8, 1.25], 1.0, "x", "reversed"),               # "unchanged", and it moved
    (1.0, [1 / 1.5, 1.5], None, "x", "reproduced"),
    (2.9, [1 / 1.5, 1.5], None, "x", "reversed"),           # "about one step" (no article figure): far from it
    (90_348.0, [5e5, 2e6], 1e6, "page faults", SMALLER),
    (8.0, [0.0, 5.0], None, "% perplexity", LARGER),
    (-1.0, [0.0, 5.0], None, "% perplexity", "reversed"),  # 4-bit weights that lowered perplexity
])
def test_a_verdict_says_what_happened(measured, band, article, unit, said):
    assert lessons.verdict(measured, band, article, unit) == said
    assert said in lessons.VERDICTS
