"""The one measurement harness: a stage (or a variant, or llama.cpp) measured by the protocol,
one JSON record per measurement. `make report`, `python -m app bench`, the notebooks and
the llama.cpp comparison (scripts/bench_vs_llama.py) all measure through here.

    measure(engine, stage, prompt_tokens, n_predict)    in this process: the record
    stage_in_child(name, model, ...)                    in a fresh process (its own peak RSS and
                                                        JIT warm-up): `python -m app bench stage`
                                                        or, for llama.cpp, `... baseline`

The protocol: exactly `prompt_tokens` prompt ids (BENCH_TEXT, the same ids for every engine),
greedy, exactly `n_predict` tokens (EOS ignored), JIT warmed up first and reported apart. A
record holds the timings (TTFT, decode median/mean/spread), load and JIT time, peak RSS, page
faults, the settings, the model's type mix, the machine, the package versions and the code
that ran (protocol.header). Records of `make report` go to
profiles/results/<machine>/<model>/<stage>.json; charts and tables are drawn from them only.

Counters (app/measure/counters.py): `counters` holds those of the timed region (task clock,
context switches, page faults, and instructions, cycles and cache misses where the machine has
a PMU, else the reason it has none); `cold_start` those of loading the model again after its
file was evicted from the page cache, and of the first forward pass that follows (a recorded
run measures it after its timings, so it cannot disturb them).

A stage too slow for the whole model (a `max_params` in the registry below the model's size:
naive and tiling on TinyLlama's 1.1B) is measured on its first few layers (layers_to_measure)
and on none, and extrapolated to every layer; the record says so (`extrapolated`: the method and
every figure measured) and the tables mark it.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from app import ROOT
from app.measure import roofline
from app.measure.counters import Counters, evict
from app.measure.machine import machine_id, rusage
from app.measure.phases import PHASE_NAMES
from app.measure.protocol import header, run_child
from app.models import resolve
from common.cpu import cache_sizes
from common.generate import Generation, Sampler, generate
from common.model import LlamaConfig, flops_per_token, n_params, prompt_matmul_ops
from stages import info, load, logit_tolerance
from stages.registry import REPORT_PROMPT_TOKENS

RESULTS_DIR = ROOT / "profiles" / "results"
BASELINE = "llama.cpp"
# The fewest layers a stage too slow for the whole model runs before its time is extrapolated
# to all of them (more where a layer's weights are small: see layers_to_measure).
EXTRAPOLATED_LAYERS = 1
ZERO_LAYER_RUNS = 3

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
            "file_size": gguf.file_size, "n_params": n_params(LlamaConfig.from_gguf(gguf)),
            "type_mix_bytes": dict(mix)}


def run_record(engine, stage, gen, text, jit_s, counters: dict | None = None) -> dict:
    """The figures every run and benchmark reports (see the measurement protocol); counters:
    those of the timed region (app/measure/counters.py), when it was counted."""
    rec = {
        "stage": stage, "model": engine.gguf.path.split("/")[-1],
        "prompt_tokens": gen.prompt_tokens, "n_prompt": len(gen.prompt_tokens),
        "tokens": gen.tokens, "n_generated": len(gen.tokens), "text": text,
        "ttft_ms": gen.ttft_ms, "decode_ms": gen.decode_ms_median, "decode_ms_mean": gen.decode_ms_mean,
        "decode_ms_all": gen.decode_ms, "tokens_per_s": gen.tokens_per_s,
        "load_s": engine.load_s, "jit_s": jit_s, "threads": engine.backend.threads,
        "n_ctx": engine.n_ctx, "uses_kv_cache": engine.uses_kv_cache,
        "weights_mb": engine.weight_bytes() / 2**20, "kv_cache_mb": engine.kv_bytes() / 2**20,
        "stop_reason": gen.stop_reason,
        # for the roofline: what one forward pass computes and reads
        "flops_per_token": flops_per_token(engine.config, len(gen.prompt_tokens)),
        "prompt_matmul_ops": prompt_matmul_ops(engine.config, len(gen.prompt_tokens)),
        "weights_stream_bytes": engine.weight_stream_bytes(),
        "kv_bytes_per_position": 2 * engine.config.n_layer * engine.config.kv_dim * 4,
    }
    rec.update(rusage())
    if counters is not None:
        rec["counters"] = counters
    return rec


def settings_for(stage: str, prompt_tokens: int | None, n_predict: int | None) -> tuple[int, int]:
    """The report's settings unless given: the registry's prompt length and token count."""
    return prompt_tokens or REPORT_PROMPT_TOKENS, n_predict or info(stage).tokens.report


def counted_generate(engine, prompt, n_predict: int):
    """generate() by the protocol, with the counters of exactly that region: (Generation, counters)."""
    with Counters() as counted:
        gen = generate(engine, prompt, n_predict, Sampler(), ignore_eos=True)
    return gen, counted.result


def measure(engine, stage: str, prompt_tokens: int, n_predict: int) -> dict:
    """Run the protocol on a loaded engine and return its record (not written)."""
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    jit_s = engine.warmup()
    gen, counters = counted_generate(engine, prompt, n_predict)
    rec = run_record(engine, stage, gen, engine.tokenizer.decode(gen.tokens), jit_s, counters)
    return _finish(rec, engine, gen, prompt_tokens, n_predict)


def _finish(rec: dict, engine, gen, prompt_tokens: int, n_predict: int) -> dict:
    d = np.asarray(gen.decode_ms) if gen.decode_ms else np.asarray([np.nan])
    rec.update({
        "kind": "stage",
        "decode_ms_p10": float(np.percentile(d, 10)), "decode_ms_p90": float(np.percentile(d, 90)),
        "decode_ms_min": float(d.min()), "decode_ms_max": float(d.max()),
        "model_info": model_summary(engine.gguf),
    })
    n = len(gen.prompt_tokens)
    modelled = roofline.traffic(rec["stage"], engine.config, n, 1 if engine.uses_kv_cache else n + 1)
    if modelled:                            # naive, tiling: the roofline places them by it
        rec["traffic"] = modelled
    rec.update(header({"prompt_tokens": prompt_tokens, "n_predict": n_predict, "sampling": "greedy",
                       "ignore_eos": True, "threads": engine.backend.threads, "n_ctx": engine.n_ctx}))
    return rec


def results_dir(model_file: str, out_dir=None) -> Path:
    if out_dir:
        return Path(out_dir)
    return RESULTS_DIR / machine_id() / Path(model_file).stem


def record_name(rec: dict) -> str:
    """A record's file name without .json: the stage, or llama.cpp[-Nt] for the baseline."""
    if rec.get("kind") == "baseline":
        return BASELINE if rec.get("threads", 1) == 1 else f"{BASELINE}-{rec['threads']}t"
    return rec["stage"]


def record_path(rec: dict, out_dir=None) -> Path:
    """Where a stage's (or llama.cpp's) record goes: its model's folder of this machine's results."""
    return results_dir(rec["model"], out_dir) / f"{record_name(rec)}.json"


def profile_run(engine, stage: str, prompt_tokens: int, n_predict: int) -> list[dict]:
    """A separate, per-op profiled run (the timers slow it a little; figures come from measure):
    the stage's own profiler's rows (common/profile.py). Where the layer stack runs as one compiled
    call that keeps a clock per phase (the backend's phase_seconds), that call's row also carries
    `phases_ms`: the run's time in each phase (phases.PHASE_NAMES), which the per-op chart splits it by."""
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    clock = getattr(engine.backend, "phase_seconds", None)
    before = None if clock is None else np.array(clock, dtype=np.float64)
    with engine.backend.profiler(engine) as prof:
        generate(engine, prompt, n_predict, Sampler(), ignore_eos=True)
    rows = prof.rows()
    if before is not None:
        with_phases(rows, np.asarray(engine.backend.phase_seconds, dtype=np.float64) - before)
    return rows


def with_phases(rows: list[dict], seconds) -> list[dict]:
    """rows with the compiled stack's row given `phases_ms` ({phase: ms}, in layer_stack.PHASES'
    order) from the seconds its clock counted per phase, or `phase_clock: False` where it counted
    none (a stage whose compiled calls keep no clock: the chart says so)."""
    if len(seconds) != len(PHASE_NAMES):
        raise ValueError(f"the layer stack counted {len(seconds)} phases and app/measure/phases.py names "
                         f"{len(PHASE_NAMES)} (PHASE_NAMES): name them in layer_stack.PHASES' order")
    stack = next((r for r in rows if r["op"] in ("forward_layers", "forward_layers_batch")), None)
    if stack is None:
        return rows
    if np.sum(seconds) > 0:
        stack["phases_ms"] = {name: float(s * 1e3) for name, s in zip(PHASE_NAMES, seconds)}
    else:
        stack["phase_clock"] = False
    return rows


def too_slow_for(stage: str, params: int) -> bool:
    """Whether the registry says the stage takes minutes per token on a model this size."""
    limit = info(stage).max_params
    return limit is not None and params > limit


def layers_to_measure(engine) -> int:
    """Enough layers that their weights are twice the last-level cache: then, as in the whole
    model, no layer's weights are still cached when its next pass starts (one small layer run
    again and again would be timed from the cache, and extrapolate too fast)."""
    layer_bytes = sum(engine.backend.weight_bytes(w) for w in vars(engine.layers[0]).values())
    llc = max(cache_sizes().values(), default=0)
    return min(len(engine.layers), max(EXTRAPOLATED_LAYERS, math.ceil(2 * llc / max(layer_bytes, 1))))


def measure_extrapolated(engine, stage: str, prompt_tokens: int, n_predict: int, n_layers: int | None = None) -> dict:
    """The protocol on the model cut to its first n_layers layers and to none, each timing
    extrapolated linearly to every layer: t(L) = t(0) + L * (t(n) - t(0)) / n. Every layer has
    the same shapes, so each costs the same; t(0) is what no layer costs (the embedding, the
    final norm, the output matrix), the fastest of ZERO_LAYER_RUNS runs. Returns the record (not
    written), labelled `extrapolated`."""
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    n_layers = n_layers or layers_to_measure(engine)
    every_layer = engine.layers
    n_total = len(every_layer)
    runs = {}
    try:
        for k in (0, n_layers):
            engine.layers = every_layer[:k]          # the graph runs the layers it is given
            jit_s = engine.warmup()
            # t(0) is short, and its noise is multiplied by L/n below: the fastest of a few runs
            tries = [counted_generate(engine, prompt, n_predict) for _ in range(ZERO_LAYER_RUNS if k == 0 else 1)]
            gen = min(tries, key=lambda t: t[0].ttft_ms + sum(t[0].decode_ms))
            runs[k] = (*gen, jit_s)
    finally:
        engine.layers = every_layer
    (gen0, _, jit0), (genk, counters, jitk) = runs[0], runs[n_layers]

    def whole(t0: float, tk: float) -> float:
        return t0 + (tk - t0) * n_total / n_layers

    gen = Generation(prompt_tokens=genk.prompt_tokens, tokens=genk.tokens, stop_reason=genk.stop_reason,
                     ttft_ms=whole(gen0.ttft_ms, genk.ttft_ms),
                     decode_ms=[whole(a, b) for a, b in zip(gen0.decode_ms, genk.decode_ms)])
    rec = run_record(engine, stage, gen, engine.tokenizer.decode(gen.tokens), jit0 + jitk, counters)
    rec["extrapolated"] = {
        "method": (f"timed with the first {n_layers} of {n_total} layers and with none (the fastest of "
                   f"{ZERO_LAYER_RUNS} runs); each figure "
                   f"extrapolated as t(0) + {n_total} x (t({n_layers}) - t(0)) / {n_layers} (every layer has "
                   f"the same shapes); tokens, text and counters are those of the {n_layers}-layer run"),
        "layers_measured": n_layers, "n_layer": n_total,
        "measured": {str(k): {"ttft_ms": g.ttft_ms, "decode_ms_all": g.decode_ms} for k, (g, _, _) in runs.items()},
    }
    return _finish(rec, engine, gen, prompt_tokens, n_predict)


def cold_start(stage: str, model_path, prompt_tokens: int, n_ctx=None, threads=None, layers=None) -> dict:
    """The article's cold start: the model file evicted from the page cache, then loaded and run
    once over the prompt, each counted (page faults, major ones from the disk, per second).
    layers: run the first forward pass on that many layers (a stage measured by extrapolation)."""
    eviction = evict(model_path)
    with Counters() as loading:
        engine = load(stage, model_path, n_ctx=n_ctx, threads=threads)
    every_layer = engine.layers
    engine.layers = every_layer[:layers] if layers is not None else every_layer
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    with Counters() as first:
        engine.greedy_next(prompt, 0)
    return {"eviction": eviction.as_dict(), "load": loading.result, "first_forward": first.result,
            "prompt_tokens": len(prompt), "layers": len(engine.layers), "n_layer": len(every_layer)}


VALIDATE_POSITIONS = 4      # prompt positions whose logits are checked before a stage is measured


def _reference_logits(engine, tokens) -> np.ndarray:
    """float64 logits of the reference forward (common/reference.py), computed in a process of its
    own (its float64 weights must not count in the measured stage's peak RSS) and kept beside the
    records' scratch files (profiles/results/<machine>/tmp/, not committed), so every stage of a
    report compares with the same array without computing it again."""
    st = os.stat(engine.gguf.path)
    key = hashlib.sha256(f"{engine.gguf.path}:{st.st_size}:{st.st_mtime_ns}:{list(tokens)}".encode()).hexdigest()[:16]
    cache = RESULTS_DIR / machine_id() / "tmp" / f"reference-{key}.npy"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        code = ("import sys, numpy as np; from common import reference; from common.gguf import GGUFFile; "
                "np.save(sys.argv[2], reference.forward(GGUFFile(sys.argv[1]), [int(t) for t in sys.argv[3:]]))")
        subprocess.run([sys.executable, "-c", code, engine.gguf.path, str(cache), *map(str, tokens)], cwd=ROOT,
                       check=True)
    return np.load(cache)


def validate(engine, stage: str, prompt: list) -> dict:
    """Before a stage is timed, its logits for the first prompt positions against the float64
    reference, within the stage's own tolerance (stages.logit_tolerance): what the record says
    about its numbers, and what the tables and charts check before they show its figures."""
    tokens = prompt[:VALIDATE_POSITIONS]
    engine.reset()
    got = np.asarray(engine.forward(tokens, 0), dtype=np.float64)
    engine.reset()
    want = _reference_logits(engine, tokens)
    diff = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
    tol = logit_tolerance(stage)
    return {"positions": len(tokens), "max_abs_diff": diff, "tolerance": tol, "passed": bool(diff <= tol),
            "against": "common/reference.py (float64)"}


def bench_stage(stage: str, model, prompt_tokens=None, n_predict=None, threads=None, ctx_size=None,
                profile_n: int = 0, cold: bool = True) -> dict:
    """Load and measure one stage or variant: its record (not written); with profile_n, a per-op
    profile of a run of profile_n tokens added; with cold, the cold start. A stage too slow for
    the model is measured by extrapolation (measure_extrapolated)."""
    prompt_tokens, n_predict = settings_for(stage, prompt_tokens, n_predict)
    path = resolve(model)
    engine = load(stage, path, n_ctx=ctx_size, threads=threads, progress=True)
    layers = layers_to_measure(engine) if too_slow_for(stage, n_params(engine.config)) else None
    if layers:
        rec = measure_extrapolated(engine, stage, prompt_tokens, n_predict, layers)
        rec["validation"] = {"skipped": "measured on a few layers only (extrapolated): no whole-model forward "
                                        "to compare with the reference"}
    else:
        checked = validate(engine, stage, bench_prompt(engine.tokenizer, prompt_tokens))
        rec = measure(engine, stage, prompt_tokens, n_predict)
        rec["validation"] = checked
        if profile_n:
            rec["profile"] = profile_run(engine, stage, prompt_tokens, profile_n)
            rec["profile_settings"] = {"prompt_tokens": prompt_tokens, "n_predict": profile_n}
    if cold:
        n_ctx, threads = engine.n_ctx, engine.backend.threads
        del engine                                   # unmapped, so that its pages can be evicted
        gc.collect()
        rec["cold_start"] = cold_start(stage, path, prompt_tokens, n_ctx, threads, layers)
    return rec


def stage_in_child(name: str, model, prompt_tokens: int, n_predict: int, threads: int | None = None,
                   out_dir=None, profile_n: int = 0, n_ctx: int | None = None) -> dict:
    """One measurement in a fresh process, so that its peak RSS, page faults and JIT warm-up are
    that engine's alone: `python -m app bench stage` for a stage or variant, `... baseline` for
    llama.cpp. The record is written to out_dir unless it is None; returned either way."""
    cmd = [sys.executable, "-m", "app", *(["baseline"] if name == BASELINE else ["bench", "stage", "--stage", name]),
           "-m", model, "--prompt-tokens", prompt_tokens, "-n", n_predict, "--json"]
    cmd += ["--threads", threads] if threads else []
    cmd += ["--ctx-size", n_ctx] if n_ctx else []
    cmd += ["--out", out_dir] if out_dir else ["--no-write"]
    cmd += ["--profile-n", profile_n] if profile_n and name != BASELINE else []
    return run_child(cmd, name)
