"""The engine every stage shares: the GGUF reader (gguf.py), the ggml block formats (quants.py),
the tokenizers (tokenizer/), the llama graph written once against the op surface (model.py,
backend.py), generation and samplers (generate.py) and the float64 reference (reference.py).
The stages (stages/) are backends of it; the application (app/: `python -m app`)
sits on top of both. Nothing here imports either, and importing it configures nothing: the
application's entry points set numba up (app.configure_numba)."""
