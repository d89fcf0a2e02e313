"""One name per thing: a module-level constant name (UPPER_CASE) means one value across common/ and
stages/, written the same way wherever it is defined, so that a reader who has met a name once
knows it everywhere. Two names are a stage's own by design: LOGIT_TOLERANCE (a stage that rounds
differently declares its own, which its backend's logit_tolerance carries; later stages inherit it)
and STACK (each steps module's layer stack: the one before it with that stage's steps swapped in)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE_FACTS = {"LOGIT_TOLERANCE", "STACK"}


def constants(source: str) -> dict[str, str]:
    """{NAME: the source of its value} for the module-level UPPER_CASE names a module assigns
    (tuple targets unpacked: `A, B = 1, 2`)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                pairs += list(zip(target.elts, value.elts))
            elif isinstance(target, ast.Name) and target.id.isupper() and len(target.id) > 1:
                out[target.id] = ast.unparse(value)
    return out


def clashes(modules: dict[str, str]) -> dict[str, dict[str, str]]:
    """{NAME: {module: value}} for every constant name given different values in different modules."""
    seen = defaultdict(dict)
    for name, source in modules.items():
        for const, value in constants(source).items():
            seen[const][name] = value
    return {c: where for c, where in seen.items()
            if c not in STAGE_FACTS and len(set(where.values())) > 1}


def _sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text()
            for folder in ("common", "stages") for p in sorted((ROOT / folder).rglob("*.py"))}


def test_one_value_per_constant_name():
    found = clashes(_sources())
    assert not found, "constant names with more than one value (give each thing its own name): " + "; ".join(
        f"{c}: " + ", ".join(f"{m} = {v}" for m, v in where.items()) for c, where in found.items())


def test_a_name_with_two_values_is_caught():
    """Planted: the name PREFILL_ROWS meaning 64 in one module and 16 in another (as it once did),
    and a tuple assignment giving F32 a second meaning; the same value twice, and a stage fact,
    pass."""
    planted = {"a.py": "PREFILL_ROWS = 64\nF32, F16 = 0, 1\nLOGIT_TOLERANCE = 2.0\nGROUP = 8\n",
               "b.py": "PREFILL_ROWS = 16\nimport x\nF32 = x.FloatType()\nLOGIT_TOLERANCE = 5e-3\nGROUP = 8\n"}
    assert set(clashes(planted)) == {"PREFILL_ROWS", "F32"}
    assert clashes({**_sources(), **planted}).keys() >= {"PREFILL_ROWS", "F32"}
