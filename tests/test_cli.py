"""The command line as a user meets it: `python -m common run / bench / model`."""

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
    return subprocess.run([sys.executable, "-m", "common", *args], cwd=ROOT, input=stdin, text=True,
                          capture_output=True, timeout=timeout, env=env)


def test_run_json_has_the_protocol_fields(default_model_path):
    p = run("run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "Hello", "-n", "4", "--json")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert REQUIRED <= set(rec), REQUIRED - set(rec)
    assert rec["stage"] == "kv_cache" and len(rec["tokens"]) == rec["n_generated"] <= 4
    assert rec["ttft_ms"] > 0 and rec["peak_rss_mb"] > 0


def test_run_streams_text_then_prints_the_figures(default_model_path):
    p = run("run", "--stage", "kv_cache", "-m", str(default_model_path), "-p", "The capital of France is",
            "-n", "6", "--profile")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("The capital of France is")
    for figure in ("TTFT", "ms/token", "tokens/s", "JIT", "peak RSS", "page faults", "matmul ffn_down"):
        assert figure in p.stderr


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
