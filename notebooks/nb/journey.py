"""The running total that closes every stage's chapter: one chart of every stage's time to first
token and decode, from the records `make report` wrote, with this machine's floor drawn (decode:
the weights' bytes over the measured bandwidth; the prompt: its multiply-adds over the measured
peak) and the chapter's stage highlighted; the README's chart is the same drawing
(app/report/charts.py draw_journey).

    findings["running total"] = nb.journey("kv_cache")     # the chart, and where the stage stands
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from app.report.charts import _ratio, draw_journey, floors, journey_size
from notebooks.nb.measure import recorded
from notebooks.nb.plots import show
from notebooks.nb.text import md
from stages import info, unavailable_reason


def standing(res, stage: str) -> str:
    """Where a stage's record stands, in a sentence: its times and their multiples of the floor."""
    r = next(x for x in res.stages if x["stage"] == stage)
    f = floors(res)
    parts = []
    for key, what in (("decode_ms", "decode"), ("ttft_ms", "time to first token")):
        times = f.times(r, key) if f else None
        parts.append(f"{what} {r[key]:,.1f} ms" + (f", {_ratio(times)}× the floor" if times else ""))
    return f"{stage}: " + "; ".join(parts)


def journey(stage: str, results_root=None) -> str:
    """Draw the journey with `stage` highlighted and say where it stands; where the records have no
    run of it (the GPU stage on a machine without one), the journey without it, and why."""
    rec = recorded(results_root)
    if rec.results is None or not (rec.results.stages or rec.results.baselines):
        md(f"_{rec.note}_")
        return f"{stage}: no records to place it among the others (`make report` writes them)"
    res = rec.results
    here = stage in res.names
    fig = plt.figure(figsize=journey_size(len(res.stages) + len(res.baselines)))
    draw_journey(fig, res, stage if here else None)
    show(fig)
    md(rec.note)
    if not here:
        why = None if info(stage).gpu else unavailable_reason(stage)
        where = ("a machine with an NVIDIA GPU measures it" if info(stage).gpu else
                 f"a machine that runs it measures it: here, {why}" if why else "`make report` measures it")
        return f"{stage}: not in these records ({where}); the others are drawn without it"
    return standing(res, stage)
