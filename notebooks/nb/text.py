"""Showing things in a chapter: Markdown, tables, the code of a function as the module has it now
(never a pasted copy), kernels, images, and the list of findings that closes every chapter."""

from __future__ import annotations

import ast
import inspect
import re
import sys
import types
from pathlib import Path

from IPython.display import Image, Markdown, display

from app.inspect_gguf import human_size
from notebooks.nb.settings import model_path, rel, settings


def md(text: str):
    display(Markdown(text))


def _cell(value) -> str:
    """A table cell's text: a '|' inside it would end the cell and a line break the row (a chat
    template's Jinja holds both), so they are written escaped."""
    return str(value).replace("|", "\\|").replace("\n", "\\n")


def md_table(headers, rows) -> str:
    out = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def show_table(headers, rows):
    md(md_table(headers, rows))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', as `python -m app inspect` writes sizes."""
    return human_size(n)


def show_source(*objects, note: str = ""):
    """The code of functions or classes as the module has it now (never a pasted copy), with
    the file and line it comes from. A numba kernel shows its Python source."""
    parts = []
    for obj in objects:
        fn = getattr(obj, "py_func", obj)                   # a numba dispatcher -> its Python function
        lines, first = inspect.getsourcelines(fn)
        parts.append(f"`{rel(inspect.getsourcefile(fn))}`, line {first}:\n\n```python\n{''.join(lines).rstrip()}\n```")
    md((note + "\n\n" if note else "") + "\n\n".join(parts))


def show_file_excerpt(path, start_pattern: str, max_lines: int = 40, language: str = "c") -> bool:
    """A file from the first match of start_pattern (a regex, may span lines) to the end of that
    block (a line holding only '}') or max_lines. False if the file or the pattern is not there."""
    path = Path(path)
    if not path.exists():
        return False
    text = path.read_text()
    m = re.search(start_pattern, text, re.M)
    if m is None:
        return False
    lines = text.splitlines()
    start = text.count("\n", 0, m.start())
    end = start + 1
    while end < len(lines) and end - start < max_lines and lines[end - 1].rstrip() != "}":
        end += 1
    md(f"`{rel(path)}`, line {start + 1}:\n\n```{language}\n" + "\n".join(lines[start:end]) + "\n```")
    return True


def show_class_from_file(path, class_name: str, methods=None, note: str = "") -> bool:
    """show_source for a class (or some of its methods) read from the file without importing it."""
    src = class_source_from_file(path, class_name, methods)
    if src is None:
        return False
    what = f"{class_name}" + (f" ({', '.join(methods)})" if methods else "")
    md((note + "\n\n" if note else "") + f"`{rel(path)}`: {what}\n\n```python\n{src}\n```")
    return True


def class_source_from_file(path, class_name: str, methods=None) -> str | None:
    """A class (or some of its methods) from a file, read without importing it: a stage whose
    imports need hardware this machine lacks (PyCUDA) can still be read."""
    path = Path(path)
    if not path.exists():
        return None
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if not methods:
                return ast.get_source_segment(text, node)
            found = [ast.get_source_segment(text, n) for n in node.body
                     if isinstance(n, ast.FunctionDef) and n.name in methods]
            return "\n\n".join("    " + s for s in found) if found else None
    return None


def module_kernels(module) -> list:
    """The numba kernels a module defines itself (not those it imports), in file order."""
    out = []
    for obj in vars(module).values():
        fn = getattr(obj, "py_func", None)
        if fn is not None and getattr(fn, "__module__", None) == module.__name__:
            out.append(obj)
    return sorted(out, key=lambda d: d.py_func.__code__.co_firstlineno)


def find_kernels(module, name_part: str) -> list:
    """Numba kernels whose name contains name_part, defined in `module` or in a stages.* module
    it imports (a stage may keep its per-format kernels in a module of their own)."""
    modules = [module] + [v for v in vars(module).values()
                          if isinstance(v, types.ModuleType) and v.__name__.startswith("stages.")]
    for v in vars(module).values():
        owner = getattr(getattr(v, "py_func", None), "__module__", "")
        if owner.startswith("stages.") and owner in sys.modules and sys.modules[owner] not in modules:
            modules.append(sys.modules[owner])
    found = [k for m in modules for k in module_kernels(m) if name_part.lower() in k.__name__.lower()]
    return list(dict.fromkeys(found))


def show_image(path) -> bool:
    """A chart `make report` drew, if it is there."""
    path = Path(path)
    if not path.exists():
        return False
    display(Image(filename=str(path)))
    return True


# a number that is not one, as str() or an f-string writes it: nan, -inf, "nan ms", "infx" ("{r:.1f}x")
NOT_A_NUMBER = re.compile(r"(?<![\w.])[-+]?(nan|inf|infinity)x?(?![A-Za-z0-9_])", re.I)


class Findings(dict):
    """What a chapter measured, in the order it measured it; `show()` renders the list that
    closes the chapter (every figure in it computed by the cells above, none typed in).

    A finding is a name and a sentence (or a number). One that holds NaN or an infinity is a
    measurement that went wrong, not a finding: setting it raises, so the chapter fails where
    the figure was computed instead of printing "nan ms" at its end."""

    def __setitem__(self, key, value):
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"a finding needs a name, not {key!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"finding '{key}': a sentence or a number, not {type(value).__name__}")
        text = str(value)
        if not text.strip():
            raise ValueError(f"finding '{key}' is empty")
        bad = NOT_A_NUMBER.search(text)
        if bad:
            raise ValueError(f"finding '{key}' holds '{bad.group(0)}' (a measurement that failed): {text}")
        super().__setitem__(key, value)

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def show(self, title: str = "What we measured here"):
        """The list as Markdown, and the same findings as JSON beside it (tests read that)."""
        if not self:
            raise ValueError("no findings to show: a chapter ends with what it measured")
        cfg = settings()
        lines = [f"### {title}", "", f"_{cfg.describe()}; model `{model_path().name}`._", ""]
        lines += [f"- **{k}**: {v}" for k, v in self.items()]
        display({"text/markdown": "\n".join(lines),
                 "application/json": {"title": title, "findings": {k: str(v) for k, v in self.items()}}}, raw=True)
