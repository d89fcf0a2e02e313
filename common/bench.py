"""One stage, measured by the protocol: fixed prompt tokens, greedy, a fixed number of tokens
(EOS ignored), JIT warmed up first and reported apart, one JSON record written.

    python -m common bench --stage simd [--prompt-tokens 64 -n 16]

Records go to profiles/results/<machine>/<model>/<stage>.json: the timings (TTFT, decode
median/mean/spread), load and JIT time, peak RSS, page faults, the settings, the model's
type mix, the machine and the package versions. Charts are drawn from these files only.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "profiles" / "results"

# Per-stage settings, chosen so a stage's measurement takes about a minute on 2 cores:
# the stages without a KV cache recompute the whole text for every token.
BENCH_SETTINGS = {
    "naive": (16, 4),
    "tiling": (16, 4),
    "simd": (64, 16),
}
BENCH_SETTINGS_CACHED = (64, 32)

# The benchmark prompt: plain English, long enough for any prompt length asked for (it is
# repeated if need be); only its token ids matter, and those are recorded.
BENCH_TEXT = (
    "A language model reads text as a sequence of tokens and, one token at a time, predicts "
    "what comes next. Each prediction runs the same stack of layers: a normalization, an "
    "attention step that looks back over every earlier position, and a feed-forward network. "
    "Almost all of the arithmetic is matrix multiplication, and almost all of the time goes "
    "into moving the weights from memory to the processor. Making it fast is therefore less "
    "about clever mathematics than about caches, vector registers, and not doing work twice. "
)


def bench_prompt(tokenizer, n_tokens: int) -> list[int]:
    """Exactly n_tokens ids: BOS if the model wants one, then the benchmark text."""
    ids = tokenizer.encode(BENCH_TEXT * (1 + n_tokens // 60))
    return ids[:n_tokens]


def model_summary(gguf) -> dict:
    mix = Counter()
    for t in gguf.tensors.values():
        mix[t.type_name] += t.nbytes
    return {"file": os.path.basename(gguf.path), "name": gguf.get("general.name", ""),
            "file_size": gguf.file_size, "type_mix_bytes": dict(mix)}


def settings_for(stage: str, prompt_tokens: int | None, n_predict: int | None):
    p, n = BENCH_SETTINGS.get(stage, BENCH_SETTINGS_CACHED)
    return prompt_tokens or p, n_predict or n


def measure(engine, stage: str, prompt_tokens: int, n_predict: int) -> dict:
    """Run the protocol on a loaded engine and return its record (not written)."""
    from common.generate import Sampler, generate
    from common.machine import machine_info
    from common.run_cli import run_record
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    jit_s = engine.warmup()
    gen = generate(engine, prompt, n_predict, Sampler(), ignore_eos=True)
    rec = run_record(engine, stage, gen, engine.tokenizer.decode(gen.tokens), jit_s)
    d = np.asarray(gen.decode_ms) if gen.decode_ms else np.asarray([np.nan])
    rec.update({
        "kind": "stage",
        "decode_ms_p10": float(np.percentile(d, 10)), "decode_ms_p90": float(np.percentile(d, 90)),
        "decode_ms_min": float(d.min()), "decode_ms_max": float(d.max()),
        "settings": {"prompt_tokens": prompt_tokens, "n_predict": n_predict, "sampling": "greedy",
                     "ignore_eos": True, "threads": engine.backend.threads, "n_ctx": engine.n_ctx},
        "model_info": model_summary(engine.gguf),
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    return rec


def results_dir(model_file: str, out_dir=None) -> Path:
    from common.machine import machine_id
    if out_dir:
        return Path(out_dir)
    return RESULTS_DIR / machine_id() / Path(model_file).stem


def write_record(rec: dict, out_dir=None, name: str | None = None) -> Path:
    folder = results_dir(rec["model"], out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or rec['stage']}.json"
    tmp = path.with_suffix(".json.part")
    tmp.write_text(json.dumps(rec, indent=1, default=float))
    os.replace(tmp, path)
    return path


def profile_run(engine, stage: str, prompt_tokens: int, n_predict: int) -> list[dict]:
    """A separate, per-op profiled run (the timers slow it a little; figures come from measure)."""
    from common.generate import Sampler, generate
    from common.run_cli import start_profile, stop_profile
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    profiler = start_profile(engine)
    try:
        generate(engine, prompt, n_predict, Sampler(), ignore_eos=True)
    finally:
        rows = stop_profile(engine, profiler)
    return rows


def bench_stage(stage: str, model, prompt_tokens=None, n_predict=None, threads=None, ctx_size=None,
                out_dir=None, profile_n: int = 0):
    """Load, measure and record one stage (and, with profile_n, a per-op profile of a run of
    profile_n tokens). Returns (record, path)."""
    from common.models import resolve
    from stages import fastest_stage, load
    stage = fastest_stage() if stage == "fastest" else stage
    prompt_tokens, n_predict = settings_for(stage, prompt_tokens, n_predict)
    engine = load(stage, resolve(model), n_ctx=ctx_size, threads=threads, progress=True)
    rec = measure(engine, stage, prompt_tokens, n_predict)
    if profile_n:
        rec["profile"] = profile_run(engine, stage, prompt_tokens, profile_n)
        rec["profile_settings"] = {"prompt_tokens": prompt_tokens, "n_predict": profile_n}
    return rec, write_record(rec, out_dir)
