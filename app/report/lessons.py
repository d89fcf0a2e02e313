"""The article beside your machine: each of the article's claims, its figure, this machine's figure
from the committed records, and a verdict.

    python -m app lessons [--json]        the ledger, from the records `make report` wrote
    make report                              also writes it to profiles/lessons.md (+ lessons.png)

A verdict says what happened (verdict()): `reproduced` when this machine's figure lies within the
claim's band (stated in every row: a factor around the article's figure, or a threshold for a
qualitative claim); outside it, `same direction, larger` or `same direction, smaller` when the
effect went the article's way by more or by less (a KV cache that beat the article's 10.6x), and
`reversed` when it went the other way (a speed-up that slowed down; a claim that something stays
the same, where it moved); `not measured here` when the records cannot give the figure (then
`why` says what is missing: a GPU, a PMU, a record). Every measured figure names the
records it was computed from; a stage ratio also names its metric and its two stages, so that
it can be recomputed from them (tests/test_lessons.py does).

Which records: the article's own workload where `make report --article` measured it (TinyLlama
1.1B's geometry with synthetic weights, a 512-token prompt, naive and tiling extrapolated from
a few layers), else the default model's report (SmolLM2, a 32-token prompt: the rows say so).
The article's figures are the article's (TinyLlama 1.1B Chat Q4_K_M on an i3-7100 with a GTX 750
Ti); where its own arithmetic does not add up, the row says that too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app import ROOT
from app.measure.machine import machine_id
from app.measure.provenance import describe
from app.models import DEFAULT_MODEL, MODELS
from app.report.charts import Results, load_results

RESULTS_DIR = ROOT / "profiles" / "results"
LARGER, SMALLER = "same direction, larger", "same direction, smaller"
VERDICTS = ("reproduced", LARGER, SMALLER, "reversed", "not measured here")
# What each row is, in a few words (the chart's labels; a row's id is for code).
LABELS = {
    "ram_balloon": "float32 at load: memory ÷ file size",
    "page_faults": "page faults of a naive cold start",
    "ipc_naive": "naive: instructions per cycle",
    "tiling_speedup": "tiling: decode speed-up over naive",
    "simd_speedup": "SIMD: decode speed-up over tiling",
    "kv_decode_speedup": "KV cache: decode speed-up over simd",
    "kv_ttft_unchanged": "KV cache: first token, simd ÷ kv_cache",
    "quantized_ttft_speedup": "quantized: first-token speed-up",
    "cuda_decode_speedup": "GPU: decode speed-up over the CPU",
    "cuda_ttft_slower": "GPU: first token, CPU ÷ GPU",
    "end_to_end": "end to end: naive ÷ the fastest stage",
    "ttft_decode_different": "prompt's gain ÷ decode's gain",
    "precision_loss_small": "4-bit weights: perplexity cost",
}

# The article's setting, which `make report --article` measures.
ARTICLE_PROMPT_TOKENS = 512
ARTICLE_MODELS = ("tinyllama", "tinyllama-synthetic")     # the real file where present, else its geometry
ARTICLE_FLOAT32_BYTES = 1.1e9 * 4                         # TinyLlama's 1.1 B weights as float32
ARTICLE_RAM_GB = (0.7, 2.8)                               # the file, the eager float32 process, in GB
PRECISION_THRESHOLD = 0.05                                # "matters little": at most +5% perplexity
# The article's CPU, an Intel Core i3-7100 (Intel's specification): per-core L1d and L2, shared L3.
ARTICLE_CPU = "Intel Core i3-7100"
ARTICLE_CACHES = {"L1d": 32 * 2**10, "L2": 256 * 2**10, "L3": 3 * 2**20}
REQUANTIZED_4BIT = ("Q4_0", "Q4_K")


def article_folder_name(model_stem: str) -> str:
    """The records folder of the article's workload on a model: <stem>-prompt512."""
    return f"{model_stem}-prompt{ARTICLE_PROMPT_TOKENS}"


@dataclass
class Row:
    id: str
    claim: str                      # what the article says, in its words where it gave them
    article: float | None           # its figure, in `unit`
    article_text: str               # the figure as the article wrote it
    measured: float | None
    unit: str
    verdict: str
    why: str
    records: list = field(default_factory=list)        # paths of the records `measured` comes from
    band: list | None = None                           # [low, high]: `reproduced` inside it
    metric: str | None = None                          # stage ratios: ttft_ms or decode_ms
    from_stage: str | None = None
    to_stage: str | None = None

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k in ("measured", "article")}


def _shown(path: Path) -> str:
    path = Path(path)
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _band(article: float, factor: float) -> list:
    return [article / factor, article * factor]


def verdict(measured: float, band, article: float | None = None, unit: str = "x") -> str:
    """What happened to a claim: `reproduced` inside its band; outside, for a ratio ("x"), whether
    it went the article's way (both on the same side of 1) by more or by less than the article's
    figure (the band's middle where the article gave none), else `reversed` (and a claim of no
    change, 1x, that moved is reversed too); for a count, a rate or a share, larger or smaller than
    the band, reversed where a figure the band holds above zero fell below it."""
    if band[0] <= measured <= band[1]:
        return "reproduced"
    if unit == "x":
        ref = math.log(article if article else math.sqrt(band[0] * band[1]))
        got = math.log(measured) if measured > 0 else -math.inf
        if abs(ref) < 1e-12 or ref * got <= 0:
            return "reversed"
        return LARGER if abs(got) > abs(ref) else SMALLER
    if measured < 0 <= band[0]:
        return "reversed"
    return LARGER if measured > band[1] else SMALLER


def _x(v: float) -> str:
    return f"{v:,.2f}x" if v < 10 else f"{v:,.1f}x" if v < 100 else f"{v:,.0f}x"


# ---- where the records are ------------------------------------------------------------------

@dataclass
class Sources:
    """The record folders one ledger reads: the default model's report and, where it was
    measured, the article's workload; perplexity.json beside the default model's records."""
    default: Results | None
    article: Results | None
    perplexity: dict | None
    perplexity_path: Path | None
    machine: str

    def folder_for(self, *stages) -> Results | None:
        """The article's workload if it has every stage named, else the default report if it does."""
        for res in (self.article, self.default):
            if res is not None and all(_record(res, s) for s in stages):
                return res
        return None


def _record(res: Results | None, stage: str) -> dict | None:
    if res is None:
        return None
    return next((r for r in res.stages if r["stage"] == stage), None)


def _record_path(res: Results, stage: str) -> str:
    return _shown(res.folder / f"{stage}.json")


def _is_article(res: Results | None, sources: Sources) -> bool:
    return res is not None and res is sources.article


def find_sources(results_dir=None, machine: str | None = None) -> Sources:
    """This machine's records (machine_id()), else the first machine's that has the default model's."""
    root = Path(results_dir or RESULTS_DIR)
    machines = [machine or machine_id()] + sorted(p.name for p in root.glob("*") if p.is_dir())
    for m in dict.fromkeys(machines):
        default_dir = root / m / DEFAULT_MODEL.path.stem
        article_dirs = [root / m / article_folder_name(MODELS[name].path.stem) for name in ARTICLE_MODELS
                        if name in MODELS]
        article_dir = next((d for d in article_dirs if d.is_dir() and any(d.glob("*.json"))), None)
        if not default_dir.is_dir() and article_dir is None:
            continue
        default = load_results(default_dir) if default_dir.is_dir() else None
        article = load_results(article_dir) if article_dir else None
        ppl_path = default_dir / "perplexity.json"
        ppl = json.loads(ppl_path.read_text()) if ppl_path.exists() else None
        return Sources(default, article, ppl, ppl_path if ppl else None, m)
    return Sources(None, None, None, None, machine or machine_id())


# ---- the claims -----------------------------------------------------------------------------

def _workload(res: Results, sources: Sources) -> str:
    """A phrase naming the workload the records measured."""
    r = res.stages[0] if res.stages else {}
    prompt = (r.get("settings") or {}).get("prompt_tokens", r.get("n_prompt"))
    name = (r.get("model_info") or {}).get("name") or r.get("model", "?")
    if _is_article(res, sources):
        return f"the article's workload ({name}, {prompt}-token prompt)"
    return f"{r.get('model', '?')} with a {prompt}-token prompt (the article: TinyLlama 1.1B, " \
           f"{ARTICLE_PROMPT_TOKENS} tokens; `make report --article` measures that)"


def _extrapolated(*recs) -> str:
    names = [r["stage"] for r in recs if r.get("extrapolated")]
    if not names:
        return ""
    e = next(r["extrapolated"] for r in recs if r.get("extrapolated"))
    return f"; {', '.join(names)} extrapolated from {e['layers_measured']} of {e['n_layer']} layers"


def stage_ratio(sources: Sources, rid: str, claim: str, article: float, article_text: str, metric: str,
                from_stage: str, to_stage: str | None, factor: float, why_reproduced: str,
                why_refuted: str) -> Row:
    """A claim about one stage against another: measured = from_stage[metric] / to_stage[metric].
    to_stage None: the fastest recorded stage (by that metric)."""
    band = _band(article, factor)
    res = sources.folder_for(from_stage) if to_stage is None else sources.folder_for(from_stage, to_stage)
    if res is not None and to_stage is None:
        to_stage = min((r for r in res.stages if r["stage"] != from_stage), key=lambda r: r[metric],
                       default={}).get("stage")
    if res is None or to_stage is None:
        missing = [s for s in (from_stage, to_stage) if s and not _record(sources.default, s)]
        return Row(rid, claim, article, article_text, None, "x", "not measured here",
                   f"no record of {', '.join(missing) or 'these stages'} on this machine"
                   + (" (the cuda stage runs where an NVIDIA GPU is; its records go in that machine's folder)"
                      if "cuda" in missing else ""),
                   [], band, metric, from_stage, to_stage)
    a, b = _record(res, from_stage), _record(res, to_stage)
    measured = a[metric] / b[metric]
    said = verdict(measured, band, article)
    template = why_reproduced if said == "reproduced" else why_refuted
    cmp = "more than" if measured > article else "less than"
    why = template.format(measured=_x(measured), cmp=cmp, to=to_stage, article=article_text) + \
        f" [{_workload(res, sources)}{_extrapolated(a, b)}]"
    return Row(rid, claim, article, article_text, measured, "x", said, why,
               [_record_path(res, from_stage), _record_path(res, to_stage)], band, metric, from_stage, to_stage)


def ram_balloon(sources: Sources) -> Row:
    file_gb, ram_gb = ARTICLE_RAM_GB
    article = ram_gb / file_gb
    band = _band(article, 1.25)
    text = f"{file_gb * 1000:.0f} MB file -> {ram_gb} GB in RAM, eager FP32"
    claim = ("Dequantizing every weight to float32 at load balloons memory: the 700 MB file takes 2.8 GB "
             "(the article's own arithmetic does not add up: 1.1 B weights x 4 bytes is 4.4 GB, not 2.8 GB)")
    res = sources.folder_for("naive")
    if res is None:
        return Row("ram_balloon", claim, article, text, None, "x", "not measured here",
                   "no naive record on this machine", [], band)
    r = _record(res, "naive")
    weights = r["weights_mb"] * 2**20
    file_bytes = r["model_info"]["file_size"]
    measured = weights / file_bytes
    said = verdict(measured, band, article)
    per_weight = 8 * file_bytes / r["model_info"]["n_params"]
    why = (f"float32 costs 32 bits per weight against the file's {per_weight:.1f} on average, so the "
           f"{file_bytes / 2**20:,.0f} MiB file becomes {r['weights_mb']:,.0f} MiB of weights "
           f"(peak RSS {r['peak_rss_mb']:,.0f} MiB); the article's 2.8 GB is less than its own model's "
           f"4.4 GB of float32, so it cannot have held every weight in float32 "
           f"[{_workload(res, sources)}]")
    return Row("ram_balloon", claim, article, text, measured, "x", said, why, [_record_path(res, "naive")], band)


def page_faults(sources: Sources) -> Row:
    claim = "A naive run takes over a million page faults, about 44 thousand a second"
    text = ">1 M page faults at ~44 k/s"
    res = sources.folder_for("naive")
    r = _record(res, "naive") if res else None
    cold = (r or {}).get("cold_start")
    if not cold:
        why = ("no naive record on this machine" if r is None else
               f"{_record_path(res, 'naive')} predates the cold-start counters: `make report` measures them")
        return Row("page_faults", claim, 1e6, text, None, "page faults", "not measured here", why,
                   [_record_path(res, "naive")] if r else [])
    load, first = cold["load"], cold["first_forward"]
    faults = sum(x["minor_faults"] + x["major_faults"] for x in (load, first))
    major = load["major_faults"] + first["major_faults"]
    seconds = (load["wall_ms"] + first["wall_ms"]) / 1e3
    weights = r["weights_mb"] * 2**20
    # The article's count scaled to this model's float32 weights: one fault per 4 KiB page touched.
    scale = weights / ARTICLE_FLOAT32_BYTES
    band = _band(1e6 * scale, 2.0)
    said = verdict(faults, band, unit="page faults")
    resident = cold["eviction"].get("resident_after")
    why = (f"{faults:,} faults ({major:,} of them major, from the disk) in loading and one forward pass after "
           f"evicting the file ({faults / seconds:,.0f} a second); one fault per 4 KiB page of the float32 weights "
           f"would be {weights / 4096:,.0f}, the article's count scaled to this model {1e6 * scale:,.0f}: the faults "
           f"come from first touching the float32 copies, and only the major ones from reading the file"
           + ("; fewer than one per 4 KiB page, most likely because numpy asks the kernel for transparent huge "
              "pages on large arrays (madvise), and one fault then maps 2 MiB" if faults < weights / 4096 / 2 else "")
           + (f"; {resident:.0%} of the file stayed cached (mapped by another process)" if resident and resident > 0.01
              else "") + f" [{_workload(res, sources)}]")
    return Row("page_faults", claim, 1e6, text, float(faults), "page faults", said, why,
               [_record_path(res, "naive")], band)


def ipc_naive(sources: Sources) -> Row:
    claim = "The naive stage retires 0.98 instructions per cycle"
    band = _band(0.98, 1.5)
    res = sources.folder_for("naive")
    r = _record(res, "naive") if res else None
    pmu = ((r or {}).get("counters") or {}).get("pmu")
    if not pmu or not pmu.get("available"):
        why = ("no naive record on this machine" if r is None else
               f"{_record_path(res, 'naive')} predates the counters: `make report` measures them" if not pmu else
               pmu.get("reason") or "no PMU")
        return Row("ipc_naive", claim, 0.98, "IPC 0.98", None, "instructions/cycle", "not measured here", why,
                   [_record_path(res, "naive")] if r else [], band)
    ipc = pmu["ipc"]
    said = verdict(ipc, band, unit="instructions/cycle")
    why = (f"{pmu['instructions']:,} instructions in {pmu['cycles']:,} cycles; cache misses "
           f"{pmu['cache_miss_rate']:.1%} of references: " +
           ("the naive loop waits on memory as in the article" if ipc < 1.5 else
            "the core keeps its pipelines busier than the article's, the loads hitting in cache") +
           f" [{_workload(res, sources)}{_extrapolated(r)}]")
    return Row("ipc_naive", claim, 0.98, "IPC 0.98", ipc, "instructions/cycle", said, why,
               [_record_path(res, "naive")], band)


def precision_loss(sources: Sources) -> Row:
    claim = "Computing with 4-bit weights costs little precision"
    band = [0.0, PRECISION_THRESHOLD * 100]
    rec = sources.perplexity
    if not rec:
        return Row("precision_loss_small", claim, None, "matters little", None, "% perplexity", "not measured here",
                   "no perplexity record on this machine: `python -m app perplexity --compare` (or "
                   "`make report args=--perplexity`) measures it", [], band)
    rows = {r["row"]: r for r in rec["rows"]}
    ref = rows.get(rec["reference_stage"])
    four = [rows[f"{rec['reference_stage']} on {t}"] for t in REQUANTIZED_4BIT
            if f"{rec['reference_stage']} on {t}" in rows]
    if not ref or not four:
        return Row("precision_loss_small", claim, None, "matters little", None, "% perplexity", "not measured here",
                   f"{_shown(sources.perplexity_path)} has no reference row or no 4-bit requantized row", [], band)
    worst = max(four, key=lambda r: r["ppl"])
    loss = (worst["ppl"] / ref["ppl"] - 1) * 100
    said = verdict(loss, band, unit="% perplexity")
    int8 = next((r for r in rec["rows"] if r["row"] in rec.get("rounds_activations", [])), None)
    each = ", ".join(f"{r['weights'].split()[-1]} {(r['ppl'] / ref['ppl'] - 1) * 100:+.2f}%" for r in four)
    why = (f"perplexity {ref['ppl']:.3f} with the file's own (Q4_1) weights, {worst['ppl']:.3f} with them rounded "
           f"again to {worst['weights'].split()[-1]}, the worst 4-bit type ({each})"
           + (f"; int8 activations {(int8['ppl'] / ref['ppl'] - 1) * 100:+.2f}%" if int8 else "")
           + f"; the reference is the Q4_1 file, not the original weights; 'little' read as at most "
           f"+{PRECISION_THRESHOLD:.0%} [{rec['model']}, {rec['text']}, chunks of {rec['ctx']} tokens]")
    return Row("precision_loss_small", claim, None, "matters little", loss, "% perplexity", said, why,
               [_shown(sources.perplexity_path)], band)


# The article's GPU stage against its CPU one: decode 2.8x faster, TTFT 3.93 s against 2.76 s.
ARTICLE_CUDA_DECODE_GAIN, ARTICLE_CUDA_TTFT_GAIN = 2.8, 2.76 / 3.93
DIFFERENT_PROBLEMS = [1.25, 100.0]     # "different": one phase's gain 1.25x the other's or more


def ttft_decode_different(sources: Sources) -> Row:
    """The article's second lesson: what wins decode need not win the prompt (its GPU stage won one
    and lost the other). Here: the prefill stage against repack, the stage it builds on, which
    changes the prompt's kernels and leaves decode's matmuls alone: its TTFT gain over its decode gain."""
    claim = ("Time to first token and decode are different problems: the GPU stage won decode and lost the "
             "prompt; what speeds one phase need not speed the other")
    article = ARTICLE_CUDA_DECODE_GAIN / ARTICLE_CUDA_TTFT_GAIN
    text = "GPU: decode 2.8x faster, TTFT 3.93 s vs 2.76 s"
    band = DIFFERENT_PROBLEMS
    res = sources.folder_for("repack", "prefill")
    if res is None:
        return Row("ttft_decode_different", claim, article, text, None, "x", "not measured here",
                   "no record of both repack and prefill on this machine (`make report` measures them)", [], band)
    a, b = _record(res, "repack"), _record(res, "prefill")
    ttft, decode = a["ttft_ms"] / b["ttft_ms"], a["decode_ms"] / b["decode_ms"]
    measured = max(ttft / decode, decode / ttft)
    said = verdict(measured, band, article)
    why = (f"the prefill stage, which changes the prompt's kernels (attention in tiles, two rows per register) and "
           f"keeps decode's, took the time to first token {_x(ttft)} faster than repack and decode {_x(decode)}: "
           f"the gains differ by {_x(measured)}"
           + (", so here too the two phases are different problems" if said == "reproduced" else
              f", less than {_x(band[0])}: the prompt's changes moved decode about as much")
           + f" (the article's: its GPU's decode gain over its TTFT gain, {_x(article)}) [{_workload(res, sources)}]")
    return Row("ttft_decode_different", claim, article, text, measured, "x", said, why,
               [_record_path(res, "repack"), _record_path(res, "prefill")], band)


def ledger(sources: Sources) -> list[Row]:
    """Every row, in the article's order."""
    return [
        ram_balloon(sources),
        page_faults(sources),
        ipc_naive(sources),
        stage_ratio(sources, "tiling_speedup", "Tiling the matmul halves the time per token", 2.0, "2x",
                    "decode_ms", "naive", "tiling", 1.5,
                    "{measured}: blocking reuses each cache line as it did in the article",
                    "{measured}, {cmp} the article's {article}: what the tiles save depends on whether the "
                    "naive loop was waiting on memory (re-reading matrices larger than the last-level cache) or "
                    "on its chain of dependent adds, which tiling keeps"),
        stage_ratio(sources, "simd_speedup", "SIMD gains only 3%, because the loop is memory-bound", 1.03, "+3%",
                    "decode_ms", "tiling", "simd", 1.15,
                    "{measured}: as in the article, the loop waits on memory, so wider arithmetic buys little",
                    "{measured}, not 3%: the lesson reverses here. On the article's i3 (3 MB of last-level "
                    "cache) each row re-read matrices of tens of MB from memory, so the loop was bound by memory; "
                    "here the tiled loop is bound by its chain of dependent float adds, which the 4 x 4 register "
                    "block and packed FMAs break (see the roofline, naive and tiling placed by the traffic their "
                    "loop order causes)"),
        stage_ratio(sources, "kv_decode_speedup", "The KV cache makes decode 10.6x faster (512-token prompt)", 10.6,
                    "10.6x", "decode_ms", "simd", "kv_cache", 1.5,
                    "{measured}: each step computes one row instead of the whole text",
                    "{measured}, {cmp} the article's {article}: each step computes one row instead of the whole "
                    "text, so the gain is about the text's length, scaled by how well the stage without a cache "
                    "multiplies many rows at once (simd's register block does)"),
        stage_ratio(sources, "kv_ttft_unchanged", "The KV cache leaves time to first token unchanged", 1.0,
                    "unchanged", "ttft_ms", "simd", "kv_cache", 1.25,
                    "{measured}: prefill has nothing cached to reuse, as in the article",
                    "{measured}: prefill has nothing to reuse, yet the figure moved: the prefill code or the "
                    "machine's state differed between the runs"),
        stage_ratio(sources, "quantized_ttft_speedup", "Quantized kernels make time to first token 4x faster", 4.0,
                    "4x", "ttft_ms", "kv_cache", "quantized", 1.5,
                    "{measured}: reading 4-bit blocks instead of float32 cuts the bytes prefill waits on",
                    "{measured}, {cmp} the article's {article}: a prefill that reads every weight once per prompt "
                    "token waits on memory and gains what the bytes shrink; this one multiplies each weight by "
                    "every prompt row at once, so it is bound by arithmetic, and 4-bit weights help decode instead"),
        stage_ratio(sources, "cuda_decode_speedup", "The GPU makes decode 2.8x faster than the CPU", 2.8, "2.8x",
                    "decode_ms", "quantized", "cuda", 1.5,
                    "{measured}: the GPU's memory bandwidth wins decode, as in the article",
                    "{measured}, {cmp} the article's {article}: a GPU's lead in decode is its memory bandwidth "
                    "over the CPU's, which differs from the GTX 750 Ti's over the i3"),
        stage_ratio(sources, "cuda_ttft_slower", "The GPU's time to first token was slower than the CPU's "
                    "(3.93 s against 2.76 s), from two mistakes: the embedding lookup on the host and a "
                    "cudaMalloc/cudaFree around every op (copying the logits back was sound)", 2.76 / 3.93,
                    "3.93 s vs 2.76 s", "ttft_ms", "quantized", "cuda", 1.25,
                    "{measured}: slower on the GPU than on the CPU, as in the article",
                    "{measured}: without the two mistakes the GPU's prefill is not slower (the cuda stage's "
                    "switches alloc_per_op and host_embedding bring them back to measure them)"),
        stage_ratio(sources, "end_to_end", "From 22.67 s to 190 ms per token, end to end", 22.67 / 0.19,
                    "22.67 s -> 190 ms per token", "decode_ms", "naive", None, 1.5,
                    "{measured} from naive to {to}, as in the article",
                    "{measured} from naive to {to}, {cmp} the article's naive to KV cache + quantized CUDA: "
                    "its steps differ in size (the lessons above say which and why)"),
        ttft_decode_different(sources),
        precision_loss(sources),
    ]


# ---- showing it -----------------------------------------------------------------------------

def _figure(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return _x(v)
    if unit == "page faults":
        return f"{v:,.0f}"
    if unit.startswith("%"):
        return f"{v:+.2f}%"
    return f"{v:.2f}"


def markdown(rows: list[Row], sources: Sources) -> str:
    recs = [r for res in (sources.default, sources.article) if res for r in res.stages + res.baselines]
    lines = [
        "# The article beside this machine",
        "",
        f"Drawn by `python -m app lessons` from the records of machine `{sources.machine}` "
        f"({describe(recs) if recs else 'no records'}). A verdict says what happened: `reproduced` when this "
        f"machine's figure lies inside the row's band; outside it, `{LARGER}` or `{SMALLER}` when the effect went "
        f"the article's way by more or by less, `reversed` when it went the other way; `not measured here` when "
        f"the records cannot give it (the row says why). Ratios are the first stage's time over the second's.",
        "",
        "| claim (id) | the article | this machine | band | verdict | why | records |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        band = f"{_figure(r.band[0], r.unit)} .. {_figure(r.band[1], r.unit)}" if r.band else "-"
        records = "<br>".join(f"`{p}`" for p in r.records) or "-"
        lines.append(f"| {r.claim} (`{r.id}`) | {r.article_text} | {_figure(r.measured, r.unit)} | {band} "
                     f"| **{r.verdict}** | {r.why} | {records} |")
    return "\n".join(lines) + "\n"


VERDICT_COLORS = {"reproduced": "#2e7d32", LARGER: "#b35900", SMALLER: "#b35900", "reversed": "#c00000",
                  "not measured here": "#6d6d6d"}


def chart(rows: list[Row], path, machine: str = "this machine"):
    """The ratio rows as bars: the article's figure beside this machine's, log scale, each row's
    verdict at its end in its colour."""
    from app.report.charts import _pyplot
    plt = _pyplot()
    ratios = [r for r in rows if r.unit == "x" and r.article]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(ratios) + 1.9))
    ys = range(len(ratios))
    ax.barh([y + 0.2 for y in ys], [r.article for r in ratios], height=0.4, color="#9aa5b1", label="the article")
    measured = [(y, r) for y, r in zip(ys, ratios) if r.measured]
    ax.barh([y - 0.2 for y, _ in measured], [r.measured for _, r in measured], height=0.4, color="#2f6db3",
            label="this machine")
    for y, r in zip(ys, ratios):
        ax.annotate(r.verdict, (max(r.article, r.measured or 0), y), xytext=(4, 0), textcoords="offset points",
                    fontsize=8, va="center", color=VERDICT_COLORS[r.verdict], fontweight="bold")
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xscale("log")
    top = max([r.article for r in ratios] + [r.measured for _, r in measured])
    ax.set_xlim(right=top * 40)                              # room for the verdicts
    ax.set_yticks(list(ys), [LABELS.get(r.id, r.id) for r in ratios], fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlabel("the first time ÷ the second (the float32 row: memory held ÷ file size), log scale; "
                  "right of 1: faster", fontsize=8.5)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    ax.set_title(f"The article's ratios beside {machine}\n(profiles/lessons.md gives each row's figures and why)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sources_machine(sources: Sources) -> str:
    """The machine a ledger's records were measured on, as the charts name it."""
    from app.report.charts import _machine_of, machine_label
    res = next((r for r in (sources.default, sources.article) if r is not None and (r.stages or r.baselines)), None)
    return machine_label(_machine_of(res)) if res else sources.machine


def write(out_dir, results_dir=None) -> list[Path]:
    """profiles/lessons.md and lessons.png from the records."""
    sources = find_sources(results_dir)
    rows = ledger(sources)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png = out_dir / "lessons.md", out_dir / "lessons.png"
    md.write_text(markdown(rows, sources))
    chart(rows, png, sources_machine(sources))
    return [md, png]


def cmd_lessons(args):
    sources = find_sources(args.results)
    rows = ledger(sources)
    if args.json:
        print(json.dumps({"machine": sources.machine, "rows": [r.as_json() for r in rows]}, default=float))
    else:
        print(markdown(rows, sources))


def add_commands(sub):
    p = sub.add_parser("lessons", help="the article's claims beside this machine's records, with verdicts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--results", default=None, help="records folder (default: profiles/results)")
    p.set_defaults(func=cmd_lessons)
