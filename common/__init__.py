"""The engine every stage shares: the GGUF reader (gguf.py), the ggml block formats (quants.py),
the tokenizers (tokenizer/), the llama graph written once against the op surface (model.py,
backend.py), generation and samplers (generate.py) and the float64 reference (reference.py).
The stages (stages/) are backends of it; the application (common/app/: `python -m common`)
sits on top of both. Nothing here imports either."""

import os
from pathlib import Path

# numba caches compiled kernels here (cache=True), so only the first run of a stage pays
# for compilation; set before anything imports numba.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".numba_cache"))
