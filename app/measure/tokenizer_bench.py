"""How fast does common/tokenizer/ encode ~100 KB of English text? (target: under 1 s)

    python -m app bench tokenizer [-m MODEL.gguf] [--file TEXT] [--kb 100] [--repeat 5]

The text is the docstrings of a fixed list of standard-library modules (English prose with some
code in it), cut to --kb kilobytes, unless --file names a text file. Reported:
  cold  a fresh Tokenizer, so every distinct word goes through the BPE merge loop once
  warm  the same text again: the per-word cache answers almost everything
Where llama-cpp-python is installed, llama.cpp tokenizes the same text too: its time for
reference, and its ids must equal ours. Writes profiles/bench/tokenizer.json.
"""

from __future__ import annotations

import importlib
import inspect
import statistics
import sys
import time
from pathlib import Path

from app.measure.protocol import BENCH_DIR, add_options, header
from common.generate import ParameterError
from common.tokenizer import Tokenizer

MODULES = ("argparse", "collections", "json", "os", "pathlib", "re", "subprocess", "typing", "logging",
           "inspect", "textwrap", "functools", "itertools", "datetime", "decimal", "fractions", "string",
           "shutil", "tarfile", "zipfile", "csv", "threading", "socket", "email.message", "http.client",
           "urllib.request", "unittest", "asyncio", "concurrent.futures", "heapq", "bisect", "random",
           "statistics", "pickle", "struct", "codecs", "locale", "gettext", "optparse", "difflib")


def stdlib_docstrings(n_chars: int) -> str:
    """English prose from the standard library's docstrings, in a fixed order, n_chars long."""
    parts, total = [], 0
    for name in MODULES:
        module = importlib.import_module(name)
        objects = [module] + [obj for attr, obj in sorted(vars(module).items())
                              if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module.__name__]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc:
                parts.append(doc)
                total += len(doc) + 2
        if total >= n_chars:
            break
    text = "\n\n".join(parts)
    if len(text) < n_chars:
        text = (text + "\n\n") * (n_chars // len(text) + 1)
    return text[:n_chars]


def timed(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, times


def add_arguments(p):
    add_options(p, out=BENCH_DIR / "tokenizer.json")
    p.add_argument("--file", help="tokenize this UTF-8 text file instead")
    p.add_argument("--kb", type=float, default=100, help="kilobytes of docstring text (default 100)")
    p.add_argument("--repeat", type=int, default=5)


def records(args):
    if not Path(args.model).exists():
        raise ParameterError(f"{args.model} is missing: run `make model`")
    if args.file:
        text, source = Path(args.file).read_text(encoding="utf-8"), args.file
    else:
        text = stdlib_docstrings(int(args.kb * 1000))
        source = f"standard-library docstrings, Python {sys.version.split()[0]}"
    n_bytes = len(text.encode("utf-8"))

    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(args.model)
    load_s = time.perf_counter() - t0

    def cold():
        tok._cache.clear()          # forget every word: the merge loop runs for each distinct one
        return tok.encode(text, add_bos=False)

    ids, cold_times = timed(cold, args.repeat)
    _, warm_times = timed(lambda: tok.encode(text, add_bos=False), args.repeat)
    distinct = len(tok._cache)

    print(f"model   {Path(args.model).name} ({tok.model}, pre={tok.pre}, {tok.n_vocab} tokens; load {load_s:.2f} s)")
    print(f"text    {len(text):,} characters, {n_bytes:,} bytes: {source}")
    words = f"{distinct:,} distinct words cached" if tok.model == "gpt2" else "SentencePiece: no word cache"
    print(f"tokens  {len(ids):,} ({n_bytes / len(ids):.2f} bytes/token; {words})")
    for label, times in (("cold", cold_times), ("warm", warm_times)):
        best, med = min(times), statistics.median(times)
        print(f"{label:7s} best {best * 1000:7.1f} ms  median {med * 1000:7.1f} ms  "
              f"({n_bytes / best / 1e6:5.2f} MB/s, {len(ids) / best / 1e3:6.0f} k tokens/s)")
    verdict = "under" if min(cold_times) < 1.0 else "OVER"
    print(f"target  cold encode of ~100 KB under 1 s: {verdict} ({min(cold_times):.3f} s)")
    rec = {"kind": "tokenizer", "model": Path(args.model).name, "text": source, "bytes": n_bytes, "tokens": len(ids),
           "load_s": load_s, "cold_s": cold_times, "warm_s": warm_times, "distinct_words": distinct}
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp: llama-cpp-python not installed (`make baseline`), no reference timing")
    else:
        llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
        data = text.encode("utf-8")
        ref, ref_times = timed(lambda: llm.tokenize(data, add_bos=False, special=False), args.repeat)
        same = "identical ids" if ref == ids else f"DIFFERENT ids ({len(ref)} vs {len(ids)} tokens)"
        print(f"llama.cpp best {min(ref_times) * 1000:7.1f} ms  ({same})")
        rec["llama_cpp"] = {"s": ref_times, "same_ids": ref == ids, "tokens": len(ref)}
    rec.update(header({"kb": args.kb, "repeat": args.repeat}, args.command_line))
    yield args.out, rec


def failures(rec: dict) -> list[str]:
    """llama.cpp's ids where they differ from ours."""
    return [] if rec.get("llama_cpp", {}).get("same_ids", True) else ["llama.cpp's ids differ from ours"]
