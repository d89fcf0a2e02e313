"""Whose figures a chapter shows: the first output of every chapter (its setup cell, written by
notebooks/build.py) names the machine, the code, the date and the settings its outputs were made
with, and says whether they are the book's (executed once by `make book-execute`, committed) or
the reader's own (any other run, such as `make notebooks`).

The same facts go out three ways in one output: HTML and Markdown for the reader (Jupyter, the
book, GitHub's notebook view) and JSON for the tests, which check that a committed chapter was
executed for the book, at full settings, on a machine whose records are in profiles/results/.
"""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone

from IPython.display import display

from notebooks.nb.settings import Settings, model_path

BOOK_ENV = "LLM_BOOK_EXECUTION"      # set by `notebooks/build.py --execute` (make book-execute) only
CAPTION_CLASS = "chapter-provenance"  # the book's test finds the caption by it


def provenance(cfg: Settings) -> dict:
    """The facts of this run: machine id (as profiles/results/ names its folder), the code's commit
    and hash (as every record carries them), when, with which settings and model, and for whom."""
    from app.measure.machine import machine_id
    from app.measure.provenance import provenance as code
    p = code()
    return {"machine": machine_id(), "commit": p["commit"], "dirty": p["dirty"], "code_hash": p["code_hash"],
            "executed": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "settings": "quick" if cfg.quick else "full", "settings_detail": cfg.describe(),
            "model": model_path().name, "for_the_book": os.environ.get(BOOK_ENV, "") == "1"}


def sentences(p: dict) -> tuple[str, str]:
    """(the lead, the details) of the caption, as plain text with `code` spans."""
    commit = (p["commit"] or "unknown")[:7] + (" + uncommitted changes" if p["dirty"] else "")
    where = (f"on `{p['machine']}`, code of commit `{commit}` (code hash `{p['code_hash']}`), {p['executed']}, "
             f"model `{p['model']}`; {p['settings_detail']}.")
    if p["for_the_book"]:
        return ("These are the book's figures.",
                f"This chapter was executed once for the book {where} Charts and tables read from `profiles/` "
                "name their own records. To see your own machine's figures, run the chapter yourself "
                "(`make notebooks`, then Run All): this line will then name your machine.")
    return ("These are your machine's figures.",
            f"This chapter was executed {where} Charts and tables read from `profiles/` name their own records. "
            "The book (`make book`) shows the chapter as executed once on the records' machine.")


def _html_code(text: str) -> str:
    parts = html.escape(text).split("`")
    return "".join(f"<code>{s}</code>" if i % 2 else s for i, s in enumerate(parts))


def show(cfg: Settings) -> None:
    """Display the caption: the setup cell's output."""
    p = provenance(cfg)
    lead, rest = sentences(p)
    display({"text/html": f'<div class="{CAPTION_CLASS}"><p><strong>{_html_code(lead)}</strong> '
                          f"{_html_code(rest)}</p></div>",
             "text/markdown": f"**{lead}** {rest}",
             "application/json": {"provenance": p}}, raw=True)
