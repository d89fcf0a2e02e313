"""A draft model made from the model itself: its first few layers.

Speculative decoding with a draft model (`python -m app run --spec draft --model-draft FILE`)
wants a second, cheaper model with the same vocabulary. Where no smaller model of the family is
at hand, the model's own first layers are one: the same embedding, the same output matrix and
final norm, the same tokenizer, and a fraction of the layers in between (the layers' weights are
copied as the file stores them, no rounding). It guesses worse than a trained small model, and
costs about n_layers / block_count of a step.

    first_layers("models/SmolLM2-135M-Instruct.Q4_1.gguf", 6)
        -> models/draft/SmolLM2-135M-Instruct.Q4_1.first6.gguf (written once, then reused)
"""

from __future__ import annotations

import re
from pathlib import Path

from app.models import MODELS_DIR, resolve
from common.gguf import GGUFError, GGUFFile, GGUFWriter

LAYER = re.compile(r"^blk\.(\d+)\.")


def first_layers(model, n_layers: int, out_dir: Path | None = None) -> Path:
    """The model cut to its first n_layers layers (1 <= n_layers <= its block count)."""
    model = resolve(model)
    out = Path(out_dir or MODELS_DIR / "draft") / f"{model.stem}.first{n_layers}.gguf"
    if out.exists() and out.stat().st_mtime >= model.stat().st_mtime:
        return out
    with GGUFFile(model) as g:
        arch = g.architecture
        total = int(g.metadata.get(f"{arch}.block_count", 0))
        if not 1 <= n_layers <= total:
            raise GGUFError(f"a draft of {n_layers} layers from {model.name}, which has {total}: "
                            f"give 1..{total}")
        out.parent.mkdir(parents=True, exist_ok=True)
        w = GGUFWriter(out)                  # a .part file, renamed when complete
        for key, value in g.metadata.items():
            if key == "general.alignment":
                continue
            if key == f"{arch}.block_count":
                value = n_layers
            w.add(key, value, g.metadata_types[key], g.array_types.get(key))
        w.add("general.draft_of", f"{model.name}: its first {n_layers} of {total} layers, copied as stored")
        for name, t in g.tensors.items():
            m = LAYER.match(name)
            if m and int(m.group(1)) >= n_layers:
                continue
            w.add_tensor(name, t.data, t.ggml_type, shape=t.shape)
        w.write()
    return out
