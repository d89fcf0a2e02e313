"""The stages: one module per optimization, each a Backend subclass that inherits from the
stage it builds on and overrides only what its optimization changes. Their order, numbers,
lessons and default settings are in stages/registry.py.

    engine = load("simd", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = engine.forward(tokens, start_pos=0)        # float32 [len(tokens), n_vocab]
"""

from __future__ import annotations

import importlib
import importlib.util

from common.backend import FLOAT_TOLERANCE, Backend
from common.gguf import GGUFFile
from common.model import LlamaModel
from stages.registry import REGISTRY, STAGES, VARIANTS, Stage

__all__ = ["STAGES", "VARIANTS", "REGISTRY", "Stage", "StageError", "info", "load", "backend_class",
           "unavailable_reason", "runnable_stages", "SURFACE", "op_owners", "logit_tolerance", "FLOAT_TOLERANCE"]



class StageError(ValueError):
    """An unknown stage, or one this machine cannot run; the message says why."""


def info(stage: str) -> Stage:
    """The registry's entry for a stage or a variant."""
    if stage not in REGISTRY:
        raise StageError(f"unknown stage '{stage}'; the stages are: {', '.join(STAGES)}"
                         + (f" (variants: {', '.join(VARIANTS)})" if VARIANTS else ""))
    return REGISTRY[stage]


def backend_class(stage: str):
    s = info(stage)
    return getattr(importlib.import_module(s.module), s.backend)


def unavailable_reason(stage: str) -> str | None:
    """None if this machine can run the stage, else a sentence saying what is missing."""
    return backend_class(stage).unavailable_reason()


def logit_tolerance(stage: str) -> float:
    """The bound a stage's logits keep to the float64 reference (common/reference.py): its
    backend's, inherited from the stage it builds on unless it rounds differently."""
    return backend_class(stage).logit_tolerance


def runnable_stages() -> list[str]:
    return [s for s in STAGES if unavailable_reason(s) is None]


def load(stage: str, model, n_ctx: int | None = None, threads: int | None = None,
         progress: bool = False) -> LlamaModel:
    """A LlamaModel bound to the stage's backend (see common/model.py); `model` is a GGUF
    file's path, or the file already open (GGUFFile), which is then not read again."""
    reason = unavailable_reason(stage)
    if reason:
        raise StageError(f"stage '{stage}' cannot run here: {reason}")
    backend = backend_class(stage)(threads=threads)
    gguf = model if isinstance(model, GGUFFile) else GGUFFile(model)
    model = LlamaModel(gguf, backend, n_ctx=n_ctx, progress=progress)
    model.stage = stage
    return model


# What a stage may change: every op and hook the op surface declares (common/backend.py), in
# the order it declares them.
SURFACE = [k for k in vars(Backend) if not k.startswith("_") and k != "name"]


def op_owners(classes: dict | None = None) -> dict[str, dict[str, str | None]]:
    """{op: {stage: the stage whose class defines the op this stage runs}}: the stage itself
    where it overrides the op, the stage it inherits it from otherwise, None for the op
    surface's own default (common/backend.py). Read from the classes ({stage: Backend
    subclass}; default: the registry's stages), not from a list."""
    classes = classes or {name: backend_class(name) for name in STAGES}
    owner_of = {cls: name for name, cls in classes.items()}
    table = {}
    for op in SURFACE:
        row = {}
        for name, cls in classes.items():
            definer = next(k for k in cls.__mro__ if op in vars(k))
            row[name] = owner_of.get(definer)
        table[op] = row
    return table
