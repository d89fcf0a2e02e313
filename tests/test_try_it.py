"""The chapters' "Try it" experiments (exercises/NN_name/experiments.py, `make try-it ch=NN`):
every one runs at its quick settings and writes its record, each measurement a finite number
under its label; a prediction is printed before the measurement; an experiment that measures
NaN is refused (a planted one). The experiments that run the default model take the
default_model_path fixture: where the model is missing the suite says which make target
fetches it. Costs: the experiments that load stages dominate (a few seconds each, warm cache).
"""

from __future__ import annotations

import json

import pytest

from exercises import try_it

CHAPTERS = list(try_it.chapters())
REQUIRED = ["01", "02", "03", "04", "05", "07", "08", "09", "10", "11", "12", "13", "14", "15"]


def test_every_required_chapter_has_two_or_three_experiments():
    assert [c for c in REQUIRED if c not in CHAPTERS] == []
    for ch in CHAPTERS:
        _, exps = try_it.experiments(ch)
        assert 2 <= len(exps) <= 3, ch
        for e in exps:
            assert e.knob and len(e.predict) > 60, (ch, e.name)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_experiments_run_at_quick_settings(chapter, tmp_path, request):
    _, exps = try_it.experiments(chapter)
    if any(e.model for e in exps):
        request.getfixturevalue("default_model_path")
    lines = []
    records = try_it.run(chapter, quick=True, out=lines.append, results_dir=tmp_path)
    text = "\n".join(lines)
    assert [r["experiment"] for r in records] == [e.name for e in exps]
    for e in exps:                                       # the prediction comes before the figures
        assert text.index(f"predict:  {e.predict}") < text.index("measured:", text.index(f"· {e.name}"))
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["quick"] is True and saved["machine"]
    assert [r["experiment"] for r in saved["experiments"]] == [e.name for e in exps]
    assert all(r["rows"] for r in saved["experiments"])


def test_a_measurement_that_is_not_a_number_is_refused(monkeypatch, tmp_path):
    _, exps = try_it.experiments("03")
    broken = [try_it.Experiment(e.name, e.knob, e.predict, lambda quick: {"rows": [("x", float("nan"), "ms")]})
              for e in exps[:1]]
    real = try_it.experiments
    monkeypatch.setattr(try_it, "experiments", lambda ch: (real(ch)[0], broken))
    with pytest.raises(ValueError, match="measured nan, not a number"):
        try_it.run("03", quick=True, out=lambda s: None, results_dir=tmp_path)


def test_an_unknown_experiment_names_the_chapters_own(capsys):
    assert try_it.main(["02", "tile_q"]) == 2
    assert "chapter 02 has no experiment 'tile_q': tile_k, b_width, aliasing" in capsys.readouterr().err
