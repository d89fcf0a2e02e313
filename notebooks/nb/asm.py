"""The assembly LLVM generated for a numba kernel, and what to look for in it: packed FMAs by
register width, scalar ones, and the hot loop."""

from __future__ import annotations

import re
from collections import Counter

from numba import njit


def kernel_asm(dispatcher, *args) -> str:
    """x86/ARM assembly of a numba kernel, compiled now with its own options: numba cannot show
    the assembly of a kernel it loaded from its on-disk cache."""
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    fn = njit(**options)(dispatcher.py_func)
    fn(*args)
    return "\n".join(fn.inspect_asm().values())


PACKED_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ps\b[^\n]*?%?([xyz]mm)\d+")
SCALAR_FMA = re.compile(r"\bvfn?m(?:add|sub)\d+ss\b")
SCALAR_MUL_ADD = re.compile(r"\bv?(?:mul|add)ss\b")


def fma_counts(asm: str) -> dict:
    """Float multiply-add instructions in x86 assembly: packed FMAs by register width (xmm 4,
    ymm 8, zmm 16 floats), scalar FMAs, and scalar multiplies and adds (one float each)."""
    packed = Counter(PACKED_FMA.findall(asm))
    return {"packed FMA, zmm (16 floats)": packed.get("zmm", 0), "packed FMA, ymm (8 floats)": packed.get("ymm", 0),
            "packed FMA, xmm (4 floats)": packed.get("xmm", 0), "scalar FMA": len(SCALAR_FMA.findall(asm)),
            "scalar mul / add": len(SCALAR_MUL_ADD.findall(asm))}


def hot_loop(asm: str, max_lines: int = 40) -> str:
    """The basic block with the most floating-point multiply-adds (packed or scalar, or plain
    multiplies and adds): the inner loop, in practice."""
    blocks, current = [], []
    for line in asm.splitlines():
        if re.match(r"^\.?L\w+:", line.strip()) and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    work = re.compile(r"\bv?(?:fn?m(?:add|sub)\d+|mul|add)[sp]s\b")
    best = max(blocks, key=lambda b: sum(bool(work.search(x)) for x in b))
    text = "\n".join(x for x in best if x.strip())
    lines = text.splitlines()
    return "\n".join(lines[:max_lines] + ([f"    ... ({len(lines) - max_lines} more lines)"]
                                          if len(lines) > max_lines else []))
