"""`make report` validates before it records: a stage's logits for the first prompt positions are
checked against the float64 reference in the same run, the record carries the result, and a
stage that fails is shown as failed, never as a figure (a planted wrong stage, and its twin)."""

from __future__ import annotations

import json

import numpy as np

from app.measure import bench
from app.report import charts
from stages import load
from tests.test_quantized import MIXED_TYPES, write_tiny_llama


def test_a_stage_passes_and_a_wrong_one_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path / "results")        # the reference's cache
    path = write_tiny_llama(tmp_path / "tiny.gguf", MIXED_TYPES)
    engine = load("quantized", path)
    prompt = [3, 17, 42, 5, 9]
    good = bench.validate(engine, "quantized", prompt)
    assert good["passed"] and good["positions"] == bench.VALIDATE_POSITIONS and good["max_abs_diff"] < 5e-3
    real = type(engine.backend).matmul
    monkeypatch.setattr(type(engine.backend), "matmul", lambda self, x, w: real(self, x, w) * np.float32(1.01))
    bad = bench.validate(engine, "quantized", prompt)                          # 1% off: caught
    assert not bad["passed"] and bad["max_abs_diff"] > bad["tolerance"]
    assert list((tmp_path / "results").rglob("reference-*.npy")), "the reference is computed once and kept"


def _record(stage, decode, validation):
    return {"kind": "stage", "stage": stage, "ttft_ms": 10.0, "decode_ms": decode, "tokens_per_s": 1e3 / decode,
            "n_prompt": 4, "n_generated": 4, "peak_rss_mb": 100.0, "settings": {"threads": 1},
            **({"validation": validation} if validation is not None else {})}


def test_a_failed_stage_is_a_failed_row_and_no_figure(tmp_path):
    ok = {"positions": 4, "max_abs_diff": 1e-3, "tolerance": 5e-3, "passed": True}
    wrong = {"positions": 4, "max_abs_diff": 3.5, "tolerance": 5e-3, "passed": False}
    for rec in (_record("quantized", 20.0, ok), _record("threads", 5.0, wrong), _record("kv_cache", 40.0, None)):
        (tmp_path / f"{rec['stage']}.json").write_text(json.dumps(rec))
    res = charts.load_results(tmp_path)
    assert res.names == ["kv_cache", "quantized"] and [r["stage"] for r in res.failed] == ["threads"]
    table = charts.results_table(res)
    assert "| threads | **failed validation** |" in table and "3.500 > 0.005" in table
    assert "5.0 |" not in table.split("threads")[1].splitlines()[0]             # its decode figure is not shown
    assert "not validated in the run that measured them" in table and "kv_cache" in table.split("not validated")[1]
