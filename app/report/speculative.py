"""The speculative decoding record (profiles/bench/speculative.json, `python -m app bench speculative`)
drawn: its page (profiles/bench/speculative.md), its chart (profiles/speculative.png) and the
ledger-style row for the claim "k guesses cost about one step", every figure computed from the
record. Ratios are medians over rounds of ratios taken within a round; tokens/s are medians over
rounds of (tokens after the first / their time, summed over a set's prompts)."""

from __future__ import annotations

import numpy as np

from app.measure.speculative import ENGINES, LLAMA_LOOKUP, OURS, OURS_LOOKUP, medians
from app.report.lessons import Row, verdict

CLAIM_K = 4                 # "k guesses": the k the claim is read at
CLAIM_BAND = [1 / 1.5, 1.5]  # "about one step": within 1.5x of it
TARGETS = {("copy", OURS_LOOKUP, OURS): 2.0, ("free", OURS_LOOKUP, OURS): 0.97,   # never below 0.97x plain
           ("copy", OURS_LOOKUP, LLAMA_LOOKUP): 1.0, ("free", OURS_LOOKUP, LLAMA_LOOKUP): 1.0}


def _sets(rec) -> list[str]:
    return list(dict.fromkeys(r["set"] for t in rec["threads"].values() for r in t["runs"]))


def throughput(runs: list[dict], set_name: str, engine: str) -> list[float]:
    """tokens/s per round for one set and engine: its prompts' tokens after the first over their time."""
    out = []
    for r in sorted({x["round"] for x in runs}):
        mine = [x for x in runs if x["round"] == r and x["set"] == set_name and x["engine"] == engine]
        if mine:
            out.append(sum(x["n_tokens"] - 1 for x in mine) / sum(x["decode_s"] for x in mine))
    return out


def ratio(runs, set_name: str, a: str, b: str) -> float | None:
    """Median over rounds of tokens/s of a over b, each round's own."""
    x, y = throughput(runs, set_name, a), throughput(runs, set_name, b)
    if not x or len(x) != len(y):
        return None
    return float(np.median(np.asarray(x) / np.asarray(y)))


def accept_rate(runs, set_name: str) -> float | None:
    mine = [x for x in runs if x["set"] == set_name and x["engine"] == OURS_LOOKUP]
    drafted = sum(x["drafted"] for x in mine)
    return sum(x["accepted"] for x in mine) / drafted if drafted else None


def same_text(runs, set_name: str) -> str:
    """Whether our lookup wrote plain decoding's text for every prompt and round; where it parted,
    how many and the largest lead plain's pick had there (logits)."""
    mine = [x for x in runs if x["set"] == set_name and x["engine"] == OURS_LOOKUP]
    if not mine:
        return "-"
    parted = [x["parting"] for x in mine if x.get("parting")]
    if not parted:
        return "yes"
    return f"parted in {len(parted)} of {len(mine)}, at a lead of at most {max(p['gap'] for p in parted):.3f} logits"


def claim_rows(rec: dict, shown: str) -> list[Row]:
    """The claim at k = CLAIM_K, one row per thread count: measured t(k+1) / t(1) against the band."""
    rows = []
    for threads, t in rec["threads"].items():
        v = t["verify"]
        k = min(CLAIM_K, len(v["k"]) - 1)
        measured = medians(v["ours_ms"])[k]
        roof = v["roofline"]
        said = verdict(measured, CLAIM_BAND)
        llama = f"; llama.cpp's own pass {medians(v['llama_ms'])[k]:.2f}x" if v.get("llama_ms") else ""
        why = (f"{rec['stage']} at {threads} thread(s): a pass of {k + 1} rows costs {measured:.2f}x one decode step; "
               f"the roofline predicts {roof['ratio'][k]:.2f}x (the ridge at {roof['ridge_rows']:.1f} rows: "
               f"{roof['bytes'] / 1e6:.0f} MB read at {roof['bandwidth_gbs']:.0f} GB/s against "
               f"{roof['flops_per_token'] / 1e6:.0f} MFLOP per row at {roof['peak_gflops']:.0f} G/s, the "
               f"{roof.get('peak_name', 'float peak')}){llama}")
        rows.append(Row(f"spec_verify_cost_{threads}t", f"Verifying k = {k} guesses in one pass costs about one "
                        f"decode step", None, "beyond the article", measured, "x", said, why, [shown], CLAIM_BAND))
    return rows


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def page(rec: dict, shown: str) -> str:
    s = rec["settings"]
    load = rec.get("load_average") or {}
    lines = [
        "# Speculative decoding: k guesses, one verify pass",
        "",
        f"Drawn from `{shown}` by `python -m app bench speculative --draw-only` (chart: "
        f"`profiles/speculative.png`). {rec['model']}, stage `{rec['stage']}`, on {rec['machine']['cpu']} "
        f"({rec['machine']['physical_cores']} cores); code {rec['provenance']['code_hash']}, commit "
        f"{rec['provenance']['commit'][:10]}{' (dirty)' if rec['provenance']['dirty'] else ''}; "
        f"{s['rounds']} alternating rounds, medians; load average {load.get('start', '?')} at the start, "
        f"{load.get('end', '?')} at the end."
        + (" **Quick settings: a check of the script, not a measurement to quote.**" if s.get("quick") else ""),
        "",
        "## A verify pass of k+1 rows over one decode step",
        "",
        f"One pass of k+1 rows at the end of a {s['context']}-token context, over one plain decode step, per round, "
        f"median; the roofline's floor from the machine's bandwidth and peak (app/measure/speculative.py says how).",
        "",
    ]
    threads = list(rec["threads"])
    head = ["k"] + [f"{h}, {t} thread(s)" for t in threads for h in ("ours", "roofline", "llama.cpp")]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    cols = []
    for t in threads:
        v = rec["threads"][t]["verify"]
        cols.append((medians(v["ours_ms"]), v["roofline"]["ratio"],
                     medians(v["llama_ms"]) if v.get("llama_ms") else None))
    for k in rec["threads"][threads[0]]["verify"]["k"]:
        cells = [str(k)]
        for ours, roof, llama in cols:
            cells += [_x(ours[k]), _x(roof[k]), _x(llama[k]) if llama else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## The claim", "", "| claim (id) | this machine | band | verdict | why | record |",
              "|---|---:|---|---|---|---|"]
    for r in claim_rows(rec, shown):
        lines.append(f"| {r.claim} (`{r.id}`) | {_x(r.measured)} | {_x(r.band[0])} .. {_x(r.band[1])} "
                     f"| **{r.verdict}** | {r.why} | `{r.records[0]}` |")
    lines += ["", "## Tokens/s: plain decoding against prompt lookup", "",
              f"Greedy, exactly {s['n_predict']} tokens per prompt (EOS ignored), tokens/s over the tokens after "
              f"the first; prompts: `app/measure/speculative_prompts.json` ({', '.join(_sets(rec))}); "
              f"--draft-max {s['draft_max']} for ours, num_pred_tokens {s['draft_max']} for llama-cpp-python's "
              f"LlamaPromptLookupDecoding. Accept rate: guesses kept / guesses made. Same text: whether ours with "
              f"lookup wrote plain decoding's greedy text; where it parted, plain's one-row logits at that token "
              f"say by how much its own pick led (a stage whose multi-row pass rounds otherwise, as the 8-bit "
              f"ones do, parts at near-ties).",
              "", "| set | threads | " + " | ".join(ENGINES) + " | lookup / plain | accept rate | ours, lookup / "
              "llama.cpp, lookup | same text as plain |", "|---|---:|" + "---:|" * (len(ENGINES) + 3) + "---|"]
    for set_name in _sets(rec):
        for t in threads:
            runs = rec["threads"][t]["runs"]
            tps = [throughput(runs, set_name, e) for e in ENGINES]
            rate = accept_rate(runs, set_name)
            same = same_text(runs, set_name)
            lines.append(f"| {set_name} | {t} | " + " | ".join(f"{np.median(x):.1f}" if x else "-" for x in tps) +
                         f" | {_x(ratio(runs, set_name, OURS_LOOKUP, OURS))} | "
                         f"{'-' if rate is None else f'{rate:.0%}'} | "
                         f"{_x(ratio(runs, set_name, OURS_LOOKUP, LLAMA_LOOKUP))} | "
                         f"{same} |")
    lines += ["", "## Targets", "", "| set | threads | ratio | measured | target | met |",
              "|---|---:|---|---:|---:|---|"]
    for (set_name, a, b), want in TARGETS.items():
        for t in threads:
            got = ratio(rec["threads"][t]["runs"], set_name, a, b)
            lines.append(f"| {set_name} | {t} | {a} / {b} | {_x(got)} | {want:.2f}x | "
                         f"{'-' if got is None else 'yes' if got >= want else 'no'} |")
    return "\n".join(lines) + "\n"


def chart(rec: dict, path):
    from app.report.charts import _pyplot
    plt = _pyplot()
    threads = list(rec["threads"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = ["#2f6db3", "#d9822b", "#3a9e5f", "#8e44ad"]
    for t, c in zip(threads, colors):
        v = rec["threads"][t]["verify"]
        left.plot(v["k"], medians(v["ours_ms"]), "o-", color=c, label=f"ours ({rec['stage']}), {t} thread(s)")
        left.plot(v["k"], v["roofline"]["ratio"], "--", color=c, label=f"roofline's floor, {t} thread(s)")
        if v.get("llama_ms"):
            left.plot(v["k"], medians(v["llama_ms"]), ":", marker=".", color=c, label=f"llama.cpp, {t} thread(s)")
    left.axhline(1, color="black", lw=0.8)
    left.set_xlabel("guesses k (a pass of k+1 rows)")
    left.set_ylabel("time of the pass / one decode step")
    left.set_title("What verifying k guesses costs", fontsize=10)
    left.legend(fontsize=7)
    sets = _sets(rec)
    width = 0.8 / (len(ENGINES) * len(threads))
    i = 0
    for t in threads:
        for e, c in zip(ENGINES, ["#9aa5b1", "#2f6db3", "#e0b084", "#d9822b"]):
            ys = [np.median(throughput(rec["threads"][t]["runs"], s, e) or [np.nan]) for s in sets]
            right.bar(np.arange(len(sets)) + i * width - 0.4 + width / 2, ys, width, color=c,
                      alpha=1.0 if t == threads[0] else 0.6, label=f"{e}, {t} thread(s)")
            i += 1
    right.set_xticks(range(len(sets)), [f"{s} text" for s in sets])
    right.set_ylabel("tokens/s (after the first)")
    right.set_title("Plain decoding and prompt lookup", fontsize=10)
    right.margins(y=0.3)
    right.legend(fontsize=7, ncol=2)
    from app.report.charts import machine_label
    fig.suptitle(f"Speculative decoding: {rec['model']} on {machine_label(rec['machine'])}\nmedians of "
                 f"{rec['settings']['rounds']} rounds; profiles/bench/speculative.md gives the figures", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
