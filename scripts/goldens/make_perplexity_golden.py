"""Record llama.cpp's perplexity of the committed text as a golden file for the tests.

    make llama-cpp                   # llama-cpp-python, if not installed yet
    .venv/bin/python -m scripts.goldens.make_perplexity_golden [-m MODEL] [-f TEXT] [--out FILE.npz]

llama.cpp (through llama-cpp-python) tokenizes the text once, as llama-perplexity does (BOS in
front where the vocabulary adds one), and evaluates it by llama-perplexity's method at each
context size in CTXS: non-overlapping chunks of ctx tokens, each from an empty KV cache, its
first token replaced by BOS where the vocabulary adds one, every logit of the chunk kept
(logits_all); positions ctx/2 .. ctx-2 scored. The log-softmax of those logits is taken here
in float64, by the same formula as app/measure/perplexity.py (which is not imported, so the
golden figure depends on llama.cpp's tokens and logits only). The file keeps llama.cpp's token
ids and, per context size, the sum of the negative log-likelihoods of every chunk and the
number of tokens each scored: tests/test_perplexity.py checks our tokens against the ids and
each stage's perplexity over the first chunks against these sums.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from app import ROOT

CTXS = (64, 128, 512)
DEFAULT_TEXT = ROOT / "tests" / "fixtures" / "text" / "alice-in-wonderland-ch1-4.txt"


def nll_sums(logits: np.ndarray, chunk: list[int]) -> tuple[float, int]:
    """Sum and count of -log softmax(logits[j])[chunk[j+1]] over j = ctx/2 .. ctx-2."""
    ctx = len(chunk)
    first = ctx // 2
    rows = logits[first:ctx - 1].astype(np.float64)
    targets = np.asarray(chunk[first + 1:])
    top = rows.max(axis=1)
    lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    nll = lse - rows[np.arange(len(targets)), targets]
    return float(nll.sum()), len(nll)


def main():
    from app.models import DEFAULT_MODEL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path))
    ap.add_argument("-f", "--file", default=str(DEFAULT_TEXT))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "llama_cpp_perplexity.npz"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: `make llama-cpp`")

    text = Path(args.file).read_text(encoding="utf-8")
    out = {"llama_cpp_version": np.array(llama_cpp.__version__), "text": np.array(Path(args.file).name),
           "model": np.array(Path(args.model).name), "ctxs": np.array(CTXS)}
    for ctx in CTXS:
        llm = llama_cpp.Llama(args.model, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                              n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)   # add_special, as llama-perplexity
        add_bos = llm._model.add_bos_token()                                  # the vocabulary says
        out["ids"] = np.array(ids, dtype=np.int32)
        out["add_bos"] = np.array(bool(add_bos))
        sums, counts = [], []
        for i in range(len(ids) // ctx):
            chunk = list(ids[i * ctx:(i + 1) * ctx])
            feed = [llm.token_bos()] + chunk[1:] if add_bos else chunk
            llm.reset()
            llm.eval(feed)
            logits = np.array(llm.scores[:ctx], dtype=np.float32)
            s, n = nll_sums(logits, chunk)
            sums.append(s)
            counts.append(n)
        out[f"ctx{ctx}_nll_sums"] = np.array(sums)
        out[f"ctx{ctx}_counts"] = np.array(counts, dtype=np.int32)
        print(f"ctx {ctx}: {len(ids)} tokens, {len(sums)} chunks, PPL {np.exp(sum(sums) / sum(counts)):.4f}")
        del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
