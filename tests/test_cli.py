"""The command line as a user meets it: `python -m app run / bench / model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"stage", "model", "prompt_tokens", "tokens", "text", "ttft_ms", "decode_ms", "decode_ms_mean",
            "tokens_per_s", "load_s", "jit_s", "peak_rss_mb", "minor_faults", "major_faults"}


def run(*args, stdin=None, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, input=stdin, text=True,
                          capture_output=True, timeout=timeout, env=env)


def test_run_json_has_the_protocol_fields(default_model_path):
    p = run("run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "Hello", "-n", "4", "--json")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert REQUIRED <= set(rec), REQUIRED - set(rec)
    assert rec["stage"] == "kv_cache" and len(rec["tokens"]) == rec["n_generated"] <= 4
    assert rec["ttft_ms"] > 0 and rec["peak_rss_mb"] > 0


def test_run_opens_the_model_file_once(default_model_path, monkeypatch, capsys):
    """The prompt is tokenized and checked against the context from the same open file the
    weights then load from: one GGUFFile per run (a counted constructor)."""
    from app.cli import main
    from common.gguf import GGUFFile
    opened = []
    real = GGUFFile.__init__

    def counted(self, path):
        opened.append(str(path))
        real(self, path)
    monkeypatch.setattr(GGUFFile, "__init__", counted)
    assert main(["run", "--stage", "quantized", "-m", str(default_model_path), "-n", "2", "--json"]) == 0
    assert len(opened) == 1, opened
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_generated"] == 2


def test_run_streams_text_then_prints_the_figures(default_model_path):
    p = run("run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "The capital of France is",
            "-n", "6", "--profile")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("The capital of France is")
    for figure in ("TTFT", "ms/token", "tokens/s", "JIT", "peak RSS", "page faults", "matmul ffn_down"):
        assert figure in p.stderr


def test_an_end_of_generation_token_is_not_text_unless_asked_for(default_model_path):
    """The reply to this prompt ends in <|im_end|> (greedy): the streamed text and --json's
    `text` leave it out, as the server does; --special (llama.cpp's flag) puts it back."""
    args = ("run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "Say OK.", "-n", "16")
    plain, special, streamed = run(*args, "--json"), run(*args, "--json", "--special"), run(*args)
    assert plain.returncode == special.returncode == streamed.returncode == 0, plain.stderr + special.stderr
    rec, rec_special = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (plain, special))
    assert rec["stop_reason"] == "eog" and rec["tokens"] == rec_special["tokens"], "a prompt that ends in EOG"
    assert rec_special["text"].endswith("<|im_end|>") and rec_special["text"].removesuffix("<|im_end|>") == rec["text"]
    assert "<|im_end|>" not in rec["text"] and "<|im_end|>" not in streamed.stdout
    assert streamed.stdout.startswith("Say OK.") and rec["text"].strip() in streamed.stdout


def test_ignore_eos_generates_every_token_asked_for(default_model_path, capsys):
    """A prompt whose reply ends soon (the one above: it ends in <|im_end|>) measures a few
    tokens; with --ignore-eos (llama.cpp's flag) it makes all -n, and times them."""
    from app.cli import main
    args = ["run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "Say OK.", "-n", "16", "--json"]
    recs = []
    for extra in ([], ["--ignore-eos"]):
        assert main(args + extra) == 0
        recs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    ended, ignored = recs
    assert ended["stop_reason"] == "eog" and ended["n_generated"] < 16       # the twin: the end does end it
    assert ignored["stop_reason"] == "length" and ignored["n_generated"] == 16
    assert ignored["tokens"][:ended["n_generated"]] == ended["tokens"]       # the same text, then on past the end
    assert ignored["decode_ms"] > 0 and ignored["tokens_per_s"] > 0          # measured (NaN fails both)


@pytest.mark.parametrize("args, message", [
    (("--stage", "warp"), "the stages are: naive"),
    (("-m", "no/such/model.gguf"), "no model file"),
    (("-p", "word " * 3000), "exceeds the context window of 2048"),
])
def test_bad_input_is_one_clear_line(args, message, default_model_path):
    if "-m" not in args:
        args = ("-m", str(default_model_path)) + args
    p = run("run", "--stage", "simd", *args) if "--stage" not in args else run("run", *args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr
    assert "loading" not in p.stderr                          # refused before any weight was read


def test_chat_keeps_the_cache_between_turns(default_model_path):
    p = run("run", "--stage", "kv_cache", "-m", str(default_model_path), "--chat", "-n", "12",
            stdin="What is 2+2?\nAnd 3+3?\n/reset\n")
    assert p.returncode == 0, p.stderr
    turns = [line for line in p.stderr.splitlines() if "new prompt tokens" in line]
    assert len(turns) == 2
    first, second = (int(t.split("[")[1].split()[0]) for t in turns)
    assert second < first            # the second turn feeds only what the cache has not seen
    assert "conversation forgotten" in p.stderr


def test_model_list_names_every_model():
    p = run("model", "--list")
    assert p.returncode == 0
    for name in ("smollm2", "tinyllama", "tinyllama-synthetic"):
        assert name in p.stdout


# ---- bad values: refused where they are parsed, in one line, exit 2 -----------------------------

BAD_VALUES = [
    ("run", ["-n", "-1"], "-n/--n-predict", "n_predict (-n, max_tokens) = -1: must be an integer >= 1"),
    ("run", ["-n", "0"], "-n/--n-predict", "n_predict (-n, max_tokens) = 0"),
    ("run", ["-n", "ten"], "-n/--n-predict", "'ten' is not an integer"),
    ("run", ["-t", "0"], "-t/--threads", "threads (-t) = 0: must be an integer >= 1"),
    ("run", ["-t", "-4"], "-t/--threads", "threads (-t) = -4"),
    ("run", ["-c", "0"], "-c/--ctx-size", "ctx_size (-c) = 0: must be an integer >= 1"),
    ("run", ["--top-p", "5"], "--top-p", "top_p = 5.0: must be a number in (0, 1]"),
    ("run", ["--top-p", "0"], "--top-p", "top_p = 0.0"),
    ("run", ["--temp", "-1"], "--temp", "temp = -1.0: must be a number >= 0"),
    ("run", ["--temp", "nan"], "--temp", "temp = nan"),
    ("run", ["--temp", "warm"], "--temp", "'warm' is not a number"),
    ("run", ["--top-k", "-1"], "--top-k", "top_k = -1: must be an integer >= 0"),
    ("run", ["--min-p", "2"], "--min-p", "min_p = 2.0: must be a number in [0, 1]"),
    ("run", ["--repeat-penalty", "0"], "--repeat-penalty", "repeat_penalty = 0.0: must be a number > 0"),
    ("run", ["--repeat-last-n", "-2"], "--repeat-last-n", "repeat_last_n = -2"),
    ("run", ["--seed", "-1"], "--seed", "seed = -1: must be an integer >= 0"),
    ("run", ["--frequency-penalty", "3"], "--frequency-penalty", "frequency_penalty = 3.0: must be a number in [-2"),
    ("run", ["--presence-penalty", "x"], "--presence-penalty", "'x' is not a number"),
    ("serve", ["--kv-pages", "0"], "--kv-pages", "kv_pages (--kv-pages) = 0: must be an integer >= 1"),
    ("serve", ["--max-queue", "-1"], "--max-queue", "max_queue (--max-queue) = -1: must be an integer >= 0"),
    ("serve", ["--drain-timeout", "-3"], "--drain-timeout", "'-3': must be a number of seconds >= 0"),
    ("serve", ["--stream-interval", "-5"], "--stream-interval", "'-5': must be a number of milliseconds >= 0"),
    ("bench", ["-n", "0"], "-n/--n-predict", "n_predict (-n, max_tokens) = 0"),
    ("bench", ["--prompt-tokens", "0"], "--prompt-tokens", "prompt_tokens (--prompt-tokens) = 0"),
    ("bench", ["--profile-n", "-1"], "--profile-n", "profile_n (--profile-n) = -1: must be an integer >= 0"),
    ("bench", ["-t", "0"], "-t/--threads", "threads (-t) = 0"),
]


@pytest.mark.parametrize("command, args, flag, message", BAD_VALUES,
                         ids=[f"{c} {' '.join(a)}" for c, a, _, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2_before_anything_loads(command, args, flag, message, capsys):
    from app.cli import main
    with pytest.raises(SystemExit) as stopped:
        main([command, "-m", "never/opened.gguf", *args])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"error: argument {flag}: {message}"), lines[0]
    assert captured.out == ""


def test_n_minus_one_prints_no_timing():
    """`-n -1` used to generate nothing and print TTFT 0.0 ms; now it is refused like any bad value."""
    p = run("run", "--stage", "simd", "-n", "-1", timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "n_predict" in p.stderr
    assert "TTFT" not in p.stderr and "Traceback" not in p.stderr


def test_good_values_parse_to_the_engines_settings():
    from app.args import sampling_params
    from app.cli import build_parser
    args = build_parser().parse_args(["run", "-t", "2", "-c", "512", "-n", "8", "--temp", "0.7", "--top-k", "0",
                                      "--top-p", "1", "--min-p", "0", "--repeat-last-n", "-1", "--seed", "3",
                                      "--frequency-penalty", "0.5", "--presence-penalty", "-1", "--special"])
    assert (args.threads, args.ctx_size, args.n_predict, args.special) == (2, 512, 8, True)
    p = sampling_params(args)
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.repeat_last_n, p.seed) == (0.7, 0, 1.0, 0.0, -1, 3)
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -1.0)
    defaults = build_parser().parse_args(["run"])
    assert defaults.threads is None and defaults.ctx_size is None and defaults.n_predict is None
    assert not defaults.special and sampling_params(defaults).frequency_penalty == 0


# ---- the test command itself: skips are visible, CI refuses unexpected ones, hangs are stopped ------

SKIPPING_TESTS = '''
import ctypes, time
import pytest

def test_runs():
    pass

def test_needs_a_gpu():
    pytest.skip("gpu test: no NVIDIA GPU here")

def test_needs_a_file():
    pytest.skip("the default model is not there")

@pytest.mark.xfail(strict=True, reason="a known gap")
def test_known_gap():
    assert False
'''
HANGING_TESTS = '''
import ctypes, time

def test_python_hang():
    time.sleep(120)

def test_compiled_hang():
    ctypes.PyDLL(None).sleep(120)      # C code holding the interpreter lock: no Python watchdog can run

def test_after():
    pass
'''


def run_pytest(tmp_path, source, *args, **env):
    """pytest on one test file (or {name: source} of several) beside copies of tests/conftest.py
    and pyproject.toml (its pytest settings: xfail_strict), in a fresh process."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    files = source if isinstance(source, dict) else {"test_sample.py": source}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("CI", "LLM_TEST_TIMEOUT", "LLM_TEST_TIMEOUT_GRACE", "LLM_MODELS_DIR")}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-rfEsx", "-p", "no:cacheprovider", *args,
                           *(str(tmp_path / name) for name in files)], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120)


def test_skips_show_their_reasons(tmp_path):
    p = run_pytest(tmp_path, SKIPPING_TESTS)
    assert p.returncode == 0, p.stdout
    assert "SKIPPED [1] test_sample.py" in p.stdout and "the default model is not there" in p.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in p.stdout


def test_in_ci_an_unexpected_skip_fails(tmp_path):
    p = run_pytest(tmp_path, SKIPPING_TESTS, CI="true")
    assert p.returncode == 1, p.stdout
    assert "FAILED test_sample.py::test_needs_a_file" in p.stdout
    assert "unexpected skip in CI: the default model is not there" in p.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed" in p.stdout        # the gpu skip is an expected one


MODULE_SKIPS = {
    "test_gone.py": 'import pytest\npytest.importorskip("no_such_module_anywhere")\n\ndef test_never_collected():\n'
                    '    pass\n',
    "test_kept.py": "def test_runs():\n    pass\n",
}
EXPECTED_MODULE_SKIP = dict(MODULE_SKIPS, **{
    "test_gone.py": 'import pytest\npytest.skip("gpu test: no NVIDIA GPU here", allow_module_level=True)\n\n'
                    'def test_never_collected():\n    pass\n'})


def test_in_ci_an_unexpected_module_level_skip_fails_the_run(tmp_path):
    """A module-level importorskip skips at collection, before any test of the module can report:
    outside CI a skip with its reason, in CI a collection error that fails the run."""
    p = run_pytest(tmp_path, MODULE_SKIPS)
    assert p.returncode == 0 and "1 passed, 1 skipped" in p.stdout, p.stdout
    p = run_pytest(tmp_path, MODULE_SKIPS, CI="1")
    assert p.returncode not in (0, 5), p.stdout
    assert "ERROR collecting test_gone.py" in p.stdout
    assert "unexpected skip in CI, at collection: could not import 'no_such_module_anywhere'" in p.stdout


def test_in_ci_an_expected_module_level_skip_passes(tmp_path):
    p = run_pytest(tmp_path, EXPECTED_MODULE_SKIP, CI="1")
    assert p.returncode == 0 and "1 passed, 1 skipped" in p.stdout, p.stdout


XFAILS = '''
import pytest

@pytest.mark.xfail(reason="a known gap")
def test_strict_gap():
    assert False

@pytest.mark.xfail(reason="a gap that was closed")
def test_closed_gap():
    pass

@pytest.mark.xfail(strict=False, reason="a loose gap")
def test_loose_gap():
    assert False

def test_imperative_xfail():
    pytest.xfail("not today")

@pytest.mark.xfail(run=False, reason="never run")
def test_not_run():
    assert False
'''


def test_xfails_are_strict_and_in_ci_only_a_strict_marker_counts(tmp_path):
    """pyproject.toml's xfail_strict: an xfail that passes fails, everywhere. In CI only a strict
    xfail marker whose test ran and failed is an expected failure; a non-strict one, an xfail
    called inside the test and one that never runs are skips by another name."""
    p = run_pytest(tmp_path, XFAILS)
    assert p.returncode == 1, p.stdout
    assert "[XPASS(strict)] a gap that was closed" in p.stdout and "1 failed, 4 xfailed" in p.stdout
    p = run_pytest(tmp_path, XFAILS, CI="1")
    assert p.returncode == 1, p.stdout
    assert "3 failed, 1 xfailed, 1 error" in p.stdout, p.stdout               # run=False: at setup
    assert "a non-strict xfail in CI: a loose gap" in p.stdout
    assert "xfail without running the test, in CI: not today" in p.stdout
    assert "xfail without running the test, in CI: [NOTRUN] never run" in p.stdout


NEEDS_VOCAB = '''
import pytest

@pytest.mark.needs("vocab")
def test_a():
    pass

@pytest.mark.needs("vocab")
def test_b():
    pass

@pytest.mark.needs("vocab")
def test_c():
    pass

def test_free():
    pass
'''


def test_a_missing_fixture_file_is_one_message_naming_make(tmp_path):
    """models/vocab/ absent (LLM_MODELS_DIR pointed at an empty folder): outside CI the tests
    that need it skip with one reason, `make vocab`; in CI the first fails with it and the rest
    skip behind it; with the folder there, they run."""
    empty = tmp_path / "models"
    empty.mkdir()
    p = run_pytest(tmp_path, NEEDS_VOCAB, LLM_MODELS_DIR=str(empty))
    assert p.returncode == 0 and "1 passed, 3 skipped" in p.stdout, p.stdout
    skipped = [line for line in p.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "SKIPPED [3]" in skipped[0] and "run `make vocab`" in skipped[0], skipped
    p = run_pytest(tmp_path, NEEDS_VOCAB, LLM_MODELS_DIR=str(empty), CI="1")
    assert p.returncode == 1 and "1 passed, 2 skipped, 1 error" in p.stdout, p.stdout       # the error: at setup
    failed = [line for line in p.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert len(failed) == 1 and "make vocab" in failed[0], failed
    (empty / "vocab").mkdir()
    (empty / "vocab" / ".complete").touch()
    p = run_pytest(tmp_path, NEEDS_VOCAB, LLM_MODELS_DIR=str(empty), CI="1")
    assert p.returncode == 0 and "4 passed" in p.stdout, p.stdout


def test_the_allowed_skip_reasons_are_anchored():
    """EXPECTED_SKIPS patterns describe a whole reason: the reasons tests/util.py writes match;
    a sentence that only contains their words (an ISA probe that regressed, the old unanchored
    forms) does not."""
    from tests.conftest import expected_skip
    from tests.util import lacks
    allowed = [lacks("avx2", "f16c", have=frozenset(), then="the int8 stage runs its loops"),
               lacks("avx2", "fma", have=frozenset({"avx2"})),
               "gpu test: no NVIDIA GPU, driver or PyCUDA", "nvcc not found (the CUDA toolkit is not installed)",
               "llama-cpp-python not installed (`make baseline`)",
               "the check reads x86 assembly; this is an arm64 machine",
               "slow test: set LLM_SLOW_TESTS=1 (or `make test-all`) to run it"]
    refused = ["the ISA probe found no AVX2, though this CPU has no trouble with it",
               "this CPU (or numba's target) has no AVX2: the int8 stage runs its auto-vectorized loops only",
               "named_isa() says this CPU has no AVX2 (LLVM's host features)",
               "not a gpu test: the default model is missing", "the default model is not there",
               "records.json has no page (only comparison and kernel records do)", "the check reads x86 assembly"]
    assert [r for r in allowed if not expected_skip(r)] == []
    assert [r for r in refused if expected_skip(r)] == []


def test_a_python_hang_is_stopped(tmp_path):
    p = run_pytest(tmp_path, HANGING_TESTS, "-k", "python_hang", LLM_TEST_TIMEOUT="2")
    assert p.returncode != 0 and "+ Timeout +" in p.stdout + p.stderr              # pytest-timeout's report
    assert "test_python_hang" in p.stdout + p.stderr


def test_a_compiled_hang_holding_the_interpreter_is_stopped(tmp_path):
    p = run_pytest(tmp_path, HANGING_TESTS, "-k", "compiled_hang", LLM_TEST_TIMEOUT="1", LLM_TEST_TIMEOUT_GRACE="2")
    assert p.returncode != 0
    assert "Timeout (0:00:03)!" in p.stderr and "test_compiled_hang" in p.stderr     # faulthandler's dump


# ---- compile: the kernels into numba's disk cache, before the processes that need them ------------

COMPILES = ("import sys, app; app.configure_numba()\n"
            "from numba.core import event\n"
            "from app.compile import exercise\n"
            "with event.install_recorder('numba:compile') as rec:\n"
            "    exercise('kv_cache', sys.argv[1])\n"
            "print(sum(1 for _, e in rec.buffer if e.is_start))\n")


def compiles_in_a_new_process(cache, model) -> int:
    """How many functions numba compiles (not loads from `cache`) while a new process runs
    kv_cache's paths, as `app compile` runs them."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    p = subprocess.run([sys.executable, "-c", COMPILES, str(model)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip().splitlines()[-1])


def test_compile_fills_the_cache_so_a_later_process_compiles_nothing(tmp_path, default_model_path):
    """After `app compile --stages kv_cache`, a new process running that stage's single and
    batched paths compiles nothing; with an empty cache the same count is not zero (what shows
    the count can fail)."""
    assert compiles_in_a_new_process(tmp_path / "empty", default_model_path) > 0
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "filled"))
    p = subprocess.run([sys.executable, "-m", "app", "compile", "--stages", "kv_cache", "--jobs", "1",
                        "-m", str(default_model_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert "compiled 1 of 1 jobs" in p.stdout
    assert compiles_in_a_new_process(tmp_path / "filled", default_model_path) == 0


def test_compile_names_the_stage_that_failed_and_exits_non_zero(default_model_path):
    p = run("compile", "--stages", "kv_cache,no_such_stage", "--jobs", "2", "-m", str(default_model_path))
    assert p.returncode == 1
    assert "no_such_stage" in p.stderr and "failed" in p.stderr
    assert "compiled 1 of 2 jobs" in p.stdout
