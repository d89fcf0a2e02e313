"""The article beside the reader's machine, in a chapter: the article's claim and figure (from the
lessons ledger, app/report/lessons.py, the one place the article's figures are written), the
figure the chapter just measured live, and the recorded figure with its verdict and why."""

from __future__ import annotations

from app.report import lessons
from notebooks.nb.text import md, md_table

_LEDGER: dict = {}


def ledger() -> dict:
    """{row id: lessons.Row} from this machine's committed records (read once per kernel)."""
    if not _LEDGER:
        _LEDGER.update({r.id: r for r in lessons.ledger(lessons.find_sources())})
    return _LEDGER


def row(rid: str) -> lessons.Row:
    return ledger()[rid]


def figure(value, unit: str) -> str:
    """A figure as the ledger writes it ('12.3x', '+1.50%', '1,234')."""
    return lessons._figure(value, unit)


def verdict_of(rid: str, value: float) -> str:
    """What the ledger's band says of a live figure."""
    r = row(rid)
    if value is None or r.band is None:
        return "not measured here"
    return lessons.verdict(value, r.band, r.article, r.unit)


def beside(rid: str, live: float | None, live_note: str = "", explain: str = ""):
    """Show the article's claim, the live figure (and what the ledger's band makes of it), the
    recorded figure and its why (returns nothing: a chapter's cell that ends with it shows the
    table alone)."""
    r = row(rid)
    live_verdict = verdict_of(rid, live) if live is not None else "not measured here"
    band = f"{figure(r.band[0], r.unit)} .. {figure(r.band[1], r.unit)}" if r.band else "-"
    rows = [("the article", r.article_text, "-", ""),
            ("live, this notebook", figure(live, r.unit) if live is not None else "-", live_verdict, live_note),
            ("recorded (`make report`)", figure(r.measured, r.unit), r.verdict,
             ", ".join(f"`{p}`" for p in r.records) or "no record")]
    text = f"**{r.claim}** (`{r.id}`; a figure inside {band} counts as reproduced)\n\n" + \
        md_table(["", "figure", "verdict", "from"], rows) + f"\n\n_Why, from the records:_ {r.why}"
    if explain:
        text += f"\n\n{explain}"
    md(text)
