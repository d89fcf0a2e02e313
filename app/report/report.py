"""`make report`: measure every stage this machine can run, then redraw the charts, the README
table, the generated pages and the lessons ledger from the JSON records.

    python -m app report [-m MODEL] [--stages naive,simd] [--draw-only] [--no-baseline]
    python -m app report --draw-only        redraw the charts, tables, pages and the README's answer and
                                            table from the committed records; measures nothing and
                                            needs no model file (-m names whose records, --article too)
    python -m app report --article          the article's workload, every stage (see below)
    python -m app report --perplexity       also the perplexity comparison (perplexity.json)

Each stage is measured in its own process (clean peak RSS, its own JIT warm-up) through the
one harness (app/measure/bench.py), with the registry's settings (stages/registry.py): the same
prompt length for every stage so TTFT compares like with like, and fewer generated tokens for
the stages that recompute the whole text per token (the chart says so). The stages are compiled
into numba's disk cache first (app/compile.py, not measured: warm_the_cache), so no measured
process runs the compiler. The machine's bandwidth and peak FLOP/s are measured once
(profiles/results/<machine>/machine.json) for the roofline.
llama.cpp's rows (1 thread, the article's setting, and all cores) are measured when
llama-cpp-python is installed (`make baseline`).

`-m tinyllama-synthetic` (or any GGUF file) writes its charts and a results.md under
profiles/<model>/. On a model larger than a stage's `max_params` in the registry (naive and
tiling: LARGE_MODEL_PARAMS) the stage is left out unless named in --stages.

`--article` measures the article's setting: TinyLlama 1.1B (the real file where models/ has it,
else its geometry with synthetic weights, `make model name=tinyllama-synthetic`, labelled so) with
a 512-token prompt, every stage, into profiles/results/<machine>/<model>-prompt512/ with its
charts and results.md under profiles/<model>-prompt512/. The stages without a KV cache generate
2 tokens (a prompt pass and one decode step, each a 512-token pass), the others 16; naive and
tiling would take tens of minutes per pass there, so they run a few layers and extrapolate
(app/measure/bench.py says how; their records and rows say so). Expect it to take a while, most
of it naive's and tiling's few layers of 512-token passes.

`--perplexity` adds the comparison of app/measure/perplexity.py (`python -m app perplexity
--compare`) on the default model: every float stage, int8, and the model requantized to four
types, on the committed text (minutes per row).

Every drawing also writes profiles/lessons.md and lessons.png (app/report/lessons.py): each of
the article's claims beside this machine's records.

Every record says which code it measured (app/measure/provenance.py); the report warns when the
records it draws were measured with other code than the code checked out now.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from app import ROOT
from app.compile import compile_all, in_compile_order
from app.measure import perplexity, roofline
from app.measure.baseline import llama_cpp_version
from app.measure.bench import BASELINE, results_dir, stage_in_child
from app.measure.protocol import header, write_record
from app.measure.provenance import provenance, stale
from app.models import DEFAULT_MODEL, MODELS, FetchError, resolve
from app.report import charts, lessons, pages
from common.cpu import physical_cores
from common.gguf import GGUFFile
from common.model import LlamaConfig, n_params
from stages import STAGES, info, runnable_stages, unavailable_reason
from stages.registry import REPORT_PROMPT_TOKENS, Tokens

PROFILES = ROOT / "profiles"


# The article's workload: tokens generated after its 512-token prompt.
ARTICLE_TOKENS_CACHED = 16          # stages with a KV cache (and llama.cpp)
ARTICLE_TOKENS_RECOMPUTING = 2      # the others: a prompt pass and one decode step, each 512 tokens


@dataclass(frozen=True)
class Workload:
    """What a report measures: the registry's settings, or the article's."""
    prompt_tokens: int = REPORT_PROMPT_TOKENS
    article: bool = False

    def n_predict(self, stage: str) -> int:
        if not self.article:
            return info(stage).tokens.report
        return ARTICLE_TOKENS_CACHED if info(stage).kv_cache else ARTICLE_TOKENS_RECOMPUTING

    def profile_n(self, stage: str) -> int:
        return 0 if self.article else info(stage).tokens.profile      # no profiled run of 512-token passes

    @property
    def baseline_tokens(self) -> int:
        return ARTICLE_TOKENS_CACHED if self.article else Tokens().report


REPORT = Workload()
ARTICLE = Workload(lessons.ARTICLE_PROMPT_TOKENS, article=True)


def measure_stage(stage: str, model: Path, out_dir: Path, threads=None, workload: Workload = REPORT) -> dict:
    return stage_in_child(stage, model, workload.prompt_tokens, workload.n_predict(stage), threads=threads,
                            out_dir=out_dir, profile_n=workload.profile_n(stage))


def measure_baseline(model: Path, out_dir: Path, threads: int = 1, workload: Workload = REPORT) -> dict:
    """llama.cpp's row, same prompt ids as the stages, as many tokens as the KV-cache stages."""
    return stage_in_child(BASELINE, model, workload.prompt_tokens, workload.baseline_tokens, threads=threads,
                            out_dir=out_dir)


def article_model() -> Path:
    """TinyLlama 1.1B Q4_K_M where models/ has it, else its synthetic geometry."""
    for name in lessons.ARTICLE_MODELS:
        if name in MODELS and MODELS[name].path.exists():
            return MODELS[name].path
    raise FetchError("the article's workload needs TinyLlama 1.1B: `make model name=tinyllama-synthetic` writes "
                     "its geometry with synthetic weights (a few minutes), or `make model name=tinyllama`")


def model_params(model: Path) -> int:
    with GGUFFile(model) as g:
        return n_params(LlamaConfig.from_gguf(g))


def too_large(params: int) -> list[str]:
    """The stages left out on a model this size unless named."""
    return [s for s in STAGES if info(s).max_params is not None and params > info(s).max_params]


def measure_machine(folder: Path, force: bool = False) -> dict:
    path = folder / "machine.json"
    if path.exists() and not force:
        return json.loads(path.read_text())
    rec = {"kind": "machine", **roofline.measure(), **header()}
    write_record(rec, path)
    return rec


def _shown(path: Path) -> str:
    """A path as the README shows it: relative to the repository when inside it."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def draw(folder: Path, charts_dir: Path, update_readme_table: bool, why_missing=None) -> list:
    res = charts.load_results(folder, expected=STAGES, why_missing=why_missing)
    written = charts.draw_all(res, charts_dir)
    caption = charts.caption(res, _shown(folder))
    if update_readme_table:
        if charts.update_readme(ROOT / "README.md", charts.results_table(res), caption,
                                charts.answer(res, _shown(folder))):
            written.append(ROOT / "README.md")
    elif res.stages:                       # another model: its table beside its charts
        path = charts_dir / "results.md"
        path.write_text(caption + charts.results_table(res) + "\n")
        written.append(path)
    for p in res.problems + res.chart_notes:
        print(f"note: {p}", file=sys.stderr)
    old = stale(res.stages + res.baselines)
    if old:
        print(f"warning: {', '.join(old)} measured with other code than the code checked out now "
              f"(code {provenance()['code_hash']}); `make report` measures them again", file=sys.stderr)
    return written


def nothing_to_draw(folder: Path) -> str:
    """Why --draw-only stops where this machine has no records (drawing would empty the pages)."""
    others = sorted(p.parent.name for p in folder.parent.parent.glob(f"*/{folder.name}") if any(p.glob("*.json")))
    return (f"no records of this machine ({folder.parent.name}) for {folder.name} under {folder.parent.parent.name}/: "
            f"`make report` measures them (the committed ones are of {', '.join(others) or 'no machine'}, and a "
            f"page is drawn only from the machine it names); nothing was redrawn")


def warm_the_cache(todo: list, model: Path) -> None:
    """The stages about to be measured compiled first (app/compile.py: a prompt and a few steps
    of each on `model`, processes of their own, not measured), so that each measured process
    loads its kernels from numba's disk cache. A process that compiled them would count LLVM's
    memory in its peak RSS (a layer stack takes hundreds of MiB to compile) and record a figure
    that depends on whether the cache was warm."""
    jobs = in_compile_order([s for s in todo if s != "cuda"])      # PyCUDA builds its own kernels (nvcc)
    if jobs:
        print(f"warming numba's cache (not measured): {', '.join(jobs)}", file=sys.stderr)
        compile_all(jobs, str(model), physical_cores())


def model_to_draw(model, article: bool) -> Path:
    """The model whose records --draw-only redraws: its file need not be here (drawing reads the
    records only); for the article's workload, the first of its models that has records."""
    if article:
        for name in lessons.ARTICLE_MODELS:
            path = MODELS[name].path if name in MODELS else None
            if path and any((results_dir(path.name).parent / lessons.article_folder_name(path.stem)).glob("*.json")):
                return path
        return article_model()
    model = model or DEFAULT_MODEL.name
    return MODELS[str(model)].path if str(model) in MODELS else Path(model)


def recorded_params(folder: Path, model: Path) -> int:
    """The model's parameter count as its records say it (model_info), else read from its file."""
    for path in sorted(folder.glob("*.json")):
        n = (json.loads(path.read_text()).get("model_info") or {}).get("n_params")
        if n:
            return n
    return model_params(model)


def run(model=None, stages=None, draw_only=False, baseline=True, remeasure_machine=False, article=False,
        with_perplexity=False):
    workload = ARTICLE if article else REPORT
    if draw_only:
        model = model_to_draw(model, article)
    else:
        model = article_model() if article else resolve(model)
    folder = results_dir(model.name)
    is_default = model.resolve() == DEFAULT_MODEL.path.resolve() and not article
    charts_dir = PROFILES if is_default else PROFILES / model.stem
    if article:
        folder = folder.parent / lessons.article_folder_name(model.stem)
        charts_dir = PROFILES / folder.name
    if draw_only and not any(folder.glob("*.json")):
        raise SystemExit(nothing_to_draw(folder))
    params = recorded_params(folder, model) if draw_only else model_params(model)
    left_out = [] if article else too_large(params)      # the article's workload extrapolates them
    if not draw_only:
        todo = stages or runnable_stages()
        for s in STAGES:
            if s not in todo and not stages:
                print(f"skipping {s}: {unavailable_reason(s)}", file=sys.stderr)
        if not stages and left_out:
            for s in left_out:
                print(f"skipping {s}: a {params / 1e9:.1f}B-parameter model takes minutes per token there "
                      f"(above {info(s).max_params / 1e6:.0f}M parameters); --stages {s},... measures it anyway",
                      file=sys.stderr)
            todo = [s for s in todo if s not in left_out]
        print("measuring the machine's bandwidth and peak FLOP/s ...", file=sys.stderr)
        measure_machine(folder.parent, force=remeasure_machine)
        warm_the_cache(todo, model)
        bar = tqdm(todo, desc="stages", unit="stage")
        for stage in bar:
            bar.set_postfix_str(stage)
            t0 = time.perf_counter()
            try:
                rec = measure_stage(stage, model, folder, workload=workload)
            except RuntimeError as e:
                tqdm.write(f"{e}")
                continue
            tqdm.write(f"{stage:>10}: TTFT {rec['ttft_ms']:9.1f} ms, decode {rec['decode_ms']:8.1f} ms/token "
                       f"({time.perf_counter() - t0:.0f} s)" + (" extrapolated" if rec.get("extrapolated") else ""))
        if baseline:
            if llama_cpp_version():
                for threads in sorted({1, physical_cores()}):     # the article's 1 thread; all cores
                    rec = measure_baseline(model, folder, threads, workload)
                    print(f"{BASELINE:>10}: TTFT {rec['ttft_ms']:9.1f} ms, decode {rec['decode_ms']:8.1f} "
                          f"ms/token ({threads} thread{'s' if threads > 1 else ''})", file=sys.stderr)
            else:
                print("llama.cpp row: llama-cpp-python not installed (`make baseline` adds it)", file=sys.stderr)
        if with_perplexity:
            print("perplexity: every float stage, int8 and four requantized models ...", file=sys.stderr)
            rec = perplexity.compare(DEFAULT_MODEL.path, progress=lambda line: print(line, file=sys.stderr))
            written_ppl = perplexity.write(rec, results_dir(DEFAULT_MODEL.filename))
            print(f"wrote {os.path.relpath(written_ppl, ROOT)}", file=sys.stderr)
    why_missing = {s: "too slow on a model this size; --stages names it to measure it" for s in left_out}
    written = draw(folder, charts_dir, update_readme_table=is_default, why_missing=why_missing)
    written += pages.redraw(PROFILES / "bench")
    written += lessons.write(PROFILES)
    written.append(charts.write_ops_page(PROFILES))
    for path in written:
        print(f"wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)


def add_commands(sub):
    p = sub.add_parser("report", help="measure every stage, redraw profiles/*.png and the README table",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--stages", default=None, help="comma-separated stages to (re)measure (default: all runnable)")
    p.add_argument("--draw-only", action="store_true", help="redraw from the records without measuring")
    p.add_argument("--no-baseline", action="store_true", help="skip llama.cpp's rows")
    p.add_argument("--remeasure-machine", action="store_true", help="measure bandwidth and peak FLOP/s again")
    p.add_argument("--article", action="store_true",
                   help="the article's workload: TinyLlama 1.1B (or its synthetic geometry), 512-token prompt, "
                        "every stage (naive and tiling extrapolated from a few layers)")
    p.add_argument("--perplexity", action="store_true",
                   help="also the perplexity comparison of the stages and requantized models (tens of minutes)")
    p.set_defaults(func=lambda a: run(a.model, a.stages.split(",") if a.stages else None, a.draw_only,
                                      not a.no_baseline, a.remeasure_machine, a.article, a.perplexity))
