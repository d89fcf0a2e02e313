"""Measuring in a chapter: loading a stage, running it by the report's protocol (the same record
`python -m app bench stage` writes, so live results and recorded ones draw with the same code),
profiling it per op, memory and page faults, and the records `make report` keeps."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.measure import bench
from app.measure.bench import RESULTS_DIR
from app.measure.machine import machine_id, rusage
from app.report.charts import load_results
from common.generate import Sampler, generate
from common.profile import format_table
from notebooks.nb.settings import ROOT, Settings, model_path, rel
from notebooks.nb.text import md, show_table
from stages import STAGES, unavailable_reason
from stages import load as load_stage


def memory_now() -> dict:
    """Current and peak resident memory (MiB) and page faults so far, of this process."""
    r = rusage()
    rss = r["peak_rss_mb"]
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass                                 # not Linux: the peak is the best figure there is
    return {"rss_mb": rss, **r}


def faults_between(before: dict, after: dict) -> int:
    """Page faults (minor + major) between two memory_now() readings."""
    return sum(after[k] - before[k] for k in ("minor_faults", "major_faults"))


def missing_stage(stage: str) -> str | None:
    """None if this checkout has the stage and this machine can run it, else a sentence why not."""
    if stage not in STAGES:
        return f"stage '{stage}' is not in this checkout yet (stages/{stage}.py is missing)"
    try:
        reason = unavailable_reason(stage)
    except Exception as e:               # its module could not even be imported (e.g. no PyCUDA)
        reason = f"{type(e).__name__}: {e}"
    return f"stage '{stage}' cannot run on this machine: {reason}" if reason else None


def load(stage: str):
    """The stage on the notebook's model, kernels compiled (or loaded from numba's cache)."""
    gc.collect()                         # let the previous eager model's float32 copies go first
    engine = load_stage(stage, model_path())
    engine.jit_s = engine.warmup()
    return engine


def prompt_ids(engine, n_tokens: int) -> list[int]:
    """The benchmark's prompt (app/measure/bench.py), cut to n_tokens: the same ids as the records."""
    return bench.bench_prompt(engine.tokenizer, n_tokens)


class KeepLogits(Sampler):
    """Greedy, keeping every logits row it is given (a copy each): to set the rows a sequence
    saw in a batch beside those it saw alone."""

    def __init__(self):
        super().__init__()
        self.logits = []

    def choose(self, logits, history=()):
        self.logits.append(np.array(logits))
        return int(np.argmax(logits))


def measure(engine, cfg: Settings, n_predict: int | None = None) -> dict:
    """One run by the measurement protocol; the same record `python -m app bench stage` writes."""
    n = n_predict or cfg.n_for(engine.stage)
    rec = bench.measure(engine, engine.stage, cfg.prompt_tokens, n)
    rec["source"] = "live"
    return rec


def measure_pair(before: str, after: str, cfg: Settings) -> tuple[list[dict], list[dict]]:
    """measure() of a stage and of the one it builds on, each loaded fresh and let go before the
    next, a line each; and the per-op profile of `after`: ([before's record, after's], rows)."""
    live = []
    for stage in (before, after):
        engine = load(stage)
        live.append(measure(engine, cfg))
        if stage == after:
            rows = profile(engine, cfg)
        del engine
    for r in live:
        print(f"{r['stage']:>8}: TTFT {r['ttft_ms']:7.0f} ms, decode {r['decode_ms']:7.0f} ms/token  {r['text']!r}")
    return live, rows


def measure_live(stages, threads, cfg: Settings) -> dict:
    """{(stage, threads): record} of measure() for every stage that runs here at each thread
    count, each loaded fresh and let go before the next."""
    live = {}
    for s in stages:
        if missing_stage(s):
            continue
        for t in threads:
            gc.collect()
            engine = load_stage(s, model_path(), threads=t)
            engine.stage = s
            engine.warmup()
            live[(s, t)] = measure(engine, cfg)
            del engine
    return live


def profile(engine, cfg: Settings) -> list[dict]:
    """Per-op rows (common/profile.py) of a profiled run at the notebook's settings."""
    return bench.profile_run(engine, engine.stage, cfg.prompt_tokens, cfg.profile_n_for(engine.stage))


def print_profile(rows: list[dict], title: str):
    print(format_table(rows, title))


def measure_in_subprocess(stage: str, prompt: str, n_predict: int) -> dict:
    """`python -m app run --json` in a fresh process: peak RSS and page faults of that stage
    alone, untouched by whatever this notebook loaded before."""
    cmd = [sys.executable, "-m", "app", "run", "--stage", stage, "-m", str(model_path()),
           "-p", prompt, "-n", str(n_predict), "--json"]
    # Linux carries a process's peak RSS (ru_maxrss) across fork + exec, so a child started
    # straight from this kernel would report the kernel's own memory as its peak. A shell in
    # between (forking, not exec-ing, the command) starts the count afresh.
    proc = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *cmd], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_ms(engine, tokens, length: int, reps: int = 2) -> float:
    """Milliseconds of the decode step that produces token number `length + 1`: the whole text
    again for a stage without a KV cache, one token on a cache holding `length - 1` for one with."""
    if engine.uses_kv_cache:
        engine.reset()
        if length > 1:
            engine.forward(tokens[:length - 1], 0, all_logits=False)
        feed, start = tokens[length - 1:length], length - 1
    else:
        feed, start = tokens[:length], 0
    best = float("inf")
    for _ in range(reps):                # rewriting the same cache position gives the same result
        t0 = time.perf_counter()
        engine.greedy_next(feed, start)
        best = min(best, time.perf_counter() - t0)
    engine.reset()
    return best * 1e3


@dataclass
class MatmulWork:
    """Per generated token: the rows each layer matmul multiplied (M of x [M, K]) and the
    multiply-adds of all the step's matmuls."""
    rows: list = field(default_factory=list)
    macs: list = field(default_factory=list)


def matmul_work(engine, prompt, n_predict: int) -> MatmulWork:
    """Generate greedily while counting what the matmuls compute: x [M, K] @ W -> [M, N] is
    M*K*N multiply-adds. Counted from the arrays the stage really multiplies."""
    backend, work = engine.backend, MatmulWork()
    step = {"rows": 0, "macs": 0}
    matmul = backend.matmul

    def counting(x, w):
        out = matmul(x, w)
        step["rows"] = max(step["rows"], x.shape[0])
        step["macs"] += x.shape[0] * x.shape[1] * out.shape[1]
        return out

    def on_token(_):
        work.rows.append(step["rows"])
        work.macs.append(step["macs"])
        step.update(rows=0, macs=0)

    backend.matmul = counting
    try:
        generate(engine, prompt, n_predict, ignore_eos=True, on_token=on_token)
    finally:
        del backend.matmul                # back to the class's method
    return work


@dataclass
class Recorded:
    results: object | None               # app.report.charts.Results, or None
    note: str                            # one sentence for the reader: where these come from

    def get(self, stage: str) -> dict | None:
        if self.results is None:
            return None
        return next((r for r in self.results.stages if r["stage"] == stage), None)


def recorded(results_root=None) -> Recorded:
    """The records `make report` wrote for the notebook's model: this machine's if there are any,
    else another machine's (said so), else None (said so). Never raises for missing files."""
    root = Path(results_root or RESULTS_DIR)
    stem = model_path().stem
    mine = root / machine_id() / stem
    # another machine's: the one that recorded the most (an older folder may hold a few stages only)
    others = sorted((p for p in root.glob(f"*/{stem}") if p != mine), key=lambda p: (-len(list(p.glob("*.json"))), p))
    candidates = [mine] + others
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("*.json")):
            res = load_results(folder)
            if not res.stages and not res.baseline:
                continue
            cpu = (res.stages[0].get("machine") or {}).get("cpu", "?") if res.stages else "?"
            where = "this machine" if folder == mine else f"another machine ({cpu}), not this one"
            note = f"Recorded results: `{rel(folder)}/` ({', '.join(res.names)}), measured on {where}."
            if res.problems:
                note += " " + " ".join(res.problems)
            return Recorded(res, note)
    return Recorded(None, f"No recorded results for {stem} under `{rel(root)}/` yet: `make report` "
                          f"measures every stage and writes them. Only the live figures are shown.")


def find_records(stage: str, results_root=None) -> list[tuple[Path, dict]]:
    """Every record of a stage for the notebook's model, on any machine (the cuda stage is
    recorded where a GPU was lent, a machine other than the reader's)."""
    out = []
    for path in sorted(Path(results_root or RESULTS_DIR).glob(f"*/{model_path().stem}/{stage}.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return out


def ceilings(threads: int = 1, integer: bool = False) -> dict:
    """The machine's bandwidth (GB/s) and peak (G operations/s) at `threads` (the recorded
    machine.json of this machine if there is one, else measured now: about a second); integer:
    the integer unit's peak where the machine has one (a stage with int8 matmuls), named in
    `peak_name`. app/measure/speculative.py's ceilings, with the source said for a page."""
    from app.measure.speculative import ceilings as measured
    c = measured(threads, integer)
    recorded = c["source"].endswith("machine.json")
    return dict(c, source=f"recorded in `{c['source']}`" if recorded else
                "measured just now by app/measure/roofline.py (no recorded machine.json for this machine)")


def best_seconds(fn, reps: int) -> float:
    fn()                                  # compile / warm the caches first
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _bench_records(pattern: str, kind: str):
    """The committed records of one kind under profiles/bench/ whose path matches `pattern` (a
    glob below that folder), in path order."""
    for path in sorted((ROOT / "profiles" / "bench").glob(pattern)):
        record = json.loads(path.read_text())
        if record.get("kind") == kind:
            yield record


def _machine_named(m: dict) -> str:
    """A record's machine: its id, or for a record made before ids named the ISA, its CPU, design
    (family/model) and cores."""
    from app.measure.machine import machine_id
    if "isa" in m and "cpu_signature" in m:
        return machine_id(m)
    sig = m.get("cpu_signature") or {}
    design = f" (family {sig['family']} model {sig['model']})" if sig.get("family") is not None else ""
    return f"{m.get('cpu', '?')}{design}, {m.get('physical_cores', '?')} cores"


def recorded_vs_llama(engines) -> list[tuple]:
    """(model, row, decode / llama.cpp, TTFT / llama.cpp, measured on, prompt tokens) for the rows of
    `engines` in every committed comparison record (profiles/bench/vs_llama_*.json, `python -m app
    bench vs-llama`): ratios of times, each record's own machine and prompt."""
    from app.measure import compare
    rows = []
    for record in _bench_records("**/vs_llama_*.json", "comparison"):
        on, prompt = _machine_named(record["machine"]), record.get("settings", {}).get("prompt_tokens", "?")
        for row, f in compare.summary(record).items():
            if f["engine"] in engines and "decode_ms_over_llama_cpp" in f:
                rows.append((record["model"], row, f"{f['decode_ms_over_llama_cpp']:.2f}",
                             f"{f['ttft_ms_over_llama_cpp']:.2f}", f"`{on}`", prompt))
    return rows


def show_vs_llama(engines, missing: str) -> list[tuple[str, str, str, str]]:
    """The table of recorded_vs_llama(engines), or the sentence `missing` where no record has
    them. The rows."""
    rows = recorded_vs_llama(engines)
    if rows:
        show_table(["model", "row", "decode / llama.cpp", "TTFT / llama.cpp", "measured on", "prompt tokens"], rows)
        md("_Ratios of times: under 1, faster than llama.cpp on the same file, machine and threads; each row "
           "is its record's machine, which need not be this one._")
    else:
        md(missing)
    return rows


def decode_ratios(rows) -> str:
    """show_vs_llama's rows as one sentence of decode ratios (a chapter's finding)."""
    return ", ".join(f"{r[0]} {r[1]} decode {r[2]}x on {r[4].strip('`')}" for r in rows)


def vs_llama_ratios(stage: str, engines: str = "") -> str | None:
    """The recorded comparison of `stage` with llama.cpp, shown (show_vs_llama), and its decode
    ratios as one sentence; None where none is recorded, and the page then names the command
    that measures it (`--engines engines`, where given)."""
    command = "python -m app bench vs-llama" + (f" --engines {engines}" if engines else "")
    rows = show_vs_llama([stage], f"_No recorded comparison of the {stage} stage yet: `{command}` writes it._")
    return decode_ratios(rows) if rows else None


def recorded_ttft() -> list[tuple]:
    """(model, engine, prompt, TTFT / llama.cpp's better, decode / llama.cpp's better) of every
    committed prompt-length sweep (profiles/bench/ttft_*.json, `python -m app bench ttft`)."""
    from app.measure import ttft
    rows = []
    for record in _bench_records("ttft_*.json", "ttft_sweep"):
        for engine, by_length in ttft.summary(record).items():
            for n, f in by_length.items():
                if "ttft_ms_over_llama" in f:
                    rows.append((record["model"], engine, n, f"{f['ttft_ms_over_llama']:.2f}",
                                 f"{f['decode_ms_over_llama']:.2f}"))
    return rows
