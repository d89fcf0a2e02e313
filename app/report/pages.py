"""What is drawn from a benchmark's record (profiles/bench/): its page, markdown beside the record,
and for some a chart, every figure from the record alone. `python -m app bench NAME` draws them
when it has measured; `... --draw-only` and `python -m app report` draw them again.

    DRAWINGS            {record kind: Drawing(page, chart)}: page(record, source) -> markdown,
                        chart(record, path) draws a PNG
    draw(record, path)  the record at `path` drawn: its page beside it, its chart (chart_path)
    page_for(path)      the page a record file stands behind, or None
    redraw(folder, kinds)   every record under folder (of those kinds) drawn again
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app import ROOT
from app.measure import (
    compare,
    constrain_bench,
    kernel_bench,
    loadtest,
    prefetch_bench,
    shared_core,
    soak,
    spec_serve,
    tp_bench,
    ttft,
)
from app.measure.protocol import BENCH_DIR, shown
from app.report import speculative


@dataclass(frozen=True)
class Drawing:
    page: Callable[[dict, str], str]            # (record, its path as shown) -> markdown
    chart: Callable[[dict, Path], None] | None = None


DRAWINGS = {
    "comparison": Drawing(compare.page), "kernels": Drawing(kernel_bench.page), "ttft_sweep": Drawing(ttft.page),
    "constrain": Drawing(constrain_bench.page), "prefetch": Drawing(prefetch_bench.page),
    "shared_core": Drawing(shared_core.page), "soak": Drawing(soak.page), "speculative_serve": Drawing(spec_serve.page),
    "tp": Drawing(tp_bench.page, tp_bench.chart), "speculative": Drawing(speculative.page, speculative.chart),
    "batching": Drawing(loadtest.page, loadtest.chart),
}
# The charts the README shows live in profiles/, beside the results' charts; every other chart
# beside its record.
README_CHARTS = {BENCH_DIR / "batching.json": ROOT / "profiles" / "batching.png",
                 BENCH_DIR / "speculative.json": ROOT / "profiles" / "speculative.png"}


def kind_of(record) -> str | None:
    return record.get("kind") if isinstance(record, dict) else None


def chart_path(path: Path) -> Path:
    path = Path(path)
    return README_CHARTS.get(path.resolve(), path.with_suffix(".png"))


def draw(record: dict, path: Path) -> list[Path]:
    """The page (and chart) of the record written at `path`; the files drawn (none for a kind
    without a drawing)."""
    drawing = DRAWINGS.get(kind_of(record))
    if drawing is None:
        return []
    page = Path(path).with_suffix(".md")
    page.write_text(drawing.page(record, shown(path)))
    if drawing.chart is None:
        return [page]
    chart = chart_path(path)
    drawing.chart(record, chart)
    return [page, chart]


def page_for(record_path: Path) -> str | None:
    """The page a record stands behind, or None if it has none."""
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, ValueError):
        return None
    drawing = DRAWINGS.get(kind_of(record))
    return None if drawing is None else drawing.page(record, shown(record_path))


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
