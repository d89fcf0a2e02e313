"""What code a measurement ran: every record carries it, every table and chart says it.

    commit      the git commit checked out (None outside a git checkout)
    dirty       whether the measured code (stages/, common/) had uncommitted changes
    code_hash   sha256 of the measured code itself: every .py and .cu file of stages/ and of the
                engine (common/), by path and content, Python files without
                their comments and docstrings (prose does not change what runs). Two records with
                the same hash measured the same kernels and graph, whatever the commit says.

`make report` compares the records it draws with the code checked out now and says when they
were measured with other code.
"""

from __future__ import annotations

import ast
import hashlib
import io
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

from app import ROOT

MEASURED_CODE = ("stages", "common")       # what a stage's figures depend on


def measured_files(root: Path = ROOT) -> list[Path]:
    files = []
    for top in MEASURED_CODE:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".cu") and "__pycache__" not in path.parts:
                files.append(path)
    return files


def code_only(source: str) -> str:
    """A Python file's tokens without comments and docstrings, one per line: what runs."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add((first.lineno, first.col_offset))
    keep = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL) or (tok.type == tokenize.STRING and tok.start in docstrings):
            continue
        keep.append(f"{tok.type} {tok.string}")
    return "\n".join(keep)


def code_hash(root: Path = ROOT) -> str:
    """16 hex digits of sha256 over the measured files' paths and code."""
    h = hashlib.sha256()
    for path in measured_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        text = path.read_text(encoding="utf-8")
        h.update((code_only(text) if path.suffix == ".py" else text).encode() + b"\0")
    return h.hexdigest()[:16]


def _git(*args, root: Path = ROOT) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


@lru_cache(maxsize=1)
def provenance() -> dict:
    """{'commit', 'dirty', 'code_hash'} of the code checked out now."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", *MEASURED_CODE) if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None, "code_hash": code_hash()}


def describe(records: list[dict]) -> str:
    """One phrase naming the code the records measured: 'commit 1a2b3c4 (code 5d6e...)', with
    the stages that differ named, and 'uncommitted changes' where a record says so."""
    groups: dict[tuple, list[str]] = {}
    for r in records:
        p = r.get("provenance") or {}
        key = ((p.get("commit") or "")[:7] or "unknown", p.get("code_hash") or "unknown", bool(p.get("dirty")))
        groups.setdefault(key, []).append(r.get("row") or r.get("stage", "?"))
    if not groups:
        return "no records"

    def one(key):
        commit, code, dirty = key
        return f"commit {commit}{' + uncommitted changes' if dirty else ''} (code {code})"
    if len(groups) == 1:
        return one(next(iter(groups)))
    return "; ".join(f"{', '.join(names)}: {one(key)}" for key, names in groups.items())


def stale(records: list[dict]) -> list[str]:
    """The records (by stage or row) whose code differs from the code checked out now."""
    now = provenance()["code_hash"]
    return [r.get("row") or r.get("stage", "?") for r in records
            if (r.get("provenance") or {}).get("code_hash") != now]
