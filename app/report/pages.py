"""What is drawn from a benchmark's record (profiles/bench/): its page, markdown beside the record,
and for some a chart, every figure from the record alone. `python -m app bench NAME` draws them
when it has measured; `... --draw-only` and `python -m app report` draw them again.

    DRAWINGS            {record kind: (module, page, chart)}: page(record, source) -> markdown,
                        chart(record, path) draws a PNG
    draw(record, path)  the record at `path` drawn: its page beside it, its chart (chart_path)
    page_for(path)      the page a record file stands behind, or None
    redraw(folder, kinds)   every record under folder (of those kinds) drawn again
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from app import ROOT
from app.measure.protocol import BENCH_DIR, shown

# {record kind: (module, its page function, its chart function or None)}; a module is imported
# when one of its records is drawn.
DRAWINGS = {
    "comparison": ("app.measure.compare", "page", None), "kernels": ("app.measure.kernel_bench", "page", None),
    "ttft_sweep": ("app.measure.ttft", "page", None), "constrain": ("app.measure.constrain_bench", "page", None),
    "prefetch": ("app.measure.prefetch_bench", "page", None), "shared_core": ("app.measure.shared_core", "page", None),
    "soak": ("app.measure.soak", "page", None), "speculative_serve": ("app.measure.spec_serve", "page", None),
    "tp": ("app.measure.tp_bench", "page", "chart"), "speculative": ("app.report.speculative", "page", "chart"),
    "batching": ("app.measure.loadtest", "page", "chart"), "serve_cost": ("app.measure.serve_cost", "page", None),
}
# The charts the README shows live in profiles/, beside the results' charts; every other chart
# beside its record.
README_CHARTS = {BENCH_DIR / "batching.json": ROOT / "profiles" / "batching.png",
                 BENCH_DIR / "speculative.json": ROOT / "profiles" / "speculative.png"}


def kind_of(record) -> str | None:
    return record.get("kind") if isinstance(record, dict) else None


def drawing(kind: str | None):
    """(page, chart or None) of a record kind; None for a kind without a drawing."""
    if kind not in DRAWINGS:
        return None
    module, page, chart = DRAWINGS[kind]
    m = importlib.import_module(module)
    return getattr(m, page), getattr(m, chart) if chart else None


def chart_path(path: Path) -> Path:
    path = Path(path)
    return README_CHARTS.get(path.resolve(), path.with_suffix(".png"))


def draw(record: dict, path: Path) -> list[Path]:
    """The page (and chart) of the record written at `path`; the files drawn (none for a kind
    without a drawing)."""
    drawn = drawing(kind_of(record))
    if drawn is None:
        return []
    page, chart = drawn
    md = Path(path).with_suffix(".md")
    md.write_text(page(record, shown(path)))
    if chart is None:
        return [md]
    chart(record, chart_path(path))
    return [md, chart_path(path)]


def page_for(record_path: Path) -> str | None:
    """The page a record stands behind, or None if it has none."""
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, ValueError):
        return None
    drawn = drawing(kind_of(record))
    return None if drawn is None else drawn[0](record, shown(record_path))


def redraw(folder: Path = BENCH_DIR, kinds=None) -> list[Path]:
    """Every record under folder (of `kinds`, default all) drawn again; the files drawn."""
    written = []
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if kinds is None or kind_of(record) in kinds:
            written += draw(record, path)
    return written
