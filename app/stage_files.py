"""Which files each stage brings, and which it reads: the stage tower, from the source.

A stage is its module (stages/<name>.py) and the files the registry says it brings
(stages/registry.py, `kernels`). Reading stage N's files must show stage N's lesson and what it
inherits, nothing of a later stage: the files its module imports, followed import by import (an
AST walk: nothing is imported), must all belong to the stage, to a stage it builds on, or to no
stage at all (a package's __init__). `python -m app stages` prints the counts; tests/test_layers.py
holds the rule.

    own_files(stage)      its module and the files it brings, relative to the repository
    reads(stage)          every file under stages/ its module imports, directly or not, and the
                          files it brings
    foreign(stage)        those of reads() that another stage brings, not one it builds on
    lines(paths)          their lines, in all
"""

from __future__ import annotations

import ast
from pathlib import Path

from stages.registry import REGISTRY

ROOT = Path(__file__).resolve().parent.parent


def own_files(stage: str) -> list[str]:
    s = REGISTRY[REGISTRY[stage].variant_of or stage]           # a variant: its stage's files
    return [s.path] + [f"stages/{k}" for k in s.kernels]


def ancestry(stage: str) -> list[str]:
    """The stage and every stage it builds on, itself first."""
    chain = [stage]
    while REGISTRY[chain[-1]].builds_on is not None:
        chain.append(REGISTRY[chain[-1]].builds_on)
    return chain


def _imports(path: Path, root: Path) -> set[str]:
    """The files under stages/ (relative to root) that the module at `path` imports anywhere."""
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if not name.startswith("stages"):
                continue
            rel = Path(*name.split("."))
            for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
                if (root / candidate).is_file():
                    found.add(candidate.as_posix())
    return found


def reads(stage: str, root: Path = ROOT) -> set[str]:
    seen, todo = set(), own_files(stage)
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += _imports(root / f, root) if f.endswith(".py") else []
    return seen


def foreign(stage: str, root: Path = ROOT) -> list[str]:
    """Files the stage reads that belong to another stage than it or those it builds on."""
    allowed = {f for s in ancestry(stage) for f in own_files(s)}
    owner = {f: s for s in REGISTRY for f in own_files(s)}
    return sorted(f for f in reads(stage, root) if f in owner and f not in allowed)


def lines(paths, root: Path = ROOT) -> int:
    return sum(len((root / p).read_text(encoding="utf-8").splitlines()) for p in paths)
