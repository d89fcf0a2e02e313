"""The report's charts and README table, drawn from a committed fixture (tests/fixtures/report):
four stage records (tiling's decode figure is NaN), llama.cpp at 1 and 2 threads, and machine.json;
'quantized' is expected but has no record."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from app.report import charts
from tests.util import expected_isa

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


def test_the_report_compiles_its_stages_in_make_compiles_order(monkeypatch):
    """The report warms the cache in app/compile.py's order (repack before fused, which then loads
    repack's stack instead of compiling it again), whatever order it measures in; cuda is left to nvcc."""
    from app.report import report
    jobs = []
    monkeypatch.setattr(report, "compile_all", lambda todo, model, at_once: jobs.append(todo))
    report.warm_the_cache(["naive", "fused", "repack", "cuda", "prefill"], Path("m.gguf"))
    assert jobs == [["repack", "prefill", "fused", "naive"]]


@pytest.mark.parametrize("params, measured", [(135e6, ["naive", "tiling", "simd"]), (1.1e9, ["simd"])])
def test_report_leaves_the_recompute_stages_out_on_large_models(monkeypatch, tmp_path, capsys, params, measured):
    """Above a stage's max_params (naive and tiling: LARGE_MODEL_PARAMS) the stage would take tens
    of minutes: left out, and said so; the rest compiled first (none measured while numba compiles
    it: its peak RSS would hold LLVM's), then measured, and another model's table written beside
    its charts."""
    from app.report import report
    from stages.registry import LARGE_MODEL_PARAMS
    calls = []
    monkeypatch.setattr(report, "compile_all", lambda jobs, model, at_once: calls.append(("compiled", jobs, model)))
    rec = dict(fixture_record("simd"), stage="simd")

    def fake_measure(stage, model, folder, threads=None, workload=None):
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
    monkeypatch.setattr(report.lessons, "write", lambda out_dir, results_dir=None: [])
    model = tmp_path / "big.gguf"
    model.write_bytes(b"not read: model_params is stubbed")
    report.run(model=str(model), baseline=False)
    assert calls == [("compiled", measured, str(model))] + measured
    err = capsys.readouterr().err
    assert ("skipping naive: a 1.1B-parameter model" in err) == (params > LARGE_MODEL_PARAMS)
    assert (tmp_path / "profiles" / "big" / "results.md").read_text().count("| simd |") == 1


# ---- the article's workload ------------------------------------------------------------------

def test_the_article_workload_measures_every_stage_at_512_tokens(monkeypatch, tmp_path):
    """--article: TinyLlama's geometry, a 512-token prompt, every stage (naive and tiling too: the
    harness extrapolates them), 2 tokens for the stages without a KV cache and 16 for the others,
    into <model>-prompt512 beside the model's own folder, and the ledger drawn."""
    from app.report import report
    calls, drawn, compiled = [], [], []
    monkeypatch.setattr(report, "compile_all", lambda jobs, model, at_once: compiled.append((jobs, model)))

    def fake_measure(stage, model, folder, threads=None, workload=None):
        calls.append((stage, workload.prompt_tokens, workload.n_predict(stage), workload.profile_n(stage)))
        folder.mkdir(parents=True, exist_ok=True)
        rec = dict(fixture_record("simd"), stage=stage)
        (folder / f"{stage}.json").write_text(json.dumps(rec))
        return rec

    model = tmp_path / "tinyllama-1.1b-synthetic.Q4_K_M.gguf"
    model.write_bytes(b"not read")
    monkeypatch.setattr(report, "article_model", lambda: model)
    monkeypatch.setattr(report, "model_params", lambda model: 1.1e9)
    monkeypatch.setattr(report, "measure_stage", fake_measure)
    monkeypatch.setattr(report, "measure_machine", lambda folder, force=False: {})
    monkeypatch.setattr(report, "PROFILES", tmp_path / "profiles")
    monkeypatch.setattr(report, "results_dir", lambda name: tmp_path / "results" / "m" / Path(name).stem)
    monkeypatch.setattr(report, "runnable_stages", lambda: ["naive", "tiling", "simd", "kv_cache", "quantized"])
    monkeypatch.setattr(report.lessons, "write", lambda out_dir, results_dir=None: drawn.append(out_dir) or [])
    report.run(article=True, baseline=False)
    assert compiled == [(["naive", "tiling", "simd", "kv_cache", "quantized"], str(model))]
    assert calls == [("naive", 512, 2, 0), ("tiling", 512, 2, 0), ("simd", 512, 2, 0), ("kv_cache", 512, 16, 0),
                     ("quantized", 512, 16, 0)]
    folder = tmp_path / "results" / "m" / "tinyllama-1.1b-synthetic.Q4_K_M-prompt512"
    assert sorted(p.name for p in folder.glob("*.json")) == [f"{s}.json" for s in sorted(c[0] for c in calls)]
    assert (tmp_path / "profiles" / folder.name / "results.md").exists()
    assert drawn == [tmp_path / "profiles"]


def test_the_article_workload_says_how_to_get_its_model(monkeypatch, tmp_path):
    from app import models
    from app.report import report
    for name in ("tinyllama", "tinyllama-synthetic"):
        monkeypatch.setitem(models.MODELS, name, models.ModelSource(name, "absent.gguf", "absent"))
    monkeypatch.setattr(models, "MODELS_DIR", tmp_path)
    with pytest.raises(models.FetchError, match="make model name=tinyllama-synthetic"):
        report.article_model()


def test_an_extrapolated_stage_is_marked_in_the_table(res):
    rec = next(r for r in res.stages if r["stage"] == "naive")
    rec["extrapolated"] = {"layers_measured": 1, "n_layer": 22, "method": "..."}
    table = charts.results_table(res)
    assert "| naive (extrapolated) |" in table and "ran 1 of 22 layers" in table


def test_extrapolation_is_linear_in_the_layers(default_model_path, monkeypatch):
    """The harness's extrapolation, on timings made up to cost 10 ms + 3 ms per layer of prompt
    and 2 ms + 0.5 ms per layer a token: t(0) + L x (t(n) - t(0)) / n gives exactly the whole
    model's figures, from the layers layers_to_measure picks and none, and the engine is whole
    again afterwards. (Whether real timings extrapolate that well is a measurement:
    scripts/bench_harness.py.)"""
    import dataclasses

    from app.measure import bench
    from stages import load
    engine = load("tiling", default_model_path)
    real = bench.counted_generate

    def made_up(engine, prompt, n_predict):
        gen, counters = real(engine, prompt, n_predict)
        L = len(engine.layers)
        return dataclasses.replace(gen, ttft_ms=10 + 3 * L, decode_ms=[2 + 0.5 * L] * len(gen.decode_ms)), counters
    monkeypatch.setattr(bench, "counted_generate", made_up)
    # how many layers layers_to_measure picks follows the last-level cache; pinned here to what
    # two layers' weights fill, whatever this machine's cache is (a large one picks every layer)
    layer_bytes = sum(engine.backend.weight_bytes(w) for w in vars(engine.layers[0]).values())
    monkeypatch.setattr(bench.roofline, "cache_bytes", lambda: {"L3": 2 * layer_bytes})
    assert bench.layers_to_measure(engine) == 4                         # twice the cache: 4 layers
    rec = bench.measure_extrapolated(engine, "tiling", 8, 3)
    e, n = rec["extrapolated"], len(engine.layers)
    assert e["n_layer"] == n == 30 and e["layers_measured"] == 4
    k = e["layers_measured"]
    assert set(e["measured"]) == {"0", str(k)}
    assert e["measured"]["0"]["ttft_ms"] == 10 and e["measured"][str(k)]["ttft_ms"] == 10 + 3 * k
    assert rec["ttft_ms"] == pytest.approx(10 + 3 * n) and rec["decode_ms"] == pytest.approx(2 + 0.5 * n)
    assert len(engine.layers) == n                                      # the engine is whole again
    monkeypatch.setattr(bench.roofline, "cache_bytes", lambda: {"L3": 64 * n * layer_bytes})
    assert bench.layers_to_measure(engine) == n                         # a cache larger than the model: all


# ---- the roofline ----------------------------------------------------------------------------

def test_the_bandwidth_probe_sums_every_chunk_and_leaves_the_thread_count():
    """The probe's parallel sum is the serial one's (every chunk summed once), its figures are
    ordered (best >= median) and numba's thread count is what it was. How the GB/s on N threads
    compare with one thread's is a measurement: scripts/bench_harness.py."""
    import numba
    import numpy as np

    from app.measure import roofline
    a = np.arange(1 << 12, dtype=np.float32) % 7
    for n_chunks in (1, 2, 8):
        assert roofline._sum_parallel(a, n_chunks) == a.sum() == roofline._sum(a)
    before = numba.get_num_threads()
    best, median = roofline.bandwidth_gbs(np.ones(1 << 16, np.float32), 2, reps=3)
    assert best >= median > 0 and numba.get_num_threads() == before


@pytest.mark.skipif(expected_isa() is None, reason="the integer peak's loop needs AVX2 + F16C: "
                    "numba's target has neither VNNI nor AVX2 here")
def test_the_integer_peak_does_every_chains_products(monkeypatch):
    """The peak's loop runs INT_CHAINS dot products a round, each its own: compiled in the AVX2
    form (and the VNNI form where the target has it), the code holds a vpmaddubsw (or a vpdpbusd)
    per chain (the vpmaddwd and vpaddd after it LLVM may fuse into vpdpwssd where the target has
    VNNI). With one signed operand shared by every chain LLVM computed the AVX2 products once a
    round and added them to each chain: the loop timed vpaddd, not the products."""
    import collections

    import numba

    from app.measure import roofline
    from stages.kernels import vector_ir
    wanted = {"avx2": "vpmaddubsw", "vnni": "vpdpbusd"}
    for isa in ("avx2", "vnni") if expected_isa() == "vnni" else ("avx2",):
        monkeypatch.setattr(vector_ir, "ISA", isa)
        monkeypatch.setattr(vector_ir, "ZMM", vector_ir.has_zmm() and isa == "vnni")

        @numba.njit
        def peak(reps):
            return roofline._int_dots(reps)
        peak(3)                                                  # compiled
        asm = "\n".join(peak.inspect_asm().values())
        counts = collections.Counter(line.split()[0] for line in asm.splitlines() if line.strip())
        assert counts[wanted[isa]] >= roofline.INT_CHAINS, (isa, counts[wanted[isa]])


def test_naive_and_tiling_traffic_follows_their_loop_order():
    from app.measure import roofline
    caches = {"L1d": 32 * 2**10, "L2": 2**20, "L3": 8 * 2**20}
    small, big = (576, 1536), (2048, 5632)                            # 3.4 MiB fits L3; 44 MiB does not
    assert roofline.loop_order_bytes("naive", *small, rows=33, caches=caches) == 4 * 576 * 1536
    assert roofline.loop_order_bytes("naive", *big, rows=33, caches=caches) == 33 * 4 * 2048 * 5632
    assert roofline.loop_order_bytes("tiling", *big, rows=33, caches=caches) == 5 * 4 * 2048 * 5632   # ceil(33/8)
    assert roofline.loop_order_bytes("simd", *big, rows=33, caches=caches) is None
    tiny_l2 = {"L2": 64 * 2**10, "L3": 2**20}                          # 2048 lines of one column walk overflow L2
    assert roofline.loop_order_bytes("naive", *big, rows=1, caches=tiny_l2) == 16 * 4 * 2048 * 5632
    assert roofline.cache_bytes({"L1d": "48K", "L1i": "32K", "L2": "2048K", "L3": "32M"}) == \
        {"L1d": 48 * 2**10, "L2": 2 * 2**20, "L3": 32 * 2**20}


def test_the_roofline_places_a_stage_by_its_modelled_traffic():
    rec = fixture_record("naive")
    plain = {kind: x for kind, x, _ in charts.roofline_points(rec)}
    traffic = {"method": "modelled", "prefill_bytes": 10 * rec["weights_stream_bytes"],
               "decode_bytes": 20 * rec["weights_stream_bytes"]}
    modelled = {kind: x for kind, x, _ in charts.roofline_points(dict(rec, traffic=traffic))}
    assert modelled["prefill"] < plain["prefill"] and modelled["decode"] < plain["decode"]
    assert charts.roofline_basis(dict(rec, traffic={"method": "modelled"})) == "modelled traffic"
    assert charts.roofline_basis(rec) == "minimum bytes"


def test_draw_only_without_this_machines_records_stops_and_redraws_nothing(tmp_path, monkeypatch):
    """A machine with no records of its own: --draw-only says so and names the machines that have
    some, rather than drawing empty pages over the committed ones (the planted twin: with a record
    in its folder it goes on to draw, stopped here before it writes)."""
    from app.report import report
    folder = tmp_path / "this-cpu" / "m"
    (tmp_path / "other-cpu" / "m").mkdir(parents=True)
    (tmp_path / "other-cpu" / "m" / "repack.json").write_text("{}")
    monkeypatch.setattr(report, "results_dir", lambda name: folder)
    monkeypatch.setattr(report, "resolve", lambda model: Path("m.gguf"))
    monkeypatch.setattr(report, "model_params", lambda model: 1)
    monkeypatch.setattr(report, "draw", lambda *a, **k: pytest.fail("drew pages without this machine's records"))
    with pytest.raises(SystemExit, match=r"no records of this machine \(this-cpu\) for m .*of other-cpu"):
        report.run(draw_only=True)
    folder.mkdir(parents=True)
    (folder / "repack.json").write_text("{}")

    class Drawn(Exception):
        pass

    def drawn(*a, **k):
        raise Drawn
    monkeypatch.setattr(report, "draw", drawn)
    with pytest.raises(Drawn):
        report.run(draw_only=True)
