"""The engine every stage shares: GGUF, ggml block formats, tokenizers, the llama graph."""

import os
from pathlib import Path

# numba caches compiled kernels here (cache=True), so only the first run of a stage pays
# for compilation; set before anything imports numba.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".numba_cache"))
