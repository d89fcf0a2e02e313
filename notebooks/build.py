"""Write the notebooks (.ipynb) from their sources in notebooks/src/ (Python, "percent" format).

    .venv/bin/python notebooks/build.py            # rewrite every notebooks/NN_*.ipynb
    .venv/bin/python notebooks/build.py --check    # exit 1 if a notebook differs from its source

Edit the source, not the .ipynb: a source is plain Python, so it diffs, greps and lints like the
rest of the repository. In a source, `# %%` starts a code cell and `# %% [markdown]` a Markdown
cell whose lines are written as comments (`# ` is stripped). Every notebook gets the same first
cell, SETUP below, which finds the repository root so that `common`, `stages` and `notebooks.nb` import.

The notebooks are committed without outputs (tests/test_notebooks.py checks this): every figure
in them is measured on the reader's own machine when they run it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

SETUP = """\
# The repository root (where `common/`, `stages/` and `notebooks/` live) on the import path,
# wherever Jupyter started.
import sys
from pathlib import Path
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "notebooks" / "nb" / "__init__.py").exists())
sys.path.insert(0, str(ROOT))
from notebooks import nb
cfg = nb.settings()
print(cfg.describe())"""

KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}


def parse(text: str) -> list[tuple[str, str]]:
    """Percent-format source -> [(kind, text)], kind 'code' or 'markdown'. Lines before the
    first marker (the file's own header) are not part of the notebook."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(lines).strip("\n")
            if body:
                cells.append((kind, body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        elif kind == "code":
            lines.append(line)
    flush()
    return cells


def build(source: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    cells = parse(source.read_text())
    if not cells or cells[0][0] != "markdown":
        raise ValueError(f"{source.name}: a notebook opens with its title, a Markdown cell")
    cells.insert(1, ("code", SETUP))
    for i, (kind, text) in enumerate(cells):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text, id=f"{source.stem.replace('_', '-')}-{i:02d}"))   # stable ids: clean diffs
    nbformat.validate(nb)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def targets() -> dict[Path, str]:
    """{notebook path: the text it should have}, one per source."""
    return {HERE / f"{src.stem}.ipynb": render(build(src)) for src in sorted(SRC.glob("[0-9][0-9]_*.py"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report notebooks that differ from their source")
    args = ap.parse_args()
    stale = []
    for path, text in targets().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(text)
    verb = "differ from their sources" if args.check else "written"
    print(f"{len(stale)} notebook(s) {verb}" + (f": {', '.join(stale)}" if stale else ""))
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
