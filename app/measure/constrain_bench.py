"""What a grammar costs a decode step, measured: behind profiles/bench/constrain.md
(`python scripts/bench_constrain.py`).

    masks     the tokens of greedy constrained replies replayed through their matchers: per
              position, the mask's computation and its application to a row of logits (49,152
              floats -> -inf where forbidden), one sequence at a time (batch 1) and for 8
              sequences at once (fill_masks: llguidance's threads), per row; for a JSON schema
              and for a tools grammar (tool_choice auto over two tools)
    batch 1   decode ms/token of a greedy reply under the schema (common/generate.py: Session),
              and of the same prompt without it for as many tokens (the engine's argmax path)
    batch 8   the server's batched step (app/serve/engine_loop.py) with 8 requests decoding: step
              ms without constraints, with one per request (each draw computes its mask), and
              with the 8 masks filled at once before each step (fill_masks), the way the server
              should; only steps with all 8 decoding count

Rounds alternate the order of the conditions; ratios are taken within a round, medians over
rounds. The page sets the mask's cost beside the step's: the mask and its application must
stay far below a step for decode under a schema to keep pace with decode without one.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from common.constrain import Constraint, Grammar, fill_masks, ll_tokenizer
from common.generate import Sampler, Session
from common.paged_kv import PageTable

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "address", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                         "tags": {"type": "array", "items": {"enum": ["friend", "work", "family"]},
                                  "maxItems": 3}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"type": "string", "maxLength": 30},
                                                         "unit": {"enum": ["C", "F"]}}}}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                           "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}]
PEOPLE = ["Ada", "Brook", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana"]
CITIES = ["Oslo", "Lagos", "Lima", "Pune", "Kyoto", "Quito", "Perth", "Turin"]
BATCH = 8
QUICK = " (--quick: a check of the script, not a measurement)"


def grammars(tok, ll) -> dict:
    """The grammars masks are timed for, each with BATCH prompts: a JSON schema, and tools as
    the server step will build them (render_prompt, structured)."""
    from app.structured import render_prompt, structured
    tools = structured({"tools": TOOLS}, ll)
    people = [tok.encode(f"Person {i + 1}, {name}, as JSON:") for i, name in enumerate(PEOPLE[:BATCH])]
    questions = [tok.encode(render_prompt(tok, [{"role": "user", "content": f"What is the weather in {city}?"}],
                                          tools), parse_special=True) for city in CITIES[:BATCH]]
    return {"json schema": (Grammar.json_schema(SCHEMA).checked(ll), people),
            "tools (auto, 2 functions)": (tools.grammar, questions)}


def constrained_reply(engine, ll, grammar, prompt, n: int):
    """A greedy reply under the grammar (its Generation)."""
    tok = engine.tokenizer
    return Session(engine).generate(prompt, n, Sampler(constraint=Constraint(grammar, ll)), stop_ids=tok.eog_ids)


def replay_masks(engine, ll, grammar, traces: list, rng) -> dict:
    """Per position of the traces: the mask (us) and its application (us), one sequence at a
    time; then 8 sequences a step, their masks filled at once: per row."""
    n_vocab = engine.config.n_vocab
    row = rng.standard_normal(n_vocab).astype(np.float32)
    one_mask, one_apply = [], []
    for tokens in traces:
        c = Constraint(grammar, ll)
        for t in tokens:
            t0 = time.perf_counter()
            c.mask()
            t1 = time.perf_counter()
            c.apply(row)
            t2 = time.perf_counter()
            one_mask.append((t1 - t0) * 1e6)
            one_apply.append((t2 - t1) * 1e6)
            c.consume(t)
    cs = [Constraint(grammar, ll) for _ in traces]
    fill, apply = [], []
    for k in range(min(len(t) for t in traces)):
        t0 = time.perf_counter()
        fill_masks(cs)
        t1 = time.perf_counter()
        for c in cs:
            c.apply(row)
        t2 = time.perf_counter()
        fill.append((t1 - t0) * 1e6 / len(cs))
        apply.append((t2 - t1) * 1e6 / len(cs))
        for c, tokens in zip(cs, traces):
            c.consume(tokens[k])
    return {"batch1": {"mask_us": one_mask, "apply_us": one_apply},
            "batch8": {"fill_us_per_row": fill, "apply_us_per_row": apply}}


def batch_steps(engine, ll, grammar, prompt_ids: list, n: int, mode: str) -> list:
    """Step ms of the server's scheduler while all of `prompt_ids` decode. mode: plain | lazy
    (a constraint per request, each draw computes its mask) | filled (fill_masks before each step)."""
    from app.serve.engine_loop import EngineLoop
    from app.serve.sequence import Ask, Sequence
    tok = engine.tokenizer
    pages = len(prompt_ids) * (PageTable.pages_for(max(map(len, prompt_ids)) + n) + 1)
    loop = EngineLoop(engine, kv_pages=pages, max_batch=len(prompt_ids))
    for ids in prompt_ids:
        stop = frozenset(tok.eog_ids) if mode != "plain" else frozenset()     # plain: all n tokens
        seq = Sequence(Ask(prompt=list(ids), max_tokens=n, stop_ids=stop))
        if mode != "plain":
            seq.sampler = Sampler(constraint=Constraint(grammar, ll))
        loop.submit(seq)
    steps = []
    while not loop.scheduler.idle:
        running = loop.scheduler.running
        decoding = sum(1 for s in running if s.table is not None and len(s.context) - len(s.table) == 1)
        t0 = time.perf_counter()
        if mode == "filled":
            fill_masks([s.sampler.constraint for s in running])
        rows = loop.step()
        dt = (time.perf_counter() - t0) * 1e3
        if rows == decoding == len(prompt_ids):
            steps.append(dt)
    return steps


def measure(engine, rounds: int, n: int, progress=lambda text: None) -> dict:
    """The record's measurements (the module docstring)."""
    tok = engine.tokenizer
    ll = ll_tokenizer(tok, engine.config.n_vocab)
    rng = np.random.default_rng(0)
    grams = grammars(tok, ll)
    schema, ids = grams["json schema"]
    progress("the replies to replay")
    traces = {name: [constrained_reply(engine, ll, g, p, n).tokens for p in ps] for name, (g, ps) in grams.items()}
    out = {"traces": {k: [len(t) for t in v] for k, v in traces.items()},
           "texts": {k: tok.decode(v[0], skip_special=True) for k, v in traces.items()},
           "rounds": [], "masks": {}}
    for r in range(rounds):
        rec = {"batch1": {}, "batch8": {}}
        order = ["plain", "constrained"] if r % 2 == 0 else ["constrained", "plain"]
        for name in order:
            progress(f"round {r + 1}: batch 1, {name}")
            if name == "constrained":
                gen = constrained_reply(engine, ll, schema, ids[0], n)
            else:
                gen = Session(engine).generate(ids[0], len(traces["json schema"][0]), Sampler(), ignore_eos=True)
            rec["batch1"][name + "_ms"] = gen.decode_ms_median
        rec["batch1"]["tokens"] = len(traces["json schema"][0])
        modes = ["plain", "lazy", "filled"]
        for mode in modes[r % 3:] + modes[:r % 3]:
            progress(f"round {r + 1}: batch 8, {mode}")
            steps = batch_steps(engine, ll, schema, ids, n, mode)
            rec["batch8"][mode + "_ms"] = statistics.median(steps) if steps else float("nan")
            rec["batch8"][mode + "_steps"] = len(steps)
        out["rounds"].append(rec)
    for name, (g, _) in grams.items():
        progress(f"masks: {name}")
        out["masks"][name] = replay_masks(engine, ll, g, traces[name], rng)
    return out


# ---- the page -------------------------------------------------------------------------------------

def summary(record: dict) -> dict:
    """Medians over rounds of the step times, ratios within rounds, mask figures per grammar."""
    rounds = record["rounds"]

    def med(xs):
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")
    b1 = {k: med([r["batch1"][k] for r in rounds]) for k in ("plain_ms", "constrained_ms")}
    b1["ratio"] = med([r["batch1"]["plain_ms"] / r["batch1"]["constrained_ms"] for r in rounds])
    b8 = {k: med([r["batch8"][k] for r in rounds]) for k in ("plain_ms", "lazy_ms", "filled_ms")}
    for mode in ("lazy", "filled"):
        b8[mode + "_ratio"] = med([r["batch8"]["plain_ms"] / r["batch8"][mode + "_ms"] for r in rounds])
    masks = {}
    for name, m in record["masks"].items():
        one, eight = m["batch1"], m["batch8"]
        masks[name] = {"mask_us": med(one["mask_us"]), "mask_p90_us": float(np.percentile(one["mask_us"], 90)),
                       "apply_us": med(one["apply_us"]), "fill_us_per_row": med(eight["fill_us_per_row"]),
                       "fill_p90_us_per_row": float(np.percentile(eight["fill_us_per_row"], 90)),
                       "apply_us_per_row": med(eight["apply_us_per_row"])}
    return {"batch1": b1, "batch8": b8, "masks": masks}


def page(record: dict, source: str) -> str:
    from app.measure.provenance import describe
    s = summary(record)
    st, m = record["settings"], record["machine"]
    b1, b8 = s["batch1"], s["batch8"]
    lines = [
        "# Constrained decoding: what the mask costs a step",
        "",
        f"_Generated from `{source}`; do not edit. Measured on {m.get('cpu', '?')} ({m.get('physical_cores')} cores) "
        f"with {describe([{'row': 'all', 'provenance': record.get('provenance')}])}, {record.get('time', '?')}: "
        f"`{record['command']}`. Stage {st['stage']}, {st['threads']} thread(s), {st['model']}; greedy, up to "
        f"{st['n_predict']} tokens a reply; {st['rounds']} round(s) in alternating order, medians over rounds, "
        f"ratios within a round; load average {record.get('load_average_before', '?')} before, "
        f"{record.get('load_average_after', '?')} after{QUICK if st.get('quick') else ''}._",
        "",
        "Decode steps (app/measure/constrain_bench.py). Batch 1: ms/token of a reply under the JSON schema against the "
        "same prompt without it. Batch 8: the server's step with 8 requests decoding, without constraints, with one "
        "per request (each draw computes its mask), and with the 8 masks filled at once before the step.",
        "",
        "| batch | step without a constraint, ms | under the schema, ms | tokens/s under it / without |",
        "|---:|---:|---:|---:|",
        f"| 1 | {b1['plain_ms']:.2f} | {b1['constrained_ms']:.2f} | {b1['ratio']:.3f} |",
        f"| 8 | {b8['plain_ms']:.2f} | {b8['lazy_ms']:.2f} (masks one by one) | {b8['lazy_ratio']:.3f} |",
        f"| 8 | {b8['plain_ms']:.2f} | {b8['filled_ms']:.2f} (masks filled at once) | {b8['filled_ratio']:.3f} |",
        "",
        f"The mask per row, replayed along greedy replies ({record['n_vocab']} tokens: the mask is "
        f"{(record['n_vocab'] + 31) // 32} 32-bit words; applying it writes -inf into a row of logits). Share of a "
        "step: mask and application of every row of the step, over the step without a constraint.",
        "",
        "| grammar | mask, us (median / p90) | apply, us | share of a batch-1 step | 8 rows at once: mask per row, us "
        "(median / p90) | apply per row, us | share of a batch-8 step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, g in s["masks"].items():
        share1 = (g["mask_us"] + g["apply_us"]) / 1e3 / b1["plain_ms"]
        share8 = BATCH * (g["fill_us_per_row"] + g["apply_us_per_row"]) / 1e3 / b8["plain_ms"]
        lines.append(f"| {name} | {g['mask_us']:.1f} / {g['mask_p90_us']:.1f} | {g['apply_us']:.1f} | {share1:.1%} | "
                     f"{g['fill_us_per_row']:.1f} / {g['fill_p90_us_per_row']:.1f} | {g['apply_us_per_row']:.1f} | "
                     f"{share8:.1%} |")
    lines += ["", "The replies replayed (the first of each grammar):", ""]
    for name, text in record["texts"].items():
        lines.append(f"- {name}: `{' '.join(text.split())[:160]}`")
    return "\n".join(lines) + "\n"
