"""What a grammar costs a decode step, measured: behind profiles/bench/constrain.md.

    python -m app bench constrain                     # the stage the server batches through, all cores
    python -m app bench constrain --stage repack --threads 2 --rounds 5
    python -m app bench constrain --quick --out trial/constrain.json   # a check of the benchmark, minutes

    masks     the tokens of greedy constrained replies replayed through their matchers: per
              position, the mask's computation and its application to a row of logits (49,152
              floats -> -inf where forbidden), one sequence at a time (batch 1) and for 8
              sequences at once (fill_masks: llguidance's threads), per row; for a JSON schema
              and for a tools grammar (tool_choice auto over two tools)
    run       decode ms/token of a greedy reply under the schema (common/generate.py: Session,
              what `run -j` does), and of the same prompt without it for as many tokens (the
              engine's argmax path)
    server    the server's own step (app/serve/engine_loop.py) with 1 and with 8 requests
              decoding, their sequences made as the server makes them (the matcher in the
              sampler): step ms without constraints and under the schema, the masks of the
              step filled at once before any row draws (what the server does); at 8, also with
              each draw computing its own mask (OneByOne: the engine loop without its
              _fill_masks), to show what filling them together saves; only steps with every
              request decoding count

Rounds alternate the order of the conditions; ratios are taken within a round, medians over
rounds. The page sets the mask's cost beside the step's: the mask and its application must
stay far below a step for decode under a schema to keep pace with decode without one. A
benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from app.args import chosen_stage, fastest_stage
from app.measure.protocol import BENCH_DIR, add_options, header, load_average, median, order
from app.serve.engine_loop import EngineLoop
from app.serve.sequence import Ask, Sequence
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
QUICK = " (--quick: a check of the benchmark, not a measurement)"
RECORD = BENCH_DIR / "constrain.json"


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


class OneByOne(EngineLoop):
    """The engine loop without its masks filled at once: each constrained draw computes its own."""

    @staticmethod
    def _fill_masks(segments, rows):
        pass


SERVER_MODES = ("plain", "constrained", "one by one")


def batch_steps(engine, ll, grammar, prompt_ids: list, n: int, mode: str) -> list:
    """Step ms of the server's engine loop while all of `prompt_ids` decode. mode: plain (no
    constraint) | constrained (each request's matcher in its sampler, as Server.submit makes
    it; the loop fills the step's masks at once) | one by one (the same, each draw computing its
    own mask)."""
    tok = engine.tokenizer
    pages = len(prompt_ids) * (PageTable.pages_for(max(map(len, prompt_ids)) + n) + 1)
    loop = (OneByOne if mode == "one by one" else EngineLoop)(engine, kv_pages=pages, max_batch=len(prompt_ids))
    for ids in prompt_ids:
        stop = frozenset(tok.eog_ids) if mode != "plain" else frozenset()     # plain: all n tokens
        loop.submit(Sequence(Ask(prompt=list(ids), max_tokens=n, stop_ids=stop),
                             constraint=None if mode == "plain" else Constraint(grammar, ll)))
    steps = []
    while not loop.scheduler.idle:
        running = loop.scheduler.running
        decoding = sum(1 for s in running if s.table is not None and len(s.context) - len(s.table) == 1)
        t0 = time.perf_counter()
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
        rec = {"batch1": {}, "server": {}}
        for name in order(["plain", "constrained"], r):
            progress(f"round {r + 1}: run, {name}")
            if name == "constrained":
                gen = constrained_reply(engine, ll, schema, ids[0], n)
            else:
                gen = Session(engine).generate(ids[0], len(traces["json schema"][0]), Sampler(), ignore_eos=True)
            rec["batch1"][name + "_ms"] = gen.decode_ms_median
        rec["batch1"]["tokens"] = len(traces["json schema"][0])
        for batch in (1, BATCH):
            modes = SERVER_MODES if batch == BATCH else SERVER_MODES[:2]
            step = rec["server"].setdefault(str(batch), {})
            for mode in order(modes, r, rotate=True):
                progress(f"round {r + 1}: the server's step, {batch} decoding, {mode}")
                steps = batch_steps(engine, ll, schema, ids[:batch], n, mode)
                step[mode + "_ms"] = median(steps)
                step[mode + "_steps"] = len(steps)
        out["rounds"].append(rec)
    for name, (g, _) in grams.items():
        progress(f"masks: {name}")
        out["masks"][name] = replay_masks(engine, ll, g, traces[name], rng)
    return out


# ---- the page -------------------------------------------------------------------------------------

def summary(record: dict) -> dict:
    """Medians over rounds of the step times, ratios (tokens/s under the schema over without:
    step without / step under) within rounds, mask figures per grammar."""
    rounds = record["rounds"]
    b1 = {k: median([r["batch1"][k] for r in rounds]) for k in ("plain_ms", "constrained_ms")}
    b1["ratio"] = median([r["batch1"]["plain_ms"] / r["batch1"]["constrained_ms"] for r in rounds])
    server = {}
    for batch in rounds[0]["server"]:
        steps = [r["server"][batch] for r in rounds]
        modes = [m for m in SERVER_MODES if m + "_ms" in steps[0]]
        row = {m + "_ms": median([s[m + "_ms"] for s in steps]) for m in modes}
        for m in modes[1:]:
            row[m + "_ratio"] = median([s["plain_ms"] / s[m + "_ms"] for s in steps])
        server[int(batch)] = row
    masks = {}
    for name, m in record["masks"].items():
        one, eight = m["batch1"], m["batch8"]
        masks[name] = {"mask_us": median(one["mask_us"]), "mask_p90_us": float(np.percentile(one["mask_us"], 90)),
                       "apply_us": median(one["apply_us"]), "fill_us_per_row": median(eight["fill_us_per_row"]),
                       "fill_p90_us_per_row": float(np.percentile(eight["fill_us_per_row"], 90)),
                       "apply_us_per_row": median(eight["apply_us_per_row"])}
    return {"batch1": b1, "server": server, "masks": masks}


def page(record: dict, source: str) -> str:
    from app.measure.provenance import describe
    s = summary(record)
    st, m = record["settings"], record["machine"]
    b1, one, eight = s["batch1"], s["server"][1], s["server"][BATCH]
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
        "Decode steps (app/measure/constrain_bench.py). run: ms/token of `run -j`'s path, a reply under the JSON "
        "schema against the same prompt without it. server: the server's own step with 1 and with "
        f"{BATCH} requests decoding, without constraints and under the schema, each request its own matcher; the "
        "step's masks filled at once before any row draws, as the server does, and (the last row) each draw "
        "computing its own.",
        "",
        "| path | requests decoding | step without a constraint, ms | under the schema, ms | "
        "tokens/s under it / without |",
        "|---|---:|---:|---:|---:|",
        f"| run | 1 | {b1['plain_ms']:.2f} | {b1['constrained_ms']:.2f} | {b1['ratio']:.3f} |",
        f"| server | 1 | {one['plain_ms']:.2f} | {one['constrained_ms']:.2f} | {one['constrained_ratio']:.3f} |",
        f"| server | {BATCH} | {eight['plain_ms']:.2f} | {eight['constrained_ms']:.2f} (masks filled at once) | "
        f"{eight['constrained_ratio']:.3f} |",
        f"| server | {BATCH} | {eight['plain_ms']:.2f} | {eight['one by one_ms']:.2f} (masks one by one) | "
        f"{eight['one by one_ratio']:.3f} |",
        "",
        f"The mask per row, replayed along greedy replies ({record['n_vocab']} tokens: the mask is "
        f"{(record['n_vocab'] + 31) // 32} 32-bit words; applying it writes -inf into a row of logits). Share of a "
        "step: mask and application of every row of the step, over the server's step without a constraint.",
        "",
        "| grammar | mask, us (median / p90) | apply, us | share of a 1-request step | "
        f"{BATCH} rows at once: mask per row, us (median / p90) | apply per row, us | "
        f"share of a {BATCH}-request step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, g in s["masks"].items():
        share1 = (g["mask_us"] + g["apply_us"]) / 1e3 / one["plain_ms"]
        share8 = BATCH * (g["fill_us_per_row"] + g["apply_us_per_row"]) / 1e3 / eight["plain_ms"]
        lines.append(f"| {name} | {g['mask_us']:.1f} / {g['mask_p90_us']:.1f} | {g['apply_us']:.1f} | {share1:.1%} | "
                     f"{g['fill_us_per_row']:.1f} / {g['fill_p90_us_per_row']:.1f} | {g['apply_us_per_row']:.1f} | "
                     f"{share8:.1%} |")
    lines += ["", "The replies replayed (the first of each grammar):", ""]
    for name, text in record["texts"].items():
        lines.append(f"- {name}: `{' '.join(text.split())[:160]}`")
    return "\n".join(lines) + "\n"


# ---- the benchmark: `python -m app bench constrain` -------------------------------------------------

def add_arguments(p):
    p.add_argument("--stage", default=None, help="the stage (default: the one the server batches through, as "
                                                  "`python -m app serve` picks)")
    add_options(p, rounds=3, out=RECORD)
    p.add_argument("--threads", type=int, default=None, help="threads (default: the stage's, the physical cores)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens a reply at most (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="1 round of 24-token replies: checks the benchmark (the "
                                                        "record says so; not a measurement to quote)")


def records(args):
    """Measure (the module docstring); yields (where, record): settings, machine, code and the load
    average before and after beside every measurement."""
    from app.models import resolve
    from stages import load
    if args.quick:
        args.rounds, args.n_predict = 1, 24
    stage = chosen_stage(args.stage or fastest_stage(serving=True))
    model = resolve(args.model)
    before = load_average()
    engine = load(stage, model, threads=args.threads)
    engine.warmup()
    measured = measure(engine, args.rounds, args.n_predict, progress=lambda text: print(text, file=sys.stderr))
    settings = {"stage": stage, "threads": engine.backend.threads, "model": Path(model).name, "rounds": args.rounds,
                "n_predict": args.n_predict, "quick": args.quick, "batch": BATCH}
    rec = {"kind": "constrain", "n_vocab": engine.config.n_vocab, "load_average_before": before, **measured,
           **header(settings, args.command_line)}
    rec["load_average_after"] = load_average()
    yield args.out, rec
