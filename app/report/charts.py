"""Charts and the README table, drawn from the JSON records under profiles/ and nothing else.

    load_results(folder)     the stage/baseline records of one machine and model, in stage order
    speedup_chart(...)       TTFT and decode ms/token per stage, log axis, speedups annotated
    ops_chart(...)           where each stage's time goes, per op (stacked shares)
    roofline_chart(...)      the machine's ceilings and every stage placed on them
    results_table(...)       the README's markdown table

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
OPS_BEGIN = "<!-- ops-table:begin -->"
OPS_END = "<!-- ops-table:end -->"


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


def _title(res: Results) -> str:
    if not res.stages:
        return ""
    r = res.stages[0]
    cpu = (r.get("machine") or {}).get("cpu", "")
    return f"{r['model']} on {cpu}" if cpu else r["model"]


def _code(res: Results) -> str:
    """Which code the records measured (app/measure/provenance.py), for a chart's caption."""
    return f"measured with {describe(res.stages + res.baselines)}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def _bar_name(r: dict) -> str:
    threads = (r.get("settings") or {}).get("threads") or r.get("threads") or 1
    extrapolated = "\nextrapolated" if r.get("extrapolated") else ""
    return f"{r['stage']}\n{threads} thread{'s' if threads > 1 else ''}{extrapolated}"


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


def speedup_chart(res: Results, path):
    plt = _pyplot()

    res.baselines.sort(key=lambda b: b.get("threads") or 1)
    rows = list(res.stages) + [dict(b, stage="llama.cpp") for b in res.baselines]
    if not rows:
        raise ValueError(f"no measurable records in {res.folder}")
    names = [_bar_name(r) for r in rows]
    # One panel above the other: each bar gets the width its three-line label needs.
    fig, axes = plt.subplots(2, 1, figsize=(11, 9.5))
    for ax, key, label in ((axes[0], "ttft_ms", "time to first token (ms)"),
                           (axes[1], "decode_ms", "decode (ms per token, median)")):
        values = [r[key] for r in rows]
        colors = ["#9aa5b1" if r.get("kind") == "baseline" else "#2f6db3" for r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for b in bars[len(res.stages):]:
            b.set_hatch("//")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), names)
        ax.set_ylabel(label)
        ax.grid(axis="y", which="both", alpha=0.25)
        ups = _speedups(res, key) + [(None, None)] * (len(rows) - len(res.stages))
        for i, (b, (vs_naive, vs_prev)) in enumerate(zip(bars, ups)):
            text = f"{values[i]:,.0f}" if values[i] >= 10 else f"{values[i]:.1f}"
            if vs_naive:
                text += f"\n{_ratio(vs_naive)}x naive"
            if vs_prev:
                text += f"\n{_ratio(vs_prev)}x {REGISTRY[rows[i]['stage']].builds_on}"
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=7.5, xytext=(0, 2), textcoords="offset points")
        ax.set_ylim(min(values) / 3, max(values) * 8)
    fig.suptitle(f"The journey: {_title(res)}", fontsize=12)
    fig.text(0.5, 0.005, _settings_note(res, rows), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Op groups of the stacked chart, in drawing order; anything else lands in "other ops".
OP_GROUPS = [
    ("matmul attention (q,k,v,o)", ("matmul attn_q", "matmul attn_k", "matmul attn_v", "matmul attn_output")),
    ("matmul ffn (gate,up,down)", ("matmul ffn_gate", "matmul ffn_up", "matmul ffn_down")),
    ("matmul output head", ("matmul output",)),
    ("attention (dot, softmax, sum)", ("attention",)),
    ("norms", ("rms_norm",)),
    ("rope", ("rope",)),
    ("swiglu", ("swiglu", "silu", "mul")),
    ("sampling (argmax)", ("argmax",)),
    ("python overhead", ("python overhead",)),
]
OP_COLORS = ["#2f6db3", "#5b9bd5", "#9dc3e6", "#ed7d31", "#70ad47", "#ffc000", "#a5a5a5", "#7030a0",
             "#c00000", "#444444"]


def op_shares(profile_rows: list[dict]) -> dict:
    """{group: share} from a profile's rows (see common/profile.py); shares sum to 1."""
    total = sum(r["total_ms"] for r in profile_rows) or 1.0
    out = {g: 0.0 for g, _ in OP_GROUPS}
    out["other ops"] = 0.0
    for r in profile_rows:
        group = next((g for g, ops in OP_GROUPS if r["op"] in ops), "other ops")
        out[group] += r["total_ms"] / total
    return out


def plot_op_shares(ax, profiles: dict):
    """Stacked horizontal bars on ax: per label, the share of time of each op group
    ({label: profile rows}). Used by ops_chart and by the notebooks."""
    labels = list(profiles)
    groups = [g for g, _ in OP_GROUPS] + ["other ops"]
    shares = [op_shares(profiles[k]) for k in labels]
    left = [0.0] * len(labels)
    for g, color in zip(groups, OP_COLORS):
        vals = [s[g] * 100 for s in shares]
        ax.barh(range(len(labels)), vals, left=left, color=color, label=g)
        for i, v in enumerate(vals):
            if v >= 6:
                ax.text(left[i] + v / 2, i, f"{v:.0f}%", ha="center", va="center", fontsize=7, color="white")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the profiled run's time (%)")


def ops_chart(res: Results, path):
    plt = _pyplot()
    recs = [r for r in res.stages if r.get("profile")]
    if not recs:
        raise ValueError("no stage record carries a per-op profile")
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(recs) + 2.2))
    plot_op_shares(ax, {r["stage"]: r["profile"] for r in recs})
    ax.legend(ncol=4, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.set_title(f"Where the time goes, per op: {_title(res)}\n{_code(res)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ops_markdown(res: Results) -> str:
    recs = [r for r in res.stages if r.get("profile")]
    groups = [g for g, _ in OP_GROUPS] + ["other ops"]
    lines = ["| op | " + " | ".join(r["stage"] for r in recs) + " |",
             "|---|" + "---:|" * len(recs)]
    shares = [op_shares(r["profile"]) for r in recs]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(f"{s[g] * 100:.1f}%" for s in shares) + " |")
    return "\n".join(lines) + "\n"


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


def roofline_chart(res: Results, path):
    plt = _pyplot()
    if not res.machine:
        raise ValueError(f"no machine.json beside {res.folder}: `make report` measures it")
    m = res.machine
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [2 ** (i / 4) for i in range(-24, 48)]
    styles = ["-", "--"]
    for (threads, bw), style in zip(sorted(m["bandwidth_gbs"].items(), key=lambda kv: int(kv[0])), styles):
        peak = m["peak_gflops"].get(threads)
        ax.plot(xs, [min(peak, bw * x) for x in xs], style, color="black", lw=1.2,
                label=f"{threads} thread(s): {bw:.1f} GB/s, {peak:.0f} GFLOP/s")
        ints = (m.get("int_peak_gops") or {}).get(threads)
        if ints:                        # the int8 stages' ceiling: their multiply-adds are integer ones
            ax.plot(xs, [min(ints, bw * x) for x in xs], style, color="tab:red", lw=1.0,
                    label=f"{threads} thread(s): integer peak, {m['int_instruction']}: {ints:.0f} Gop/s")
    markers = {"prefill": "o", "decode": "^"}
    for i, rec in enumerate(res.stages):
        color = f"C{i}"
        basis = " (modelled traffic)" if rec.get("traffic") else ""
        for kind, x, y in roofline_points(rec):
            ax.scatter([x], [y], marker=markers[kind], color=color, s=60, zorder=3,
                       label=f"{rec['stage']} {kind}{basis}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights + KV read; naive and tiling: the bytes their "
                  "loop order moves, modelled, where recorded)", fontsize=8)
    ax.set_ylabel("achieved GFLOP/s (int8 stages: integer Gop/s)")
    ax.grid(which="both", alpha=0.2)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(f"Roofline: {_title(res)}\n{_code(res)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, digits=1):
    if not _finite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def results_table(res: Results) -> str:
    """The README's markdown table: one row per stage, llama.cpp last."""
    head = ("| stage | TTFT (ms) | decode (ms/token) | tokens/s | decode speedup vs naive | vs previous "
            "| peak RSS (MiB) | prompt / generated |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ups = _speedups(res, "decode_ms")
    for r, (vs_naive, vs_prev) in zip(res.stages, ups):
        s = r.get("settings") or {}
        threads = s.get("threads") or r.get("threads") or 1
        name = r["stage"] + (f" ({threads} threads)" if threads > 1 else "") + \
            (" (extrapolated)" if r.get("extrapolated") else "")
        lines.append(f"| {name} | {_fmt(r['ttft_ms'])} | {_fmt(r['decode_ms'])} | {_fmt(r['tokens_per_s'])} "
                     f"| {_fmt(vs_naive) + 'x' if vs_naive else '-'} | {_fmt(vs_prev, 2) + 'x' if vs_prev else '-'} "
                     f"| {_fmt(r.get('peak_rss_mb'), 0)} | {s.get('prompt_tokens', r['n_prompt'])} / "
                     f"{s.get('n_predict', r['n_generated'])} |")
    for b in sorted(res.baselines, key=lambda b: b.get("threads") or 1):
        t = b.get("threads") or 1
        lines.append(f"| llama.cpp ({t} thread{'s' if t > 1 else ''}) | {_fmt(b['ttft_ms'])} | {_fmt(b['decode_ms'])} "
                     f"| {_fmt(b['tokens_per_s'])} | - | - | {_fmt(b.get('peak_rss_mb'), 0)} "
                     f"| {b['n_prompt']} / {b['n_generated']} |")
    for r in res.failed:
        v = r["validation"]
        lines.append(f"| {r['stage']} | **failed validation** | - | - | - | - | - | max logit error "
                     f"{_fmt(v['max_abs_diff'], 3)} > {v['tolerance']:g} |")
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
    m = r.get("machine") or {}
    return (f"Measured by `make report` on {m.get('cpu', '?')} ({m.get('physical_cores', '?')} cores), "
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


def update_readme(readme: Path, table: str, caption: str = "") -> bool:
    """Rewrite the results table (and the stage table) between their markers; False if the
    README has no results markers."""
    text = replace_block(readme.read_text(), TABLE_BEGIN, TABLE_END, caption + table)
    if text is None:
        return False
    text = replace_block(text, STAGES_BEGIN, STAGES_END, stages_table()) or text
    text = replace_block(text, OPS_BEGIN, OPS_END, ops_table()) or text
    readme.write_text(text)
    return True


def draw_all(res: Results, out_dir) -> list[Path]:
    """Every chart that the records allow; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in (("speedup.png", speedup_chart), ("ops.png", ops_chart), ("roofline.png", roofline_chart)):
        try:
            fn(res, out_dir / name)
            written.append(out_dir / name)
        except ValueError as e:
            res.chart_notes.append(f"{name} not drawn: {e}")
    if any(r.get("profile") for r in res.stages):
        (out_dir / "ops.md").write_text(ops_markdown(res))
        written.append(out_dir / "ops.md")
    return written
