"""The chapters' notebooks (notebooks/NN_*.ipynb): written from their sources in notebooks/src/,
executed once for the book, committed with their outputs.

    .venv/bin/python notebooks/build.py               # write each notebook whose cells differ from its source
    .venv/bin/python notebooks/build.py --check       # exit 1 if a notebook's cells differ from its source
    .venv/bin/python notebooks/build.py --execute     # write and execute every chapter for the book (make book-execute)
    .venv/bin/python notebooks/build.py --execute 02 12                   # only these chapters
    .venv/bin/python notebooks/build.py --book        # the book: build/book/html/index.html (make book)

Edit the source, not the .ipynb: a source is plain Python in jupytext's "percent" format (`# %%`
starts a code cell, `# %% [markdown]` a Markdown cell written as comments), so it diffs, greps and
lints like the rest of the repository; jupytext reads it. Lines before the first `# %%` are the
file's own header, not part of the notebook. Every notebook gets the same first code cell, SETUP
below: it finds the repository root (so that `common`, `stages` and `notebooks.nb` import) and
shows whose figures the outputs are (notebooks/nb/provenance.py).

The committed notebooks carry the outputs of one execution for the book (`--execute`): full
settings, on the machine whose records profiles/ holds, the machine, commit and date named in the
first output. A notebook is stale when its cells differ from its source; writing it again drops its
outputs (they were made by other cells), so the book says so until the chapter is executed again.
tests/test_notebooks.py checks the cells against the sources and the outputs' provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = HERE / "src"

SETUP = """\
# The repository root (where `common/`, `stages/` and `notebooks/` live) on the import path,
# wherever Jupyter started; then whose figures this page shows (machine, code, date, settings).
import sys
from pathlib import Path
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "notebooks" / "nb" / "__init__.py").exists())
sys.path.insert(0, str(ROOT))
from notebooks import nb
from notebooks.nb import provenance
cfg = nb.settings()
provenance.show(cfg)"""
SETUP_TAGS = ["remove-input"]         # the book shows the setup cell's caption, not its plumbing

KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}
CELL_TIMEOUT_S = 3600                 # one cell at full settings (the slow stages re-run the whole text per token)
BOOK_ENV = "LLM_BOOK_EXECUTION"       # notebooks/nb/provenance.py reads it: the outputs are the book's
BOOK_DIR = ROOT / "build" / "book"    # html/ (the site) and doctrees/ (Sphinx's cache between builds)


def parse(text: str) -> list:
    """Percent-format source -> notebook cells (jupytext), without the file's header, with
    no blank lines around a cell and only the tags of a cell's metadata (jupytext also keeps
    its own spacing hints there)."""
    import jupytext
    cells = jupytext.reads(text, fmt="py:percent").cells
    if cells and not text.lstrip().startswith("# %%"):
        cells = cells[1:]                       # the header before the first marker
    out = []
    for c in cells:
        source = c.source.strip("\n")
        if not source.strip():
            continue
        tags = c.metadata.get("tags")
        out.append(nbformat.v4.new_markdown_cell(source) if c.cell_type == "markdown"
                   else nbformat.v4.new_code_cell(source))
        if tags:
            out[-1].metadata["tags"] = list(tags)
    return out


def build(source: Path) -> nbformat.NotebookNode:
    """The notebook a source makes: its cells, the setup cell second, no outputs."""
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    cells = parse(source.read_text())
    if not cells or cells[0].cell_type != "markdown":
        raise ValueError(f"{source.name}: a notebook opens with its title, a Markdown cell")
    setup = nbformat.v4.new_code_cell(SETUP)
    setup.metadata["tags"] = list(SETUP_TAGS)
    cells.insert(1, setup)
    for i, cell in enumerate(cells):
        cell.id = f"{source.stem.replace('_', '-')}-{i:02d}"      # stable ids: clean diffs
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def sources() -> dict[Path, Path]:
    """{notebook path: its source}, one per chapter."""
    return {HERE / f"{src.stem}.ipynb": src for src in sorted(SRC.glob("[0-9][0-9]_*.py"))}


def cells_of(nb) -> list[tuple]:
    """What a notebook's source decides: each cell's kind, id, text and tags (not its outputs)."""
    return [(c["cell_type"], c.get("id"), c["source"] if isinstance(c["source"], str) else "".join(c["source"]),
             tuple(c.get("metadata", {}).get("tags", ()))) for c in nb["cells"]]


def matches_source(path: Path, source: Path) -> bool:
    """The committed notebook has the cells its source makes now (outputs aside)."""
    return path.exists() and cells_of(json.loads(path.read_text())) == cells_of(build(source))


def book_provenance(nb) -> dict | None:
    """The provenance the setup cell showed (notebooks/nb/provenance.py), or None if the
    notebook was not executed."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "provenance.show(cfg)" in "".join(cell["source"]):
            for out in cell.get("outputs", []):
                data = out.get("data", {}).get("application/json")
                if isinstance(data, dict) and "provenance" in data:
                    return data["provenance"]
            return None
    return None


def problems(path: Path, source: Path, root: Path = ROOT) -> list[str]:
    """Why a committed notebook is not its chapter as the book shows it, [] where it is: its cells
    are its source's now, and its outputs are one top-to-bottom execution for the book, at full
    settings, on a machine whose records profiles/results/ holds, with no error and no path of
    the machine that ran it. The book prints these on the page; the tests fail on them."""
    num = source.stem[:2]
    if not path.exists():
        return [f"no notebook: `make book-execute chapters={num}` writes and executes it"]
    if not matches_source(path, source):
        return [f"stale: its cells differ from its source, notebooks/src/{source.name}; "
                f"`make book-execute chapters={num}` writes and executes it for the book"]
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    raised = [f"cell {c.get('id')} raised {out.get('ename')}: {out.get('evalue')}"
              for c in code for out in c.get("outputs", []) if out.get("output_type") == "error"]
    p = book_provenance(nb)
    if p is None:
        return raised or [f"not executed: the page shows its text and code without outputs; `make book-execute "
                          f"chapters={num}` executes it for the book (`make notebooks` runs it on your machine)"]
    found = list(raised)
    if not p.get("for_the_book") or p.get("settings") != "full":
        found.append(f"not the book's execution: its outputs come from a run at {p.get('settings')} settings "
                     f"{'for the book' if p.get('for_the_book') else 'outside `make book-execute`'}")
    if not (root / "profiles" / "results" / str(p.get("machine"))).is_dir():
        found.append(f"executed on {p.get('machine')}, a machine with no records in profiles/results/")
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(counts) + 1)):
        found.append(f"its outputs are not one run from the top (execution counts {counts})")
    caption = ["".join(out["data"]["text/html"]) for out in code[0].get("outputs", [])
               if "text/html" in out.get("data", {})]
    if not any(p.get("machine", "?") in t and (p.get("commit") or "?")[:7] in t for t in caption):
        found.append("its first output does not name the machine and the commit its provenance holds")
    found += [f"cell {cid} names a path of the machine that ran it ({m.group(0)}): show it with nb.rel()"
              for cid, t in output_texts(nb) for m in [MACHINE_PATH.search(t)] if m]
    return found


# ---- executing the chapters for the book ------------------------------------------------------

# an absolute path into a checkout or an environment: a committed output never names one
MACHINE_PATH = re.compile(r"/(?:[\w.+-]+/)+(?:\.venv|site-packages|notebooks|stages|common|profiles|models|app)/")


def output_texts(nb):
    """(cell id, text) of every text an output holds."""
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items()
                                             if k.startswith("text/") or k == "application/json"]
            texts += out.get("traceback", []) + [out.get("evalue", "")]
            for t in texts:
                yield cell.get("id"), t if isinstance(t, str) else json.dumps(t) if isinstance(t, dict) else "".join(t)


def relative_paths(nb, root: Path = ROOT):
    """Outputs name the repository's files as the reader sees them (from its root), not as they
    lie on the machine that executed them."""
    prefix = str(root) + os.sep

    def fix(value):
        if isinstance(value, str):
            return value.replace(prefix, "").replace(str(root), ".")
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for key in ("text", "traceback", "evalue"):
                if key in out:
                    out[key] = fix(out[key])
            if "data" in out:
                out["data"] = nbformat.from_dict({k: (fix(v) if not k.startswith("image/") else v)
                                                  for k, v in out["data"].items()})


def kernel_spec(folder: Path) -> str:
    """A kernel spec that runs this interpreter, under `folder` (put it on JUPYTER_PATH): the
    chapters see this environment's packages whatever kernels the machine has installed."""
    name = "llm-chapters"
    spec = folder / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name, "language": "python"}))
    return name


def execute(source: Path, kernel: str, timeout: int = CELL_TIMEOUT_S):
    """The chapter built from its source and run top to bottom in a fresh kernel (from
    notebooks/, as Jupyter runs it); figures inline, as a reader sees them. A cell that raises
    stops the run, its error kept as that cell's output."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    nb = build(source)
    try:
        NotebookClient(nb, kernel_name=kernel, timeout=timeout, record_timing=False,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    except CellExecutionError:
        pass                                      # problems() names the cell and its error
    relative_paths(nb)
    return nb


def chosen(names: list[str]) -> dict[Path, Path]:
    every = sources()
    if not names:
        return every
    picked = {p: s for p, s in every.items() if any(s.stem == n or s.stem.startswith(n + "_") for n in names)}
    unknown = [n for n in names if not any(s.stem == n or s.stem.startswith(n + "_") for s in every.values())]
    if unknown:
        sys.exit(f"error: no chapter {', '.join(unknown)}; the chapters: {', '.join(s.stem for s in every.values())}")
    return picked


def execute_for_the_book(names: list[str]) -> int:
    """Execute the chosen chapters one after another (each measures: none beside another) and
    write their notebooks; say how long each took and what keeps one from being the book's."""
    os.environ[BOOK_ENV] = "1"
    os.environ.pop("MPLBACKEND", None)           # the kernel's inline backend: charts become outputs
    total, failed = time.perf_counter(), {}
    with tempfile.TemporaryDirectory() as jupyter_path:
        os.environ["JUPYTER_PATH"] = jupyter_path
        kernel = kernel_spec(Path(jupyter_path))
        for path, source in chosen(names).items():
            t0 = time.perf_counter()
            print(f"executing {source.stem} ...", flush=True)
            path.write_text(render(execute(source, kernel)))
            print(f"  {path.name}: {time.perf_counter() - t0:.0f} s", flush=True)
            if found := problems(path, source):
                failed[source.stem] = found
    print(f"executed in {time.perf_counter() - total:.0f} s")
    for name, found in failed.items():
        print(f"error: {name} is not the book's execution:\n  " + "\n  ".join(found), file=sys.stderr)
    return 1 if failed else 0


# ---- the book --------------------------------------------------------------------------------

def build_book(out: Path = BOOK_DIR) -> Path:
    """The static site (Sphinx, notebooks/book/conf.py) from the committed notebooks, executing
    none; returns its front page. Sphinx's warnings (a chapter that is not the book's execution
    of its source, a broken reference) go to stderr."""
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(HERE / "book"),
                    str(ROOT), str(out / "html"), "-d", str(out / "doctrees")], check=True)
    return out / "html" / "index.html"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report notebooks whose cells differ from their source")
    ap.add_argument("--execute", action="store_true",
                    help="write and execute the chapters for the book (LLM_NOTEBOOK_QUICK=1: quick settings, "
                         "which the tests refuse in a committed notebook)")
    ap.add_argument("--book", nargs="?", const=str(BOOK_DIR), metavar="DIR",
                    help=f"build the book into DIR/html (default {BOOK_DIR.relative_to(ROOT)}; make book)")
    ap.add_argument("chapters", nargs="*", help="with --execute: chapters by number or name (default: all)")
    args = ap.parse_args()
    if args.chapters and not args.execute:
        ap.error("chapters are named only with --execute")
    if args.execute:
        sys.exit(execute_for_the_book(args.chapters))
    if args.book:
        front = build_book(Path(args.book).resolve())
        print(f"the book: {front.relative_to(ROOT) if front.is_relative_to(ROOT) else front}")
        return
    stale = []
    for path, source in sources().items():
        if not matches_source(path, source):
            stale.append(path.stem)
            if not args.check:
                path.write_text(render(build(source)))
    if args.check:
        print(f"{len(stale)} notebook(s) differ from their sources" + (f": {', '.join(stale)}" if stale else ""))
    else:
        print(f"{len(stale)} notebook(s) written without outputs" + (
            f": {', '.join(stale)}; `make book-execute chapters=\"{' '.join(s[:2] for s in stale)}\"` "
            "executes them for the book" if stale else ""))
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
