"""The measurement protocol (app/measure/protocol.py) and `python -m app bench NAME`
(app/measure/benchmarks.py), on stub measurements: nothing here is timed. Alternating rounds cancel
a drift of the machine's speed (planted: rounds always in one order); the rounds, the record's
header and its writing are written once (planted: each written again in a module); every
benchmark the README and the Makefile name runs through `python -m app bench`."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from app.measure import benchmarks, protocol
from app.measure.benchmarks import BENCHMARKS, Benchmark, run_benchmark, with_default

ROOT = Path(__file__).resolve().parent.parent


# ---- rounds -----------------------------------------------------------------------------------------

def test_rounds_alternate_and_rotate():
    assert [protocol.order("abc", r) for r in range(3)] == [list("abc"), list("cba"), list("abc")]
    assert [protocol.order("abc", r, rotate=True) for r in range(4)] == \
        [list("abc"), list("bca"), list("cab"), list("abc")]
    calls = []
    got = protocol.alternating("ab", 2, lambda item, r: calls.append((item, r)) or f"{item}{r}")
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1)] and got == {"a": ["a0", "a1"], "b": ["b0", "b1"]}


def drifting_medians(rounds: int = 4) -> dict:
    """Two identical conditions on a machine that slows down by one unit per measurement."""
    clock = iter(range(100))
    got = protocol.alternating(["a", "b"], rounds, lambda item, r: next(clock))
    return {k: protocol.median(v) for k, v in got.items()}


def test_alternating_rounds_cancel_a_drift(monkeypatch):
    medians = drifting_medians()
    assert medians["a"] == medians["b"]
    monkeypatch.setattr(protocol, "order", lambda items, r, rotate=False: list(items))   # planted: one order
    medians = drifting_medians()
    assert medians["a"] < medians["b"]            # the second condition always measured on a slower machine


def test_a_median_of_what_was_measured():
    assert protocol.median([3.0, float("nan"), 1, np.float32(2.0), float("inf"), None, "x"]) == 2.0
    assert math.isnan(protocol.median([])) and math.isnan(protocol.median([float("nan")]))
    assert protocol.median(np.array([1, 2, 3, 4])) == 2.5


def test_rounds_that_do_not_pair_are_an_error():
    assert protocol.paired([1, 2], [3, 4], ("a", "b")) == [(1, 3), (2, 4)]
    with pytest.raises(ValueError, match="a has 2 rounds and b 3: the ratios pair them round by round"):
        protocol.paired([1, 2], [3, 4, 5], ("a", "b"))


# ---- the record ---------------------------------------------------------------------------------------

def test_the_header_says_machine_code_time_and_how():
    from app.measure.machine import machine_info
    from app.measure.provenance import provenance
    h = protocol.header({"rounds": 3}, "python -m app bench kernels")
    assert h["machine"] == machine_info() and h["provenance"] == provenance()
    assert h["settings"] == {"rounds": 3} and h["command"] == "python -m app bench kernels"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", h["time"])
    assert set(protocol.header()) == {"machine", "provenance", "time"}


def test_a_record_is_written_whole_then_drawn(tmp_path):
    path = tmp_path / "deep" / "r.json"
    drawn = []
    assert protocol.write_record({"kind": "x", "ms": np.float64(1.5)}, path,
                                 draw=lambda rec, p: drawn.append((rec["kind"], p)) or [p.with_suffix(".md")]) == \
        [path, path.with_suffix(".md")]
    assert json.loads(path.read_text()) == {"kind": "x", "ms": 1.5} and drawn == [("x", path)]
    with pytest.raises(TypeError):
        protocol.write_record({"kind": "x", "ms": object()}, path)          # cannot be written
    assert json.loads(path.read_text()) == {"kind": "x", "ms": 1.5}         # the record before it stands
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]


def test_a_child_measurement_is_its_last_json_line():
    say = "import sys; print('loading'); print('R {\"a\": 1}'); print('{\"b\": 2}'); print('noise', file=sys.stderr)"
    assert protocol.run_child([sys.executable, "-c", say], "stub") == {"b": 2}
    assert protocol.run_child([sys.executable, "-c", say], "stub", mark="R ") == {"a": 1}
    fail = "import sys; print('what went wrong', file=sys.stderr); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"stub failed \(exit 3\):\nwhat went wrong"):
        protocol.run_child([sys.executable, "-c", fail], "stub")


# ---- written once ----------------------------------------------------------------------------------------

# What the protocol owns, as another module would write it again.
AGAIN = {
    "the alternating-rounds loop": re.compile(r"\bif \w+ % 2 == 0 else [\w.\[\]\"']+\[::-1\]"),
    "the median of the rounds": re.compile(r"^def _?median\(", re.M),
    "the record's header": re.compile(r"[\"'](machine|provenance)[\"']\s*:\s*(machine_info|provenance)\(\)"),
    "writing a record": re.compile(r"write_text\(json\.dumps\("),
}
PLANTED = {
    "the alternating-rounds loop": "for e in engines if k % 2 == 0 else engines[::-1]:\n",
    "the median of the rounds": "def _median(xs):\n    return statistics.median(xs)\n",
    "the record's header": 'rec = {"kind": "x", "machine": machine_info(), "provenance": provenance()}\n',
    "writing a record": "out.write_text(json.dumps(record, indent=1))\n",
}


def written_again(sources: dict[str, str]) -> list[str]:
    return [f"{where}: {what}" for where, text in sources.items() for what, pattern in AGAIN.items()
            if pattern.search(text)]


def test_the_protocol_is_written_once():
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "app").rglob("*.py"))
               if p.name != "protocol.py"}
    assert written_again(sources) == [], "app/measure/protocol.py owns these: call it"


@pytest.mark.parametrize("what", list(PLANTED))
def test_a_protocol_written_again_is_caught(what):
    assert written_again({"app/measure/x.py": PLANTED[what]}) == [f"app/measure/x.py: {what}"]


# ---- python -m app bench ----------------------------------------------------------------------------------

BENCH_COMMAND = re.compile(r"`(?:\.venv/bin/)?python -m app (bench\b[^`]*)`"          # in the text, maybe wrapped
                           r"|^(?:\.venv/bin/python|\t\$\(PY\)) -m app (bench\b[^#\n]*)", re.M)  # a shell line


def bench_commands(text: str) -> list[str]:
    """Every `python -m app bench ...` a text gives: in backticks, or a line of a shell block or a recipe."""
    return [" ".join((m.group(1) or m.group(2)).split()) for m in BENCH_COMMAND.finditer(text)]


def parses(command: str) -> str | None:
    """None where `python -m app COMMAND` parses, NAME's own options too (--help: prints and stops, as
    it should); else a complaint."""
    from app.cli import build_parser
    argv = with_default(command.replace("$(stage)", "simd").replace("$(model)", "m").replace("$(args)", "")
                        .replace("$(if $(np),--np $(np))", "").split())
    try:
        args = build_parser().parse_args(argv)
        benchmarks.parser_for(args.benchmark).parse_args(args.rest)
    except SystemExit as stopped:
        if stopped.code:
            return f"`python -m app {command}` does not parse"
    return None


def test_every_benchmark_the_readme_and_makefile_name_runs_through_app_bench():
    texts = {name: (ROOT / name).read_text() for name in ("README.md", "Makefile")}
    commands = [c for text in texts.values() for c in bench_commands(text)]
    assert len(commands) >= 8, commands
    assert [p for p in map(parses, commands) if p] == []
    for name, text in texts.items():
        assert not re.findall(r"scripts/(?:bench_\w+|loadtest|soak|tune_tiling|cuda_profile)\.py", text), \
            f"{name} still runs a benchmark as a script"
    assert parses("bench nonesuch --rounds 3") and parses("bench kernels --no-such-option")    # planted


def test_bench_with_options_alone_is_the_stage_bench():
    assert with_default(["bench", "--stage", "simd"]) == ["bench", "stage", "--stage", "simd"]
    assert with_default(["bench", "tp", "--rounds", "1"]) == ["bench", "tp", "--rounds", "1"]
    assert with_default(["bench", "--help"]) == ["bench", "--help"] and with_default(["run"]) == ["run"]


def test_every_drawn_kind_is_written_by_a_benchmark():
    from app.report.pages import DRAWINGS, drawing
    assert {k for b in BENCHMARKS.values() for k in b.kinds} == set(DRAWINGS)
    for name in BENCHMARKS:                                  # every module has the two functions
        module = benchmarks.module_of(name)
        assert callable(module.add_arguments) and callable(module.records), name
    assert all(callable(drawing(kind)[0]) for kind in DRAWINGS)


def stub(record, path, failures=()):
    """A benchmark module that 'measures' the given record."""
    from types import SimpleNamespace

    def records(args):
        assert args.command_line == "python -m app bench stub"
        yield path, record
    return SimpleNamespace(add_arguments=lambda p: None, records=records, failures=lambda rec: list(failures))


def test_a_benchmark_writes_its_record_prints_its_page_and_says_what_failed(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace
    record = json.loads(next((ROOT / "profiles" / "bench" / "prefetch").glob("*.json")).read_text())
    path = tmp_path / "p.json"
    monkeypatch.setitem(BENCHMARKS, "stub", Benchmark("stub", "a stub", ("prefetch",)))
    module = stub(record, path)
    monkeypatch.setattr(benchmarks, "module_of", lambda name: module)

    def run(*rest):
        args = SimpleNamespace(benchmark="stub", rest=list(rest), command_line="python -m app bench stub")
        return run_benchmark(args)
    assert run() == 0
    out = capsys.readouterr()
    assert json.loads(path.read_text()) == record and out.out.strip() == path.with_suffix(".md").read_text().strip()
    assert "wrote " in out.err
    path.with_suffix(".md").unlink()
    assert run("--draw-only", str(path)) == 0 and path.with_suffix(".md").exists()
    module = stub(record, path, failures=["the claim"])
    assert run() == 1
    assert "does not hold: the claim" in capsys.readouterr().err


def test_the_cuda_profile_runs_on_the_emulated_kernels(tmp_path, capsys):
    """`bench cuda-profile`'s measurement (app/measure/cuda_profile.py) on the CPU emulator of the
    kernels and the tests' tiny model: both tables printed, decode's copies counted per token (a
    few bytes each way: the token in, its argmax out), no device allocation while generating."""
    from app.measure.cuda_profile import profile
    from tests.test_cuda import emulated_device, load_cuda, write_tiny_model
    engine = load_cuda(write_tiny_model(tmp_path / "tiny.gguf"), emulated_device())
    rec = profile(engine, prompt_tokens=4, n=3)
    printed = capsys.readouterr().out
    assert "prefill of 4 tokens" in printed and "decode, 3 tokens" in printed
    assert rec["n_decode"] == 3 and len(rec["tokens"]) == 4 and rec["device_allocs_while_generating"] == 0
    per_token = rec["decode"]["copies_per_token"]
    assert per_token["h2d_count"] >= 1 and per_token["d2h_count"] >= 1 and per_token["d2h_bytes"] <= 64
    assert rec["decode"]["kernels"] and rec["prefill"]["kernels"]
