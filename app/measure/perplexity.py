"""`python -m app perplexity`: how well a stage predicts a text, by llama.cpp's method.

    python -m app perplexity --stage kv_cache -m MODEL -f TEXT [--ctx 512] [--chunks N] [--json]
    python -m app perplexity --compare [-m MODEL] [-f TEXT] [--out DIR]

The method of llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp), step for step:
the whole text is tokenized once (with BOS in front where the vocabulary adds one); it is cut
into non-overlapping chunks of `ctx` tokens (the tail that does not fill a chunk is dropped; at
least two chunks are needed); in each chunk the first token is replaced by BOS where the
vocabulary adds one (SmolLM2's does not), and the chunk is evaluated from scratch (an empty KV
cache). Position j's logits predict token j+1; the positions from ctx/2 to ctx-2 are scored,
so every scored token has seen at least half a context. The negative log-likelihood
-log softmax(logits_j)[token_{j+1}] is averaged over every scored token of every chunk, and
PPL = exp(that mean). JSON keys: ppl, n_tokens (the whole text), n_chunks, ctx, stage, model,
and scored (tokens scored), nll (their mean), seconds; with --per-token also per_token, every
scored token's {"index" (in the text's ids), "token", "nll"}.

`--compare` is the comparison the lessons ledger and chapter 05 read: on the committed text
(tests/fixtures/text/, public domain), every float stage this machine runs (they compute with
the file's own weights; naive and tiling, hours over the whole text, only if --stages names
them), the int8 stage (activations rounded to 8 bits), and the same model
requantized to Q8_0, Q4_0, Q4_K and Q6_K from its own dequantized weights (requantize()). The
reference is therefore the file's Q4_1 weights, not the original float weights, which the file
does not contain: a requantized model loses what a second rounding loses. It writes one record,
perplexity.json, beside the stage records.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from app import ROOT
from app.measure.bench import model_summary, results_dir
from app.measure.protocol import header, write_record
from app.models import DEFAULT_MODEL, MODELS_DIR, resolve
from common.gguf import BLOCK_SIZES, GGMLType, GGUFError, GGUFFile, GGUFWriter
from common.quants import QUANTIZE_TYPES, dequantize_tensor, quantize
from common.tokenizer import Tokenizer
from stages import REGISTRY, StageError, info, load, runnable_stages

DEFAULT_TEXT = ROOT / "tests" / "fixtures" / "text" / "alice-in-wonderland-ch1-4.txt"
DEFAULT_CTX = 512
REQUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
# A row that cannot hold whole blocks of the type asked for gets the type llama-quantize falls
# back to (llama-quant.cpp): Q4_K -> Q5_0 there; this project has no Q5_0 quantizer, so Q4_1,
# the other 32-value 4-bit type with an offset. Q6_K -> Q8_0 as in llama.cpp.
FALLBACK = {GGMLType.Q4_K: GGMLType.Q4_1, GGMLType.Q6_K: GGMLType.Q8_0}
# Stages that change the numbers themselves (int8 rounds every activation row to 8 bits); the
# others compute the model's function in float and differ only in summation order.
ROUNDS_ACTIVATIONS = ("int8",)


class PerplexityError(StageError):
    """A text too short for the context, a bad --ctx: said in one line (a user error)."""


def tokenize(gguf: GGUFFile, text: str) -> tuple[list[int], Tokenizer]:
    """The whole text, tokenized once, with BOS where the vocabulary adds one."""
    tok = Tokenizer.from_gguf(gguf)
    return tok.encode(text), tok


def chunks(ids: list[int], ctx: int, n_chunks: int | None = None) -> list[list[int]]:
    if ctx < 4 or ctx % 2:
        raise PerplexityError(f"--ctx {ctx}: must be an even number of tokens, at least 4")
    if len(ids) < 2 * ctx:
        raise PerplexityError(f"the text is {len(ids)} tokens: a context of {ctx} needs at least {2 * ctx} "
                              f"(two chunks); use a longer text or a smaller --ctx")
    n = len(ids) // ctx if n_chunks is None else min(n_chunks, len(ids) // ctx)
    if n < 1:
        raise PerplexityError(f"--chunks {n_chunks}: must be at least 1")
    return [list(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]


def scored_nll(logits: np.ndarray, chunk: list[int]) -> np.ndarray:
    """-log p(token j+1 | tokens 0..j) for j = ctx/2 .. ctx-2, in float64: [ctx/2 - 1]."""
    ctx = len(chunk)
    first = ctx // 2
    rows = np.asarray(logits[first:ctx - 1], dtype=np.float64)           # [ctx/2 - 1, n_vocab]
    targets = np.asarray(chunk[first + 1:ctx])
    top = rows.max(axis=1)
    log_sum = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    return log_sum - rows[np.arange(len(targets)), targets]


def evaluate(engine, ids: list[int], ctx: int, bos_id: int | None, n_chunks: int | None = None,
             progress=None, per_token: bool = False) -> dict:
    """llama-perplexity's figure for a loaded engine over token ids (bos_id: replace each chunk's
    first token with it; None where the vocabulary adds no BOS)."""
    if ctx > engine.n_ctx:
        raise PerplexityError(f"--ctx {ctx} exceeds the engine's context of {engine.n_ctx}")
    parts = chunks(ids, ctx, n_chunks)
    t0 = time.perf_counter()
    per_chunk, tokens = [], []
    for c, chunk in enumerate(parts):
        feed = list(chunk)
        if bos_id is not None:
            feed[0] = bos_id
        engine.reset()
        logits = engine.forward(feed, 0, all_logits=True)
        if not np.isfinite(logits).all():
            raise FloatingPointError(f"stage {getattr(engine, 'stage', '?')}: NaN or Inf in the logits")
        nll = scored_nll(logits, chunk)
        per_chunk.append((float(nll.sum()), len(nll)))
        if per_token:
            first = c * ctx + ctx // 2 + 1                             # the text index of the first scored token
            tokens += [{"index": first + j, "token": int(ids[first + j]), "nll": float(x)} for j, x in enumerate(nll)]
        if progress:
            progress(len(per_chunk), len(parts), math.exp(sum(s for s, _ in per_chunk) / sum(n for _, n in per_chunk)))
    engine.reset()
    total, count = sum(s for s, _ in per_chunk), sum(n for _, n in per_chunk)
    return {"ppl": math.exp(total / count), "nll": total / count, "n_tokens": len(ids), "n_chunks": len(parts),
            "ctx": ctx, "scored": count, "chunk_nll_sums": [s for s, _ in per_chunk],
            "seconds": time.perf_counter() - t0, **({"per_token": tokens} if per_token else {})}


def perplexity(stage: str, model, text_path, ctx: int = DEFAULT_CTX, n_chunks: int | None = None,
               threads: int | None = None, progress=None, per_token: bool = False) -> dict:
    """Load the stage on the model and evaluate the text: the JSON the command prints."""
    model = resolve(model)
    text = Path(text_path).read_text(encoding="utf-8")
    with GGUFFile(model) as g:
        ids, tok = tokenize(g, text)
        chunks(ids, ctx, n_chunks)                         # a short text is refused before loading
    engine = load(stage, model, n_ctx=max(ctx, 8), threads=threads)
    engine.stage = stage
    engine.warmup()
    out = evaluate(engine, ids, ctx, tok.bos_id if tok.add_bos else None, n_chunks, progress, per_token)
    return {"stage": stage, "model": model.name, "text": Path(text_path).name, "add_bos": tok.add_bos,
            "threads": engine.backend.threads, **out}


# ---- the same model, rounded again ----------------------------------------------------------

def requantize(model, ggml_type: str, out_dir: Path | None = None) -> Path:
    """The model with every matrix (the embedding too) dequantized and quantized again to
    ggml_type, norms kept in float32, as `llama-quantize --pure` would; rows too short for the
    type's blocks fall back as llama-quantize does (FALLBACK). Written once, then reused."""
    model = resolve(model)
    target = GGMLType[ggml_type]
    if target not in QUANTIZE_TYPES:
        raise GGUFError(f"requantize: no quantizer for {ggml_type} (have: {', '.join(t.name for t in QUANTIZE_TYPES)})")
    out = Path(out_dir or MODELS_DIR / "requantized") / f"{model.stem}.requantized-{ggml_type}.gguf"
    if out.exists() and out.stat().st_mtime >= model.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with GGUFFile(model) as g:
        w = GGUFWriter(out)                        # writes a .part file, renamed when complete
        for key, value in g.metadata.items():
            if key not in ("general.alignment", "general.file_type"):     # file_type would be stale
                w.add(key, value, g.metadata_types[key], g.array_types.get(key))
        w.add("general.requantized_from", f"{model.name}: every matrix dequantized, then quantized to {ggml_type}")
        for name, t in g.tensors.items():
            values = dequantize_tensor(t).astype(np.float32)
            if len(t.shape) != 2:
                w.add_tensor(name, values)
                continue
            kind = target if t.shape[1] % BLOCK_SIZES[target][0] == 0 else FALLBACK.get(target, target)
            w.add_tensor(name, quantize(values, kind), kind, shape=t.shape)
        w.write()
    return out


def type_mix(model) -> dict:
    with GGUFFile(resolve(model)) as g:
        return model_summary(g)["type_mix_bytes"]


# ---- the comparison -------------------------------------------------------------------------

def compare(model=None, text_path=DEFAULT_TEXT, ctx: int = DEFAULT_CTX, stages=None, types=REQUANTIZED_TYPES,
            reference_stage: str = "kv_cache", progress=print) -> dict:
    """Every stage's perplexity on the model's own weights, and the reference stage's on the
    model requantized to each type: one record (kind 'perplexity')."""
    model = resolve(model)
    stages = stages or [s for s in runnable_stages() if REGISTRY[s].max_params is None]
    rows = []
    t0 = time.perf_counter()
    for stage in stages:
        r = perplexity(stage, model, text_path, ctx)
        rows.append({"row": stage, "weights": "the file's own", **r})
        progress(f"{stage:>12}: PPL {r['ppl']:.4f} ({r['seconds']:.0f} s)")
    for t in types:
        path = requantize(model, t)
        r = perplexity(reference_stage, path, text_path, ctx)
        rows.append({"row": f"{reference_stage} on {t}", "weights": f"requantized to {t}",
                     "type_mix_bytes": type_mix(path), **r})
        progress(f"{t:>12}: PPL {r['ppl']:.4f} ({r['seconds']:.0f} s)")
    rec = {"kind": "perplexity", "model": model.name, "text": Path(text_path).name, "ctx": ctx,
           "reference": f"{model.name}: its own weights, as stored in the file (the original float weights "
                        f"are not in it)", "reference_stage": reference_stage, "rows": rows,
           "rounds_activations": [s for s in stages if s in ROUNDS_ACTIVATIONS],
           "seconds": time.perf_counter() - t0, "model_info": model_summary(GGUFFile(model))}
    rec.update(header({"ctx": ctx, "text": Path(text_path).name, "method": "llama-perplexity"}))
    return rec


def write(rec: dict, out_dir=None) -> Path:
    return write_record(rec, results_dir(rec["model"], out_dir) / "perplexity.json")[0]


# ---- the command ----------------------------------------------------------------------------

def cmd_perplexity(args):
    if args.compare:
        rec = compare(args.model, args.file, args.ctx, args.stages.split(",") if args.stages else None,
                      progress=lambda line: print(line, file=sys.stderr))
        path = None if args.no_write else write(rec, args.out)
        if args.json:
            print(json.dumps(rec, default=float))
        elif path:
            print(f"wrote {path}", file=sys.stderr)
        return
    stage = args.stage
    info(stage)                                                # an unknown stage: a one-line error
    progress = None if args.json else \
        (lambda i, n, ppl: print(f"[{i}/{n}] {ppl:.4f}", file=sys.stderr))
    r = perplexity(stage, args.model, args.file, args.ctx, args.chunks, args.threads, progress, args.per_token)
    if args.json:
        r.pop("chunk_nll_sums")
        print(json.dumps(r))
    else:
        print(f"{stage} on {r['model']}: PPL = {r['ppl']:.4f} over {r['n_chunks']} chunks of {r['ctx']} tokens "
              f"({r['scored']} scored of {r['n_tokens']}; {r['seconds']:.1f} s)")


def add_commands(sub):
    p = sub.add_parser("perplexity", help="perplexity of a stage on a text (llama-perplexity's method)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", "-s", default="kv_cache", help="the stage (default: %(default)s)")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("-f", "--file", default=str(DEFAULT_TEXT), help="text file (default: the committed text)")
    p.add_argument("-c", "--ctx", type=int, default=DEFAULT_CTX, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, help="evaluate only the first N chunks")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads for the stages that use several")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--per-token", action="store_true",
                   help="with --json: every scored token's negative log-likelihood too (per_token)")
    p.add_argument("--compare", action="store_true",
                   help="every stage and the requantized models: one record, perplexity.json")
    p.add_argument("--stages", default=None, help="with --compare: the stages (default: all this machine runs)")
    p.add_argument("--out", default=None, help="with --compare: folder for the record")
    p.add_argument("--no-write", action="store_true", help="with --compare: do not write the record")
    p.set_defaults(func=cmd_perplexity)
