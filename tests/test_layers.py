"""The project's structure holds: imports go down the layers only (engine <- stages <- application
<- scripts, notebooks), no module import cycle anywhere, and the checks themselves can fail."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import layers

ROOT = Path(__file__).resolve().parent.parent
MAX_STAGE_DOCSTRING_LINES = 40


def test_imports_go_down_the_layers_only():
    assert layers.violations(ROOT) == []


def test_no_import_cycle():
    assert layers.cycles(ROOT) == []


def test_the_checks_catch_a_lower_layer_importing_a_higher_one_and_a_cycle(tmp_path):
    def write(name, text):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("common/__init__.py", "")
    write("common/model.py", "def f():\n    from app import cli\n")                # engine -> application
    write("app/__init__.py", "")
    write("app/cli.py", "")
    write("app/report/report.py", "import stages.naive\n")                    # allowed: down
    write("stages/kv_cache.py", "from app.cli import main\n")                 # stages -> application
    write("stages/__init__.py", "")
    write("stages/naive.py", "from common.model import f\nfrom stages import tiling\n")
    write("stages/tiling.py", "from . import naive\n")                              # a cycle, relative
    write("scripts/x.py", "from notebooks import nb\n")                            # sideways
    write("notebooks/nb/__init__.py", "")
    assert layers.violations(tmp_path) == [
        "common.model imports app.cli (application is not below engine)",
        "scripts.x imports notebooks.nb (notebooks is not below scripts)",
        "stages.kv_cache imports app.cli (application is not below stages)",
    ]
    assert layers.cycles(tmp_path) == [["stages.naive", "stages.tiling"]]


def test_stage_docstrings_teach_in_a_screenful():
    """A stage file's docstring says what changes, why, and what limits it; the figures live in
    the records, so it stays short."""
    for path in sorted((ROOT / "stages").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert len(doc.splitlines()) <= MAX_STAGE_DOCSTRING_LINES, f"{path.name}: {len(doc.splitlines())} lines"


def test_no_kernel_takes_more_than_twelve_positional_parameters(tmp_path):
    assert layers.wide_functions(ROOT) == []
    planted = tmp_path / "stages" / "kernels" / "k.py"
    planted.parent.mkdir(parents=True)
    wide = ", ".join(f"a{i}" for i in range(13))
    eleven = ", ".join(f"a{i}" for i in range(11))
    twelve = ", ".join(f"a{i}" for i in range(12))
    planted.write_text(f"def ok(a, b, *, c=1):\n    pass\n\n\ndef wide({wide}):\n    pass\n\n\n"
                       f"def typer_ok(typingctx, {eleven}):\n    pass\n\n\n"
                       f"def typer_wide(typingctx, {twelve}):\n    pass\n")
    assert layers.wide_functions(tmp_path) == ["stages/kernels/k.py:wide (13)", "stages/kernels/k.py:typer_wide (13)"]


def test_importing_a_stage_leaves_numbas_configuration_alone():
    """The entry points set numba's threading layers and cache folder (app.configure_numba); a
    stage module, imported on its own, changes neither."""
    import subprocess
    import sys
    code = ("import numba; a = numba.config.THREADING_LAYER_PRIORITY; c = numba.config.CACHE_DIR; "
            "import stages.fused, stages.repack; "
            "assert numba.config.THREADING_LAYER_PRIORITY == a and numba.config.CACHE_DIR == c, 'changed'")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("NUMBA_")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-500:]


def test_no_function_of_the_server_is_longer_than_eighty_lines(tmp_path):
    assert layers.long_functions(ROOT) == []
    planted = tmp_path / "app" / "serve" / "s.py"
    planted.parent.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(79))          # with its def: 80 lines, the most allowed
    method = body.replace("    x", "        x")
    planted.write_text(f"def ok():\n{body}\n\nclass C:\n    async def long(self):\n{method}        pass\n")
    assert layers.long_functions(tmp_path) == ["app/serve/s.py:long (81)"]


def test_the_scheduler_only_decides_it_imports_no_threading(tmp_path):
    """app/serve/scheduler.py plans steps; the thread, the lock and the queues between threads
    are the engine loop's (app/serve/engine_loop.py)."""
    assert not layers.imports_module(ROOT / "app" / "serve" / "scheduler.py", "threading")
    assert layers.imports_module(ROOT / "app" / "serve" / "engine_loop.py", "threading"), "the twin: the loop does"
    for i, text in enumerate(["import threading\n", "from threading import Condition\n",
                              "def f():\n    import threading.local\n", "import os, threading as t\n"]):
        (tmp_path / f"s{i}.py").write_text(text)
        assert layers.imports_module(tmp_path / f"s{i}.py", "threading"), text
    (tmp_path / "ok.py").write_text("import threadingx\nfrom . import threading\n")
    assert not layers.imports_module(tmp_path / "ok.py", "threading")


def test_no_stage_reads_a_later_stages_files():
    """The stage tower holds inside stages/kernels/ too: a stage's files import only its own and
    those of the stages it builds on (stages/registry.py, `kernels`), so reading stage N shows stage
    N's lesson and what it inherits; and every file under stages/ belongs to one stage (or is a
    package's __init__), so none escapes the rule."""
    from app import stage_files
    from stages.registry import REGISTRY
    assert {s: stage_files.foreign(s) for s in REGISTRY} == {s: [] for s in REGISTRY}
    owned = [f for s in REGISTRY for f in stage_files.own_files(s) if REGISTRY[s].variant_of is None]
    assert len(owned) == len(set(owned)), "a file brought by two stages"
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "stages").rglob("*") if p.suffix in (".py", ".cu")
             and "__pycache__" not in p.parts and p.name != "__init__.py"} - {"stages/registry.py"}
    assert files - set(owned) == set(), "files under stages/ that no stage brings (stages/registry.py, kernels)"
    lines = {s: stage_files.lines(stage_files.reads(s)) for s in ("fused", "repack", "prefill")}
    assert lines["fused"] < lines["repack"] < lines["prefill"], lines


def test_the_tower_check_catches_a_stage_reading_a_later_stages_file(tmp_path, monkeypatch):
    """Planted: the fused stage's layer stack importing the prefill stage's pair kernel (as it once
    did), in a copy of stages/."""
    import shutil

    from app import stage_files
    shutil.copytree(ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    stack = tmp_path / "stages" / "kernels" / "layer_stack.py"
    stack.write_text("from stages.kernels.pair_gemm import pair_gemm\n" + stack.read_text())
    assert stage_files.foreign("fused", tmp_path) == ["stages/kernels/pair_gemm.py", "stages/kernels/repacked.py"]
    assert stage_files.foreign("fused") == []
    assert "stages/kernels/pair_gemm.py" in stage_files.foreign("repack", tmp_path)
    assert stage_files.foreign("prefill", tmp_path) == []
