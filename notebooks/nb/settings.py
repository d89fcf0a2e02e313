"""The notebooks' settings: quick (LLM_NOTEBOOK_QUICK=1, what the tests run) or the report's own,
and which model they run (LLM_NOTEBOOK_MODEL)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.models import resolve
from stages.registry import REGISTRY, REPORT_PROMPT_TOKENS, Tokens

ROOT = Path(__file__).resolve().parents[2]
QUICK_ENV = "LLM_NOTEBOOK_QUICK"
MODEL_ENV = "LLM_NOTEBOOK_MODEL"


@dataclass(frozen=True)
class Settings:
    quick: bool
    prompt_tokens: int                      # every live measurement uses this many prompt tokens
    n_predict: dict                         # tokens generated per stage; "*" for the others
    profile_n: dict                         # tokens generated in a per-op profiled run
    naive_lengths: tuple                    # context lengths for the slow stages' cost-vs-length curve
    lengths: tuple                          # the same for the fast stages
    tile_grid: tuple                        # (TILE_I, TILE_J, TILE_K) tried by the live tile sweep
    timing_reps: int                        # repetitions of a micro-benchmark (the best one counts)

    def n_for(self, stage: str) -> int:
        return self.n_predict.get(stage, self.n_predict["*"])

    def profile_n_for(self, stage: str) -> int:
        return self.profile_n.get(stage, self.profile_n["*"])

    def describe(self) -> str:
        mode = f"quick mode ({QUICK_ENV}=1)" if self.quick else "full settings (the report's)"
        return (f"{mode}: {self.prompt_tokens} prompt tokens; tokens generated per stage: "
                f"{', '.join(f'{k} {v}' for k, v in self.n_predict.items() if k != '*' and v != self.n_predict['*'])}, "
                f"others {self.n_predict['*']}")


def is_quick() -> bool:
    return os.environ.get(QUICK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def settings(quick: bool | None = None) -> Settings:
    """Quick: as small as still shows each effect. Full: `make report`'s settings (the registry's,
    stages/registry.py), so a chapter's live bars and the recorded ones measure the same thing."""
    quick = is_quick() if quick is None else quick
    if quick:
        return Settings(quick=True, prompt_tokens=4,
                        n_predict={"naive": 2, "tiling": 2, "simd": 2, "*": 4},
                        profile_n={"*": 2},
                        naive_lengths=(2, 4, 8), lengths=(4, 8, 16, 32),
                        tile_grid=((1, 1, 4096), (8, 16, 64), (8, 64, 64), (8, 256, 256)),
                        timing_reps=3)
    return Settings(quick=False, prompt_tokens=REPORT_PROMPT_TOKENS,
                    n_predict={**{s: REGISTRY[s].tokens.report for s in REGISTRY}, "*": Tokens().report},
                    profile_n={**{s: REGISTRY[s].tokens.profile for s in REGISTRY}, "*": Tokens().profile},
                    naive_lengths=(8, 16, 32, 64), lengths=(16, 32, 64, 128, 256, 512),
                    tile_grid=tuple((i, j, k) for i in (1, 4, 8, 16) for j in (16, 64, 256)
                                    for k in (64, 256)) + ((1, 1, 4096),),
                    timing_reps=5)


def model_path() -> Path:
    return resolve(os.environ.get(MODEL_ENV) or None)


def rel(path) -> str:
    """A path as the reader sees it in the repository (no machine-specific prefix)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
