"""`python -m app inspect MODEL`: what is inside a GGUF file."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np

from common.gguf import GGUFFile


def _short(value, limit: int = 8):
    """Metadata values for display: long arrays abbreviated, numpy made JSON-friendly."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        if len(value) > limit:
            return [_short(v) for v in value[:limit]] + [f"... ({len(value)} items)"]
        return [_short(v) for v in value]
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + f"... ({len(value)} chars)"
    return value


def summary(g: GGUFFile) -> dict:
    by_type = Counter()
    bytes_by_type = Counter()
    params = 0
    for t in g.tensors.values():
        by_type[t.type_name] += 1
        bytes_by_type[t.type_name] += t.nbytes
        params += t.n_elements
    return {
        "path": g.path,
        "file_size": g.file_size,
        "version": g.version,
        "alignment": g.alignment,
        "data_offset": g.data_offset,
        "architecture": g.architecture,
        "name": g.get("general.name", ""),
        "parameters": params,
        "type_mix": {k: {"tensors": by_type[k], "bytes": bytes_by_type[k]} for k in sorted(by_type)},
        "metadata": {k: {"type": g.metadata_types[k].name, "value": _short(v)} for k, v in g.metadata.items()},
        "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type_name, "offset": t.offset,
                     "bytes": t.nbytes} for t in g.tensors.values()],
    }


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def main(path, as_json: bool = False, max_tensors: int | None = None):
    with GGUFFile(path) as g:
        s = summary(g)
    if as_json:
        print(json.dumps(s, indent=1))
        return
    print(f"{os.path.basename(s['path'])}: GGUF v{s['version']}, {human_size(s['file_size'])}, "
          f"{s['architecture']} '{s['name']}', {s['parameters'] / 1e6:.1f} M parameters")
    print(f"alignment {s['alignment']}, data section at byte {s['data_offset']}\n")
    print("metadata:")
    width = max(len(k) for k in s["metadata"]) if s["metadata"] else 0
    for k, v in s["metadata"].items():
        print(f"  {k:<{width}}  {v['type']:<7} {v['value']}")
    print(f"\ntensors ({len(s['tensors'])}):")
    shown = s["tensors"] if max_tensors is None else s["tensors"][:max_tensors]
    for t in shown:
        print(f"  {t['name']:<28} {str(tuple(t['shape'])):<16} {t['type']:<6} {human_size(t['bytes']):>10}")
    if len(shown) < len(s["tensors"]):
        print(f"  ... {len(s['tensors']) - len(shown)} more (--all to list them)")
    print("\ntype mix:")
    for k, v in s["type_mix"].items():
        print(f"  {k:<6} {v['tensors']:>4} tensors  {human_size(v['bytes']):>10}")
