"""The stage registry (stages/registry.py) is the one source of stage facts, and it tells the
truth about the backends; everything that lists stages reads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.report import charts
from common.backend import Backend
from stages import REGISTRY, STAGES, VARIANTS, backend_class, info

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", list(REGISTRY))
def test_an_entry_matches_its_backend(name):
    s = info(name)
    cls = backend_class(name)
    assert cls.name == name
    assert (ROOT / s.path).exists() and (ROOT / "notebooks" / f"{s.chapter}.ipynb").exists()
    keeps_kv = cls.new_kv_cache is not Backend.new_kv_cache
    assert keeps_kv == s.kv_cache, f"{name}: the registry says kv_cache={s.kv_cache}"
    parent = s.variant_of or s.builds_on
    if parent and not s.gpu:           # the GPU stage carries its parent's lesson in its kernels
        assert issubclass(cls, backend_class(parent)), f"{name} should build on {parent}"


def test_numbers_follow_the_order_and_variants_stand_apart():
    numbers = [info(s).number for s in STAGES]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert not set(VARIANTS) & set(STAGES)
    for v in VARIANTS:
        assert info(v).variant_of in STAGES
    assert all(info(s).builds_on in (None, *STAGES) for s in STAGES)


def test_registry_runs_without_any_package():
    """`make help` prints the stage table before anything is installed."""
    p = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "stages" / "registry.py")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for s in STAGES:
        assert f" {s} " in p.stdout
    assert "stages/registry.py" in (ROOT / "Makefile").read_text()


def test_readme_stage_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    block = text.split(charts.STAGES_BEGIN)[1].split(charts.STAGES_END)[0]
    assert block == "\n" + charts.stages_table(), "run `make report` (or --draw-only) to regenerate it"


def test_the_op_page_is_drawn_from_the_classes():
    """profiles/ops_by_stage.md (the op grid, off the README's first screen) is what the classes say."""
    page = (ROOT / "profiles" / charts.OPS_PAGE).read_text()
    assert page == charts.ops_page() and page.endswith(charts.ops_table()), \
        "run `make report args=--draw-only` to regenerate it"
    assert f"profiles/{charts.OPS_PAGE}" in (ROOT / "README.md").read_text()


def test_op_owners_reads_overrides_and_inheritance_from_the_classes():
    from common.backend import Backend
    from stages import op_owners

    class First(Backend):
        def matmul(self, x, w):
            return x

    class Second(First):
        def attention(self, *a):
            return None

    owners = op_owners({"first": First, "second": Second})
    assert owners["matmul"] == {"first": "first", "second": "first"}          # inherited, and from where
    assert owners["attention"] == {"first": None, "second": "second"}         # the surface's default, then own
    real = op_owners()
    assert real["matmul"]["tiling"] == "tiling" and real["matmul"]["kv_cache"] == "simd"
    assert real["attention"]["int8"] == "threads" and real["forward_layers"]["fused"] == "fused"


def test_every_chapter_of_a_stage_is_listed_in_the_notebooks_readme():
    readme = (ROOT / "notebooks" / "README.md").read_text()
    for s in STAGES:
        assert f"{info(s).chapter}.ipynb" in readme, info(s).chapter


def test_the_cli_offers_every_stage():
    p = subprocess.run([sys.executable, "-m", "app", "run", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0
    for s in STAGES:
        assert s in p.stdout


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_file_opens_with_its_registry_label(name):
    """'Stage 6, cuda: ...': the number a reader sees in the file is the registry's."""
    import ast
    doc = ast.get_docstring(ast.parse((ROOT / info(name).path).read_text())) or ""
    assert doc.startswith(info(name).label + ":"), doc.splitlines()[0] if doc else "no docstring"
