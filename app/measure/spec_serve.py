"""Speculation in the server, measured: what `python -m app bench loadtest --spec` records and the
table drawn from it (profiles/bench/speculative_serve.json and .md).

Two parts:

* the load test: the same clients against `serve` and `serve --spec lookup`, in alternating
  rounds, on copy-heavy prompts (app/measure/speculative_prompts.json: code and prose edited, a
  template filled in, a list recited) and on free text; per set and number of clients, each
  server's tokens/s, the ratio of the two (the median of the rounds' ratios: a drift of the
  machine's speed falls on both alike), and the share of guesses kept;
* the verify pass of the server's step (`batch_verify_times`): one sequence's newest token and
  k guesses, k + 1 rows through forward_batch over the paged pool, against one row, for the
  default model and for TinyLlama's geometry (random weights, labelled synthetic: it keeps no
  guess, so only its pass is measured). What a pass of k+1 rows costs, c(k+1), and the accept
  rate a measured on the default model give the speedup a step could reach,
  max over k of E(k) / c(k+1) with E(k) = 1 + a + ... + a^k (common/speculative.py: the
  geometric model of guesses kept until the first refusal).
"""

from __future__ import annotations

import statistics

import numpy as np

from app.measure.speculative import medians, timed_passes
from common.batch import Batch, Segment
from common.paged_kv import PagePool, PageTable
from common.speculative import expected_tokens

PLAIN, LOOKUP = "ours", "ours, lookup"
TARGETS = (("copy", 1, 1.8), ("copy", 4, 1.3), ("free", 8, 0.97))     # (set, clients, lookup / plain at least)
NEVER_BELOW = 0.97          # lookup / plain at every level measured, whatever the set and the clients
PASS_TARGET = (5, 1.3)                                                 # a pass of 5 rows, at most 1.3 steps


def batch_verify_times(engine, context: list, k_max: int, rounds: int) -> list[list[float]]:
    """ms[round][k] of one server step for one sequence holding `context` but its newest token:
    that token and k guesses (k = 0: a plain decode step), every row's logits, through
    forward_batch over a page pool; the rows are given back after each pass."""
    cfg, block = engine.config, engine.backend.row_block
    pages = PageTable.pages_for(len(context) + k_max + 1)
    pool = PagePool(cfg.n_layer, cfg.kv_dim, pages + 1, dtype=engine.backend.kv_dtype)
    table = PageTable(pool)
    table.admit(context, len(context) + k_max + 1, use_cache=False)
    engine.forward_batch(Batch(pool, [Segment(table, context[:-1])], block))
    held = len(table)
    guesses = [int(t) for t in context[:k_max]]

    def one_pass(k):
        table.truncate(held)
        table.reserve_for(k + 1)
        engine.forward_batch(Batch(pool, [Segment(table, context[-1:] + guesses[:k], all_logits=True)], block))
    out = timed_passes(k_max, rounds, one_pass)
    table.release()
    return out


def speedup(ratios: list[float], a: float) -> tuple[float, int]:
    """(the best E(k) / c(k+1) over k, that k) for pass costs ratios[k] = c(k+1) in steps."""
    best = max(range(len(ratios)), key=lambda k: expected_tokens(k, a) / ratios[k])
    return expected_tokens(best, a) / ratios[best], best


def verify_record(engine, model: str, context: list, k_max: int, rounds: int) -> dict:
    ms = batch_verify_times(engine, context, k_max, rounds)
    return {"model": model, "context": len(context), "k": list(range(k_max + 1)), "ms": ms, "ratio": medians(ms),
            "step_ms": float(np.median([r[0] for r in ms]))}


# ---- the record's numbers -------------------------------------------------------------------------

def level(rec: dict, set_name: str, clients: int) -> dict | None:
    return next((x for x in rec["levels"] if x["set"] == set_name and x["clients"] == clients), None)


def round_ratios(row: dict, key: str = "decode_tokens_per_s_p50") -> list[float]:
    """lookup / plain, round by round (the two ran in the same round, one after the other), of a
    client's decode rate (its tokens after the first over their time, the median request), or of
    `key` (tokens_per_s: every client's tokens over the round's wall time, prompts included)."""
    return [r[LOOKUP][key] / r[PLAIN][key] for r in row["rounds"]]


def accept_rate(row: dict) -> float:
    drafted = sum(r[LOOKUP]["drafted"] for r in row["rounds"])
    return sum(r[LOOKUP]["accepted"] for r in row["rounds"]) / drafted if drafted else float("nan")


def median_of(row: dict, engine: str, key: str) -> float:
    return statistics.median(r[engine][key] for r in row["rounds"])


def page(rec: dict, shown: str) -> str:
    """The markdown table (profiles/bench/speculative_serve.md), drawn from the record alone."""
    s, m = rec["settings"], rec["machine"]
    lines = ["# Speculation inside the server: `serve` against `serve --spec lookup`", "",
             f"Drawn from `{shown}` by `python -m app bench loadtest --draw-only`. {s['model']}, stage "
             f"`{s['stage']}`, {s['threads']} thread(s), on {m.get('cpu', '?')}; commit "
             f"{str(rec['provenance'].get('commit', '?'))[:10]}; {s['rounds']} alternating rounds, {s['requests']} "
             f"requests per client, {s['max_tokens']} tokens each (greedy, EOS ignored), --draft-max "
             f"{s['draft_max']}; load average {rec.get('load_average', {}).get('start', '?')} at the start, "
             f"{rec.get('load_average', {}).get('end', '?')} at the end.", "",
             "Decode: a client's tokens after its first over their time (the median request), what speculation "
             "speeds up; whole requests: every client's tokens over the round's wall time, the prompts' prefill "
             "included. Ratios: lookup / plain, the median of the rounds' ratios (each round ran both servers, "
             "the order alternating). Kept: guesses kept / guesses made, over the rounds.", "",
             "| set | clients | decode tokens/s, plain / lookup | lookup / plain, decode | each round | "
             "whole requests tokens/s, plain / lookup | lookup / plain, whole | kept |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for row in rec["levels"]:
        each, whole = round_ratios(row), round_ratios(row, "tokens_per_s")
        lines.append(f"| {row['set']} | {row['clients']} | {median_of(row, PLAIN, 'decode_tokens_per_s_p50'):.1f} / "
                     f"{median_of(row, LOOKUP, 'decode_tokens_per_s_p50'):.1f} | {statistics.median(each):.2f}x | "
                     f"{', '.join(f'{x:.2f}' for x in each)} | {median_of(row, PLAIN, 'tokens_per_s'):.1f} / "
                     f"{median_of(row, LOOKUP, 'tokens_per_s'):.1f} | {statistics.median(whole):.2f}x | "
                     f"{100 * accept_rate(row):.0f}% |")
    lines += ["", "## A verify pass of k+1 rows in the server's step, over one decode step", "",
              "One sequence at the end of a context of the record's length: its newest token and k guesses through "
              "forward_batch (every row's logits), over a plain one-row step; per round, median. TinyLlama's "
              "geometry is synthetic (random weights: it keeps no guess); the speedup column applies its pass costs "
              "to the default model's accept rate on the copy set at one client (E(k) / c(k+1), the best k)."]
    copy1 = level(rec, "copy", 1)
    a = accept_rate(copy1) if copy1 else float("nan")
    for v in rec.get("verify", []):
        lines += ["", f"**{v['model']}** (context {v['context']}, one step {v['step_ms']:.2f} ms):", "",
                  "| k | " + " | ".join(str(k) for k in v["k"]) + " |", "|---" * (len(v["k"]) + 1) + "|",
                  "| c(k+1) | " + " | ".join(f"{r:.2f}x" for r in v["ratio"]) + " |"]
        if a == a:
            gain, k = speedup(v["ratio"], a)
            lines += ["", f"At the default model's accept rate on copy-heavy prompts ({100 * a:.0f}%): "
                          f"{gain:.2f}x tokens per unit of time, with k = {k}."]
    lines += ["", "## Targets", "", "| what | measured | target | met |", "|---|---:|---:|---|"]
    for set_name, clients, want in TARGETS:
        row = level(rec, set_name, clients)
        if row:
            got = statistics.median(round_ratios(row))
            lines.append(f"| {set_name}, {clients} client(s): lookup / plain, decode | {got:.2f}x | >= {want:.2f}x | "
                         f"{'yes' if got >= want else 'no'} |")
    levels = [(statistics.median(round_ratios(row)), row["set"], row["clients"]) for row in rec["levels"]]
    if levels:
        got, set_name, clients = min(levels)
        lines.append(f"| every level: the lowest lookup / plain, decode ({set_name}, {clients} client(s)) | "
                     f"{got:.2f}x | >= {NEVER_BELOW:.2f}x | {'yes' if got >= NEVER_BELOW else 'no'} |")
    rows, at_most = PASS_TARGET
    for v in rec.get("verify", []):
        if rows - 1 < len(v["ratio"]):
            got = v["ratio"][rows - 1]
            lines.append(f"| {v['model']}: a pass of {rows} rows over one step | {got:.2f}x | <= {at_most:.2f}x | "
                         f"{'yes' if got <= at_most else 'no'} |")
    return "\n".join(lines) + "\n"
