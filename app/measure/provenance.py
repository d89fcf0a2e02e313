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
import json
import os
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


# code_only tokenizes in Python: 0.7 s for the measured files, paid by every process that writes a
# record or resolves the stage 'fastest'. Its results are kept here by the sha256 of the file's bytes,
# so an edited file is tokenized again and an unchanged one never is.
CODE_ONLY_MEMO = ROOT / "build" / "code_only.json"


def _load_memo(path: Path) -> dict:
    try:
        memo = json.loads(path.read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_memo(path: Path, memo: dict):
    """Written whole and renamed into place: a process reading it meanwhile sees the old one or the new."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        with open(part, "w") as f:                 # a cache, not a record (app/measure/protocol.py writes those)
            json.dump(memo, f)
        part.replace(path)
    except OSError:
        pass                                        # a read-only checkout: computed again next time


def code_hash(root: Path = ROOT, memo_path: Path | None = CODE_ONLY_MEMO) -> str:
    """16 hex digits of sha256 over the measured files' paths and code."""
    h = hashlib.sha256()
    memo = _load_memo(memo_path) if memo_path else {}
    used = {}
    for path in measured_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        raw = path.read_bytes()
        if path.suffix == ".py":
            key = hashlib.sha256(raw).hexdigest()
            code = used[key] = memo[key] if key in memo else code_only(raw.decode("utf-8"))
        else:
            code = raw.decode("utf-8")
        h.update(code.encode() + b"\0")
    if memo_path and used.keys() != memo.keys():
        _save_memo(memo_path, used)                 # only the files as they are now
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
