"""The report's charts and README table, drawn from a committed fixture (tests/fixtures/report):
four stage records (tiling's decode figure is NaN), llama.cpp at 1 and 2 threads, and machine.json;
'quantized' is expected but has no record."""

from __future__ import annotations

import dataclasses
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
        ttft, decode = (float(c.replace(",", "")) for c in rows[stage][:2])
        assert ttft == pytest.approx(rec["ttft_ms"], abs=0.05)
        assert decode == pytest.approx(rec["decode_ms"], abs=0.05)
    # speedups over naive and over the stage before, from the decode figures
    assert rows["simd"][2] == f"{8500 / 420:,.1f}x" and rows["kv_cache"][3] == f"{420 / 30:,.2f}x"
    # × the floor: the fixture's 540 MB of weights at its 2-thread 15 GB/s is 36 ms; no prompt floor
    # (no record says its prompt's operations)
    assert rows["simd"][5] == f"{420 / 36:.1f}×" and rows["kv_cache"][5] == f"{30 / 36:.2f}×"
    assert rows["simd"][4] == "-" and rows["llama.cpp (2 threads)"][5] == f"{5 / 36:.2f}×"
    assert "tiling" in table and "NaN" in table                  # the problem is stated under the table
    assert not re.search(r"\|\s*nan\s*\|", table, re.I)


def test_speedups_start_at_naive(res):
    ups = charts._speedups(res, "decode_ms")
    assert ups[0] == (None, None)
    assert ups[1][0] == pytest.approx(8500 / 420) and ups[2][1] == pytest.approx(420 / 30)


def test_op_shares_sum_to_one():
    shares = charts.op_shares(fixture_record("simd")["profile"])
    assert math.isclose(sum(shares.values()), 1.0)
    assert shares["output head (matmul)"] > 0 and shares["python overhead"] > 0


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
    `python -m app bench harness`.)"""
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
    monkeypatch.setattr(bench, "cache_sizes", lambda: {"L3": 2 * layer_bytes})
    assert bench.layers_to_measure(engine) == 4                         # twice the cache: 4 layers
    rec = bench.measure_extrapolated(engine, "tiling", 8, 3)
    e, n = rec["extrapolated"], len(engine.layers)
    assert e["n_layer"] == n == 30 and e["layers_measured"] == 4
    k = e["layers_measured"]
    assert set(e["measured"]) == {"0", str(k)}
    assert e["measured"]["0"]["ttft_ms"] == 10 and e["measured"][str(k)]["ttft_ms"] == 10 + 3 * k
    assert rec["ttft_ms"] == pytest.approx(10 + 3 * n) and rec["decode_ms"] == pytest.approx(2 + 0.5 * n)
    assert len(engine.layers) == n                                      # the engine is whole again
    monkeypatch.setattr(bench, "cache_sizes", lambda: {"L3": 64 * n * layer_bytes})
    assert bench.layers_to_measure(engine) == n                         # a cache larger than the model: all


# ---- the roofline ----------------------------------------------------------------------------

def test_the_bandwidth_probe_sums_every_chunk_and_leaves_the_thread_count():
    """The probe's parallel sum is the serial one's (every chunk summed once), its figures are
    ordered (best >= median) and numba's thread count is what it was. How the GB/s on N threads
    compare with one thread's is a measurement: `python -m app bench harness`."""
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
    from common.cpu import cache_sizes
    assert cache_sizes({"L1d": "48K", "L1i": "32K", "L2": "2048K", "L3": "32M"}) == \
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


# ---- the floor: weight bytes ÷ bandwidth, multiply-adds ÷ peak -----------------------------------

def floor_problems(res) -> list[str]:
    """Every "× floor" cell of the results table against the floor worked out here from the records
    alone: the fewest weight bytes any stage reads over machine.json's bandwidth at the most threads
    (decode), and the prompt's matmul operations over the integer peak at those threads (TTFT)."""
    m = res.machine
    top = max(m["bandwidth_gbs"], key=int)
    decode = min(r["weights_stream_bytes"] for r in res.stages) / (m["bandwidth_gbs"][top] * 1e9) * 1e3
    ops = next((r["prompt_matmul_ops"] for r in res.stages if r.get("prompt_matmul_ops")), None)
    peak = (m.get("int_peak_gops") or {}).get(top)
    ttft = ops / (peak * 1e9) * 1e3 if ops and peak else None
    problems = []
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in charts.results_table(res).splitlines() if line.startswith("| ") and "stage |" not in line}
    for r in res.stages + res.baselines:
        name = next(n for n in rows if n.split(" (")[0] == r["stage"] and
                    (r.get("kind") != "baseline" or f"({r['threads']} thread" in n))
        for col, key, floor in ((4, "ttft_ms", ttft), (5, "decode_ms", decode)):
            want = f"{charts._ratio(r[key] / floor)}×" if floor else "-"
            if rows[name][col] != want:
                problems.append(f"{name} {key}: {rows[name][col]}, the records give {want}")
    return problems


def _with_prompt_floor(res):
    for r in res.stages:
        r["prompt_matmul_ops"] = 32 * 2 * 1.0e8
    res.machine = dict(res.machine, int_peak_gops={"1": 200.0, "2": 400.0}, int_instruction="vpdpbusd (zmm)")
    return res


PLANTED_FLOORS = {
    "one thread's bandwidth": lambda f, res: dataclasses.replace(f, bandwidth_gbs=res.machine["bandwidth_gbs"]["1"]),
    "the float peak": lambda f, res: dataclasses.replace(f, peak_gops=res.machine["peak_gflops"]["2"]),
    "the largest weights": lambda f, res: dataclasses.replace(f, weight_bytes=2 * f.weight_bytes),
}


@pytest.mark.parametrize("plant", [None, *PLANTED_FLOORS])
def test_the_floor_column_is_each_time_over_the_machines_floor(res, monkeypatch, plant):
    """The "× floor" columns, checked against the floors worked out from the records alone; each
    planted wrong rule (the floor at one thread's bandwidth, at the float peak, on twice the bytes)
    is caught."""
    res = _with_prompt_floor(res)
    if plant:
        real = charts.floors
        monkeypatch.setattr(charts, "floors", lambda r: PLANTED_FLOORS[plant](real(r), r))
    problems = floor_problems(res)
    assert bool(problems) == bool(plant), problems
    if not plant:
        f = charts.floors(res)
        assert f.decode_ms == pytest.approx(540e6 / 15e9 * 1e3) and f.ttft_ms == pytest.approx(6.4e9 / 400e9 * 1e3)
        assert "540.0 MB of weights ÷ 15.0 GB/s = 36 ms" in charts.results_table(res)


def test_a_time_of_another_prompt_length_has_no_prompt_floor(res):
    """The prompt's floor is for the prompt its operations were counted on: a record of another
    prompt length gets '-', not a ratio against the wrong floor."""
    res = _with_prompt_floor(res)
    rec = next(r for r in res.stages if r["stage"] == "simd")
    rec["settings"] = dict(rec["settings"], prompt_tokens=512)
    f = charts.floors(res)
    assert f.times(rec, "ttft_ms") is None and f.times(rec, "decode_ms") == pytest.approx(420 / 36)


def test_the_answer_works_decode_out_from_the_records(res):
    """The README's first lines: decode's floor worked out (bytes ÷ bandwidth = ms) and the fastest
    stage against it, each number the records'; without a machine.json they say what to run."""
    text = charts.answer(res, "profiles/results/m/tiny-model")
    assert "540.0 MB of weights ÷ 15.0 GB/s = 36 ms a token" in text
    assert "the fastest stage here, kv_cache, takes 30.00 ms (0.8× that floor)" in text
    assert "naive, decodes at 236× the floor" in text
    res.machine = None
    assert "`make report` measures them" in charts.answer(res, "x")


# ---- the journey chart -----------------------------------------------------------------------------

def test_the_journey_draws_the_floor_and_highlights_one_stage(res):
    """Both panels carry the floor as a dashed vertical line at the floor's time; with a stage
    highlighted its bars (and only its) take the highlight colour, the others pale; a stage with no
    record is refused by name."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure
    res = _with_prompt_floor(res)
    ttft_floor, decode_floor = 6.4e9 / 400e9 * 1e3, 540e6 / 15e9 * 1e3      # the fixture's, at 2 threads
    for highlight in (None, "simd"):
        fig = Figure(figsize=(12, 6))
        charts.draw_journey(fig, res, highlight)
        ttft_ax, decode_ax = fig.axes
        for ax, floor in ((ttft_ax, ttft_floor), (decode_ax, decode_floor)):
            assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == "--"] == [pytest.approx(floor)]
        colors = [to_hex(b.get_facecolor()) for b in decode_ax.patches][:len(res.stages)]
        want = [charts.JOURNEY_BLUE] * len(res.stages) if highlight is None else \
            [charts.JOURNEY_HIGHLIGHT if s == highlight else charts.JOURNEY_PALE for s in res.names]
        assert colors == [c.lower() for c in want]
    with pytest.raises(ValueError, match="no record of quantized"):
        charts.draw_journey(Figure(), res, "quantized")


def drawn_figures(monkeypatch):
    """The figures the charts draw, kept open long enough to be looked at (their close is deferred)."""
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


def clipped_text(fig) -> list[str]:
    """Titles and figure texts of fig that run past its edges (as drawn at its size)."""
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    texts = list(fig.texts) + [ax.title for ax in fig.axes] + ([fig._suptitle] if fig._suptitle else [])
    return [t.get_text()[:60] for t in texts if t.get_text() and
            (t.get_window_extent(renderer).x0 < box.x0 - 1 or t.get_window_extent(renderer).x1 > box.x1 + 1)]


def test_every_chart_title_fits_and_names_the_machine(res, monkeypatch, tmp_path):
    """Each chart of the report and the lessons chart: no title or caption runs off the figure, and
    the title names the model's machine; a title planted too long is caught."""
    from app.report import lessons
    from tests.test_records import committed_results
    committed = committed_results().folder.parent
    res.stages[0]["machine"] = {"cpu": "AMD EPYC 9R14", "cpu_signature": {"family": "25", "model": "17"},
                                "isa": "avx512vnni", "physical_cores": 2}
    figs = drawn_figures(monkeypatch)
    charts.draw_all(res, tmp_path)
    lessons.chart(lessons.ledger(lessons.find_sources(committed.parent, machine=committed.name)),
                  tmp_path / "lessons.png", "AMD EPYC 9R14 (family 25 model 17, AVX-512 VNNI, 2 cores)")
    assert len(figs) == 4
    for fig in figs:
        assert clipped_text(fig) == []
        titles = " ".join(t.get_text() for t in [fig._suptitle, *(ax.title for ax in fig.axes)] if t)
        assert "AMD EPYC 9R14 (family 25 model 17, AVX-512 VNNI, 2 cores)" in titles, titles
    figs[0].suptitle("x" * 400)
    assert clipped_text(figs[0])


@pytest.mark.parametrize("name", ["batching", "speculative"])
def test_the_benchmark_charts_titles_fit_and_name_their_machine(monkeypatch, tmp_path, name):
    """The load test's chart (profiles/batching.png) and speculative decoding's, drawn from their
    committed records: the title fits and names the machine the record measured (which need not be
    the results table's)."""
    from app.measure import loadtest
    from app.report import speculative
    bench = Path(__file__).resolve().parent.parent / "profiles" / "bench"
    rec = json.loads((bench / f"{name}.json").read_text())
    figs = drawn_figures(monkeypatch)
    if name == "batching":
        loadtest.chart(rec, tmp_path / "b.png")
    else:
        speculative.chart(rec, tmp_path / "s.png")
    (fig,) = figs
    assert clipped_text(fig) == []
    assert charts.machine_label(rec["machine"]) in fig._suptitle.get_text()


def test_a_machine_is_named_by_its_design_not_only_its_brand():
    assert charts.machine_label({"cpu": "Intel(R) Xeon(R) Processor @ 2.60GHz", "physical_cores": 2,
                                 "simd": ["avx2", "avx512_vnni"]}) == "Intel Xeon (AVX-512 VNNI, 2 cores)"
    assert charts.machine_label({"cpu": "AMD EPYC", "cpu_signature": {"family": "25", "model": "1"}, "isa": "avx2",
                                 "physical_cores": 4}) == "AMD EPYC (family 25 model 1, AVX2, 4 cores)"


# ---- where the time goes ---------------------------------------------------------------------------

STACK = {"op": "forward_layers", "calls": 4, "total_ms": 100.0}
PHASES_MS = {"norm_attn": 4.0, "qkv": 20.0, "attend": 6.0, "merge": 2.0, "wo": 8.0, "norm_ffn": 4.0,
             "gate_up": 30.0, "round_f": 1.0, "down": 15.0}


def test_the_compiled_stack_is_split_by_its_own_clock():
    """A compiled stack's 100 ms with 90 ms of phases: each phase in its group (the norms with their
    rounding, RoPE in q, k, v, ROUND_F with W_down), the 10 ms the phases do not cover counted as
    Python around the call; without phases the row stays whole and is named as such, never "other"."""
    ms = charts.op_ms([dict(STACK, phases_ms=PHASES_MS), {"op": "matmul output", "total_ms": 20.0}])
    assert ms["q, k, v matmuls"] == 20.0 and ms["attention (scores, softmax, sum)"] == 8.0
    assert ms["norms"] == 8.0 and ms["gate, up matmuls"] == 30.0 and ms["down matmul"] == 16.0
    assert ms["python overhead"] == pytest.approx(10.0) and ms[charts.UNSPLIT] == 0 and ms[charts.OTHER] == 0
    assert sum(ms.values()) == pytest.approx(120.0)
    whole = charts.op_ms([STACK])
    assert whole[charts.UNSPLIT] == 100.0 and whole[charts.OTHER] == 0
    with pytest.raises(ValueError, match="no group takes"):
        charts.op_ms([dict(STACK, phases_ms=dict(PHASES_MS, shuffle=1.0))])


def test_every_phase_of_the_layer_stack_has_a_name_and_a_group():
    """The phases are named in layer_stack.PHASES' order (phases.PHASE_NAMES: as many as
    OPS_PER_LAYER) and each lands in a group of the chart."""
    from app.measure.phases import PHASE_NAMES
    from stages.kernels.layer_stack import OPS_PER_LAYER
    assert len(PHASE_NAMES) == OPS_PER_LAYER
    assert set(charts.PHASE_GROUPS) == set(PHASE_NAMES)
    assert set(charts.PHASE_GROUPS.values()) <= set(charts.GROUPS)


def test_the_profile_keeps_the_phases_the_clock_counted():
    """bench.with_phases: the seconds per phase become the stack row's phases_ms; a clock that
    counted nothing marks the row (the chart then says the calls keep no clock); a count of phases
    other than the names is refused."""
    import numpy as np

    from app.measure import bench
    from app.measure.phases import PHASE_NAMES
    rows = bench.with_phases([dict(STACK), {"op": "argmax", "total_ms": 1.0}], np.arange(len(PHASE_NAMES)) / 1e3)
    assert rows[0]["phases_ms"] == {n: pytest.approx(float(i)) for i, n in enumerate(PHASE_NAMES)}
    assert "phases_ms" not in rows[1]
    assert bench.with_phases([dict(STACK)], np.zeros(len(PHASE_NAMES)))[0]["phase_clock"] is False
    with pytest.raises(ValueError, match="PHASE_NAMES"):
        bench.with_phases([dict(STACK)], np.ones(len(PHASE_NAMES) + 1))


def test_the_chart_says_what_it_cannot_split(res):
    """"Other ops" at 10% or more is named op by op; a stack without phases says why it stays whole."""
    rec = next(r for r in res.stages if r["stage"] == "simd")
    rec["profile"] = rec["profile"] + [{"op": "embed", "calls": 1, "total_ms": 1e4}]
    kv = next(r for r in res.stages if r["stage"] == "kv_cache")
    kv["profile"] = [dict(STACK, phase_clock=False)]
    notes = charts.ops_notes(res)
    assert "simd: other ops are embed" in notes
    assert any(n.startswith("kv_cache:") and "keep no clock" in n for n in notes)


def test_the_committed_profiles_leave_nothing_unexplained():
    """On the committed records of the README's table: for every stage, "other ops" under 10% and the
    compiled stack split, or the chart's notes name the stage and say why."""
    from tests.test_records import committed_results
    res = committed_results()
    notes = " ".join(charts.ops_notes(res))
    for r in (r for r in res.stages if r.get("profile")):
        shares = charts.op_shares(r["profile"])
        if shares[charts.OTHER] >= 0.10 or shares[charts.UNSPLIT] > 0:
            assert r["stage"] in notes, r["stage"]


def test_decode_intensity_is_two_flop_over_each_types_bytes_per_weight():
    """Q4_1: 32 weights in 20 bytes, 2 FLOP each: 3.2 FLOP per byte; Q8_0 32 in 34; the float
    norms (a sliver of the file) left out."""
    rec = {"model_info": {"type_mix_bytes": {"Q4_1": 66_355_200, "Q8_0": 30_081_024, "F32": 140_544}}}
    assert charts.decode_intensity(rec) == {"Q4_1": pytest.approx(3.2), "Q8_0": pytest.approx(64 / 34)}
    assert [s for s in ("quantized", "threads", "int8", "fused", "repack", "tp", "prefill")
            if charts.integer_stage(s)] == ["int8", "fused", "repack", "tp", "prefill"]


@pytest.mark.parametrize("stage", ["fused", "tp"])
def test_a_profiled_run_of_a_compiled_stack_keeps_its_phases(default_model_path, stage):
    """A profiled run of fused (whose calls keep a clock per phase) carries the phases' time, all of
    it inside the compiled stack's row; a stage whose calls keep no clock (tp's pieces, today) says
    so on the row instead of a split that would be made up."""
    from app.measure import bench
    from app.measure.phases import PHASE_NAMES
    from stages import load
    engine = load(stage, default_model_path)
    stack = next(r for r in bench.profile_run(engine, stage, 8, 3) if r["op"] == "forward_layers")
    if stage == "fused" or "phases_ms" in stack:
        assert list(stack["phases_ms"]) == list(PHASE_NAMES)
        assert 0 < sum(stack["phases_ms"].values()) <= stack["total_ms"]
    else:
        assert stack["phase_clock"] is False
