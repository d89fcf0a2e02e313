"""The generated pages under profiles/bench/: one markdown page per record that has one
(a comparison with llama.cpp, time to first token against the prompt's length, the kernel throughput,
speculative decoding, tensor parallelism's costs, constrained decoding's mask, the kernels' prefetch),
redrawn from the record alone."""

from __future__ import annotations

import json
from pathlib import Path

from app import ROOT
from app.measure import compare, constrain_bench, kernel_bench, prefetch_bench, tp_bench, ttft
from app.report import speculative

PAGES = {"comparison": compare.page, "kernels": kernel_bench.page, "speculative": speculative.page,
         "tp": tp_bench.page, "ttft_sweep": ttft.page, "constrain": constrain_bench.page,
         "prefetch": prefetch_bench.page}


def page_for(record_path: Path) -> str | None:
    """The page a record stands behind, or None if it has none."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    make = PAGES.get(record.get("kind")) if isinstance(record, dict) else None
    if make is None:
        return None
    shown = record_path.relative_to(ROOT).as_posix() if record_path.is_relative_to(ROOT) else str(record_path)
    return make(record, shown)


def redraw_pages(folder: Path) -> list[Path]:
    written = []
    for path in sorted(Path(folder).rglob("*.json")):
        text = page_for(path)
        if text is not None:
            out = path.with_suffix(".md")
            out.write_text(text)
            written.append(out)
    return written


def write_record(record: dict, path: Path) -> str:
    """A benchmark's record written to `path` (JSON) and its folder's pages redrawn; returns the
    record's own page (what a benchmark script prints when it is done)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    redraw_pages(path.parent)
    return path.with_suffix(".md").read_text()
