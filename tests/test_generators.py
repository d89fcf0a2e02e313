"""The summaries and pages drawn from records, on made-up records whose figures are worked out
by hand here (tests/test_records.py checks the committed pages against their records, which
only shows a generator agrees with itself): app/measure/compare.py's summary and page,
app/measure/kernel_bench.py's page, app/measure/loadtest.py's percentile, summary and round ratios.
"""

from __future__ import annotations

import math

import pytest

from app.measure import compare, kernel_bench, loadtest, spec_serve

PROVENANCE = {"commit": "abcdef0123456789", "code_hash": "c0de", "dirty": False}


def run(decode, ttft, rss, tokens):
    return {"decode_ms": decode, "ttft_ms": ttft, "peak_rss_mb": rss, "tokens": tokens}


def comparison(quantized_rounds=3) -> dict:
    """Three rows, three rounds: kv_cache, quantized (which builds on kv_cache) and llama.cpp."""
    runs = {
        "kv_cache@1": [run(40, 400, 100, [1, 2, 3, 4]), run(50, 500, 110, [1, 2, 3, 4]), run(45, 450, 105, [1, 2])],
        "quantized@1": [run(20, 100, 50, [1, 2, 3, 9]), run(30, 120, 50, [1]), run(22, 110, 60, [1])],
        "llama.cpp@1": [run(10, 50, 40, [1, 2, 3, 4, 5]), run(10, 60, 40, [1]), run(11, 55, 40, [1])],
    }
    runs["quantized@1"] = runs["quantized@1"][:quantized_rounds]
    return {
        "kind": "comparison", "model": "tiny.gguf", "n_params": 135e6, "file_size": 100e6, "synthetic": False,
        "settings": {"prompt_tokens": 128, "n_predict": {"kv_cache": 16, "quantized": 16, "llama.cpp": 32},
                     "threads": [1], "rounds": 3, "n_ctx": 2048, "sampling": "greedy, EOS ignored",
                     "order": "alternating (forward, backward, ...)"},
        "rows": [{"row": r, "engine": r.split("@")[0], "threads": 1} for r in runs],
        "runs": runs, "bandwidth_gbs": {"1": 20.0}, "decode_floor_ms": {"1": 5.0},
        "machine": {"cpu": "Test CPU", "physical_cores": 2}, "provenance": PROVENANCE,
        "command": "python -m app bench vs-llama --rounds 3", "time": "2025-01-01T00:00:00+0000",
    }


def test_the_comparison_summary_is_medians_of_the_rounds_ratios():
    s = compare.summary(comparison())
    kv, q, llama = s["kv_cache@1"], s["quantized@1"], s["llama.cpp@1"]
    assert (kv["decode_ms"], kv["ttft_ms"], kv["peak_rss_mb"], kv["rounds"]) == (45, 450, 105, 3)
    # per round 40/10, 50/10, 45/11: the median is 45/11, not the ratio of the medians (45/10)
    assert kv["decode_ms_over_llama_cpp"] == pytest.approx(45 / 11)
    assert kv["ttft_ms_over_llama_cpp"] == pytest.approx(450 / 55)             # 8, 8.33, 8.18
    assert "decode_ms_over_builds_on" not in kv                                # simd was not measured
    assert q["decode_ms_over_llama_cpp"] == pytest.approx(2.0)                 # 2, 3, 2
    assert q["decode_ms_over_builds_on"] == pytest.approx(0.5) and q["builds_on_row"] == "kv_cache@1"  # .5 .6 .49
    assert q["ttft_ms_over_builds_on"] == pytest.approx(110 / 450)             # .25, .24, .244
    assert "decode_ms_over_llama_cpp" not in llama and "decode_ms_over_builds_on" not in llama
    assert (kv["decode_over_floor"], q["decode_over_floor"], llama["decode_over_floor"]) == (9.0, 4.4, 2.0)
    assert kv["same_tokens_as_first_row"] and llama["same_tokens_as_first_row"]    # as far as both went
    assert not q["same_tokens_as_first_row"]                                   # 9 where kv_cache has 4


def test_rounds_that_do_not_pair_are_an_error_not_dropped():
    """quantized measured in 2 rounds of 3: zip would pair its rounds with kv_cache's first two
    and drop the third without a word."""
    with pytest.raises(ValueError, match="quantized@1 has 2 rounds and llama.cpp@1 3"):
        compare.summary(comparison(quantized_rounds=2))


def test_the_comparison_page_shows_the_summary():
    page = compare.page(comparison(), "profiles/bench/vs_llama_tiny.json")
    lines = page.splitlines()
    assert lines[0] == "# tiny.gguf: the stages beside llama.cpp"
    assert "`profiles/bench/vs_llama_tiny.json`" in lines[2] and "Test CPU (2 cores)" in lines[2]
    assert "commit abcdef0 (code c0de)" in lines[2]
    assert lines[4].startswith("135M parameters; prompt 128 tokens, then kv_cache 16, quantized 16, llama.cpp 32 "
                               "tokens generated") and "3 rounds" in lines[4]
    rows = [line for line in lines if line.startswith("| ") and "@1" in line]
    assert rows == [
        "| kv_cache@1 | 450.0 | 45.0 | 4.09 | 8.18 | - | 9.00 | 105 | yes |",
        "| quantized@1 | 110.0 | 22.0 | 2.00 | 2.00 | 0.50 (kv_cache@1) | 4.40 | 50 | no |",
        "| llama.cpp@1 | 55.0 | 10.0 | - | - | - | 2.00 | 40 | yes |",
    ]
    assert "5.0 ms at 1 thread(s) (20.0 GB/s)" in page


def kernels_record() -> dict:
    base = {"model": "m.gguf", "matrices": 2, "weights": 4_000_000, "bytes": 3 * 2**20}
    return {"kind": "kernels", "passes": 5, "machine": {"cpu": "Test CPU"}, "provenance": PROVENANCE,
            "time": "2025-01-01T00:00:00+0000", "command": "python -m app bench kernels",
            "results": [dict(base, type="Q4_1", kernels="quantized", cpu_s=0.002),
                        dict(base, type="Q4_1", kernels="int8", cpu_s=0.001),
                        dict(base, type="Q5_0", kernels="int8", cpu_s=0.004)]}


def test_the_kernels_page_is_throughput_and_the_ratio_to_quantized():
    page = kernel_bench.page(kernels_record(), "profiles/bench/kernels.json")
    assert "_Generated from `profiles/bench/kernels.json`; do not edit. Measured on Test CPU with commit abcdef0 " \
           "(code c0de)" in page and "the least CPU time of 5 passes" in page
    rows = [line for line in page.splitlines() if line.startswith("| m.gguf")]
    # 4e6 weights / 0.002 s = 2.00 Gweights/s; 3 MiB / 0.002 s = 1.57 GB/s; int8 twice that; Q5_0: no quantized row
    assert rows == ["| m.gguf | Q4_1 | quantized | 2 | 4 | 3 | 2.00 | 1.57 | 1.00x |",
                    "| m.gguf | Q4_1 | int8 | 2 | 4 | 3 | 4.00 | 3.15 | 2.00x |",
                    "| m.gguf | Q5_0 | int8 | 2 | 4 | 3 | 1.00 | 0.79 | - |"]


def test_the_load_tests_percentile_is_the_nearest_rank():
    xs = [7, 1, 10, 4, 2, 9, 3, 8, 6, 5]                   # 1..10, unsorted
    assert loadtest.percentile(xs, 0) == 1 and loadtest.percentile(xs, 100) == 10
    assert loadtest.percentile(xs, 50) == 5                # rank round(0.5 x 9) = 4 (half to even): the 5th
    assert loadtest.percentile(xs, 99) == 10               # rank round(8.91) = 9
    assert loadtest.percentile(xs, 25) == 3                # rank round(2.25) = 2
    assert loadtest.percentile([42], 99) == 42
    assert math.isnan(loadtest.percentile([], 50))
    assert xs == [7, 1, 10, 4, 2, 9, 3, 8, 6, 5]           # the caller's list is left as it was


def test_the_load_tests_level_is_the_median_of_its_rounds():
    rounds = [{"clients": 4, "tokens_per_s": 10.0, "ttft_ms_p50": 100, "kv_pages_used_max": 7, "server": "a"},
              {"clients": 4, "tokens_per_s": 30.0, "ttft_ms_p50": 300, "server": "a"},
              {"clients": 4, "tokens_per_s": 20.0, "ttft_ms_p50": 200, "kv_pages_used_max": 9, "server": "a"}]
    row = loadtest.summary(rounds)
    assert row["clients"] == 4 and row["rounds"] is rounds
    assert row["tokens_per_s"] == 20.0 and row["ttft_ms_p50"] == 200
    assert row["kv_pages_used_max"] == 8                   # the median of the rounds that sampled it
    assert "server" not in row                             # not a figure


def test_the_load_tests_ratios_pair_the_rounds():
    ours = {"clients": 4, "rounds": [{"tokens_per_s": 10.0}, {"tokens_per_s": 30.0}, {"tokens_per_s": 20.0}]}
    theirs = {"clients": 4, "rounds": [{"tokens_per_s": 5.0}, {"tokens_per_s": 10.0}, {"tokens_per_s": 40.0}]}
    assert loadtest.round_ratios(ours, theirs) == [2.0, 3.0, 0.5]
    with pytest.raises(ValueError, match="4 clients: ours has 3 rounds and llama-server 2"):
        loadtest.round_ratios(ours, dict(theirs, rounds=theirs["rounds"][:2]))


def test_the_load_test_names_a_server_slower_than_run():
    """One client through the server against `run`, paired round by round: a decode ratio under
    SERVE_VS_RUN_FLOOR is named (fused padded a lone row to 8 rows through its tiles, 5x slower
    in the server than in run); at the floor and above, nothing is said."""
    def rec(server_ms, run_ms):
        one = {"clients": 1, "rounds": [{"tokens_per_s": 1.0, "itl_ms_p50": ms} for ms in server_ms]}
        return {"engines": {loadtest.OURS: [one]}, "settings": {"stage": "fused"},
                "run": {"rounds": [{"tokens_per_s": 1.0, "itl_ms_p50": ms} for ms in run_ms]}}
    floor = loadtest.SERVE_VS_RUN_FLOOR
    assert loadtest.serving_gaps(rec([10.0, 10.0, 10.0], [10 * floor] * 3)) == []
    gaps = loadtest.serving_gaps(rec([50.0, 40.0, 10.0], [10.0, 10.0, 10.0]))       # 0.2, 0.25, 1.0: median 0.25
    assert len(gaps) == 1 and "0.25x" in gaps[0] and "fused" in gaps[0]


# ---- bench loadtest --spec: speculation in the server (app/measure/spec_serve.py) ------------------

def spec_round(plain_tps, lookup_tps, drafted=0, accepted=0):
    """A round: decode rates as given, whole-request rates half of them."""
    return {spec_serve.PLAIN: {"decode_tokens_per_s_p50": plain_tps, "tokens_per_s": plain_tps / 2},
            spec_serve.LOOKUP: {"decode_tokens_per_s_p50": lookup_tps, "tokens_per_s": lookup_tps / 2,
                                "drafted": drafted, "accepted": accepted}}


def spec_record() -> dict:
    """copy at 1 client: ratios 2.0, 1.5, 1.9 (median 1.9), 30 of 40 guesses kept; free at 8
    clients: 0.9, 1.0, 0.95 (median 0.95). One verify curve: c(1..3) = 1, 1.1, 1.5."""
    return {"kind": "speculative_serve", "levels": [
        {"set": "copy", "clients": 1, "rounds": [spec_round(10, 20, 10, 8), spec_round(20, 30, 20, 14),
                                                 spec_round(10, 19, 10, 8)]},
        {"set": "free", "clients": 8, "rounds": [spec_round(100, 90, 4, 1), spec_round(100, 100, 0, 0),
                                                 spec_round(100, 95, 2, 0)]}],
        "verify": [{"model": "tiny.gguf", "context": 64, "k": [0, 1, 2], "ms": [[2.0, 2.2, 3.0]],
                    "ratio": [1.0, 1.1, 1.5], "step_ms": 2.0}],
        "settings": {"model": "m.gguf", "stage": "repack", "threads": 2, "rounds": 3, "requests": 4,
                     "max_tokens": 64, "draft_max": 16},
        "machine": {"cpu": "a CPU"}, "provenance": PROVENANCE, "load_average": {"start": "0.1", "end": "0.2"}}


def test_the_spec_load_tests_table_is_worked_out_from_its_rounds():
    rec = spec_record()
    copy1, free8 = rec["levels"]
    assert spec_serve.round_ratios(copy1) == [2.0, 1.5, 1.9] and spec_serve.accept_rate(copy1) == 0.75
    assert spec_serve.round_ratios(free8) == [0.9, 1.0, 0.95] and spec_serve.accept_rate(free8) == pytest.approx(1 / 6)
    # the speedup at a = 0.75: k = 1 gives 1.75 / 1.1 = 1.59; k = 2 gives 2.3125 / 1.5 = 1.54
    gain, k = spec_serve.speedup([1.0, 1.1, 1.5], 0.75)
    assert (k, gain) == (1, pytest.approx(1.75 / 1.1))
    text = spec_serve.page(rec, "r.json")
    assert spec_serve.round_ratios(copy1, "tokens_per_s") == [2.0, 1.5, 1.9]
    assert "| copy | 1 | 10.0 / 20.0 | 1.90x | 2.00, 1.50, 1.90 | 5.0 / 10.0 | 1.90x | 75% |" in text
    assert "| free | 8 | 100.0 / 95.0 | 0.95x | 0.90, 1.00, 0.95 | 50.0 / 47.5 | 0.95x | 17% |" in text
    assert "| c(k+1) | 1.00x | 1.10x | 1.50x |" in text and "(75%): 1.59x tokens per unit of time, with k = 1" in text
    assert "| copy, 1 client(s): lookup / plain, decode | 1.90x | >= 1.80x | yes |" in text
    assert "| free, 8 client(s): lookup / plain, decode | 0.95x | >= 0.97x | no |" in text
    assert "copy, 4 client(s)" not in text                   # a level not measured is not a row
