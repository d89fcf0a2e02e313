"""The layer rule, read from the source (an AST walk: nothing is imported, function-local imports
count as much as module-level ones).

    engine        common/ (GGUF, block formats, tokenizer, graph, op surface, generation, reference)
    stages        stages/ (the backends and their kernels)
    application   app/ (CLI, chat, server, harness, report, ...)
    top           scripts/, notebooks/ (the chapters' sources and their helpers) and exercises/
                  (the course's exercises, their checks and experiments)
    tests         tests/

A module's layer is its top folder, nothing else. A module may import from its own layer and
the layers below it, never above; scripts, notebooks and exercises share a layer but do not
import each other. And no import cycle between modules
(a package importing its own submodules is not one).
"""

from __future__ import annotations

import ast
from pathlib import Path

FOLDERS = ("common", "stages", "app", "scripts", "notebooks", "exercises", "tests")
RANK = {"engine": 0, "stages": 1, "application": 2, "scripts": 3, "notebooks": 3, "exercises": 3, "tests": 4}


LAYER_OF_FOLDER = {"common": "engine", "stages": "stages", "app": "application",
                   "scripts": "scripts", "notebooks": "notebooks", "exercises": "exercises", "tests": "tests"}


def layer(module: str) -> str:
    return LAYER_OF_FOLDER[module.split(".")[0]]


def modules(root: Path) -> dict[str, Path]:
    """{dotted name: file} of every .py file under the project's folders."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if ".ipynb_checkpoints" in path.parts or "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(module: str, path: Path, known) -> set[str]:
    """The project modules `module` imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def add(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:                 # a submodule by name, else something of base's
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def violations(root: Path) -> list[str]:
    """'a imports b (application above engine)' for every import against the rule."""
    out = []
    for module, targets in sorted(graph(root).items()):
        mine = layer(module)
        for target in sorted(targets):
            theirs = layer(target)
            if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] and theirs != mine):
                out.append(f"{module} imports {target} ({theirs} is not below {mine})")
    return out


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), packages importing their
    own submodules excepted."""
    g = graph(root)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return [c for c in found if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]


def wide_functions(root: Path, folder: str = "stages/kernels", limit: int = 12) -> list[str]:
    """'file:function (n)' for every function under `folder` with more than `limit` positional
    parameters (a kernel that takes many arrays takes them as named records instead; an
    @intrinsic's typing context counts too: it is a parameter a reader holds like the others)."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args
                n = len(params)
                if n > limit:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.name} ({n})")
    return out


def long_functions(root: Path, folder: str = "app/serve", limit: int = 80) -> list[str]:
    """'file:function (n)' for every function under `folder` longer than `limit` lines, its
    docstring, comments and nested functions included (a function a reader holds in their head)."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.name} ({n})")
    return out


def imports_module(path: Path, name: str) -> bool:
    """Whether the file imports module `name` (or something from it) anywhere."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name == name or a.name.startswith(name + ".") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                node.module == name or node.module.startswith(name + ".")):
            return True
    return False
