"""The notebooks: built from their sources, committed with the outputs of one execution for the
book (full settings, on the records' machine, named in each chapter's first output), and every one
of them runs top to bottom in a fresh kernel with the quick settings (LLM_NOTEBOOK_QUICK=1), and in
the slow set (`make test-all`) at full settings, as a reader runs them. A cell that raises fails
its notebook's test, and so does a finding that is NaN or infinite (nb.Findings refuses it where
it is set) or a findings list that lacks what the chapter's source always sets. Each notebook's
time is printed at the end of the run.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
CHAPTERS = sorted(p.stem for p in (NOTEBOOK_DIR / "src").glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT_S = 300          # one cell; a cold numba cache is the slowest case
FULL_CELL_TIMEOUT_S = 3600    # one cell at the report's settings (the naive stage is hours per model, not per cell)

nbformat = pytest.importorskip("nbformat", reason="nbformat is in requirements-test.txt")
pytest.importorskip("jupytext", reason="jupytext is in requirements-book.txt (`make setup` installs it)")


def _build_module():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build_module()


def test_every_chapter_has_a_source_and_a_notebook():
    assert len(CHAPTERS) >= 9 and CHAPTERS[0] == "00_gguf_and_tokens"
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")) == CHAPTERS


@pytest.mark.parametrize("name", CHAPTERS)
def test_committed_notebook_is_the_books_execution_of_its_source(name):
    """What the book and GitHub show of a chapter: its source's cells now, with the outputs of one
    execution for the book (build.problems; each way it can fail is planted below)."""
    found = build.problems(NOTEBOOK_DIR / f"{name}.ipynb", NOTEBOOK_DIR / "src" / f"{name}.py")
    assert not found, f"{name}:\n" + "\n".join(found)


def _chapter_copy(tmp_path, name="02_tiling", notebook=None):
    """(notebook, source) copies of a chapter in tmp_path, the notebook as given (default: built clean)."""
    (tmp_path / "src").mkdir(exist_ok=True)
    source = tmp_path / "src" / f"{name}.py"
    shutil.copy(NOTEBOOK_DIR / "src" / f"{name}.py", source)
    path = tmp_path / f"{name}.ipynb"
    path.write_text(build.render(notebook if notebook is not None else build.build(source)))
    return path, source


def test_a_source_edit_makes_its_notebook_stale_and_a_rewrite_drops_its_outputs(tmp_path, monkeypatch):
    """The staleness rule: a notebook matches its source by its cells (kind, id, text, tags), not by
    its outputs; after an edit of the source it no longer does, and `build.py` writes it again
    without outputs (they were made by other cells), leaving a notebook that matches untouched."""
    path, source = _chapter_copy(tmp_path)
    assert build.matches_source(path, source)
    executed = build.build(source)
    executed.cells[1].outputs = [nbformat.v4.new_output("stream", text="made by these cells")]
    path.write_text(build.render(executed))
    assert build.matches_source(path, source), "outputs are not part of what a source decides"
    other, other_src = _chapter_copy(tmp_path, "04_kv_cache", notebook=executed)      # another chapter's cells
    assert not build.matches_source(other, other_src)
    for edit in (lambda t: t.replace("# %%\n", "# %%\n# one more line\n", 1),      # a code cell's text
                 lambda t: t + "\n# %% [markdown]\n# A new closing cell\n",          # a cell added
                 lambda t: t.replace("# %% [markdown]", "# %% [markdown] tags=[\"hide-input\"]", 1)):  # its tags
        original = source.read_text()
        source.write_text(edit(original))
        assert not build.matches_source(path, source), edit
        source.write_text(original)
    source.write_text(source.read_text() + "\n# %%\nprint('added')\n")
    monkeypatch.setattr(build, "HERE", tmp_path)
    monkeypatch.setattr(build, "SRC", tmp_path / "src")
    (tmp_path / "src" / "04_kv_cache.py").unlink()
    other.unlink()
    monkeypatch.setattr(sys, "argv", ["build.py", "--check"])
    with pytest.raises(SystemExit) as e:
        build.main()
    assert e.value.code == 1 and "made by these cells" in path.read_text(), "--check changes nothing"
    monkeypatch.setattr(sys, "argv", ["build.py"])
    with pytest.raises(SystemExit) as e:
        build.main()
    assert e.value.code == 0 and build.matches_source(path, source)
    assert "made by these cells" not in path.read_text() and "print('added')" in path.read_text()


def test_build_reads_percent_format_with_jupytext():
    cells = build.parse("header, not a cell\n# %% [markdown]\n# # Title\n#\n# text\n\n"
                        "# %% tags=[\"hide-input\"]\n\nx = 1\n# a comment stays code\n\n# %%\n\n")
    assert [(c.cell_type, c.source) for c in cells] == [("markdown", "# Title\n\ntext"),
                                                        ("code", "x = 1\n# a comment stays code")]
    assert cells[1].metadata == {"tags": ["hide-input"]} and cells[0].metadata == {}


# ---- the committed outputs: the book's execution --------------------------------------------------

def _executed(source, **provenance) -> nbformat.NotebookNode:
    """A chapter's notebook as `--execute` leaves it, outputs made up: a caption naming a machine
    that has records, every code cell run once in order."""
    nb = build.build(source)
    p = {"machine": "amd-epyc-f25m17-avx512vnni-2c", "commit": "0123456789abcdef", "dirty": False,
         "code_hash": "feedface", "executed": "2030-01-01 00:00 UTC", "settings": "full", "settings_detail": "full",
         "model": "m.gguf", "for_the_book": True, **provenance}
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code, 1):
        cell.execution_count = i
    code[0].outputs = [nbformat.v4.new_output("display_data", data={
        "text/html": f"<div>executed on <code>{p['machine']}</code>, commit <code>{p['commit'][:7]}</code></div>",
        "application/json": {"provenance": p}})]
    code[1].outputs = [nbformat.v4.new_output("stream", text="caches: L1d 32 KiB\n")]
    return nb


def _problems_of(tmp_path, nb) -> list[str]:
    path, source = _chapter_copy(tmp_path, notebook=nb)
    return build.problems(path, source)


def test_the_book_check_passes_an_execution_for_the_book(tmp_path):
    source = _chapter_copy(tmp_path)[1]
    assert _problems_of(tmp_path, _executed(source)) == []


PLANTS = {      # what is wrong with a committed notebook -> the words its problem says
    "clean": ("not executed", lambda nb: [c.update(outputs=[], execution_count=None)
                                          for c in nb.cells if c.cell_type == "code"]),
    "quick": ("not the book's execution", lambda nb: _set_provenance(nb, settings="quick")),
    "not for the book": ("outside `make book-execute`", lambda nb: _set_provenance(nb, for_the_book=False)),
    "unknown machine": ("no records", lambda nb: _set_provenance(nb, machine="cpu-nowhere-f0m0-avx2-1c")),
    "caption": ("does not name the machine", lambda nb: _code(nb)[0].outputs[0].data.update(
        {"text/html": "<div>executed somewhere</div>"})),
    "two runs": ("not one run from the top", lambda nb: _code(nb)[2].update(execution_count=40)),
    "error": ("raised ValueError", lambda nb: _code(nb)[1].outputs.append(
        nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[]))),
    "setup raised": ("cell 02-tiling-01 raised ImportError", lambda nb: _code(nb)[0].update(outputs=[
        nbformat.v4.new_output("error", ename="ImportError", evalue="no module", traceback=[])])),
    "machine path": ("names a path of the machine", lambda nb: _code(nb)[1].outputs.append(
        nbformat.v4.new_output("stream", text="loaded /home/someone/llm/models/m.gguf\n"))),
    "stale": ("stale", lambda nb: _code(nb)[1].update(source="x = 'not what the source says'")),
}


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _set_provenance(nb, **changes):
    _code(nb)[0].outputs[0].data["application/json"]["provenance"].update(changes)


@pytest.mark.parametrize("plant", PLANTS)
def test_the_book_check_fails_on_a_planted_notebook(plant, tmp_path):
    words, spoil = PLANTS[plant]
    nb = _executed(_chapter_copy(tmp_path)[1])
    spoil(nb)
    found = _problems_of(tmp_path, copy.deepcopy(nb))
    assert any(words in p for p in found), (plant, found)


def test_outputs_name_the_repository_files_from_its_root():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("stream", text=f"read {ROOT}/models/m.gguf\n"),
                    nbformat.v4.new_output("display_data", data={"text/markdown": f"`{ROOT}/profiles/x.json`",
                                                                 "image/png": "iVBORw0KGgo="})]
    nb.cells.append(cell)
    assert list(build.MACHINE_PATH.search(t) for _, t in build.output_texts(nb))[0]
    build.relative_paths(nb)
    assert cell.outputs[0].text == "read models/m.gguf\n"
    assert cell.outputs[1].data["text/markdown"] == "`profiles/x.json`"
    assert not any(build.MACHINE_PATH.search(t) for _, t in build.output_texts(nb))


def test_the_caption_says_whose_figures_a_page_shows(monkeypatch):
    from notebooks.nb import provenance
    p = {"machine": "amd-epyc-f25m17-avx512vnni-2c", "commit": "0123456789abcdef", "dirty": True, "code_hash": "ab",
         "executed": "2030-01-01 00:00 UTC", "settings": "full", "settings_detail": "full settings", "model": "m.gguf"}
    book = " ".join(provenance.sentences({**p, "for_the_book": True}))
    mine = " ".join(provenance.sentences({**p, "for_the_book": False}))
    assert book.startswith("These are the book's figures") and "make notebooks" in book
    assert mine.startswith("These are your machine's figures") and "make book" in mine
    assert "0123456 + uncommitted changes" in book and p["machine"] in book
    from notebooks.nb.settings import settings
    monkeypatch.setenv(provenance.BOOK_ENV, "1")
    assert provenance.provenance(settings(quick=True))["for_the_book"]
    monkeypatch.delenv(provenance.BOOK_ENV)
    assert not provenance.provenance(settings(quick=True))["for_the_book"]


def test_settings_follow_the_environment(monkeypatch):
    from notebooks import nb as notebook
    from stages import info
    from stages.registry import REPORT_PROMPT_TOKENS
    monkeypatch.setenv(notebook.QUICK_ENV, "1")
    quick = notebook.settings()
    monkeypatch.setenv(notebook.QUICK_ENV, "0")
    full = notebook.settings()
    assert quick.quick and not full.quick
    assert quick.prompt_tokens < full.prompt_tokens == REPORT_PROMPT_TOKENS
    assert full.n_for("naive") == info("naive").tokens.report
    assert full.n_for("quantized") == info("quantized").tokens.report
    assert all(quick.n_for(s) <= full.n_for(s) for s in ("naive", "tiling", "simd", "kv_cache"))


def test_missing_records_are_a_sentence_not_an_error(tmp_path):
    from notebooks import nb as notebook
    rec = notebook.recorded(results_root=tmp_path)
    assert rec.results is None and "make report" in rec.note
    assert rec.get("simd") is None
    assert notebook.find_records("cuda", results_root=tmp_path) == []


def test_fma_counts_and_hot_loop():
    from notebooks import nb as notebook
    asm = ("f:\n\tmovq %rdi, %rax\n.LBB0_1:\n\tvfmadd231ps %ymm1, %ymm2, %ymm3\n\tvfmadd231ps %zmm1, %zmm2, %zmm3\n"
           "\tvfmadd213ss %xmm1, %xmm2, %xmm3\n\tvmulss %xmm1, %xmm2, %xmm2\n\tjne .LBB0_1\n.LBB0_2:\n\tretq\n")
    counts = notebook.fma_counts(asm)
    assert counts["packed FMA, ymm (8 floats)"] == 1 and counts["packed FMA, zmm (16 floats)"] == 1
    assert counts["scalar FMA"] == 1 and counts["scalar mul / add"] == 1
    assert notebook.hot_loop(asm).startswith(".LBB0_1:")


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A folder with a kernel spec that runs this interpreter (put on JUPYTER_PATH), so the
    notebooks see this environment's packages whatever kernels the machine has installed."""
    d = tmp_path_factory.mktemp("jupyter")
    return d, build.kernel_spec(d)


@pytest.mark.timeout(3 * CELL_TIMEOUT_S, method="thread")       # a chapter, with a cold numba cache
@pytest.mark.parametrize("name", CHAPTERS)
def test_notebook_runs(name, monkeypatch, record_property, jupyter_path, default_model_path):
    run_chapter(name, True, CELL_TIMEOUT_S, monkeypatch, record_property, jupyter_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHAPTERS)
def test_notebook_runs_at_full_settings(name, monkeypatch, record_property, jupyter_path, default_model_path):
    """As a reader's `make notebooks` runs a chapter: the report's settings, not the quick ones
    (what only shows at full size, such as a prompt that fills pages, shows here)."""
    run_chapter(name, False, FULL_CELL_TIMEOUT_S, monkeypatch, record_property, jupyter_path)


def run_chapter(name, quick: bool, cell_timeout: int, monkeypatch, record_property, jupyter_path):
    """The chapter built from its source (not the committed notebook: the source is what the reader
    gets), run as a reader's own run: its caption must say the figures are that run's."""
    pytest.importorskip("ipykernel", reason="ipykernel is in requirements-test.txt")
    from nbclient import NotebookClient
    folder, kernel = jupyter_path
    monkeypatch.setenv("LLM_NOTEBOOK_QUICK", "1" if quick else "0")      # tiny prompts and generations, or not
    monkeypatch.setenv("MPLBACKEND", "Agg")            # figures are drawn, not displayed
    monkeypatch.setenv("JUPYTER_PATH", str(folder))
    monkeypatch.delenv(build.BOOK_ENV, raising=False)
    nb = build.build(NOTEBOOK_DIR / "src" / f"{name}.py")
    client = NotebookClient(nb, kernel_name=kernel, timeout=cell_timeout,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()                  # a fresh kernel, shut down after; a failing cell raises here
    record_property("notebook", (name + ("" if quick else " (full settings)"), time.perf_counter() - t0,
                                 slowest_cells(nb)))
    p = build.book_provenance(nb)
    assert p and not p["for_the_book"] and p["settings"] == ("quick" if quick else "full"), p
    assert "These are your machine's figures" in nb.cells[1].outputs[0].data["text/markdown"]
    last = [c for c in nb.cells if c.cell_type == "code"][-1]     # only "Your turn"'s text after it
    assert "findings.show()" in last.source, "a chapter's last code shows its findings"
    shown = "".join(o.get("data", {}).get("text/markdown", "") for o in last.outputs)
    assert "What we measured here" in shown
    check_findings(name, [o["data"]["application/json"] for o in last.outputs
                          if "application/json" in o.get("data", {})])


def slowest_cells(nb, n: int = 3) -> list:
    """(seconds, the cell's first line) of a run notebook's n slowest code cells, from the
    timestamps nbclient records: where a chapter's time goes (a cold compile shows here)."""
    from datetime import datetime
    out = []
    for cell in nb.cells:
        t = cell.get("metadata", {}).get("execution", {})
        if cell.cell_type == "code" and "iopub.execute_input" in t and "shell.execute_reply" in t:
            s = (datetime.fromisoformat(t["shell.execute_reply"].replace("Z", "+00:00"))
                 - datetime.fromisoformat(t["iopub.execute_input"].replace("Z", "+00:00"))).total_seconds()
            out.append((s, cell.source.strip().splitlines()[0][:70] if cell.source.strip() else ""))
    return sorted(out, reverse=True)[:n]


def finding_names(name: str) -> tuple[set, set]:
    """(names every run sets, names some run may set): `findings["..."] = ...` in the chapter's
    source, at the top level (every run) or inside an if/for/try (some runs)."""
    tree = ast.parse((NOTEBOOK_DIR / "src" / f"{name}.py").read_text())
    always, every = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "findings" \
                        and isinstance(t.slice, ast.Constant):
                    every.add(t.slice.value)
                    if node in tree.body:
                        always.add(t.slice.value)
    return always, every


def check_findings(name: str, shown: list):
    """The findings a chapter showed: one list, every name from the chapter's source (those set
    at its top level all there), every value a sentence with no NaN or infinity in it."""
    from notebooks.nb.text import NOT_A_NUMBER
    assert len(shown) == 1, f"{name}: the findings' JSON output is missing or repeated"
    found = shown[0]["findings"]
    always, every = finding_names(name)
    assert found and always, f"{name}: no findings"
    assert always <= set(found) <= every, (f"{name}: missing {sorted(always - set(found))}, "
                                           f"unknown {sorted(set(found) - every)}")
    for key, value in found.items():
        assert isinstance(value, str) and value.strip() and value != "None", f"{name}: finding '{key}' = {value!r}"
        assert not NOT_A_NUMBER.search(value), f"{name}: finding '{key}' = {value!r}"


def test_findings_refuse_what_is_not_a_measurement():
    from notebooks.nb.text import Findings
    f = Findings()
    f["decode"] = "12.5 ms/token, 3.0x the naive loop; informative, infinitely so"
    f["count"] = 3
    for bad in (float("nan"), f"{float('nan'):.1f} ms", f"{float('inf'):.0f}x", "-inf", "", None, True):
        with pytest.raises((ValueError, TypeError)):
            f["bad"] = bad
    with pytest.raises(ValueError, match="a finding needs a name"):
        f[""] = "x"
    with pytest.raises(ValueError, match="holds 'nan'"):
        f.update(other="nan ms")
    assert list(f) == ["decode", "count"]
    with pytest.raises(ValueError, match="no findings"):
        Findings().show()


def test_finding_names_are_read_from_the_source():
    always, every = finding_names("06_cuda")
    assert "this machine" in always and "PCIe per token" in always
    assert "recorded" in every - always                          # set inside an if
