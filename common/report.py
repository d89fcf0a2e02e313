"""`make report`: measure every stage this machine can run, then redraw the charts and the
README table from the JSON records.

    python -m common report [-m MODEL] [--stages naive,simd] [--draw-only] [--no-baseline]

Each stage is measured in its own process (clean peak RSS, its own JIT warm-up) by
`python -m common bench --profile`, with the settings of PROMPT_TOKENS and REPORT_N_PREDICT
in common/report.py: the same prompt length for every stage so TTFT compares like with like,
and fewer generated tokens for the stages that recompute the whole text per token (the chart
says so). The machine's bandwidth and peak FLOP/s are measured once
(profiles/results/<machine>/machine.json) for the roofline. llama.cpp's row is measured when
llama-cpp-python is installed (`make baseline`).

`-m tinyllama-synthetic` (or any GGUF file) writes its charts and a results.md under
profiles/<model>/. On models above 500M parameters naive and tiling are left out unless
named in --stages (they would take ~40 minutes there).

The whole report on the default model took 1 min 40 s on 2 cores with numba's cache warm (a
minute or two more the first time, compiling), most of it in naive and tiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"

PROMPT_TOKENS = 32
# tokens generated per stage: the stages without a KV cache re-run the whole text per token
REPORT_N_PREDICT = {"naive": 4, "tiling": 4, "simd": 16}
REPORT_N_PREDICT_DEFAULT = 64
PROFILE_N_PREDICT = {"naive": 2, "tiling": 2, "simd": 8}
PROFILE_N_PREDICT_DEFAULT = 32
# naive and tiling recompute the whole text for every token at 0.4-2 GFLOP/s: on TinyLlama's
# 1.1B parameters a 32-token forward pass is ~70 GFLOP, about 3 minutes for naive (measured:
# 1.9 s for one 32 x 2048 x 5632 matmul), so their rows alone would take ~40 minutes. Above
# this size they are measured only when asked for by name (--stages naive,tiling,...).
RECOMPUTE_STAGES = ("naive", "tiling")
LARGE_MODEL_PARAMS = 500e6


def _python() -> str:
    return sys.executable


def measure_stage(stage: str, model: Path, out_dir: Path, threads=None) -> dict:
    n = REPORT_N_PREDICT.get(stage, REPORT_N_PREDICT_DEFAULT)
    cmd = [_python(), "-m", "common", "bench", "--stage", stage, "-m", str(model), "--prompt-tokens",
           str(PROMPT_TOKENS), "-n", str(n), "--out", str(out_dir), "--json",
           "--profile-n", str(PROFILE_N_PREDICT.get(stage, PROFILE_N_PREDICT_DEFAULT))]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"stage {stage} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _model_params(model: Path) -> int:
    from common.gguf import GGUFFile
    from common.model import LlamaConfig, n_params
    with GGUFFile(model) as g:
        return n_params(LlamaConfig.from_gguf(g))


def measure_machine(folder: Path, force: bool = False) -> dict:
    path = folder / "machine.json"
    if path.exists() and not force:
        return json.loads(path.read_text())
    from common import roofline
    from common.machine import machine_info
    rec = {"kind": "machine", "machine": machine_info(), **roofline.measure(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    return rec


def measure_baseline(model: Path, out_dir: Path, threads: int = 1) -> dict:
    """llama.cpp's row in a child process (clean RSS), same prompt ids as the stages."""
    cmd = [_python(), "-m", "common", "baseline", "-m", str(model), "--prompt-tokens", str(PROMPT_TOKENS),
           "-n", str(REPORT_N_PREDICT_DEFAULT), "--threads", str(threads), "--out", str(out_dir), "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "baseline failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shown(path: Path) -> str:
    """A path as the README shows it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def draw(folder: Path, charts_dir: Path, update_readme_table: bool, why_missing=None) -> list:
    from common import charts
    from stages import STAGES
    res = charts.load_results(folder, expected=STAGES, why_missing=why_missing)
    written = charts.draw_all(res, charts_dir)
    caption = (f"Measured by `make report` on {res.stages[0]['machine']['cpu']} "
               f"({res.stages[0]['machine']['physical_cores']} cores), "
               f"{res.stages[0]['model']}, greedy, 1 thread unless stated. "
               f"Records: `{_shown(folder)}/`.\n\n") if res.stages else ""
    if update_readme_table:
        if charts.update_readme(ROOT / "README.md", charts.results_table(res), caption):
            written.append(ROOT / "README.md")
    elif res.stages:                       # another model: its table beside its charts
        path = charts_dir / "results.md"
        path.write_text(caption + charts.results_table(res) + "\n")
        written.append(path)
    for p in res.problems:
        print(f"note: {p}", file=sys.stderr)
    return written


def run(model=None, stages=None, draw_only=False, baseline=True, remeasure_machine=False):
    from tqdm import tqdm

    from common.bench import results_dir
    from common.models import DEFAULT_MODEL, resolve
    from stages import runnable_stages, unavailable_reason, STAGES
    model = resolve(model)
    folder = results_dir(model.name)
    is_default = model.resolve() == DEFAULT_MODEL.path.resolve()
    charts_dir = PROFILES if is_default else PROFILES / model.stem
    if not draw_only:
        todo = stages or runnable_stages()
        for s in STAGES:
            if s not in todo and not stages:
                print(f"skipping {s}: {unavailable_reason(s)}", file=sys.stderr)
        params = _model_params(model)
        if not stages and params > LARGE_MODEL_PARAMS:
            for s in RECOMPUTE_STAGES:
                print(f"skipping {s}: a {params / 1e9:.1f}B-parameter model takes minutes per token there "
                      f"(~40 min for both rows on 2 cores); --stages {','.join(RECOMPUTE_STAGES)},... "
                      f"measures it anyway", file=sys.stderr)
            todo = [s for s in todo if s not in RECOMPUTE_STAGES]
        print("measuring the machine's bandwidth and peak FLOP/s ...", file=sys.stderr)
        measure_machine(folder.parent, force=remeasure_machine)
        bar = tqdm(todo, desc="stages", unit="stage")
        for stage in bar:
            bar.set_postfix_str(stage)
            t0 = time.perf_counter()
            try:
                rec = measure_stage(stage, model, folder)
            except RuntimeError as e:
                tqdm.write(f"{e}")
                continue
            tqdm.write(f"{stage:>10}: TTFT {rec['ttft_ms']:9.1f} ms, decode {rec['decode_ms']:8.1f} ms/token "
                       f"({time.perf_counter() - t0:.0f} s)")
        if baseline:
            from common.baseline import llama_cpp_version
            from common.machine import physical_cores
            if llama_cpp_version():
                for threads in sorted({1, physical_cores()}):     # the article's 1 thread; all cores
                    rec = measure_baseline(model, folder, threads)
                    print(f"{'llama.cpp':>10}: TTFT {rec['ttft_ms']:9.1f} ms, decode {rec['decode_ms']:8.1f} "
                          f"ms/token ({threads} thread{'s' if threads > 1 else ''})", file=sys.stderr)
            else:
                print("llama.cpp row: llama-cpp-python not installed (`make baseline` adds it)", file=sys.stderr)
    why_missing = {}
    if _model_params(model) > LARGE_MODEL_PARAMS:
        why_missing = {s: "too slow on a model this size; --stages names it to measure it" for s in RECOMPUTE_STAGES}
    for path in draw(folder, charts_dir, update_readme_table=is_default, why_missing=why_missing):
        print(f"wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)


def add_commands(sub):
    p = sub.add_parser("report", help="measure every stage, redraw profiles/*.png and the README table",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    from common.models import DEFAULT_MODEL
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--stages", default=None, help="comma-separated stages to (re)measure (default: all runnable)")
    p.add_argument("--draw-only", action="store_true", help="redraw from the records without measuring")
    p.add_argument("--no-baseline", action="store_true", help="skip llama.cpp's row")
    p.add_argument("--remeasure-machine", action="store_true", help="measure bandwidth and peak FLOP/s again")
    p.set_defaults(func=lambda a: run(a.model, a.stages.split(",") if a.stages else None, a.draw_only,
                                      not a.no_baseline, a.remeasure_machine))

    p = sub.add_parser("baseline", help="measure llama.cpp (llama-cpp-python) on the same prompt ids",
                       description="Record llama.cpp's row: the same model, prompt token ids and thread count "
                                   "as the stages. Needs llama-cpp-python (`make baseline` installs it).")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path))
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument("-n", "--n-predict", type=int, default=REPORT_N_PREDICT_DEFAULT)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_baseline)


def cmd_baseline(args):
    from common.baseline import measure_llama_cpp
    from common.bench import bench_prompt, write_record
    from common.gguf import GGUFFile
    from common.machine import machine_info
    from common.models import resolve
    from common.tokenizer import Tokenizer
    model = resolve(args.model)
    prompt = bench_prompt(Tokenizer.from_gguf(GGUFFile(model)), args.prompt_tokens)
    rec = measure_llama_cpp(model, prompt, args.n_predict, threads=args.threads)
    rec["settings"] = {"prompt_tokens": args.prompt_tokens, "n_predict": args.n_predict, "threads": args.threads}
    rec["machine"] = machine_info()
    path = write_record(rec, args.out, name="llama.cpp" if args.threads == 1 else f"llama.cpp-{args.threads}t")
    if args.json:
        print(json.dumps(rec))
    else:
        print(f"llama.cpp: TTFT {rec['ttft_ms']:.1f} ms, decode {rec['decode_ms']:.1f} ms/token -> {path}")
