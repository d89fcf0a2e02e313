"""The notebooks: built from their sources, committed without outputs, and every one of them runs
top to bottom in a fresh kernel with the quick settings (LLM_NOTEBOOK_QUICK=1), and in the slow
set (`make test-all`) at full settings, as a reader runs them. A cell that
raises fails its notebook's test, and so does a finding that is NaN or infinite (nb.Findings
refuses it where it is set) or a findings list that lacks what the chapter's source always sets.
Each notebook's time is printed at the end of the run.
"""

from __future__ import annotations

import ast
import importlib.util
import json
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


def _build_module():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_chapter_has_a_source_and_a_notebook():
    assert len(CHAPTERS) >= 9 and CHAPTERS[0] == "00_gguf_and_tokens"
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")) == CHAPTERS


def test_committed_notebooks_are_built_from_their_sources():
    stale = [p.name for p, text in _build_module().targets().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"{stale} differ from notebooks/src/: run `python notebooks/build.py`"


def test_committed_notebooks_carry_no_outputs():
    """Outputs are the reader's own measurements; the repository keeps the notebooks clean."""
    for path in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} has outputs"


def test_build_parses_percent_format():
    cells = _build_module().parse("header, not a cell\n# %% [markdown]\n# # Title\n#\n# text\n\n"
                                  "# %%\nx = 1\n# a comment stays code\n\n# %%\n\n")
    assert cells == [("markdown", "# Title\n\ntext"), ("code", "x = 1\n# a comment stays code")]


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


KERNEL = "llm-notebooks-test"


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A folder with a kernel spec that runs this interpreter (put on JUPYTER_PATH), so the
    notebooks see this environment's packages whatever kernels the machine has installed."""
    d = tmp_path_factory.mktemp("jupyter")
    spec = d / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": KERNEL, "language": "python"}))
    return d


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
    pytest.importorskip("ipykernel", reason="ipykernel is in requirements-test.txt")
    from nbclient import NotebookClient
    monkeypatch.setenv("LLM_NOTEBOOK_QUICK", "1" if quick else "0")      # tiny prompts and generations, or not
    monkeypatch.setenv("MPLBACKEND", "Agg")            # figures are drawn, not displayed
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=cell_timeout,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()                  # a fresh kernel, shut down after; a failing cell raises here
    record_property("notebook", (name + ("" if quick else " (full settings)"), time.perf_counter() - t0,
                                 slowest_cells(nb)))
    last = nb.cells[-1]
    assert last.cell_type == "code" and "findings.show()" in last.source, "a chapter ends with its findings"
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
