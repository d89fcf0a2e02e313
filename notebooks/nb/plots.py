"""Charts in a chapter: live runs beside recorded ones, op shares, the roofline, lines and bars.
Headless (MPLBACKEND=Agg, as in the tests) a figure is still rendered, so one that cannot be
drawn fails its cell."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.ticker import MaxNLocator

from app.report.charts import plot_op_shares
from notebooks.nb.measure import Recorded
from notebooks.nb.text import show_table


def show(fig):
    """Display a figure inline and close it. Headless (MPLBACKEND=Agg, as in the tests) it is
    still rendered, so a figure that cannot be drawn fails its cell."""
    if matplotlib.get_backend().lower() == "agg":
        fig.canvas.draw()
    else:
        display(fig)
    plt.close(fig)


def _settings_of(rec: dict) -> str:
    s = rec.get("settings") or {}
    return f"{s.get('prompt_tokens', rec.get('n_prompt'))}+{s.get('n_predict', rec.get('n_generated'))}"


def stage_chart(live: list[dict], rec: Recorded | None = None, stages=None, title: str = ""):
    """TTFT and decode ms/token per stage: the live runs of this notebook beside the recorded ones
    (profiles/). Labels say prompt+generated tokens, which differ in quick mode. An axis is
    logarithmic where its bars span more than 10x, else linear from zero (a log axis fitted to
    close values draws a 1% difference as a tall bar)."""
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
        shown = [by[s][key] for _, by, _ in series for s in stages if s in by and by[s][key] == by[s][key]]
        log = bool(shown) and min(shown) > 0 and max(shown) / min(shown) > 10
        for si, (name, by, color) in enumerate(series):
            xs = [i + (si - (len(series) - 1) / 2) * width for i, s in enumerate(stages) if s in by]
            vals = [by[s][key] for s in stages if s in by]
            bars = ax.bar(xs, vals, width=width, color=color, label=name if vals else None)
            for b, s in zip(bars, [s for s in stages if s in by]):
                v = by[s][key]
                ax.annotate(f"{v:,.0f}\n({_settings_of(by[s])})" if v == v else "n/a",
                            (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(stages)), stages)
        ax.set_xlim(-0.6, len(stages) - 0.4)
        ax.set_ylabel(label)
        ax.grid(axis="y", which="both", alpha=0.25)
        ax.margins(y=0.3)
        if not log:
            ax.set_ylim(bottom=0)                   # after the margins: the bars start at zero
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title or "Stage by stage (labels: prompt+generated tokens)", fontsize=11)
    fig.tight_layout()
    show(fig)
    if rec is not None and rec.results is not None:
        missing = [s for s in stages if not rec.get(s)]
        if missing:
            print(f"not in the records: {', '.join(missing)} (`make report` measures every stage)")


def ops_chart(profiles: dict, title: str = "Where the time goes, per op"):
    """Stacked shares per op group (app.report.charts.OP_GROUPS) for {label: profile rows}."""
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
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if all(float(x).is_integer() for xs, _ in curves.values() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    ax.set_ylim(bottom=0 if not logy else None)
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    show(fig)


def bar_chart(values: dict, ylabel: str, title: str, fmt: str = "{:,.1f}", logy: bool = False,
              lines: dict | None = None):
    """{label: value} as one bar each, the value written on top; lines: {label: value} drawn across
    as dashed references (a ceiling the bars are measured against)."""
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(values) + 2), 4))
    for i, (label, v) in enumerate((lines or {}).items()):
        ax.axhline(v, ls="--", lw=1, color=f"0.{3 + 2 * i}", label=label)
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
    if lines:
        ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    show(fig)


def show_live(live: dict, new: str, old: str, threads: int) -> str | None:
    """measure_live()'s records as a table and decode as bars; where both stages ran at
    `threads`, the new one against the old in a sentence (the chapter's finding), else None."""
    if not live:
        return None
    show_table(["stage", "threads", "TTFT (ms)", "decode (ms/token)"],
               [(s, t, f"{r['ttft_ms']:.1f}", f"{r['decode_ms']:.2f}") for (s, t), r in live.items()])
    bar_chart({f"{s}@{t}": r["decode_ms"] for (s, t), r in live.items()}, "ms per token", "Decode (live)")
    if (new, threads) not in live or (old, threads) not in live:
        return None
    a, b = live[(new, threads)], live[(old, threads)]
    return (f"decode {a['decode_ms']:.2f} vs {b['decode_ms']:.2f} ms/token, TTFT "
            f"{a['ttft_ms']:.0f} vs {b['ttft_ms']:.0f} ms at {threads} thread(s)")
