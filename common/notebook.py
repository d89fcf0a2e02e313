"""What the notebooks share: their settings, showing code, measuring, and drawing.

Every chapter in notebooks/ imports this module as `nb` and keeps only its own story; a helper
that two chapters need lives here, never in a notebook.

Settings come from the environment:

    LLM_NOTEBOOK_QUICK=1    tiny prompts and generations (the test suite sets it: every notebook
                            runs top to bottom in seconds); without it, the report's own settings,
                            so what a chapter measures live compares with the recorded profiles/
    LLM_NOTEBOOK_MODEL      a GGUF path or model name (default: the default model)

Measurements reuse the engine's own tools: `common.bench.measure` makes the same record a
benchmark writes (so live results and recorded ones draw with the same code), `common.profile`
times every op, `common.charts` groups ops and places records on the roofline.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK_ENV = "LLM_NOTEBOOK_QUICK"
MODEL_ENV = "LLM_NOTEBOOK_MODEL"


# ---- settings --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    quick: bool
    prompt_tokens: int                      # every live measurement uses this many prompt tokens
    n_predict: dict                         # tokens generated per stage; "*" for the others
    profile_n: dict                         # tokens generated in a per-op profiled run
    naive_lengths: tuple                    # context lengths for the slow stages' cost-vs-length curve
    lengths: tuple                          # the same for the fast stages
    tile_grid: tuple                        # (TILE_I, TILE_J, TILE_K) tried by the live tile sweep
    timing_reps: int                        # repetitions of a micro-benchmark (the best one counts)

    def n_for(self, stage: str) -> int:
        return self.n_predict.get(stage, self.n_predict["*"])

    def profile_n_for(self, stage: str) -> int:
        return self.profile_n.get(stage, self.profile_n["*"])

    def describe(self) -> str:
        mode = f"quick mode ({QUICK_ENV}=1)" if self.quick else "full settings (the report's)"
        return (f"{mode}: {self.prompt_tokens} prompt tokens; tokens generated per stage: "
                f"{', '.join(f'{k} {v}' for k, v in self.n_predict.items() if k != '*')}, "
                f"others {self.n_predict['*']}")


def is_quick() -> bool:
    return os.environ.get(QUICK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def settings(quick: bool | None = None) -> Settings:
    """Quick: as small as still shows each effect. Full: `make report`'s settings (common/report.py),
    so a chapter's live bars and the recorded ones measure the same thing."""
    from common import report
    quick = is_quick() if quick is None else quick
    if quick:
        return Settings(quick=True, prompt_tokens=4,
                        n_predict={"naive": 2, "tiling": 2, "simd": 2, "*": 4},
                        profile_n={"*": 2},
                        naive_lengths=(2, 4, 8), lengths=(4, 8, 16, 32),
                        tile_grid=((1, 1, 4096), (8, 16, 64), (8, 64, 64), (8, 256, 256)),
                        timing_reps=3)
    return Settings(quick=False, prompt_tokens=report.PROMPT_TOKENS,
                    n_predict={**report.REPORT_N_PREDICT, "*": report.REPORT_N_PREDICT_DEFAULT},
                    profile_n={**report.PROFILE_N_PREDICT, "*": report.PROFILE_N_PREDICT_DEFAULT},
                    naive_lengths=(8, 16, 32, 64), lengths=(16, 32, 64, 128, 256, 512),
                    tile_grid=tuple((i, j, k) for i in (1, 4, 8, 16) for j in (16, 64, 256)
                                    for k in (64, 256)) + ((1, 1, 4096),),
                    timing_reps=5)


def model_path() -> Path:
    from common.models import resolve
    return resolve(os.environ.get(MODEL_ENV) or None)


def rel(path) -> str:
    """A path as the reader sees it in the repository (no machine-specific prefix)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---- showing text, tables and code -----------------------------------------------------------

def md(text: str):
    from IPython.display import Markdown, display
    display(Markdown(text))


def md_table(headers, rows) -> str:
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def show_table(headers, rows):
    md(md_table(headers, rows))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', as `python -m common inspect` writes sizes."""
    from common.inspect_gguf import _human
    return _human(n)


def show_source(*objects, note: str = ""):
    """The code of functions or classes as the module has it now (never a pasted copy), with
    the file and line it comes from. A numba kernel shows its Python source."""
    parts = []
    for obj in objects:
        fn = getattr(obj, "py_func", obj)                   # a numba dispatcher -> its Python function
        lines, first = inspect.getsourcelines(fn)
        parts.append(f"`{rel(inspect.getsourcefile(fn))}`, line {first}:\n\n```python\n{''.join(lines).rstrip()}\n```")
    md((note + "\n\n" if note else "") + "\n\n".join(parts))


def show_file_excerpt(path, start_pattern: str, max_lines: int = 40, language: str = "c") -> bool:
    """A file from the first match of start_pattern (a regex, may span lines) to the end of that
    block (a line holding only '}') or max_lines. False if the file or the pattern is not there."""
    path = Path(path)
    if not path.exists():
        return False
    text = path.read_text()
    m = re.search(start_pattern, text, re.M)
    if m is None:
        return False
    lines = text.splitlines()
    start = text.count("\n", 0, m.start())
    end = start + 1
    while end < len(lines) and end - start < max_lines and lines[end - 1].rstrip() != "}":
        end += 1
    md(f"`{rel(path)}`, line {start + 1}:\n\n```{language}\n" + "\n".join(lines[start:end]) + "\n```")
    return True


def show_class_from_file(path, class_name: str, methods=None, note: str = "") -> bool:
    """show_source for a class (or some of its methods) read from the file without importing it."""
    src = class_source_from_file(path, class_name, methods)
    if src is None:
        return False
    what = f"{class_name}" + (f" ({', '.join(methods)})" if methods else "")
    md((note + "\n\n" if note else "") + f"`{rel(path)}`: {what}\n\n```python\n{src}\n```")
    return True


def class_source_from_file(path, class_name: str, methods=None) -> str | None:
    """A class (or some of its methods) from a file, read without importing it: a stage whose
    imports need hardware this machine lacks (PyCUDA) can still be read."""
    import ast
    path = Path(path)
    if not path.exists():
        return None
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if not methods:
                return ast.get_source_segment(text, node)
            found = [ast.get_source_segment(text, n) for n in node.body
                     if isinstance(n, ast.FunctionDef) and n.name in methods]
            return "\n\n".join("    " + s for s in found) if found else None
    return None


def module_kernels(module) -> list:
    """The numba kernels a module defines itself (not those it imports), in file order."""
    out = []
    for obj in vars(module).values():
        fn = getattr(obj, "py_func", None)
        if fn is not None and getattr(fn, "__module__", None) == module.__name__:
            out.append(obj)
    return sorted(out, key=lambda d: d.py_func.__code__.co_firstlineno)


def find_kernels(module, name_part: str) -> list:
    """Numba kernels whose name contains name_part, defined in `module` or in a stages.* module
    it imports (a stage may keep its per-format kernels in a module of their own)."""
    import types
    modules = [module] + [v for v in vars(module).values()
                          if isinstance(v, types.ModuleType) and v.__name__.startswith("stages.")]
    for v in vars(module).values():
        owner = getattr(getattr(v, "py_func", None), "__module__", "")
        if owner.startswith("stages.") and owner in sys.modules and sys.modules[owner] not in modules:
            modules.append(sys.modules[owner])
    found = [k for m in modules for k in module_kernels(m) if name_part.lower() in k.__name__.lower()]
    return list(dict.fromkeys(found))


# ---- memory and page faults -----------------------------------------------------------------

def memory_now() -> dict:
    """Current and peak resident memory (MiB) and page faults so far, of this process."""
    from common.machine import rusage
    r = rusage()
    rss = r["peak_rss_mb"]
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass                                 # not Linux: the peak is the best figure there is
    return {"rss_mb": rss, **r}


def cache_sizes() -> dict:
    """This machine's caches in bytes, per core: {'L1d': 49152, 'L2': ..., 'L3': ...}."""
    from common.machine import machine_info
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    out = {}
    for name, size in machine_info()["caches"].items():
        m = re.fullmatch(r"(\d+)\s*([KMG]?)B?", size.strip())
        if m and name != "L1i":
            out[name] = int(m.group(1)) * units.get(m.group(2), 1)
    return out


def faults_between(before: dict, after: dict) -> int:
    """Page faults (minor + major) between two memory_now() readings."""
    return sum(after[k] - before[k] for k in ("minor_faults", "major_faults"))


# ---- stages: load, measure, profile ----------------------------------------------------------

def missing_stage(stage: str) -> str | None:
    """None if this checkout has the stage and this machine can run it, else a sentence why not."""
    from stages import STAGES, unavailable_reason
    if stage not in STAGES:
        return f"stage '{stage}' is not in this checkout yet (stages/{stage}.py is missing)"
    try:
        reason = unavailable_reason(stage)
    except Exception as e:               # its module could not even be imported (e.g. no PyCUDA)
        reason = f"{type(e).__name__}: {e}"
    return f"stage '{stage}' cannot run on this machine: {reason}" if reason else None


def load(stage: str):
    """The stage on the notebook's model, kernels compiled (or loaded from numba's cache)."""
    from stages import load as load_stage
    gc.collect()                         # let the previous eager model's float32 copies go first
    engine = load_stage(stage, model_path())
    engine.jit_s = engine.warmup()
    return engine


def prompt_ids(engine, n_tokens: int) -> list[int]:
    """The benchmark's prompt (common/bench.py), cut to n_tokens: the same ids as the records."""
    from common.bench import bench_prompt
    return bench_prompt(engine.tokenizer, n_tokens)


def measure(engine, cfg: Settings, n_predict: int | None = None) -> dict:
    """One run by the measurement protocol; the same record `python -m common bench` writes."""
    from common.bench import measure as bench_measure
    n = n_predict or cfg.n_for(engine.stage)
    rec = bench_measure(engine, engine.stage, cfg.prompt_tokens, n)
    rec["source"] = "live"
    return rec


def profile(engine, cfg: Settings) -> list[dict]:
    """Per-op rows (common/profile.py) of a profiled run at the notebook's settings."""
    from common.bench import profile_run
    return profile_run(engine, engine.stage, cfg.prompt_tokens, cfg.profile_n_for(engine.stage))


def print_profile(rows: list[dict], title: str):
    from common.profile import format_table
    print(format_table(rows, title))


def measure_in_subprocess(stage: str, prompt: str, n_predict: int) -> dict:
    """`python -m common run --json` in a fresh process: peak RSS and page faults of that stage
    alone, untouched by whatever this notebook loaded before."""
    cmd = [sys.executable, "-m", "common", "run", "--stage", stage, "-m", str(model_path()),
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
    from common.generate import generate
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


# ---- recorded results ------------------------------------------------------------------------

@dataclass
class Recorded:
    results: object | None               # common.charts.Results, or None
    note: str                            # one sentence for the reader: where these come from

    def get(self, stage: str) -> dict | None:
        if self.results is None:
            return None
        return next((r for r in self.results.stages if r["stage"] == stage), None)


def recorded(results_root=None) -> Recorded:
    """The records `make report` wrote for the notebook's model: this machine's if there are any,
    else another machine's (said so), else None (said so). Never raises for missing files."""
    from common.bench import RESULTS_DIR
    from common.charts import load_results
    from common.machine import machine_id
    root = Path(results_root or RESULTS_DIR)
    stem = model_path().stem
    mine = root / machine_id() / stem
    candidates = [mine] + sorted(p for p in root.glob(f"*/{stem}") if p != mine)
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
    from common.bench import RESULTS_DIR
    out = []
    for path in sorted(Path(results_root or RESULTS_DIR).glob(f"*/{model_path().stem}/{stage}.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return out


def ceilings() -> dict:
    """The machine's bandwidth (GB/s) and peak (GFLOP/s), single thread: the recorded
    machine.json of this machine if there is one, else measured now (about a second)."""
    from common.bench import RESULTS_DIR
    from common.machine import machine_id
    path = RESULTS_DIR / machine_id() / "machine.json"
    if path.exists():
        m = json.loads(path.read_text())
        return {"bandwidth_gbs": m["bandwidth_gbs"]["1"], "peak_gflops": m["peak_gflops"]["1"],
                "source": f"recorded in `{rel(path)}`"}
    from common import roofline
    m = roofline.measure(threads=1)
    return {"bandwidth_gbs": m["bandwidth_gbs"]["1"], "peak_gflops": m["peak_gflops"]["1"],
            "source": "measured just now by common/roofline.py (no recorded machine.json for this machine)"}


# ---- the generated assembly -------------------------------------------------------------------

def kernel_asm(dispatcher, *args) -> str:
    """x86/ARM assembly of a numba kernel, compiled now with its own options: numba cannot show
    the assembly of a kernel it loaded from its on-disk cache."""
    from numba import njit
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    fn = njit(**options)(dispatcher.py_func)
    fn(*args)
    return "\n".join(fn.inspect_asm().values())


PACKED_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ps\b[^\n]*?%?([xyz]mm)\d+")
SCALAR_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ss\b")
SCALAR_MUL_ADD = re.compile(r"\bv?(?:mul|add)ss\b")


def fma_counts(asm: str) -> dict:
    """Float multiply-add instructions in x86 assembly: packed FMAs by register width (xmm 4,
    ymm 8, zmm 16 floats), scalar FMAs, and scalar multiplies and adds (one float each)."""
    packed = Counter(PACKED_FMA.findall(asm))
    return {"packed FMA, zmm (16 floats)": packed.get("zmm", 0), "packed FMA, ymm (8 floats)": packed.get("ymm", 0),
            "packed FMA, xmm (4 floats)": packed.get("xmm", 0), "scalar FMA": len(SCALAR_FMA.findall(asm)),
            "scalar mul / add": len(SCALAR_MUL_ADD.findall(asm))}


def hot_loop(asm: str, max_lines: int = 40) -> str:
    """The basic block with the most floating-point multiply-adds (packed or scalar, or plain
    multiplies and adds): the inner loop, in practice."""
    blocks, current = [], []
    for line in asm.splitlines():
        if re.match(r"^\.?L\w+:", line.strip()) and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    work = re.compile(r"\bv?(?:fn?m(?:add|sub)\d+|mul|add)[sp]s\b")
    best = max(blocks, key=lambda b: sum(bool(work.search(x)) for x in b))
    text = "\n".join(x for x in best if x.strip())
    lines = text.splitlines()
    return "\n".join(lines[:max_lines] + ([f"    ... ({len(lines) - max_lines} more lines)"]
                                          if len(lines) > max_lines else []))


def best_seconds(fn, reps: int) -> float:
    fn()                                  # compile / warm the caches first
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---- drawing ---------------------------------------------------------------------------------

def show(fig):
    """Display a figure inline and close it. Headless (MPLBACKEND=Agg, as in the tests) it is
    still rendered, so a figure that cannot be drawn fails its cell."""
    import matplotlib
    import matplotlib.pyplot as plt
    if matplotlib.get_backend().lower() == "agg":
        fig.canvas.draw()
    else:
        from IPython.display import display
        display(fig)
    plt.close(fig)


def _settings_of(rec: dict) -> str:
    s = rec.get("settings") or {}
    return f"{s.get('prompt_tokens', rec.get('n_prompt'))}+{s.get('n_predict', rec.get('n_generated'))}"


def stage_chart(live: list[dict], rec: Recorded | None = None, stages=None, title: str = ""):
    """TTFT and decode ms/token per stage, log scale: the live runs of this notebook beside the
    recorded ones (profiles/). Labels say prompt+generated tokens, which differ in quick mode."""
    import matplotlib.pyplot as plt
    stages = list(stages or [r["stage"] for r in live])
    live_by = {r["stage"]: r for r in live}
    if not live and (rec is None or rec.results is None or not any(rec.get(s) for s in stages)):
        print("nothing to draw: no live run and no recorded one for these stages")
        return
    series = [("live, this notebook", live_by, "#2f6db3")]
    if rec is not None and rec.results is not None:
        series.append(("recorded (profiles/)", {s: rec.get(s) for s in stages if rec.get(s)}, "#9aa5b1"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(series)
    for ax, key, label in ((axes[0], "ttft_ms", "time to first token (ms)"),
                           (axes[1], "decode_ms", "decode (ms per token, median)")):
        for si, (name, by, color) in enumerate(series):
            xs = [i + (si - (len(series) - 1) / 2) * width for i, s in enumerate(stages) if s in by]
            vals = [by[s][key] for s in stages if s in by]
            bars = ax.bar(xs, vals, width=width, color=color, label=name if vals else None)
            for b, s in zip(bars, [s for s in stages if s in by]):
                v = by[s][key]
                ax.annotate(f"{v:,.0f}\n({_settings_of(by[s])})" if v == v else "n/a",
                            (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xticks(range(len(stages)), stages)
        ax.set_xlim(-0.6, len(stages) - 0.4)
        ax.set_ylabel(label)
        ax.grid(axis="y", which="both", alpha=0.25)
        ax.margins(y=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title or "Stage by stage (labels: prompt+generated tokens)", fontsize=11)
    fig.tight_layout()
    show(fig)
    if rec is not None and rec.results is not None:
        missing = [s for s in stages if not rec.get(s)]
        if missing:
            print(f"not in the records: {', '.join(missing)} (`make report` measures every stage)")


def ops_chart(profiles: dict, title: str = "Where the time goes, per op"):
    """Stacked shares per op group (common.charts.OP_GROUPS) for {label: profile rows}."""
    import matplotlib.pyplot as plt
    from common.charts import plot_op_shares
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(profiles) + 1.6), layout="constrained")
    plot_op_shares(ax, profiles)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(title, fontsize=11)
    show(fig)


def ops_chart_with_records(stage: str, rows: list[dict], rec, compare: tuple = ()):
    """ops_chart of this chapter's live profile next to the recorded profiles (`make report`)
    of `compare` stages and of this one, where the records hold them."""
    profiles = {f"{stage} (live)": rows}
    for s in (*compare, stage):
        if (rec.get(s) or {}).get("profile"):
            profiles[f"{s} (recorded)"] = rec.get(s)["profile"]
    ops_chart(profiles, f"{stage}: where the time goes")


def matmul_share(rows: list[dict]) -> float:
    """Fraction of a profiled run spent in the weight matmuls."""
    total = sum(r["total_ms"] for r in rows) or 1.0
    return sum(r["total_ms"] for r in rows if r["op"].startswith("matmul")) / total


def roofline_chart(ceil: dict, points: list[tuple], title: str = "Roofline (one thread)"):
    """The machine's two ceilings and points (label, FLOP per byte, GFLOP/s) on them."""
    import matplotlib.pyplot as plt
    bw, peak = ceil["bandwidth_gbs"], ceil["peak_gflops"]
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [2 ** (i / 4) for i in range(-16, 48)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="black", lw=1.2,
            label=f"ceiling: {bw:.1f} GB/s x intensity, at most {peak:.0f} GFLOP/s")
    for i, (label, x, y) in enumerate(points):
        ax.scatter([x], [y], s=55, color=f"C{i}", zorder=3, label=f"{label}: {y:.2f} GFLOP/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read from memory)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.grid(which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    show(fig)


def line_chart(curves: dict, xlabel: str, ylabel: str, title: str, logy: bool = False):
    """{label: (xs, ys)} as lines with markers."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if all(float(x).is_integer() for xs, _ in curves.values() for x in xs):
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    ax.set_ylim(bottom=0 if not logy else None)
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    show(fig)


def bar_chart(values: dict, ylabel: str, title: str, fmt: str = "{:,.1f}", logy: bool = False):
    """{label: value} as one bar each, the value written on top."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(values) + 2), 4))
    bars = ax.bar(range(len(values)), list(values.values()), color=[f"C{i}" for i in range(len(values))])
    for b, v in zip(bars, values.values()):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(values)), list(values), fontsize=8)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.25)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    show(fig)


def show_image(path) -> bool:
    """A chart `make report` drew, if it is there."""
    path = Path(path)
    if not path.exists():
        return False
    from IPython.display import Image, display
    display(Image(filename=str(path)))
    return True


# ---- the closing cell of every chapter ---------------------------------------------------------

class Findings(dict):
    """What a chapter measured, in the order it measured it; `show()` renders the list that
    closes the chapter (every figure in it computed by the cells above, none typed in)."""

    def show(self, title: str = "What we measured here"):
        cfg = settings()
        lines = [f"### {title}", "", f"_{cfg.describe()}; model `{model_path().name}`._", ""]
        lines += [f"- **{k}**: {v}" for k, v in self.items()]
        md("\n".join(lines))
