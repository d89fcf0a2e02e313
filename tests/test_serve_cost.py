"""The serve-cost benchmark (app/measure/serve_cost.py) on rounds written here: nothing is timed.
A ratio is taken within a round and the figure is the median of the rounds' ratios (planted: the
ratio of the medians); the claim fails under the target on the streamed decode alone (planted: judged
on the whole requests); the page shows the record's figures."""

from __future__ import annotations

import pytest

from app.measure import llama_tools, serve_cost
from common.generate import ParameterError


def round_(run: float, stream: float, whole: float) -> dict:
    return {"run": {"decode": run, "whole": run * 0.9, "tokens": 64}, "stream": stream, "whole": whole,
            "outside_forward": 0.05}


# run slow in the second round (the machine busy), the server slow alone in the third
ROUNDS = [round_(100, 90, 81), round_(50, 45, 40.5), round_(80, 40, 36)]


def ratio_of_medians(rounds):
    """A planted summary(): the ratio of the medians."""
    import statistics
    med = statistics.median
    return {"rounds": rounds, "outside_forward": 0.05,
            "ratio_stream": med(r["stream"] for r in rounds) / med(r["run"]["decode"] for r in rounds),
            "ratio_whole": med(r["whole"] for r in rounds) / med(r["run"]["whole"] for r in rounds)}


def summary_problems() -> list[str]:
    got = serve_cost.summary(ROUNDS)
    return [f"{k}: {got[k]:.4f}, not {v}" for k, v in (("ratio_stream", 0.9), ("ratio_whole", 0.9))
            if abs(got[k] - v) > 1e-9]


def test_the_ratios_are_taken_within_a_round(monkeypatch):
    assert summary_problems() == []
    monkeypatch.setattr(serve_cost, "summary", ratio_of_medians)
    assert summary_problems() != []


def record(stream: float, whole: float) -> dict:
    return {"kind": "serve_cost", "model": "m.gguf", "stage": "prefill", "threads": 2, "tokens": 64,
            "target": serve_cost.TARGET, "load_average": [0.1, 0.1, 0.1], "ratio_stream": stream,
            "ratio_whole": whole, "outside_forward": 0.04, "rounds": serve_cost.summary(ROUNDS)["rounds"],
            "machine": {"cpu": "a CPU", "physical_cores": 2, "isa": "avx2"}, "provenance": {"code_hash": "abc"}}


def whole_judged(rec):
    """A planted failures(): the claim judged on the whole requests."""
    return serve_cost.failures(dict(rec, ratio_stream=rec["ratio_whole"]))


@pytest.mark.parametrize("failures", [serve_cost.failures, whole_judged])
def test_the_claim_is_the_streamed_decode_at_the_target(failures):
    t = serve_cost.TARGET
    verdicts = [bool(failures(record(stream, whole))) for stream, whole in
                ((t, 0.5), (t - 0.01, 1.0), (t + 0.05, t + 0.05))]
    assert (verdicts == [False, True, False]) == (failures is serve_cost.failures), verdicts


def test_the_page_shows_the_records_figures():
    page = serve_cost.page(record(0.912, 0.987), "profiles/bench/serve_cost.json")
    for text in ("0.912x", "0.987x", "0.90, 0.90, 0.50", "prefill", "2 threads", "64 tokens", "a CPU",
                 "profiles/bench/serve_cost.json", "4.0%"):
        assert text in page, text


def with_llama(rounds, theirs):
    return [dict(r, llama={"stream": s, "decode": d}) for r, (s, d) in zip(rounds, theirs)]


# llama-server's own decode differs from run's in every round: a stream judged against run's is caught
LLAMA_ROUNDS = with_llama(ROUNDS, [(90, 120), (45, 60), (40, 60)])


def against_run(rounds):
    """A planted summary(): llama-server's stream against our `run`, not against its own decode."""
    return serve_cost.summary([dict(r, llama=dict(r["llama"], decode=r["run"]["decode"])) for r in rounds])


@pytest.mark.parametrize("summary", [serve_cost.summary, against_run])
def test_llama_servers_stream_is_set_against_its_own_decode_within_a_round(summary):
    got = summary(LLAMA_ROUNDS)["llama"]
    # rounds' ratios 0.75, 0.75, 0.667; the stream's ms a token 11.1 - 8.3, 22.2 - 16.7, 25 - 16.7
    right = abs(got["ratio_stream"] - 0.75) < 1e-9 and abs(got["streaming_ms"] - (1e3 / 45 - 1e3 / 60)) < 1e-9
    assert right == (summary is serve_cost.summary), got


def test_the_page_sets_llama_servers_stream_beside_ours():
    rec = dict(record(0.912, 0.987), rounds=serve_cost.summary(LLAMA_ROUNDS)["rounds"],
               llama=serve_cost.summary(LLAMA_ROUNDS)["llama"], settings={"llama_server": "models/llama-server/x"})
    page = serve_cost.page(rec, "profiles/bench/serve_cost.json")
    # ours: the rounds' 1000/stream - 1000/run are 1.11, 2.22 and 12.5 ms; run's median decode 80 a second
    for text in ("| llama-server, streamed: decode | 45.0 | 0.750x", "0.75, 0.75, 0.67", "ours 2.22 ms on a step of "
                 "12.50 ms", "llama-server 5.56 ms on a step of 16.67 ms", "models/llama-server/x"):
        assert text in page, text
    assert "llama-server" not in serve_cost.page(record(0.912, 0.987), "r.json")


def unchecked(choice):
    """A planted server_binary(): any path taken as given."""
    from pathlib import Path
    return Path(choice) if choice else None


@pytest.mark.parametrize("server_binary", [llama_tools.server_binary, unchecked])
def test_a_llama_server_that_is_not_there_is_refused_by_name(server_binary, tmp_path):
    missing = tmp_path / "llama-server"
    try:
        server_binary(str(missing))
        said = None
    except ParameterError as e:
        said = str(e)
    assert (said == f"no llama-server at {missing}") == (server_binary is llama_tools.server_binary), said
    assert server_binary(None) is None
