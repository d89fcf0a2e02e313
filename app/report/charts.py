"""Charts and the README table, drawn from the JSON records under profiles/ and nothing else.

    load_results(folder)     the stage/baseline records of one machine and model, in stage order
    floors(res)              the machine's floor for decode (weight bytes / bandwidth) and the prompt
                             (multiply-adds / peak), from the records and machine.json
    answer(res, folder)      the README's first lines: the three costs, decode's worked out
    journey_chart(...)       TTFT and decode ms/token per stage, log axis, the floor drawn
                             (draw_journey: the same on a notebook's figure, one stage highlighted)
    ops_chart(...)           where each stage's time goes, per op (shares and ms per token; the
                             compiled layer stack split by its own clock per phase)
    roofline_chart(...)      the machine's ceilings and every stage placed on them
    results_table(...)       the README's markdown table, with each stage's multiple of the floor

A record that is missing, or whose figures are NaN, is reported in `problems` and left out
of the charts; it is never drawn as zero.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from app.measure.provenance import describe
from stages import REGISTRY, STAGES, op_owners

TABLE_BEGIN = "<!-- results-table:begin -->"
TABLE_END = "<!-- results-table:end -->"
STAGES_BEGIN = "<!-- stages-table:begin -->"
STAGES_END = "<!-- stages-table:end -->"


def _pyplot():
    """matplotlib's pyplot, drawing to files (imported when a chart is drawn: it takes a while,
    and most commands draw none)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class Results:
    folder: Path
    stages: list = field(default_factory=list)          # records in stage order
    baselines: list = field(default_factory=list)       # llama.cpp records, by thread count
    machine: dict | None = None                          # roofline measurements
    problems: list = field(default_factory=list)         # sentences for the reader
    chart_notes: list = field(default_factory=list)      # charts the records could not draw (not in tables)
    missing: dict = field(default_factory=dict)          # expected stage -> why it has no record
    failed: list = field(default_factory=list)           # records whose logits failed their validation

    @property
    def names(self):
        return [r["stage"] for r in self.stages]

    @property
    def baseline(self) -> dict | None:
        """The single-threaded llama.cpp record (the article's setting), else the first."""
        return next((b for b in self.baselines if b.get("threads") == 1), self.baselines[0] if self.baselines else None)


def load_results(folder, expected=None, why_missing=None) -> Results:
    """Read every record in folder (one model on one machine) and its machine.json;
    why_missing: {stage: reason} for the notes on expected stages without a record."""
    folder = Path(folder)
    res = Results(folder)
    recs = {}
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            res.problems.append(f"{path.name}: unreadable ({e})")
            continue
        if rec.get("kind") == "baseline":
            if _finite(rec.get("decode_ms")) and _finite(rec.get("ttft_ms")):
                res.baselines.append(rec)
            else:
                res.problems.append(f"{path.name}: llama.cpp figures missing or NaN; left out")
        elif "stage" in rec and rec.get("kind", "stage") == "stage":
            recs[rec["stage"]] = rec
    machine = folder.parent / "machine.json"
    if machine.exists():
        res.machine = json.loads(machine.read_text())
    for name in [s for s in STAGES if s in recs] + sorted(set(recs) - set(STAGES)):
        rec = recs[name]
        bad = [k for k in ("ttft_ms", "decode_ms") if not _finite(rec.get(k))]
        if bad:
            res.problems.append(f"{name}: {', '.join(bad)} missing or NaN in {name}.json; left out")
            continue
        if (rec.get("validation") or {}).get("passed") is False:       # a wrong answer is no figure
            res.failed.append(rec)
            continue
        res.stages.append(rec)
    for name in expected or []:
        if name not in recs:
            reason = (why_missing or {}).get(name) or "not measured on this machine"
            res.missing[name] = reason
            res.problems.append(f"{name}: no record ({reason}); left out")
    return res


def _speedups(res: Results, key: str):
    """[(vs naive, vs the stage it builds on)] per stage record, None where that has no record."""
    by_name = {r["stage"]: r[key] for r in res.stages}
    out = []
    for r in res.stages:
        v = r[key]
        first = by_name.get("naive")
        entry = REGISTRY.get(r["stage"])
        prev = by_name.get(entry.builds_on) if entry and entry.builds_on else None
        out.append((first / v if first and r["stage"] != "naive" else None, prev / v if prev else None))
    return out


def machine_label(m: dict | None) -> str:
    """A machine as a reader can tell it apart: its CPU's name, its design (family and model: one
    microarchitecture each), its vector ISA level and its cores, from a record's `machine`."""
    if not m:
        return "an unnamed machine"
    name = re.sub(r"\((?:R|TM)\)|\bCPU\b|Processor|@.*", "", m.get("cpu") or "?")
    name = " ".join(name.split()) or "?"
    sig = m.get("cpu_signature") or {}
    parts = [f"family {sig['family']} model {sig['model']}"] if sig.get("family") is not None else []
    features = m.get("simd") or []         # older records name the features, not the level
    isa = m.get("isa") or next((level for feature, level in FEATURE_LEVELS if feature in features), None)
    parts += [ISA_NAMES.get(isa, isa)] if isa else []
    cores = m.get("physical_cores")
    parts += [f"{cores} core{'s' if cores != 1 else ''}"] if cores else []
    return f"{name} ({', '.join(parts)})" if parts else name


FEATURE_LEVELS = (("avx512_vnni", "avx512vnni"), ("avx_vnni", "avxvnni"), ("avx2", "avx2"))
ISA_NAMES = {"avx512vnni": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2", "avx512": "AVX-512"}


def _machine_of(res: Results) -> dict | None:
    r = (res.stages or res.baselines or [{}])[0]
    return r.get("machine") or (res.machine or {}).get("machine")


def _title(res: Results) -> str:
    """What a chart shows the records of: the model and the machine that measured them."""
    if not res.stages and not res.baselines:
        return ""
    r = (res.stages or res.baselines)[0]
    return f"{Path(r['model']).stem} on {machine_label(_machine_of(res))}"


def _code(res: Results) -> str:
    """Which code the records measured (app/measure/provenance.py), for a chart's caption."""
    return f"measured with {describe(res.stages + res.baselines)}"


def _ms(x: float) -> str:
    """A time in ms with the digits that matter: 5,531 / 60 / 4.4 / 0.36."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def _threads(r: dict) -> int:
    return (r.get("settings") or {}).get("threads") or r.get("threads") or 1


def _row_name(r: dict) -> str:
    """A stage's or llama.cpp's row, as the charts label it: 'prefill · 2 threads'."""
    t = _threads(r)
    name = "llama.cpp" if r.get("kind") == "baseline" else r["stage"]
    return f"{name} · {t} thread{'s' if t > 1 else ''}" + ("\n(extrapolated)" if r.get("extrapolated") else "")


def _settings_note(res: Results, rows: list[dict]) -> str:
    """One line saying what each bar measured: the prompt length, and who generated how many
    tokens (the stages without a KV cache generate fewer: each token costs a whole prompt)."""
    prompts, by_n = set(), {}
    for r in rows:
        s = r.get("settings") or {}
        if s:
            prompts.add(s.get("prompt_tokens"))
            by_n.setdefault(s.get("n_predict"), []).append(r["stage"])
    parts = [f"prompt {', '.join(str(p) for p in sorted(prompts, key=str))} tokens"] if prompts else []
    parts += [f"{', '.join(dict.fromkeys(names))}: {n} generated" for n, names in by_n.items()]
    if res.baselines:
        parts.append(f"llama.cpp {res.baselines[0].get('llama_cpp_version', '')} via llama-cpp-python, "
                     f"same file and prompt ids, greedy")
    text = " | ".join(parts[:-1]) + "\n" + parts[-1] if len(parts) > 2 else " | ".join(parts)
    by_reason = {}
    for name, reason in res.missing.items():
        by_reason.setdefault(reason.split(";")[0], []).append(name)
    if by_reason:
        text += "\nno bar: " + "; ".join(f"{', '.join(n)} ({r})" for r, n in by_reason.items())
    text += "\n" + _code(res)
    return text


# ---- the floor: how fast this machine could go at all ------------------------------------------

@dataclass(frozen=True)
class Floors:
    """The machine's limits for one model's two phases, from the records and machine.json:

    decode reads every weight once per token, so no token takes less than the weights' bytes over
    the memory bandwidth; the prompt's tokens share one read of the weights, so its floor is its
    multiply-adds over the core's peak (the integer one where the machine has it: the fastest way
    this CPU multiplies). Both at the most threads measured: the machine's limit, not a stage's."""
    weight_bytes: int               # the fewest weight bytes a stage reads per token (the file's blocks)
    bandwidth_gbs: float            # measured, at `threads`
    threads: int
    n_prompt: int | None            # the prompt the TTFT floor is for
    prompt_ops: float | None        # operations (2 per multiply-add) of the prompt's matmuls
    peak_gops: float | None         # the peak those operations are bounded by, at `threads`
    peak_name: str                  # what that peak is: 'integer peak (vpdpbusd (zmm))' or 'float peak'

    @property
    def decode_ms(self) -> float:
        return self.weight_bytes / (self.bandwidth_gbs * 1e9) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        if not (self.prompt_ops and self.peak_gops):
            return None
        return self.prompt_ops / (self.peak_gops * 1e9) * 1e3

    def times(self, r: dict, key: str) -> float | None:
        """A record's figure (ttft_ms or decode_ms) over its floor; None where there is no floor
        for it (another prompt length than the floor's, or no figure)."""
        v = r.get(key)
        if not _finite(v):
            return None
        if key == "decode_ms":
            return v / self.decode_ms
        if self.ttft_ms is None or (r.get("settings") or {}).get("prompt_tokens", r.get("n_prompt")) != self.n_prompt:
            return None
        return v / self.ttft_ms

    def decode_text(self) -> str:
        return (f"{self.weight_bytes / 1e6:,.1f} MB of weights ÷ {self.bandwidth_gbs:.1f} GB/s = "
                f"{_floor_ms(self.decode_ms)} ms")

    def ttft_text(self) -> str:
        if not self.ttft_ms:
            return "no prompt floor in these records"
        unit = "Gop" if self.peak_name.startswith("integer") else "GFLOP"
        return (f"{self.prompt_ops / 1e9:,.2f} {unit} ÷ {self.peak_gops:,.0f} {unit}/s = "
                f"{_floor_ms(self.ttft_ms)} ms")


def _floor_ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def floors(res: Results) -> Floors | None:
    """The floors of the records in `res` (see Floors); None without machine.json or a stage record
    that says what it reads."""
    m = res.machine or {}
    bw = m.get("bandwidth_gbs") or {}
    reads = [r for r in res.stages if r.get("weights_stream_bytes")]
    if not bw or not reads:
        return None
    threads = max(bw, key=int)
    ops = next((r for r in res.stages if r.get("prompt_matmul_ops")), None)
    ints, floats = (m.get("int_peak_gops") or {}).get(threads), (m.get("peak_gflops") or {}).get(threads)
    peak, name = (ints, f"integer peak ({m.get('int_instruction')})") if ints else (floats, "float peak")
    return Floors(min(r["weights_stream_bytes"] for r in reads), bw[threads], int(threads),
                  ops["n_prompt"] if ops else None, ops["prompt_matmul_ops"] if ops else None, peak, name)


def floor_note(f: Floors) -> str:
    """The sentence under the results table: what "× floor" divides by."""
    t = f"{f.threads} thread{'s' if f.threads > 1 else ''}"
    note = (f"× floor: a stage's time over this machine's floor (machine.json, {t}): decode reads every weight "
            f"once per token, {f.decode_text()} a token")
    if f.ttft_ms:
        note += (f"; a {f.n_prompt}-token prompt is its matmuls' operations over the {f.peak_name}, "
                 f"{f.ttft_text()}")
    return note


def fastest(res: Results) -> dict | None:
    """The stage record with the best decode."""
    return min(res.stages, key=lambda r: r["decode_ms"], default=None)


ANSWER_BEGIN = "<!-- answer:begin -->"
ANSWER_END = "<!-- answer:end -->"


def answer(res: Results, shown_folder: str) -> str:
    """The README's first lines: the three costs, decode's worked from the records (the weights'
    bytes, the measured bandwidth, the floor they give, and the fastest stage against it)."""
    f, best = floors(res), fastest(res)
    first = res.stages[0] if res.stages else None
    if f is None or best is None:
        return (f"_No records with the machine's bandwidth under `{shown_folder}/`: `make report` measures them, "
                f"and these lines then work the figures out._\n")
    name = Path(best["model"]).stem
    return (
        f"1. **Decode reads every weight once per token**, so a token takes at least the weights' bytes ÷ the "
        f"memory bandwidth. {name} on {machine_label(_machine_of(res))}: {f.decode_text()} a token; the "
        f"fastest stage here, {best['stage']}, takes {best['decode_ms']:.2f} ms "
        f"({f.times(best, 'decode_ms'):.1f}× that floor).\n"
        f"2. **The prompt is arithmetic**: its tokens share one read of the weights, so it takes at least its "
        f"multiply-adds ÷ the core's peak (the {f.peak_name.split(' (')[0]}, here).\n"
        f"3. **Overhead is the rest**: everything above both floors: Python between the ops, threads waiting for "
        f"each other, loops that waste their loads or wait on a chain of adds, work done twice. The first stage, "
        f"{first['stage']}, decodes at {f.times(first, 'decode_ms'):,.0f}× the floor; each stage after it removes "
        f"some of that.\n\n"
        f"_Worked from the records in `{shown_folder}/` and its machine.json by `make report`; "
        f"the table's \"× floor\" columns set every stage against both floors._\n")


# ---- the journey: every stage's time, and the floor ---------------------------------------------

def journey_size(rows: int) -> tuple:
    """The journey's figure size in inches for so many rows: narrow enough that its labels stay
    readable where a page scales it to its column."""
    return (11, 0.34 * rows + 3.2)


JOURNEY_BLUE, JOURNEY_HIGHLIGHT, JOURNEY_PALE, JOURNEY_GREY = "#2f6db3", "#d9480f", "#b9cbe3", "#9aa5b1"


def draw_journey(fig, res: Results, highlight: str | None = None):
    """On `fig` (a matplotlib Figure): time to first token and decode per stage, one row each, log
    scale, with this machine's floor drawn (Floors), each bar's time and its multiple of the floor
    written at its end; `highlight`: one stage's row stands out (a chapter's close), the rest pale."""
    res.baselines.sort(key=_threads)
    rows = list(res.stages) + [dict(b, stage="llama.cpp") for b in res.baselines]
    if not rows:
        raise ValueError(f"no measurable records in {res.folder}")
    if highlight is not None and highlight not in res.names:
        raise ValueError(f"no record of {highlight} in {res.folder} to highlight (recorded: {', '.join(res.names)})")
    f = floors(res)
    axes = fig.subplots(1, 2, sharey=True)
    ys = range(len(rows))
    for ax, key, label, floor, why in (
            (axes[0], "ttft_ms", "time to first token (ms)", f and f.ttft_ms, "multiply-adds ÷ peak"),
            (axes[1], "decode_ms", "decode (ms per token, median)", f and f.decode_ms, "weight bytes ÷ bandwidth")):
        values = [r[key] for r in rows]
        colors = [JOURNEY_GREY if r.get("kind") == "baseline" else
                  JOURNEY_BLUE if highlight is None else
                  JOURNEY_HIGHLIGHT if r["stage"] == highlight else JOURNEY_PALE for r in rows]
        bars = ax.barh(list(ys), values, color=colors, height=0.7)
        for b, r in zip(bars, rows):
            if r.get("kind") == "baseline":
                b.set_hatch("//")
        for y, (v, r) in enumerate(zip(values, rows)):
            times = f.times(r, key) if f else None
            text = f"{_ms(v)} ms" + (f" · {_ratio(times)}×" if times else "")
            bold = highlight is not None and r["stage"] == highlight
            ax.annotate(text, (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8.5,
                        fontweight="bold" if bold else "normal")
        low = min(values + ([floor] if floor else []))
        ax.set_xscale("log")
        ax.set_xlim(low / 2, max(values) * 25)                 # room for the labels at the bars' ends
        if floor:
            ax.axvline(floor, color="black", lw=1.2, ls="--", zorder=0.5)
            ax.annotate(f"floor {_ms(floor)} ms: {why}", (floor, -0.75), xytext=(3, 0), textcoords="offset points",
                        fontsize=8.5, va="center")
        ax.set_xlabel(label, fontsize=10)
        ax.grid(axis="x", which="major", alpha=0.3)
    axes[0].set_yticks(list(ys), [_row_name(r) for r in rows], fontsize=9.5)
    axes[0].set_ylim(len(rows) - 0.5, -1.3)                     # first stage on top, room for the floor's label
    if highlight is not None:
        for tick, r in zip(axes[0].get_yticklabels(), rows):
            if r["stage"] == highlight:
                tick.set_fontweight("bold")
                tick.set_color(JOURNEY_HIGHLIGHT)
    what = f"Where {highlight} stands in the journey" if highlight else "The journey"
    fig.suptitle(f"{what}: {_title(res)}\nbars: ms; beside each, its multiple of the machine's floor (dashed)",
                 fontsize=11.5)
    note = _settings_note(res, rows)
    if f:
        note = (f"floor, decode: {f.decode_text()} | prompt: {f.ttft_text()} ({f.peak_name}, "
                f"{f.threads} threads; machine.json)\n") + note
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=7.5)
    lines_in = 0.15 * (note.count("\n") + 1) + 0.1                 # the note's height, in inches
    fig.tight_layout(rect=(0, lines_in / fig.get_figheight(), 1, 1))


def journey_chart(res: Results, path, highlight: str | None = None):
    """draw_journey into a PNG at `path`."""
    plt = _pyplot()
    fig = plt.figure(figsize=journey_size(len(res.stages) + len(res.baselines)))
    try:
        draw_journey(fig, res, highlight)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


# ---- where the time goes, per op -----------------------------------------------------------------

# Op groups of the stacked chart, in drawing order; an op in none of them lands in "other ops".
OP_GROUPS = [
    ("q, k, v matmuls", ("matmul attn_q", "matmul attn_k", "matmul attn_v")),
    ("attention (scores, softmax, sum)", ("attention",)),
    ("wo matmul", ("matmul attn_output",)),
    ("gate, up matmuls", ("matmul ffn_gate", "matmul ffn_up")),
    ("down matmul", ("matmul ffn_down",)),
    ("output head (matmul)", ("matmul output",)),
    ("norms", ("rms_norm",)),
    ("rope", ("rope",)),
    ("swiglu", ("swiglu", "silu", "mul")),
    ("sampling (argmax)", ("argmax",)),
    ("python overhead", ("python overhead",)),
]
COMPILED = ("forward_layers", "forward_layers_batch")     # the layer stack in one compiled call
UNSPLIT = "layer stack, one compiled call (no clock per phase)"
OTHER = "other ops"
# The compiled stack's phases (stages/kernels/layer_stack.py's PHASES, named by
# app/measure/phases.PHASE_NAMES), each in the group its work belongs to. A norm phase also rounds
# its output for the next matmul and ROUND_F rounds f for W_down: the unfused int8 stage's matmuls
# round their own input, so that time is the matmuls'. QKV ends with RoPE, GATE_UP with silu(gate) * up.
PHASE_GROUPS = {"norm_attn": "norms", "qkv": "q, k, v matmuls", "attend": "attention (scores, softmax, sum)",
                "merge": "attention (scores, softmax, sum)", "wo": "wo matmul", "norm_ffn": "norms",
                "gate_up": "gate, up matmuls", "round_f": "down matmul", "down": "down matmul"}
GROUPS = [g for g, _ in OP_GROUPS] + [UNSPLIT, OTHER]
OP_COLORS = ["#1f4e8c", "#ed7d31", "#5b9bd5", "#2e7d32", "#81c784", "#9dc3e6", "#ffc000", "#bf9000", "#a5a5a5",
             "#7030a0", "#c00000", "#6d6d6d", "#d6d6d6"]


def op_ms(profile_rows: list[dict]) -> dict:
    """{group: ms} of a profile's rows (common/profile.py). The compiled stack's row is split by
    the phases its record kept (`phases_ms`, the layer stack's own clock, summed over the run):
    what the phases do not cover of that row is Python around the compiled call (python
    overhead); without phases the row stays whole, as UNSPLIT."""
    out = dict.fromkeys(GROUPS, 0.0)
    for r in profile_rows:
        if r["op"] in COMPILED:
            phases = r.get("phases_ms") or {}
            unknown = set(phases) - set(PHASE_GROUPS)
            if unknown:
                raise ValueError(f"the profile names phases no group takes: {sorted(unknown)} "
                                 f"(app/report/charts.py PHASE_GROUPS)")
            for name, ms in phases.items():
                out[PHASE_GROUPS[name]] += ms
            rest = r["total_ms"] - sum(phases.values())
            out["python overhead" if phases else UNSPLIT] += max(rest, 0.0)
            continue
        out[next((g for g, ops in OP_GROUPS if r["op"] in ops), OTHER)] += r["total_ms"]
    return out


def op_shares(profile_rows: list[dict]) -> dict:
    """{group: share} of op_ms; shares sum to 1."""
    ms = op_ms(profile_rows)
    total = sum(ms.values()) or 1.0
    return {g: v / total for g, v in ms.items()}


def other_ops(profile_rows: list[dict]) -> list[str]:
    """The ops a profile has that no group takes (what "other ops" is made of)."""
    known = {op for _, ops in OP_GROUPS for op in ops} | set(COMPILED)
    return [r["op"] for r in profile_rows if r["op"] not in known]


def per_token(rec: dict) -> int:
    """The tokens a record's profiled run generated (its profile_settings; the first is the prompt's pass)."""
    return (rec.get("profile_settings") or {}).get("n_predict") or rec.get("n_generated") or 1


def plot_op_shares(ax, profiles: dict, tokens: dict | None = None):
    """Stacked horizontal bars on ax: per label, the share of time of each op group
    ({label: profile rows}); with tokens ({label: tokens generated}), each segment also says its
    ms per generated token and each bar its total. Used by ops_chart and by the notebooks."""
    labels = list(profiles)
    ms = [op_ms(profiles[k]) for k in labels]
    totals = [sum(m.values()) or 1.0 for m in ms]
    shown = [g for g in GROUPS if any(m[g] for m in ms)]
    left = [0.0] * len(labels)
    for g in shown:
        color = OP_COLORS[GROUPS.index(g)]
        vals = [m[g] / t * 100 for m, t in zip(ms, totals)]
        ax.barh(range(len(labels)), vals, left=left, color=color, label=g, height=0.72)
        dark = color not in ("#ffc000", "#d6d6d6", "#9dc3e6", "#81c784")
        for i, v in enumerate(vals):
            if v >= 7:
                text = f"{v:.0f}%"
                if tokens and v >= 9:
                    text += f"\n{_ms(ms[i][g] / tokens[labels[i]])} ms"
                ax.text(left[i] + v / 2, i, text, ha="center", va="center", fontsize=6.5,
                        color="white" if dark else "black")
        left = [a + b for a, b in zip(left, vals)]
    if tokens:
        for i, k in enumerate(labels):
            ax.text(101, i, f"{_ms(totals[i] / tokens[k])} ms", va="center", fontsize=7.5)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the profiled run's time (%)" +
                  ("; in the segments and at the right: ms per generated token" if tokens else ""))


def ops_chart(res: Results, path):
    plt = _pyplot()
    recs = [r for r in res.stages if r.get("profile")]
    if not recs:
        raise ValueError("no stage record carries a per-op profile")
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(recs) + 3.0))
    plot_op_shares(ax, {_row_name(r): r["profile"] for r in recs}, {_row_name(r): per_token(r) for r in recs})
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    ax.set_title(f"Where the time goes, per op: {_title(res)}\nprofiled runs of each stage's prompt and "
                 f"tokens (the prompt's pass shared over them); {_code(res)}", fontsize=9.5)
    notes = ops_notes(res)
    if notes:
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.03 * len(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ops_notes(res: Results) -> list[str]:
    """What the chart cannot split, said: a compiled stack whose record holds no time per phase
    (and why: its calls keep no clock, or the record is older than the split), and the ops of
    "other ops" where they take 10% or more of a stage's time."""
    notes, unsplit = [], {}
    for r in (r for r in res.stages if r.get("profile")):
        if op_shares(r["profile"])[UNSPLIT] > 0:
            stack = next(x for x in r["profile"] if x["op"] in COMPILED)
            why = ("its compiled calls keep no clock per phase" if stack.get("phase_clock") is False else
                   "its record is older than the split by phase (`make report` measures it again)")
            unsplit.setdefault(why, []).append(r["stage"])
        if op_shares(r["profile"])[OTHER] >= 0.10:
            notes.append(f"{r['stage']}: other ops are {', '.join(other_ops(r['profile']))}")
    for why, stages in unsplit.items():
        notes.insert(0, f"{', '.join(stages)}: the layer stack runs as one compiled call, not split here: {why}")
    return notes


def ops_markdown(res: Results) -> str:
    recs = [r for r in res.stages if r.get("profile")]
    ms = [op_ms(r["profile"]) for r in recs]
    shown = [g for g in GROUPS if any(m[g] for m in ms)]
    lines = [f"Where the time goes, per op: {_title(res)}; {_code(res)}. Each cell: the share of a profiled "
             f"run (the stage's prompt and its tokens) and, in brackets, ms per generated token (the prompt's "
             f"pass shared over them). The fused stages' layer stack is split by its own clock per phase "
             f"(app/report/charts.py PHASE_GROUPS says which phase lands where).", "",
             "| op | " + " | ".join(_row_name(r) for r in recs) + " |", "|---|" + "---:|" * len(recs)]
    for g in shown:
        cells = [f"{m[g] / (sum(m.values()) or 1) * 100:.1f}% ({_ms(m[g] / per_token(r))})" if m[g] else "-"
                 for m, r in zip(ms, recs)]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| **ms per generated token** | " +
                 " | ".join(f"**{_ms(sum(m.values()) / per_token(r))}**" for m, r in zip(ms, recs)) + " |")
    lines += [f"\n_{n}_" for n in ops_notes(res)]
    return "\n".join(lines) + "\n"


# ---- the roofline --------------------------------------------------------------------------------

def roofline_points(rec: dict) -> list[tuple]:
    """[(kind, intensity FLOP/byte, achieved GFLOP/s)] for a stage's prefill and decode. The
    bytes are the weights read once plus the KV cache, or, where the record carries the traffic
    its loop order causes (`traffic`, modelled by app/measure/roofline.py), that instead."""
    w = rec.get("weights_stream_bytes") or 0
    f1 = rec.get("flops_per_token")
    if not (w and f1):
        return []
    kv_row = rec.get("kv_bytes_per_position", 0)
    traffic = rec.get("traffic") or {}
    p = rec["n_prompt"]
    pts = []
    if _finite(rec.get("ttft_ms")):
        flops = f1 * p
        weights = traffic.get("prefill_bytes") or w
        pts.append(("prefill", flops / (weights + kv_row * p), flops / (rec["ttft_ms"] / 1e3) / 1e9))
    if _finite(rec.get("decode_ms")):
        ctx = p + 1
        rows = 1 if rec.get("uses_kv_cache") else ctx        # without a cache: the whole text again
        flops = f1 * rows
        weights = traffic.get("decode_bytes") or w
        pts.append(("decode", flops / (weights + kv_row * ctx), flops / (rec["decode_ms"] / 1e3) / 1e9))
    return pts


def roofline_basis(rec: dict) -> str:
    """What a stage's roofline intensity counts: 'modelled traffic' or 'minimum bytes'."""
    return f"{rec['traffic']['method']} traffic" if rec.get("traffic") else "minimum bytes"


def integer_stage(stage: str) -> bool:
    """Whether a stage multiplies in integers (int8 and every stage built on it, stages/registry.py)."""
    while stage:
        if stage == "int8":
            return True
        entry = REGISTRY.get(stage)
        stage = entry.builds_on if entry else None
    return False


def decode_intensity(rec: dict) -> dict:
    """{ggml type: FLOP per byte} of a decode step on each weight type the model file holds (2 FLOP
    per weight, over the type's bytes per weight: Q4_1 is 32 weights in 20 bytes), for the types
    that hold at least a tenth of the file's weight bytes."""
    from common.gguf import BLOCK_SIZES, GGMLType
    mix = (rec.get("model_info") or {}).get("type_mix_bytes") or {}
    total = sum(mix.values()) or 1
    out = {}
    for name, nbytes in sorted(mix.items(), key=lambda kv: -kv[1]):
        if nbytes / total >= 0.1 and name in GGMLType.__members__:
            values, size = BLOCK_SIZES[GGMLType[name]]
            out[name] = 2 * values / size
    return out


# One colour per stage, by its number (stages/registry.py); none of them the integer ceilings' red.
STAGE_COLORS = ["#8c564b", "#e377c2", "#7f7f7f", "#9467bd", "#1f77b4", "#17becf", "#bcbd22", "#ff7f0e", "#2ca02c",
                "#000080", "#a6761d", "#f0027f"]


def roofline_chart(res: Results, path):
    plt = _pyplot()
    if not res.machine:
        raise ValueError(f"no machine.json beside {res.folder}: `make report` measures it")
    m = res.machine
    fig, ax = plt.subplots(figsize=(11, 6.8))
    xs = [2 ** (i / 4) for i in range(-8, 52)]
    by_threads = sorted(m["bandwidth_gbs"].items(), key=lambda kv: int(kv[0]))
    for (threads, bw), style in zip(by_threads, ["-", "--"]):
        t = f"{threads} thread{'s' if int(threads) > 1 else ''}"
        peak = m["peak_gflops"].get(threads)
        ax.plot(xs, [min(peak, bw * x) for x in xs], style, color="black", lw=1.2)
        ax.annotate(f"float peak, {t}: {peak:,.0f} GFLOP/s (memory {bw:.1f} GB/s)", (xs[-1], peak),
                    xytext=(-4, 3), textcoords="offset points", ha="right", fontsize=7.5)
        ints = (m.get("int_peak_gops") or {}).get(threads)
        if ints:                        # the integer stages' ceiling: their multiply-adds are integer ones
            ax.plot(xs, [min(ints, bw * x) for x in xs], style, color="tab:red", lw=1.0)
            ax.annotate(f"integer peak ({m['int_instruction']}), {t}: {ints:,.0f} Gop/s", (xs[-1], ints),
                        xytext=(-4, 3), textcoords="offset points", ha="right", fontsize=7.5, color="tab:red")
    markers = {"prefill": "o", "decode": "^"}
    handles = []
    for rec in res.stages:
        number = REGISTRY[rec["stage"]].number if rec["stage"] in REGISTRY else 0
        color = STAGE_COLORS[(number - 1) % len(STAGE_COLORS)]
        pts = roofline_points(rec)
        for kind, x, y in pts:
            ax.scatter([x], [y], marker=markers[kind], color=color, s=55, zorder=3, edgecolor="black", lw=0.4)
        if pts:
            label = rec["stage"] + (" (integer ops)" if integer_stage(rec["stage"]) else "") + \
                (" (modelled traffic)" if rec.get("traffic") else "")
            handles.append(plt.Line2D([], [], marker="s", ls="", color=color, markersize=7, label=label))
    handles += [plt.Line2D([], [], marker=mk, ls="", color="white", markeredgecolor="black", markersize=7,
                           label="the prompt (TTFT)" if kind == "prefill" else "decode (a token)")
                for kind, mk in markers.items()]
    # decode where it reads the file's own blocks once per token (a stage with a cache, on the fewest bytes)
    f = floors(res)
    anchor = next((r for r in res.stages if r.get("uses_kv_cache") and f and
                   r.get("weights_stream_bytes") == f.weight_bytes and decode_intensity(r)), None)
    if anchor:
        types = decode_intensity(anchor)
        x = dict((k, x) for k, x, _ in roofline_points(anchor))["decode"]
        ax.axvline(x, color="tab:blue", lw=0.8, ls=":")
        ax.annotate("decode: one token reads every weight once, 2 FLOP each:\n" +
                    ", ".join(f"{t} {v:.1f}" for t, v in types.items()) +
                    f" FLOP per byte; this file's mix with the KV cache {x:.1f}", (x, 0.16),
                    xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points", fontsize=7.5,
                    color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity: FLOP per byte read (weights + KV cache; naive and tiling: the bytes "
                  "their loop order moves, modelled)", fontsize=8.5)
    ax.set_ylabel("achieved GFLOP/s (integer stages: Gop/s)")
    ax.grid(which="both", alpha=0.2)
    ax.legend(handles=handles, fontsize=7.5, loc="upper left", ncol=2)
    ax.set_title(f"Roofline: {_title(res)}\n{_code(res)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, digits=1):
    if not _finite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def results_table(res: Results) -> str:
    """The README's markdown table: one row per stage, llama.cpp last; "× floor": each time over this
    machine's floor for it (Floors), said under the table."""
    head = ("| stage | TTFT (ms) | decode (ms/token) | decode vs naive | vs previous | TTFT × floor "
            "| decode × floor | peak RSS (MiB) | prompt / generated |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = floors(res)

    def times(r, key):
        x = f.times(r, key) if f else None
        return f"{_ratio(x)}×" if x else "-"

    ups = _speedups(res, "decode_ms")
    for r, (vs_naive, vs_prev) in zip(res.stages, ups):
        s = r.get("settings") or {}
        threads = s.get("threads") or r.get("threads") or 1
        name = r["stage"] + (f" ({threads} threads)" if threads > 1 else "") + \
            (" (extrapolated)" if r.get("extrapolated") else "")
        lines.append(f"| {name} | {_fmt(r['ttft_ms'])} | {_fmt(r['decode_ms'])} "
                     f"| {_fmt(vs_naive) + 'x' if vs_naive else '-'} | {_fmt(vs_prev, 2) + 'x' if vs_prev else '-'} "
                     f"| {times(r, 'ttft_ms')} | {times(r, 'decode_ms')} "
                     f"| {_fmt(r.get('peak_rss_mb'), 0)} | {s.get('prompt_tokens', r['n_prompt'])} / "
                     f"{s.get('n_predict', r['n_generated'])} |")
    for b in sorted(res.baselines, key=lambda b: b.get("threads") or 1):
        t = b.get("threads") or 1
        lines.append(f"| llama.cpp ({t} thread{'s' if t > 1 else ''}) | {_fmt(b['ttft_ms'])} | {_fmt(b['decode_ms'])} "
                     f"| - | - | {times(b, 'ttft_ms')} | {times(b, 'decode_ms')} "
                     f"| {_fmt(b.get('peak_rss_mb'), 0)} | {b['n_prompt']} / {b['n_generated']} |")
    for r in res.failed:
        v = r["validation"]
        lines.append(f"| {r['stage']} | **failed validation** | - | - | - | - | - | - | max logit error "
                     f"{_fmt(v['max_abs_diff'], 3)} > {v['tolerance']:g} |")
    if f:
        lines.append(f"\n_{floor_note(f)}_")
    unchecked = [r["stage"] for r in res.stages if "validation" not in r]
    if unchecked:
        lines.append(f"\n_not validated in the run that measured them (records from before `make report` checked "
                     f"each stage's logits against the float64 reference first): {', '.join(unchecked)}_")
    skipped = [r["stage"] for r in res.stages if "skipped" in (r.get("validation") or {})]
    if skipped:
        lines.append(f"\n_not validated: {', '.join(skipped)} (measured on a few layers only)_")
    extrapolated = [r for r in res.stages if r.get("extrapolated")]
    if extrapolated:
        e = extrapolated[0]["extrapolated"]
        lines.append(f"\n_extrapolated: {', '.join(r['stage'] for r in extrapolated)} ran {e['layers_measured']} "
                     f"of {e['n_layer']} layers (and none), their times extrapolated to every layer (the records "
                     f"say how)_")
    share = prefill_int_share(res)
    if share:
        lines.append(f"\n_{share}_")
    for p in res.problems:
        lines.append(f"\n_{p}_")
    return "\n".join(lines) + "\n"


def prefill_int_share(res: Results) -> str | None:
    """The prefill stage's prompt on the integer ceiling: its matmuls' operations (common/model.py,
    prompt_matmul_ops) over its TTFT, as a share of the integer peak at its thread count
    (machine.json, app/measure/roofline.py); None without both."""
    rec = next((r for r in res.stages if r["stage"] == "prefill" and r.get("prompt_matmul_ops")), None)
    m = res.machine or {}
    threads = str(((rec or {}).get("settings") or {}).get("threads") or (rec or {}).get("threads") or 1)
    peak = (m.get("int_peak_gops") or {}).get(threads)
    if not (rec and peak and _finite(rec.get("ttft_ms"))):
        return None
    gops = rec["prompt_matmul_ops"] / (rec["ttft_ms"] / 1e3) / 1e9
    return (f"prefill's {rec['n_prompt']}-token prompt: its matmuls at {gops:,.0f} integer Gop/s, {gops / peak:.0%} of "
            f"the integer peak ({m['int_instruction']}, {threads} thread(s): {peak:,.0f} Gop/s, machine.json)")


def caption(res: Results, shown_folder: str) -> str:
    """The line above a results table: how, where and with what code its records were measured."""
    if not res.stages and not res.baselines:
        return ""
    r = (res.stages or res.baselines)[0]
    return (f"Measured by `make report` on {machine_label(_machine_of(res))}, "
            f"{r['model']}, greedy, 1 thread unless stated; {describe(res.stages + res.baselines)}. "
            f"\"vs previous\": against the stage it builds on (stages/registry.py). "
            f"Records: `{shown_folder}/`.\n\n")


def stages_table() -> str:
    """The README's table of stages, from the registry."""
    lines = ["| # | stage | the lesson | file | chapter |", "|---:|---|---|---|---|"]
    for name in STAGES:
        s = REGISTRY[name]
        lines.append(f"| {s.number} | {s.name} | {s.lesson} | [{s.path}]({s.path}) "
                     f"| [{s.chapter}](notebooks/{s.chapter}.ipynb) |")
    return "\n".join(lines) + "\n"


def ops_table() -> str:
    """Which stage defines which op of the surface (common/backend.py), read from the classes
    (stages.op_owners): **defines** where a stage overrides it, else the stage it inherits it
    from; `base` is the surface's own default (a composition of the primitives, or a hook's
    no-op)."""
    owners = op_owners()
    lines = ["| op | " + " | ".join(f"{REGISTRY[s].number} {s}" for s in STAGES) + " |",
             "|---|" + "---|" * len(STAGES)]
    for op, row in owners.items():
        cells = ["**defines**" if owner == s else (owner or "base") for s, owner in row.items()]
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace_block(text: str, begin: str, end: str, content: str) -> str | None:
    """text with what stands between the two markers replaced; None if the markers are missing."""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda _: f"{begin}\n{content}{end}", text)


def update_readme(readme: Path, table: str, caption: str = "", answer_text: str | None = None) -> bool:
    """Rewrite the results table, the stage table and (given) the answer between their markers;
    False if the README has no results markers."""
    text = replace_block(readme.read_text(), TABLE_BEGIN, TABLE_END, caption + table)
    if text is None:
        return False
    text = replace_block(text, STAGES_BEGIN, STAGES_END, stages_table()) or text
    if answer_text is not None:
        text = replace_block(text, ANSWER_BEGIN, ANSWER_END, answer_text) or text
    readme.write_text(text)
    return True


OPS_PAGE = "ops_by_stage.md"


def ops_page() -> str:
    """profiles/ops_by_stage.md: the op grid (ops_table) with what it is."""
    return ("# Which stage defines which op\n\n"
            "Every op and hook of the surface ([common/backend.py](../common/backend.py): the article's ten "
            "primitives, the composites, the batch ops, the weights and the hooks), and for each stage whether it "
            "**defines** it or which stage it inherits it from (`base`: the surface's own default, a composition "
            "of the primitives or a hook's no-op). Read from the classes by `python -m app stages --ops`; "
            "`make report` writes this page.\n\n" + ops_table())


def write_ops_page(out_dir) -> Path:
    path = Path(out_dir) / OPS_PAGE
    path.write_text(ops_page())
    return path


def draw_all(res: Results, out_dir) -> list[Path]:
    """Every chart that the records allow; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in (("speedup.png", journey_chart), ("ops.png", ops_chart), ("roofline.png", roofline_chart)):
        try:
            fn(res, out_dir / name)
            written.append(out_dir / name)
        except ValueError as e:
            res.chart_notes.append(f"{name} not drawn: {e}")
    if any(r.get("profile") for r in res.stages):
        (out_dir / "ops.md").write_text(ops_markdown(res))
        written.append(out_dir / "ops.md")
    return written
