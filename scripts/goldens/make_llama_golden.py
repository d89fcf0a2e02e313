"""Record llama.cpp's logits on the default model as a golden file for the tests.

    make baseline-install            # or: .venv/bin/pip install -r requirements-llama.txt
    .venv/bin/python -m scripts.goldens.make_llama_golden [-m MODEL] [--out tests/golden/llama_cpp_logits.npz]

For each prompt in PROMPTS, llama.cpp (through llama-cpp-python, logits_all=True, 1 thread)
tokenizes the text and evaluates every position. Full logits would be megabytes, so the
file keeps, per position: the 16 best token ids with their logits, and the logits of a
fixed random subset of 1024 vocabulary ids. tests/test_reference.py compares the float64
reference forward against these: the same top-1 token at every position, and the logits
close (the tolerance and why are stated there). The tests never need llama.cpp itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from app import ROOT

PROMPTS = [
    "The meaning of life is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
TOP = 16
SUBSET = 1024


def main():
    from app.models import DEFAULT_MODEL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path))
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "llama_cpp_logits.npz"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: .venv/bin/pip install -r requirements-llama.txt")

    llm = llama_cpp.Llama(args.model, logits_all=True, n_ctx=512, n_threads=1, n_batch=512, verbose=False)
    n_vocab = llm.n_vocab()
    subset = np.sort(np.random.default_rng(0).choice(n_vocab, SUBSET, replace=False))
    out = {"subset_ids": subset, "llama_cpp_version": np.array(llama_cpp.__version__)}
    for i, text in enumerate(PROMPTS):
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)          # [n, n_vocab]
        top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
        out[f"p{i}_text"] = np.array(text)
        out[f"p{i}_ids"] = np.array(ids, dtype=np.int32)
        out[f"p{i}_top_ids"] = top.astype(np.int32)
        out[f"p{i}_top_logits"] = np.take_along_axis(logits, top, axis=1)
        out[f"p{i}_subset_logits"] = logits[:, subset]
        print(f"prompt {i}: {len(ids)} tokens, top-1 {top[:, 0].tolist()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
