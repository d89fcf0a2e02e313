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
