"""What splitting a model costs (the tp stage, stages/tp.py), measured: behind
profiles/bench/tp_<model>.md.

    python -m app bench tp                                  # SmolLM2 and the synthetic TinyLlama
    python -m app bench tp --model smollm2 --rounds 1 -n 8  # a quick look
    python -m app bench tp --draw-only                      # redraw the pages and charts

Conditions, each in fresh processes: the stage tp builds on in one process with N threads, and
tp as N ranks of one thread each (`mpiexec -n N`), for each N asked; rounds alternate their
order, and the page quotes medians over rounds and ratios taken within a round.

    run_worker(...)     one condition's process (every rank runs it; rank 0 returns the result):
                        the report's prompt, greedy, every step's wall time and, per rank, its time
                        in the all-reduces and the logits' gather (the rest is compute), bytes each
                        rank sends, resident memory (weights, KV cache, the whole process), the
                        collectives' own latency after a barrier, and the top logits of each step
    page(record, source), chart(record, path)       drawn from the record alone

Memory, per process: the model file's resident pages (/proc/self/smaps: every mapping of the
file) less those resident before the weights were prepared (the header and the vocabulary, which
every rank reads), plus the weights held in private memory (the repack stage's repacked copy; tp's
row-parallel slices are copied out of the file, repacked, then let go), plus the KV cache as
allocated (its arena, every position of the context). The process's whole resident size (Python,
numba, LLVM) is recorded beside it: that part does not split.

Across a link (--link: two network namespaces joined by a veth pair, app/netns.py; by default
where they can be made, root on Linux), tp at 2 ranks also runs with one rank in each namespace,
and each rank reads the bytes its end of the pair sent during the decode steps from the kernel's
counters: what crossed the wire, headers and all, beside the modelled payload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from app.measure.protocol import BENCH_DIR, alternating, header, median, run_child

TOP = 5                       # logits kept per step: enough to show how near a tie was
LATENCY_REPS = 200            # collectives timed alone, after a barrier
LINKS_GBIT = (1, 10, 100)     # network links the page projects onto (their line rates)


def _smaps_rss(path) -> int:
    """Bytes resident in this process of every mapping of `path` (Linux; 0 elsewhere)."""
    real, total, current = os.path.realpath(path), 0, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and len(head) >= 5:
                    current = head[5].strip() if len(head) == 6 else ""
                elif head and head[0] == "Rss:" and current == real:
                    total += int(head[1]) * 1024
    except OSError:
        return 0
    return total


def _vm_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _link_tx_bytes() -> int | None:
    """Bytes sent so far by this process's end of the veth pair, if it runs in one of app/netns.py's
    namespaces (where the interface exists), else None."""
    from app.netns import IFACE
    try:
        return int(Path(f"/sys/class/net/{IFACE}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _top(logits: np.ndarray) -> list:
    idx = np.argsort(logits)[::-1][:TOP]
    return [[int(i), float(logits[i])] for i in idx]


def _comm(ranks) -> dict:
    return ranks.snapshot() if ranks is not None else {}


def _delta(after: dict, before: dict, kind: str, field: str) -> float:
    return after.get(kind, {}).get(field, 0) - before.get(kind, {}).get(field, 0)


def _latency_us(ranks, n_floats: int, kind: str, counts=None) -> float:
    """The median time of one collective alone (every rank arrived, after a barrier), in us."""
    times = []
    x = np.ones(n_floats, dtype=np.float32)
    for _ in range(LATENCY_REPS):
        ranks.barrier("the barrier of the latency test")
        t0 = time.perf_counter()
        if kind == "allreduce":
            ranks.allreduce(x.copy(), "the all-reduce of the latency test")
        else:
            ranks.allgather(x[:counts[ranks.rank]], counts, "the gather of the latency test")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run_worker(stage: str, model, threads: int, prompt_tokens: int, n_predict: int, n_ctx=None) -> dict | None:
    """One condition in this process (and, for tp, in every rank): the result on rank 0, else None."""
    from app.measure.bench import bench_prompt, model_summary
    from common.gguf import GGUFFile
    from stages import load

    g = GGUFFile(model)
    header_rss = _smaps_rss(g.path)                      # the header and vocabulary: before any weight is read
    t0 = time.perf_counter()
    engine = load(stage, g, n_ctx=n_ctx, threads=threads)
    load_s = time.perf_counter() - t0
    ranks = getattr(engine.backend, "ranks", None)
    prompt = bench_prompt(engine.tokenizer, prompt_tokens)
    jit_s = engine.warmup()
    engine.reset()
    steps, tops, tokens = [], [], []
    t0 = time.perf_counter()
    logits = engine.forward(prompt, 0, all_logits=False)[0]
    ttft_ms = (time.perf_counter() - t0) * 1e3
    tok = int(np.argmax(logits))
    tokens.append(tok)
    tops.append(_top(logits))
    before = first = _comm(ranks)
    link_first = _link_tx_bytes()
    for i in range(n_predict - 1):
        t0 = time.perf_counter()
        logits = engine.forward([tok], len(prompt) + i, all_logits=False)[0]
        wall = time.perf_counter() - t0
        after = _comm(ranks)
        ar, ga = (_delta(after, before, k, "seconds") for k in ("allreduce", "gather"))
        steps.append({"ms": wall * 1e3, "allreduce_ms": ar * 1e3, "gather_ms": ga * 1e3,
                      "compute_ms": (wall - ar - ga) * 1e3})
        before = after
        tok = int(np.argmax(logits))
        tokens.append(tok)
        tops.append(_top(logits))
    end = _comm(ranks)
    link_end = _link_tx_bytes()
    n_steps = max(1, len(steps))
    per_token = {k: {f: _delta(end, first, k, f) / n_steps for f in ("calls", "payload_bytes", "sent_bytes")}
                 for k in ("allreduce", "gather")}                      # decode steps only (one row each)
    weights_file = max(0, _smaps_rss(g.path) - header_rss)
    private = int(getattr(getattr(engine.backend, "buffer", None), "nbytes", 0))      # repacked: a private copy
    me = {
        "rank": ranks.rank if ranks else 0, "host": ranks.host if ranks else os.uname().nodename,
        "pid": os.getpid(), "threads": engine.backend.threads,
        "steps": steps, "per_token": per_token,
        "link_tx_bytes_per_token": None if link_first is None else (link_end - link_first) / n_steps,
        "memory": {"file_header_bytes": header_rss, "weights_file_bytes": weights_file,
                   "weights_private_bytes": private, "kv_cache_bytes": engine.kv_bytes(),
                   "weights_and_kv_bytes": weights_file + private + engine.kv_bytes(),
                   "weights_copied_bytes": int(getattr(engine.backend, "copied_bytes", 0)),
                   "weights_held_bytes": engine.weight_bytes(), "process_rss_bytes": _vm_rss()},
        "share": vars(engine.backend.share) if getattr(engine.backend, "share", None) else None,
    }
    if ranks is not None and ranks.size > 1:
        cfg = engine.config
        counts = [s.vocab[1] - s.vocab[0] for s in engine.backend.shares]
        me["latency_us"] = {"allreduce": _latency_us(ranks, cfg.n_embd, "allreduce"),
                            "gather": _latency_us(ranks, cfg.n_vocab, "gather", counts)}
    every = ranks.allgather_json(me, "the gather of the results") if ranks else [me]
    if ranks is not None and ranks.rank != 0:
        return None
    return {"stage": stage, "n_ranks": len(every), "threads": threads, "prompt": prompt, "tokens": tokens,
            "top": tops, "ttft_ms": ttft_ms, "load_s": load_s, "jit_s": jit_s,
            "decode_ms": statistics.median(s["ms"] for s in steps) if steps else float("nan"),
            "n_layer": engine.config.n_layer, "model_info": model_summary(g), "ranks": every}


# ---- the page and the chart, from the record alone --------------------------------------------------

def label(run: dict) -> str:
    if run["stage"] == "tp":
        link = f" over a {run['link']} link" if run.get("link") else ""
        return f"tp, {run['n_ranks']} rank{'s' if run['n_ranks'] > 1 else ''}{link}"
    return f"{run['stage']}, {run['threads']} thread{'s' if run['threads'] > 1 else ''}"


def conditions(record: dict) -> dict:
    """{label: [runs, one per round]} in the record's order."""
    out = {}
    for run in record["runs"]:
        out.setdefault(label(run), []).append(run)
    return out


def rank_figures(runs: list, r: int) -> dict:
    """Medians over rounds of one rank's per-step medians (ms per decode token)."""
    def med(key):
        return median([median([s[key] for s in run["ranks"][r]["steps"]]) for run in runs])
    return {k: med(k) for k in ("ms", "compute_ms", "allreduce_ms", "gather_ms")}


def summary(record: dict) -> dict:
    """Every condition's figures, computed from the runs: what the page and the chart show."""
    out = {}
    conds = conditions(record)
    whole = next((runs for name, runs in conds.items() if runs[0]["stage"] != "tp" and runs[0]["threads"] == 1), None)
    whole_mem = median([r["ranks"][0]["memory"]["weights_and_kv_bytes"] for r in whole]) if whole else float("nan")
    for name, runs in conds.items():
        first = runs[0]
        ranks = []
        for r in range(first["n_ranks"]):
            fig = rank_figures(runs, r)
            mem = {k: median([run["ranks"][r]["memory"][k] for run in runs]) for k in first["ranks"][r]["memory"]}
            wire = [run["ranks"][r].get("link_tx_bytes_per_token") for run in runs]
            ranks.append({**fig, "memory": mem, "memory_vs_one_process": mem["weights_and_kv_bytes"] / whole_mem,
                          "allreduce_share": fig["allreduce_ms"] / fig["ms"] if fig["ms"] else float("nan"),
                          "per_token": first["ranks"][r]["per_token"],
                          "wire_bytes_per_token": median(wire) if None not in wire else None,
                          "latency_us": first["ranks"][r].get("latency_us"),
                          "share": first["ranks"][r].get("share")})
        out[name] = {"stage": first["stage"], "n_ranks": first["n_ranks"], "threads": first["threads"],
                     "link": first.get("link"),
                     "decode_ms": median([run["decode_ms"] for run in runs]),
                     "ttft_ms": median([run["ttft_ms"] for run in runs]), "ranks": ranks, "tokens": first["tokens"],
                     "top": first["top"]}
    return out


def ratio_in_rounds(record: dict, a: str, b: str) -> float:
    """Median over rounds of decode(a) / decode(b), both measured in the same round."""
    by_round = {}
    for run in record["runs"]:
        by_round.setdefault(run["round"], {})[label(run)] = run["decode_ms"]
    return median([r[a] / r[b] for r in by_round.values() if a in r and b in r])


def divergence(base: dict, other: dict) -> dict | None:
    """Where other's greedy tokens first leave base's, and how near a tie it was in base's logits
    there: base's best logit less the logit base gave other's token (None if not in its top)."""
    for i, (x, y) in enumerate(zip(base["tokens"], other["tokens"])):
        if x != y:
            top = dict((t, v) for t, v in base["top"][i])
            return {"step": i, "base_token": x, "token": y,
                    "gap": base["top"][i][0][1] - top[y] if y in top else None}
    return None


def _mib(b) -> str:
    return f"{b / 2**20:,.1f}"


def _kib(b) -> str:
    return "-" if b is None else f"{b / 1024:,.1f}"


def ratio_pairs(record: dict, s: dict) -> list:
    """[(a, b)] the page compares: tp at N ranks against the base at N threads, and tp across a
    link against the base and against tp through shared memory."""
    pairs = []
    for n in record["settings"]["ranks"]:
        one = label({"stage": record["base_stage"], "threads": n})
        for tp in (label({"stage": "tp", "n_ranks": n}), *(name for name, c in s.items()
                                                           if c["link"] and c["n_ranks"] == n)):
            if tp in s and one in s:
                pairs.append((tp, one))
        linked = [name for name, c in s.items() if c["link"] and c["n_ranks"] == n]
        if linked and label({"stage": "tp", "n_ranks": n}) in s:
            pairs += [(name, label({"stage": "tp", "n_ranks": n})) for name in linked]
    return pairs


def page(record: dict, source: str) -> str:
    from app.measure.provenance import describe
    s = summary(record)
    m = record["machine"]
    base = record["base_stage"]
    info = record["runs"][0]["model_info"]
    lines = [
        f"# Tensor parallelism: what splitting {info['file']} costs",
        "",
        f"_Generated from `{source}`; do not edit. Measured on {m.get('cpu', '?')} ({m.get('physical_cores')} cores) "
        f"with {describe([{'row': 'all', 'provenance': record.get('provenance')}])}, {record.get('time', '?')}: "
        f"`{record['command']}`. {record['settings']['prompt_tokens']} prompt tokens, "
        f"{record['settings']['n_predict']} generated, greedy; rounds: {record['settings']['rounds']}, in "
        f"alternating order; medians over rounds._",
        "",
        f"The stage tp builds on ({base}) in one process with N threads, against tp as N ranks (MPI processes) of one "
        "thread each. Per decode token, per rank: its time in the all-reduces (two per layer) and in the gather of "
        "the logits, which includes waiting for the slowest rank; the rest is its compute.",
        "",
        "| condition | rank | decode ms/token | compute | all-reduce | gather | all-reduce share | TTFT ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in s.items():
        for r, rk in enumerate(c["ranks"]):
            lines.append(f"| {name} | {r if c['stage'] == 'tp' else '-'} | {rk['ms']:.2f} | {rk['compute_ms']:.2f} "
                         f"| {rk['allreduce_ms']:.2f} | {rk['gather_ms']:.2f} | {rk['allreduce_share']:.1%} "
                         f"| {c['ttft_ms']:.0f} |")
    lines += ["", "Ratios of decode time, each taken within a round:", ""]
    for a, b in ratio_pairs(record, s):
        lines.append(f"- {a} / {b}: {ratio_in_rounds(record, a, b):.2f}")
    lines += ["", "## Bytes per token and the collectives alone", "",
              "Per rank and decode token: the messages' payload, and what the rank sends as ring algorithms send it "
              "(modelled from the sizes); across a link, what its end of the link sent, read from the kernel's "
              "counters (TCP/IP headers and MPI's own messages included). Latency: one collective alone, every rank "
              "already there (after a barrier), median of repeated calls.", "",
              "| condition | rank | collectives / token | all-reduce payload KiB | gather payload KiB | sent KiB | "
              "on the wire KiB | all-reduce alone us | gather alone us |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in s.items():
        if c["stage"] != "tp" or c["n_ranks"] < 2:
            continue
        for r, rk in enumerate(c["ranks"]):
            pt, lat = rk["per_token"], rk["latency_us"] or {}
            sent = pt["allreduce"]["sent_bytes"] + pt["gather"]["sent_bytes"]
            lines.append(f"| {name} | {r} | {pt['allreduce']['calls'] + pt['gather']['calls']:.0f} "
                         f"| {pt['allreduce']['payload_bytes'] / 1024:,.1f} "
                         f"| {pt['gather']['payload_bytes'] / 1024:,.1f} "
                         f"| {sent / 1024:,.1f} | {_kib(rk.get('wire_bytes_per_token'))} "
                         f"| {lat.get('allreduce', float('nan')):.1f} "
                         f"| {lat.get('gather', float('nan')):.1f} |")
    lines += ["", "## Memory per rank", "",
              "Weights resident (the file's pages this process mapped, less the header and vocabulary it read first), "
              "weights held in private memory (copies: the repacked weights, or slices copied out of the file), the KV "
              "cache as allocated; against one "
              f"process of {base} at 1 thread. The whole process (Python, numba, LLVM) does not split.", "",
              "| condition | rank | weights resident MiB | private MiB | KV cache MiB | weights + KV MiB "
              "| vs one process | header MiB | process RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in s.items():
        for r, rk in enumerate(c["ranks"]):
            mm = rk["memory"]
            lines.append(f"| {name} | {r if c['stage'] == 'tp' else '-'} | {_mib(mm['weights_file_bytes'])} "
                         f"| {_mib(mm.get('weights_private_bytes', mm['weights_copied_bytes']))} "
                         f"| {_mib(mm['kv_cache_bytes'])} "
                         f"| {_mib(mm['weights_and_kv_bytes'])} | {rk['memory_vs_one_process']:.2f}x "
                         f"| {_mib(mm['file_header_bytes'])} | {_mib(mm['process_rss_bytes'])} |")
    lines += _fit_lines(record, s) + _greedy_lines(record, s) + _network_lines(record, s)
    lines += ["", f"![compute, all-reduce and memory per rank]({Path(source).with_suffix('.png').name})"]
    return "\n".join(lines) + "\n"


def _fit_lines(record, s) -> list:
    ram = record["machine"].get("memory_bytes")
    one = next((c for c in s.values() if c["stage"] != "tp" and c["threads"] == 1), None)
    if not ram or not one:
        return []
    mem = one["ranks"][0]["memory"]
    overhead = mem["process_rss_bytes"] - min(mem["process_rss_bytes"], mem["weights_and_kv_bytes"])
    lines = ["", "## Where a model stops fitting one machine", "",
             f"This machine has {ram / 2**30:.1f} GiB. One process holds the weights and the KV cache, plus "
             f"{_mib(overhead)} MiB of its own (the process's resident size less both): so weights and KV cache "
             f"larger than {(ram - overhead) / 2**30:.1f} GiB do not fit. Split over N ranks on N such machines, each "
             "holds its largest share (below) plus the same per-process part:", ""]
    for c in s.values():
        if c["stage"] == "tp" and c["n_ranks"] > 1 and not c["link"]:
            worst = max(rk["memory_vs_one_process"] for rk in c["ranks"])
            lines.append(f"- {c['n_ranks']} ranks: the largest share is {worst:.2f}x of the whole, so up to "
                         f"{(ram - overhead) / worst / 2**30:.1f} GiB of weights and KV cache fit")
    return lines


def _greedy_lines(record, s) -> list:
    base = next((c for c in s.values() if c["stage"] != "tp" and c["threads"] == 1), None)
    if not base:
        return []
    lines = ["", f"## Greedy tokens against {record['base_stage']}", ""]
    for name, c in s.items():
        if name == label({"stage": base["stage"], "threads": 1, "n_ranks": 1}):
            continue
        d = divergence(base, c)
        if d is None:
            lines.append(f"- {name}: the same {len(c['tokens'])} tokens")
        else:
            gap = "outside its top logits" if d["gap"] is None else f"{d['gap']:.3f} below its best"
            lines.append(f"- {name}: the same up to step {d['step']}, then token {d['token']} where "
                         f"{record['base_stage']} chose {d['base_token']}; {record['base_stage']}'s logit for it was "
                         f"{gap} (a near-tie; the texts then go their own ways)")
    return lines


def _network_lines(record, s) -> list:
    lat_us = record["network"]["latency_us_assumed"]
    lines = ["", "## Across machines", "",
             "Bytes each rank sends per token, times tokens per second, against a link's line rate; and the "
             f"collectives' round trips at an assumed {lat_us:g} us each (an assumption, not a measurement: a switched "
             "Ethernet link's order of magnitude). Projected step: the slowest rank's compute here plus both.", "",
             "| condition | sent KiB/token | at the measured rate, MB/s | link | transfer ms/token | round trips "
             "ms/token | projected ms/token |", "|---|---:|---:|---|---:|---:|---:|"]
    for name, c in s.items():
        if c["stage"] != "tp" or c["n_ranks"] < 2 or c["link"]:
            continue
        pt = c["ranks"][0]["per_token"]
        sent = max(rk["per_token"]["allreduce"]["sent_bytes"] + rk["per_token"]["gather"]["sent_bytes"]
                   for rk in c["ranks"])
        calls = pt["allreduce"]["calls"] + pt["gather"]["calls"]
        compute = max(rk["compute_ms"] for rk in c["ranks"])
        rate = sent * 1e3 / c["decode_ms"] / 1e6
        for gbit in LINKS_GBIT:
            transfer = sent / (gbit * 1e9 / 8) * 1e3
            trips = calls * lat_us / 1e3
            lines.append(f"| {name} | {sent / 1024:,.1f} | {rate:,.1f} | {gbit} Gb/s | {transfer:.3f} | {trips:.2f} "
                         f"| {compute + transfer + trips:.2f} |")
    return lines + _link_lines(record, s)


def _link_lines(record, s) -> list:
    """The same ranks measured across a link, beside themselves through shared memory."""
    linked = [c for c in s.values() if c["link"]]
    if not linked:
        return []
    lines = ["", "## Measured across a link", "",
             f"tp's ranks {record['link']['how']}. Per rank and decode token, beside the same ranks through shared "
             "memory: the step, the time in the collectives (waiting included), what its end of the link sent, and "
             "one collective alone.", "",
             "| condition | rank | decode ms/token | all-reduce ms | gather ms | on the wire KiB/token "
             "| all-reduce alone us | gather alone us |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in linked:
        for name in (label({"stage": "tp", "n_ranks": c["n_ranks"]}), label(c)):
            for r, rk in enumerate(s[name]["ranks"] if name in s else []):
                lat = rk["latency_us"] or {}
                lines.append(f"| {name} | {r} | {rk['ms']:.2f} | {rk['allreduce_ms']:.2f} | {rk['gather_ms']:.2f} "
                             f"| {_kib(rk.get('wire_bytes_per_token'))} | {lat.get('allreduce', float('nan')):.1f} "
                             f"| {lat.get('gather', float('nan')):.1f} |")
    return lines


def chart(record: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = summary(record)
    bars = [(f"{name}\nrank {r}" if c["stage"] == "tp" else name, rk)
            for name, c in s.items() for r, rk in enumerate(c["ranks"])]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    names = [b[0].replace(", ", "\n").replace(" over a ", "\nover a ") for b in bars]     # labels that fit a bar
    bottom = np.zeros(len(bars))
    for key, color, what in (("compute_ms", "#2f6db3", "compute"), ("allreduce_ms", "#d9822b", "all-reduces"),
                             ("gather_ms", "#8f5fbf", "gather of the logits")):
        vals = np.array([b[1][key] for b in bars])
        a1.bar(names, vals, bottom=bottom, color=color, label=what)
        bottom += vals
    a1.set_ylabel("ms per decode token (median)")
    a1.set_title("Where a decode step goes, per rank")
    a1.legend()
    mem = np.array([b[1]["memory"]["weights_and_kv_bytes"] / 2**20 for b in bars])
    a2.bar(names, mem, color="#2f6db3")
    for i, b in enumerate(bars):
        a2.text(i, mem[i], f"{b[1]['memory_vs_one_process']:.2f}x", ha="center", va="bottom", fontsize=8)
    a2.set_ylabel("MiB: weights resident + private + KV cache")
    a2.set_title("Memory per rank, against one process")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=7)
    from app.report.charts import machine_label
    fig.suptitle(f"{record['runs'][0]['model_info']['file']}: tp against {record['base_stage']}, on "
                 f"{machine_label(record.get('machine'))}", fontsize=10.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the benchmark: `python -m app bench tp` -------------------------------------------------------

MARK = "TP_RESULT "           # the line of rank 0's result among what the ranks print
RUN_TIMEOUT_S = 1800
LINK = "veth"                 # the link between the two namespaces, as the page names it
LINK_HOW = ("in two network namespaces joined by a veth pair, one rank in each (app/netns.py): MPICH's UCX over "
            "TCP through the kernel's network stack, a link whose latency is the stack's, with no wire")


def run_condition(stage: str, n: int, model: Path, prompt_tokens: int, n_predict: int, ctx_size: int | None = None,
                  hosts=None) -> dict:
    """One condition in fresh processes: tp as n ranks of one thread (`mpiexec -n n`), or another
    stage as one process of n threads; the worker's result (rank 0's line on stdout). hosts:
    app.netns.TwoHosts, to run tp's ranks across its link."""
    threads = 1 if stage == "tp" else n
    cmd = [sys.executable, "-m", "app", "bench", "tp", "--worker", stage, "--threads", threads, "--model", model,
           "--prompt-tokens", prompt_tokens, "-n", n_predict]
    if ctx_size:
        cmd += ["--ctx-size", ctx_size]
    if stage == "tp":
        launch = [*hosts.mpiexec(), "-f", hosts.hosts] if hosts else [Path(sys.executable).parent / "mpiexec"]
        cmd = [*launch, "-n", n] + cmd
    run = run_child(cmd, f"{stage} at {n}", mark=MARK, timeout=RUN_TIMEOUT_S)
    if hosts:
        run["link"] = LINK
    return run


def linked(args) -> bool:
    """Whether tp at 2 ranks also runs across the namespaces' link (--link; auto: where they can be made)."""
    from app import netns
    if args.link == "no" or 2 not in args.ranks:
        return False
    why = netns.missing()
    if why and args.link == "yes":
        raise SystemExit(f"--link yes: {why}")
    if why:
        print(f"tp across a link left out: {why}", file=sys.stderr)
    return why is None


def measure(model: str, args) -> dict:
    """Every condition in fresh processes, in alternating rounds: the record."""
    from tqdm import tqdm

    from app import netns
    from app.models import resolve
    from stages import info
    path = resolve(model)
    base = info("tp").builds_on
    conds = [(base, n, False) for n in args.ranks] + [("tp", n, False) for n in args.ranks]
    conds += [("tp", 2, True)] if linked(args) else []
    runs = []
    bar = tqdm(total=len(conds) * args.rounds, desc=f"tp bench {path.name}", unit="run")
    with tempfile.TemporaryDirectory() as folder, \
            (netns.TwoHosts(folder, f"llm-tp-bench-{os.getpid()}") if any(c[2] for c in conds) else nullcontext()) \
            as hosts:
        def one(cond, rnd):
            stage, n, link = cond
            bar.set_postfix_str(f"round {rnd + 1}: {stage} {n}{' ' + LINK if link else ''}")
            run = run_condition(stage, n, path, args.prompt_tokens, args.n_predict, args.ctx_size,
                                hosts if link else None)
            run["round"] = rnd
            runs.append(run)                        # in the order measured
            bar.update(1)
        alternating(conds, args.rounds, one)
    bar.close()
    return {"kind": "tp", "model": path.name, "base_stage": base, "runs": runs,
            "settings": {"prompt_tokens": args.prompt_tokens, "n_predict": args.n_predict, "rounds": args.rounds,
                         "ranks": args.ranks, "ctx_size": args.ctx_size},
            "link": {"name": LINK, "how": LINK_HOW} if any(c[2] for c in conds) else None,
            "network": {"latency_us_assumed": args.latency_us, "links_gbit": list(LINKS_GBIT)},
            **header(command=args.command_line)}


def record_path(model: str) -> Path:
    from app.models import MODELS
    return BENCH_DIR / f"tp_{model if model in MODELS else Path(model).stem}.json"


def add_arguments(p):
    p.add_argument("--model", action="append", help="model name or path (repeatable; default: smollm2, "
                                                    "tinyllama-synthetic)")
    p.add_argument("--ranks", default="1,2", help="rank counts N, comma-separated (default: %(default)s): tp with N "
                                                  "ranks, the base stage with N threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds, in alternating order (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default: %(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens generated (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context (default: the model's, at most 2048)")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="a network round trip the page assumes for the projection across machines (default: "
                        "%(default)s us; an assumption, recorded as one)")
    p.add_argument("--link", choices=("auto", "yes", "no"), default="auto",
                   help="tp at 2 ranks also across two network namespaces joined by a veth pair (root; default: "
                        "%(default)s, where they can be made)")
    p.add_argument("--worker", help=argparse.SUPPRESS)          # one condition's process (every rank)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)


def records(args):
    from app.models import resolve
    from common.generate import ParameterError
    if args.worker:
        if len(args.model or []) != 1:
            raise ParameterError("--worker takes one --model")
        result = run_worker(args.worker, resolve(args.model[0]), args.threads, args.prompt_tokens, args.n_predict,
                            args.ctx_size)
        if result is not None:                      # rank 0
            print(MARK + json.dumps(result), flush=True)
        return
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",")})
    except ValueError:
        raise ParameterError(f"--ranks {args.ranks!r}: give rank counts such as 1,2") from None
    if min(args.ranks) < 1 or args.rounds < 1 or args.n_predict < 2 or args.prompt_tokens < 1:
        raise ParameterError("--ranks >= 1, --rounds >= 1, -n >= 2 and --prompt-tokens >= 1")
    for model in args.model or ["smollm2", "tinyllama-synthetic"]:
        yield record_path(model), measure(model, args)
