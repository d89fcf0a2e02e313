"""The stages: one module per optimization, each a Backend subclass that inherits from the
stage it builds on and overrides only what its optimization changes. Their order, numbers,
lessons and default settings are in stages/registry.py.

    engine = load("simd", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = engine.forward(tokens, start_pos=0)        # float32 [len(tokens), n_vocab]
"""

from __future__ import annotations

import importlib
import importlib.util

from common.gguf import GGUFFile
from common.model import LlamaModel
from stages.registry import REGISTRY, STAGES, VARIANTS, Stage

__all__ = ["STAGES", "VARIANTS", "REGISTRY", "Stage", "StageError", "info", "load", "backend_class",
           "unavailable_reason", "runnable_stages"]


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
    check = getattr(backend_class(stage), "unavailable_reason", None)
    return check() if check else None


def runnable_stages() -> list[str]:
    return [s for s in STAGES if unavailable_reason(s) is None]


def load(stage: str, model_path, n_ctx: int | None = None, threads: int | None = None,
         progress: bool = False) -> LlamaModel:
    """A LlamaModel bound to the stage's backend (see common/model.py)."""
    reason = unavailable_reason(stage)
    if reason:
        raise StageError(f"stage '{stage}' cannot run here: {reason}")
    backend = backend_class(stage)(threads=threads)
    model = LlamaModel(GGUFFile(model_path), backend, n_ctx=n_ctx, progress=progress)
    model.stage = stage
    return model
