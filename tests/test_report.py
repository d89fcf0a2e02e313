"""The report's charts and README table, drawn from a committed fixture (tests/fixtures/report):
four stage records (tiling's decode figure is NaN), llama.cpp at 1 and 2 threads, and machine.json;
'quantized' is expected but has no record."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from common.app import charts

FIXTURE = Path(__file__).parent / "fixtures" / "report" / "test-machine-2c" / "tiny-model"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def res():
    return charts.load_results(FIXTURE, expected=["naive", "tiling", "simd", "kv_cache", "quantized"])


def fixture_record(stage):
    return json.loads((FIXTURE / f"{stage}.json").read_text())


def test_nan_and_missing_records_are_reported_not_plotted(res):
    assert res.names == ["naive", "simd", "kv_cache"]          # tiling (NaN) left out, in stage order
    assert any(p.startswith("tiling:") and "NaN" in p for p in res.problems)
    assert any(p.startswith("quantized:") and "no record" in p for p in res.problems)
    assert res.baseline["stage"] == "llama.cpp" and res.baseline["threads"] == 1   # the article's setting
    assert sorted(b["threads"] for b in res.baselines) == [1, 2]


def test_every_chart_is_written(res, tmp_path):
    written = charts.draw_all(res, tmp_path)
    names = {p.name for p in written}
    assert {"speedup.png", "ops.png", "roofline.png", "ops.md"} <= names
    for name in ("speedup.png", "ops.png", "roofline.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_readme_table_holds_the_fixture_numbers(res):
    table = charts.results_table(res)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| stage")}
    assert set(rows) == {"naive", "simd", "kv_cache", "llama.cpp (1 thread)", "llama.cpp (2 threads)"}
    assert rows["llama.cpp (2 threads)"][1] == "5.0"
    for stage in ("naive", "simd", "kv_cache"):
        rec = fixture_record(stage)
        ttft, decode, tps = (float(c.replace(",", "")) for c in rows[stage][:3])
        assert ttft == pytest.approx(rec["ttft_ms"], abs=0.05)
        assert decode == pytest.approx(rec["decode_ms"], abs=0.05)
        assert tps == pytest.approx(rec["tokens_per_s"], abs=0.05)
    # speedups over naive and over the stage before, from the decode figures
    assert rows["simd"][3] == f"{8500 / 420:,.1f}x" and rows["kv_cache"][4] == f"{420 / 30:,.2f}x"
    assert "tiling" in table and "NaN" in table                  # the problem is stated under the table
    assert not re.search(r"\|\s*nan\s*\|", table, re.I)


def test_speedups_start_at_naive(res):
    ups = charts._speedups(res, "decode_ms")
    assert ups[0] == (None, None)
    assert ups[1][0] == pytest.approx(8500 / 420) and ups[2][1] == pytest.approx(420 / 30)


def test_op_shares_sum_to_one():
    shares = charts.op_shares(fixture_record("simd")["profile"])
    assert math.isclose(sum(shares.values()), 1.0)
    assert shares["matmul output head"] > 0 and shares["python overhead"] > 0


def test_readme_markers_rewritten_in_place(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{charts.TABLE_BEGIN}\nold\n{charts.TABLE_END}\noutro\n")
    assert charts.update_readme(readme, "| new |\n", "caption\n")
    text = readme.read_text()
    assert "old" not in text and "| new |" in text and text.startswith("intro") and text.endswith("outro\n")
    assert charts.update_readme(readme, "| newer |\n")              # idempotent markers survive
    assert "| new |" not in readme.read_text()
    plain = tmp_path / "plain.md"
    plain.write_text("no markers")
    assert not charts.update_readme(plain, "| x |\n")


def test_roofline_points_place_decode_below_prefill():
    """Decode with a cache reads every weight for one row: lower intensity than prefill."""
    pts = dict((k, (x, y)) for k, x, y in charts.roofline_points(fixture_record("kv_cache")))
    assert pts["decode"][0] < pts["prefill"][0]


@pytest.mark.parametrize("params, measured", [(135e6, ["naive", "tiling", "simd"]), (1.1e9, ["simd"])])
def test_report_leaves_the_recompute_stages_out_on_large_models(monkeypatch, tmp_path, capsys, params, measured):
    """Above a stage's max_params (naive and tiling: LARGE_MODEL_PARAMS) the stage would take tens
    of minutes: left out, and said so; the rest measured, and another model's table written
    beside its charts."""
    from common.app import report
    from stages.registry import LARGE_MODEL_PARAMS
    calls = []
    rec = dict(fixture_record("simd"), stage="simd")

    def fake_measure(stage, model, folder, threads=None):
        calls.append(stage)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stage}.json").write_text(json.dumps(dict(rec, stage=stage)))
        return rec

    monkeypatch.setattr(report, "model_params", lambda model: params)
    monkeypatch.setattr(report, "measure_stage", fake_measure)
    monkeypatch.setattr(report, "measure_machine", lambda folder, force=False: {})
    monkeypatch.setattr(report, "PROFILES", tmp_path / "profiles")
    monkeypatch.setattr(report, "results_dir", lambda name: tmp_path / "results" / "m" / Path(name).stem)
    monkeypatch.setattr(report, "runnable_stages", lambda: ["naive", "tiling", "simd"])
    model = tmp_path / "big.gguf"
    model.write_bytes(b"not read: model_params is stubbed")
    report.run(model=str(model), baseline=False)
    assert calls == measured
    err = capsys.readouterr().err
    assert ("skipping naive: a 1.1B-parameter model" in err) == (params > LARGE_MODEL_PARAMS)
    assert (tmp_path / "profiles" / "big" / "results.md").read_text().count("| simd |") == 1
